"""The executable cache of train steps: its key misses on any change of what the program is made
from, a stored step loads and computes the same numbers, and a damaged file is compiled again;
likewise for the values kept beside it (the model's variable shapes).

The programs here are compiled and loaded in one process; ``train.py`` uses the cache on GPUs
only (:func:`~k3jax.parallel.executable_cache.usable`).
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import least_squares_args, least_squares_step
from jax.sharding import NamedSharding, PartitionSpec
from suite_env import subprocess_env

from k3jax.config.mesh import MeshConfig
from k3jax.parallel import executable_cache, make_mesh
from k3jax.parallel.executable_cache import (
    ExecutableCache,
    digest,
    load_or_make,
    program_parts,
    source_digest,
    value_key,
)
from k3jax.parallel.step import MeshStep


@pytest.fixture()
def toy():
    mesh = make_mesh(MeshConfig())
    rules = MeshConfig().rules
    args, abstract = least_squares_args(mesh, rules)

    def compile_step(cache, description="toy"):
        step = MeshStep(least_squares_step(), abstract[0], mesh, rules)
        compiled = step.compile_async(*abstract, cache=cache, description=description).result()
        compiled.stored.result()  # the file is written after the step is handed out
        return compiled

    return {"mesh": mesh, "args": args, "abstract": abstract,
            "compile": compile_step}


def _outputs(compiled, args):
    return jax.tree.leaves(compiled.run(*args))


def _key(description, args, mesh):
    return digest(program_parts(description, args, mesh))


def test_stored_step_loads_and_computes_the_same(toy, tmp_path):
    cache = ExecutableCache(tmp_path)
    first = toy["compile"](cache)
    assert {"trace_s", "lower_s", "compile_s"} <= set(first.seconds)
    assert len(list(tmp_path.glob("*.executable"))) == 1
    loaded = toy["compile"](cache)
    assert set(loaded.seconds) == {"load_s"}
    assert loaded.temp_bytes() == first.temp_bytes()  # the loop logs it for a loaded step too
    for a, b in zip(_outputs(first, toy["args"]), _outputs(loaded, toy["args"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another description is another program: compiled and stored beside the first.
    assert "compile_s" in toy["compile"](cache, description="toy, another config").seconds
    assert len(list(tmp_path.glob("*.executable"))) == 2


def test_damaged_file_is_compiled_again_and_replaced(toy, tmp_path):
    """A stored step that does not load is compiled again and replaced; its compile names no
    differing parts (nothing missed), although another, newer program is stored beside it."""
    cache = ExecutableCache(tmp_path)
    reference = _outputs(toy["compile"](cache), toy["args"])
    (path,) = tmp_path.glob("*.executable")
    toy["compile"](cache, description="toy, another config")
    damaged = path.read_bytes()[:100]
    stat = path.stat()
    path.write_bytes(damaged)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # still the older of the two
    with pytest.warns(UserWarning, match="did not load"):
        again = toy["compile"](cache)
    assert "compile_s" in again.seconds and again.differs == ()
    for a, b in zip(reference, _outputs(again, toy["args"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the replaced file loads without a warning
        assert set(toy["compile"](cache).seconds) == {"load_s"}


def test_key_changes_with_each_thing_the_program_is_made_from(toy):
    mesh, (state, batch, schedule) = toy["mesh"], toy["abstract"]
    key = _key("toy", (state, batch, schedule), mesh)
    assert key == _key("toy", (state, batch, schedule), mesh)
    assert key != _key("toy, another config", (state, batch, schedule), mesh)
    w = state["params"]["w"]
    wider = {"params": {"w": jax.ShapeDtypeStruct((4, 5), w.dtype, sharding=w.sharding)}}
    assert key != _key("toy", (wider, batch, schedule), mesh)
    bf16 = {"params": {"w": jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=w.sharding)}}
    assert key != _key("toy", (bf16, batch, schedule), mesh)
    split = NamedSharding(mesh, PartitionSpec("data"))
    x = batch["x"]
    resharded = {**batch, "x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split)}
    other = {**batch, "x": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                 sharding=NamedSharding(mesh, PartitionSpec()))}
    assert _key("toy", (state, resharded, schedule), mesh) != _key(
        "toy", (state, other, schedule), mesh)


def test_source_digest_sees_every_edit(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    before = source_digest([tmp_path])
    (tmp_path / "pkg" / "b.py").write_text("y = 3\n")
    edited = source_digest([tmp_path])
    (tmp_path / "pkg" / "c.py").write_text("")
    added = source_digest([tmp_path])
    (tmp_path / "pkg" / "c.py").rename(tmp_path / "pkg" / "d.py")
    renamed = source_digest([tmp_path])
    assert len({before, edited, added, renamed}) == 4


def test_the_gradient_program_is_handed_to_its_compile_before_the_update_is_traced(toy):
    """The longer compile starts first: the gradients' lowered program goes to ``compile_each``
    while the update is still to be traced (the two programs' compiles then overlap it)."""
    mesh, rules = toy["mesh"], MeshConfig().rules
    step = MeshStep(least_squares_step(), toy["abstract"][0], mesh, rules)
    gradients, update = step.parts
    events = []

    class RecordedUpdate:  # the update program, its tracing recorded
        def trace(self, *args):
            events.append("trace update")
            return update.trace(*args)

    step.parts = (gradients, RecordedUpdate())
    programs, _ = step.lower(*toy["abstract"],
                             compile_each=lambda program: events.append("compile"))
    assert events == ["compile", "trace update", "compile"]
    compiled = [program.compile() for program in programs]
    outputs = compiled[1](toy["args"][0], *compiled[0](*toy["args"][:2]), toy["args"][2])
    reference = toy["compile"](None).run(*toy["args"])
    for a, b in zip(jax.tree.leaves(outputs), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_step_is_stored_once_store_after_is_done(toy, tmp_path):
    """With ``store_after``, the compiled step is handed out at once and written only when that
    future is done (serialising holds the interpreter lock, which the training loop needs)."""
    import concurrent.futures

    gate = concurrent.futures.Future()
    step = MeshStep(least_squares_step(), toy["abstract"][0], toy["mesh"], MeshConfig().rules)
    compiled = step.compile_async(*toy["abstract"], cache=ExecutableCache(tmp_path),
                                  description="toy", store_after=gate).result()
    compiled.run(*toy["args"])
    time.sleep(0.5)
    assert not compiled.stored.done() and not list(tmp_path.glob("*.executable"))
    gate.set_result(None)
    assert compiled.stored.result(timeout=60) in list(tmp_path.glob("*.executable"))


def test_a_kept_value_is_made_once_again_when_damaged_and_the_oldest_go(tmp_path, monkeypatch):
    made = []

    def make():
        made.append(1)
        return {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32), "axes": PartitionSpec("embed")}

    key = value_key("toy")
    assert key == value_key("toy") != value_key("toy, another config")
    first = load_or_make(tmp_path, key, make)
    assert load_or_make(tmp_path, key, make) == first and len(made) == 1
    (path,) = tmp_path.glob("*.pickle")
    path.write_bytes(path.read_bytes()[:10])
    assert load_or_make(tmp_path, key, make) == first and len(made) == 2
    monkeypatch.setattr(executable_cache, "KEEP_VALUES", 2)
    for other in ("b", "c"):
        time.sleep(0.01)  # distinct modification times
        load_or_make(tmp_path, value_key(other), make)
    assert {p.stem for p in tmp_path.glob("*.pickle")} == {value_key("b"), value_key("c")}


def test_variable_shapes_trace_the_initialiser_once_per_model(tmp_path, monkeypatch):
    """The training loop's variable shapes: traced on a miss, read back on a hit, equal either
    way; another model is another key."""
    import k3jax.model
    from k3jax.config import ModelConfig
    from k3jax.train.loop import variable_shapes

    traced = []
    abstract = k3jax.model.abstract_variables_and_axes

    def counting(*args):
        traced.append(args)
        return abstract(*args)

    monkeypatch.setattr(k3jax.model, "abstract_variables_and_axes", counting)
    cfg = ModelConfig(d_model=32, num_layers=2)
    fresh = variable_shapes(cfg, (1, 8), None)
    assert variable_shapes(cfg, (1, 8), tmp_path) == fresh and len(traced) == 2
    assert variable_shapes(cfg, (1, 8), tmp_path) == fresh and len(traced) == 2
    variable_shapes(dataclasses.replace(cfg, d_model=64), (1, 8), tmp_path)
    assert len(traced) == 3


def test_the_environment_does_not_change_when_the_kernels_are_imported():
    """The kernels' modules are imported on first use, inside a trace: on a GPU the first trace
    of the MoE imports jax's Mosaic ragged dot, which imports jax's test utilities and their
    options. A run that traced before computing its key and a resumed one that did not must
    agree, so importing every module a step can import late changes nothing the key reads (jax's
    Mosaic GPU module also sets environment variables, NVSHMEM's paths among them where NVSHMEM is
    installed). In a fresh process (the suite itself imports them) that looks like a GPU machine's:
    a stand-in NVSHMEM package, and jax's backend named "gpu" for the key, which on the CPU does
    not import the Mosaic GPU module (no trace there imports it)."""
    code = ("import importlib, json, pkgutil, sys, types\n"
            "nvidia, nvshmem = types.ModuleType('nvidia'), types.ModuleType('nvidia.nvshmem')\n"
            "nvidia.__path__, nvshmem.__path__, nvidia.nvshmem = [], ['/opt/nvshmem'], nvshmem\n"
            "sys.modules.update({'nvidia': nvidia, 'nvidia.nvshmem': nvshmem})\n"
            "import jax\n"
            "from k3jax.parallel.executable_cache import environment\n"
            "def read():\n"
            "    env = environment()\n"
            "    return {'options': env['options'], 'env': env['env']}\n"
            "read()\n"
            "assert 'jax.experimental.mosaic.gpu' not in sys.modules  # no start-up cost on CPUs\n"
            "jax.default_backend = lambda: 'gpu'\n"
            "before = read()\n"
            "for package in ('pallas_kernels', 'k3jax.ops'):\n"
            "    path = importlib.import_module(package).__path__\n"
            "    for m in pkgutil.iter_modules(path):\n"
            "        importlib.import_module(f'{package}.{m.name}')\n"
            "import jax.experimental.pallas.ops.gpu.ragged_dot_mgpu\n"
            "import jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu\n"
            "import jax._src.test_util\n"
            "print(json.dumps([before, read()]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), check=True)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert "MOSAIC_GPU_NVSHMEM_SO_PATH" in after["env"]  # the stand-in took effect
    assert before == after


def test_a_miss_names_the_parts_of_the_key_that_changed(toy, tmp_path, monkeypatch):
    """A compiled step says why it was not loaded: the names of the key's parts in which the most
    recently used stored step differs (nothing stored: nothing to name)."""
    cache = ExecutableCache(tmp_path)
    assert toy["compile"](cache).differs == ()
    assert toy["compile"](cache).differs == ()  # loaded
    assert toy["compile"](cache, description="toy, another config").differs == ("program",)
    monkeypatch.setenv("JAX_K3JAX_TEST_MARK", "1")
    monkeypatch.setattr(executable_cache, "KEEP", 2)
    assert toy["compile"](cache, description="toy, another config").differs == (
        "env.JAX_K3JAX_TEST_MARK",)
    # The oldest program went, and its parts with it.
    stems = {p.stem for p in tmp_path.glob("*.executable")}
    assert len(stems) == 2 and {p.stem for p in tmp_path.glob("*.json")} == stems


def test_the_miss_line_names_the_first_parts_and_counts_the_rest():
    from k3jax.train.loop import MISS_NAMES, miss_line

    assert miss_line(("env.XLA_FLAGS",)) == (
        "[compile] no stored step matched: the most recently used one was made with other "
        "env.XLA_FLAGS (docs/runs.md)")
    names = tuple(f"options.jax_{i}" for i in range(MISS_NAMES + 3))
    line = miss_line(names)
    assert f"options.jax_{MISS_NAMES - 1} and 3 more" in line
    assert f"options.jax_{MISS_NAMES}" not in line
