"""The packages of k3jax and pallas_kernels depend on each other one way only.

Every import statement (module level or inside a function: a lazy import is still a dependency) of
``k3jax/`` and ``pallas_kernels/`` is read with :mod:`ast` and mapped to a package-level edge: a
module ``k3jax/ops/kda.py`` belongs to ``k3jax.ops``, ``k3jax/model.py`` to ``k3jax.model``,
``pallas_kernels/kda.py`` to ``pallas_kernels``. A package may import only packages of a lower tier
of ``TIERS``. Packages not named there (command-line tools such as a converter or a sweep) sit on
top: they may import anything, and nothing named in ``TIERS`` may import them. The package itself,
``k3jax`` (the public API), gathers everything, tools included, through its ``_EXPORTS`` table of
lazy imports, which count as its edges. The whole graph has no cycle, and neither has the graph
of the modules themselves.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("k3jax", "pallas_kernels")

TIERS = (
    ("k3jax.config", "k3jax.devices", "k3jax.files"),
    ("pallas_kernels",),       # the kernels: config, devices and each other only
    ("k3jax.ops",),            # the math; calls the kernels, never the other way
    ("k3jax.layers", "k3jax.stack"),
    ("k3jax.model",),
    ("k3jax.accounting",),
    ("k3jax.parallel",),
    ("k3jax.data",),
    ("k3jax.train",),
    ("k3jax.evaluate", "k3jax.plot"),
)
RANK = {name: rank for rank, tier in enumerate(TIERS) for name in tier}


def package_of(dotted: str) -> str | None:
    """The package-level node of a module path (``k3jax.ops.kda`` -> ``k3jax.ops``), or None when
    it is outside the two top packages. A name that is no module of k3jax (``from k3jax import
    K3Model``) is the ``k3jax`` package itself."""
    parts = dotted.split(".")
    if parts[0] not in TOP_PACKAGES:
        return None
    if parts[0] == "pallas_kernels" or len(parts) == 1:
        return parts[0]
    sub = ROOT / parts[0] / parts[1]
    is_module = sub.is_dir() or sub.with_suffix(".py").is_file()
    return f"{parts[0]}.{parts[1]}" if is_module else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@functools.cache
def imported_modules(path: Path) -> frozenset[str]:
    """Every module an ``import`` or ``from ... import`` of ``path`` names (relative ones resolved;
    ``from a import b`` counts as ``a.b``, which is ``a`` when ``b`` is not a module)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif _is_exports_table(node):  # {name: (module, attribute)}, imported when first used
            found.update(value.elts[0].value for value in node.value.values)
    return frozenset(found)


def _is_exports_table(node: ast.AST) -> bool:
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets))


@functools.cache
def source_files() -> tuple[Path, ...]:
    return tuple(path for top in TOP_PACKAGES for path in sorted((ROOT / top).rglob("*.py")))


@functools.cache
def all_modules() -> frozenset[str]:
    return frozenset(module_name(path) for path in source_files())


def module_of(dotted: str) -> str | None:
    """The module of the two top packages that a dotted import names (``k3jax.ops.kda.kda`` ->
    ``k3jax.ops.kda``; a package is its ``__init__``), or None outside them."""
    while dotted and dotted not in all_modules():
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def import_graph(node_of) -> dict[str, dict[str, set[str]]]:
    """``{node: {imported node: {the files that import it}}}`` over both top packages, with each
    module mapped to its node by ``node_of`` (:func:`package_of` or :func:`module_of`)."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in source_files():
        src = node_of(module_name(path))
        edges = graph.setdefault(src, {})
        for target in filter(None, map(node_of, imported_modules(path))):
            if target != src:
                edges.setdefault(target, set()).add(str(path.relative_to(ROOT)))
    return graph


def package_graph() -> dict[str, dict[str, set[str]]]:
    return import_graph(package_of)


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of the graph as a closed path of packages (depth-first search), or None."""
    done: set[str] = set()
    path: list[str] = []                   # the packages being visited, outermost first

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = None if node in done else visit(node)
        if cycle:
            return cycle
    return None


def test_graph_is_read_from_the_sources():
    graph = package_graph()
    assert {"k3jax.ops", "k3jax.layers", "k3jax.model", "pallas_kernels"} <= set(graph)
    assert "k3jax.ops" in graph["k3jax.layers"]          # the layers call the ops


def test_every_package_imports_only_lower_tiers():
    def rank(package: str) -> int:
        return RANK.get(package, len(TIERS))      # not in TIERS: a tool, above every tier

    wrong = [f"{src} imports {dst} (in {', '.join(sorted(files))})"
             for src, edges in package_graph().items() for dst, files in edges.items()
             if rank(dst) >= rank(src) and (src in RANK or dst in RANK)]
    assert not wrong, "imports against the order " + " -> ".join("/".join(t) for t in TIERS) + \
        ":\n" + "\n".join(wrong)


def test_package_graph_has_no_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_module_graph_has_no_cycle():
    """No two modules need each other, inside a package either (so none waits on a half-imported
    other, and each can be read without the other)."""
    cycle = find_cycle(import_graph(module_of))
    assert cycle is None, "module import cycle: " + " -> ".join(cycle)
