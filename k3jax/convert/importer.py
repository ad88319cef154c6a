"""Hugging Face safetensors -> k3jax variables and an ordinary k3jax checkpoint (a workdir).

The import checks every name and shape from the file headers before reading any data, then streams:
the target variables are allocated on the devices in their final sharding (zeros), and the shards
are read one after another, each tensor copied out, changed to the k3jax layout (transposes, conv
and ``A_log`` reshapes, MXFP4 decoding) and written into its slot of the device array (a scanned
layer or one expert of a stacked expert tensor) by a jitted in-place update. The host holds one
tensor at a time, never the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert.errors import ConversionError
from k3jax.convert.exporter import HF_CONFIG
from k3jax.convert.files import HFDirectory
from k3jax.convert.hf_config import config_from_hf
from k3jax.convert.names import IGNORED_PREFIXES, Entry, canonical, layer_places, place, tensor_map

PACKED, SCALE = ".weight_packed", ".weight_scale"
# safetensors dtypes a plain tensor may have: it is cast to the variable's dtype when read
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def read_config(hf_dir: str | Path) -> tuple[ModelConfig, str]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    return config_from_hf(json.loads(path.read_text()))


def match_tensors(files: HFDirectory, entries: list[Entry], layout: str) -> dict[str, tuple]:
    """``entry name -> ("plain", file name)`` or ``("mxfp4", packed name, scale name)``.

    Raises :class:`ConversionError` listing every missing, unknown, mis-shaped and mis-typed
    tensor (from the headers: no data is read).
    """
    want = {e.name: e for e in entries}
    sources, unknown, bad, typed = {}, [], [], []
    for name in sorted(files.shapes):
        if name.startswith(IGNORED_PREFIXES[layout]):
            continue
        base = name[:-len(PACKED)] + ".weight" if name.endswith(PACKED) else None
        if name.endswith(SCALE) and (name[:-len(SCALE)] + PACKED) in files.shapes:
            continue  # read with its packed partner
        key = canonical(base or name, set(want))
        if key not in want or key in sources:
            unknown.append(name)
            continue
        e = want[key]
        if base is None:
            sources[key] = ("plain", name)
            if not _shape_ok(e, files.shapes[name]):
                bad.append(f"{name}: {files.shapes[name]}, expected {e.shape}")
            if files.dtypes[name] not in FLOAT_DTYPES:
                typed.append(f"{name}: {files.dtypes[name]}, expected one of "
                             f"{', '.join(FLOAT_DTYPES)}")
            continue
        scale = name[:-len(PACKED)] + SCALE
        sources[key] = ("mxfp4", name, scale)
        out, inp = e.shape
        need = {name: (out, inp // 2), scale: (out, inp // mxfp4.GROUP)}
        bad += [f"{n}: {files.shapes.get(n, 'absent')}, expected {s} (MXFP4 of {e.shape})"
                for n, s in need.items() if files.shapes.get(n) != s]
        typed += [f"{n}: {files.dtypes[n]}, expected U8 (MXFP4 codes and E8M0 scales)"
                  for n in need if files.dtypes.get(n, "U8") != "U8"]
    missing = [n for n in want if n not in sources]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
    if unknown:
        problems.append(f"unknown {len(unknown)} tensor(s): {_names(unknown)}")
    if bad:
        problems.append(f"mis-shaped {len(bad)} tensor(s): {_names(bad)}")
    if typed:
        problems.append(f"mis-typed {len(typed)} tensor(s): {_names(typed)}")
    if problems:
        raise ConversionError(f"{files.directory} does not match the {layout} model of its "
                              "config.json: " + "; ".join(problems))
    return sources


def _names(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _shape_ok(e: Entry, shape: tuple[int, ...]) -> bool:
    if e.name.endswith("A_log"):  # [1, 1, H, 1], [H], or flat with zero padding (checked on read)
        heads = e.shape[2]
        return shape == e.shape or (len(shape) == 1 and shape[0] >= heads)
    return shape == e.shape


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(full: jax.Array, part: jax.Array, index: jax.Array) -> jax.Array:
    """``full[index...] = part`` in place; ``index`` holds the leading indices (int32)."""
    n = index.shape[0]
    start = (*[index[i] for i in range(n)], *([0] * part.ndim))
    return jax.lax.dynamic_update_slice(full, part.reshape((1,) * n + part.shape), start)


def load_variables(hf_dir: str | Path, cfg: ModelConfig, layout: str, shardings=None,
                   log=lambda msg: None) -> dict:
    """``{'params', 'balance'}`` of ``cfg`` filled from ``hf_dir``, shard by shard.

    ``shardings``: a tree of ``jax.sharding.Sharding`` like the variables (None: default device).
    """
    from k3jax.model import abstract_variables

    files = HFDirectory(hf_dir)
    entries = tensor_map(cfg, layout)
    sources = match_tensors(files, entries, layout)
    abstract = abstract_variables(cfg)
    zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    variables = jax.jit(zeros, out_shardings=shardings)()
    places, by_name = layer_places(cfg), {e.name: e for e in entries}
    filled = _check_coverage(entries, places, abstract)
    first_file = {k: src[1] for k, src in sources.items()}
    names_by_shard = files.names_by_shard()
    for shard in files.shards():
        mine = [k for k, f in first_file.items() if files.shard_of[f] == shard]
        plain = {sources[k][1]: k for k in mine}
        for file_name, array in files.iter_shard(shard, sorted(plain)):
            e = by_name[plain[file_name]]
            src = sources[e.name]
            if src[0] == "mxfp4":
                array = mxfp4.dequantize(array, files.read(src[2]), np.float32, src[1])
            path, index = place(e, places)
            leaf = _get(variables, path)
            part = np.asarray(e.to_k3(array)).astype(leaf.dtype)
            if index:
                _set(variables, path, _write_slot(leaf, part, jnp.asarray(index, jnp.int32)))
            else:
                _set(variables, path, jax.device_put(part, leaf.sharding))
            filled[path] -= 1
        log(f"[from-hf] {shard}: {len(mine)} of {len(names_by_shard[shard])} tensors placed")
    if any(filled.values()):
        _unfilled(filled)
    return variables


def _check_coverage(entries, places, abstract) -> dict:
    """How many writes each variable needs (its slots); every variable must get some tensor."""
    need, depth = {}, {}
    for e in entries:
        path, index = place(e, places)
        need[path], depth[path] = need.get(path, 0) + 1, len(index)
    leaves = {tuple(getattr(k, "key", k) for k in p): x
              for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    orphans = sorted("/".join(p) for p in leaves if p not in need)
    if orphans:
        raise ConversionError(f"k3jax variables with no Hugging Face tensor: {orphans[:12]}")
    for path, n in need.items():
        slots = leaves[path].shape[:depth[path]]
        if int(np.prod(slots, dtype=np.int64)) != n:
            raise ConversionError(f"{'/'.join(path)}: {n} tensors for {slots} slots")
    return need


def _unfilled(filled: dict):
    raise ConversionError("variables left partly unwritten: "
                          f"{sorted('/'.join(p) for p, n in filled.items() if n)[:12]}")


def _get(tree: dict, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


# -- a k3jax checkpoint -------------------------------------------------------------------------

def import_hf(hf_dir: str | Path, out: str | Path, experiment=None, overrides=(),
              log=print) -> Path:
    """Write ``out`` as a k3jax training workdir (``config.json``, ``checkpoints/0`` and the source
    ``hf_config.json``, whose token ids ``to-hf`` keeps) holding the
    weights of ``hf_dir``; ``train.py --config OUT/config.json --workdir OUT`` fine-tunes it and
    ``python -m k3jax.evaluate --workdir OUT`` evaluates it.

    ``experiment``: an ExperimentConfig for everything but the model (data, optimiser, mesh; default
    the defaults); ``overrides``: ``--set`` strings applied after the model is put in.
    """
    from k3jax.config.experiment import ExperimentConfig, apply_overrides
    from k3jax.model import logical_axes
    from k3jax.parallel import make_mesh, use_mesh, variable_shardings
    from k3jax.parallel.sharding import like_params_shardings, shardings_of
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.optim import build_optimizer
    from k3jax.train.step import init_state

    model, layout = read_config(hf_dir)
    model_sets = [o for o in overrides if o.startswith("model.")]
    base = apply_overrides(experiment or ExperimentConfig(),
                           [o for o in overrides if o not in model_sets])
    exp = apply_overrides(dataclasses.replace(base, model=model), model_sets)
    out = Path(out)
    if (out / "checkpoints").exists():
        raise FileExistsError(f"{out / 'checkpoints'} exists; import into a new directory")
    mesh, rules = make_mesh(exp.mesh), exp.mesh.rules
    axes = logical_axes(exp.model)  # one trace of the model for the shardings and the optimiser
    with use_mesh(mesh, rules):
        variables = load_variables(hf_dir, exp.model, layout,
                                   variable_shardings(exp.model, mesh, rules, axes), log)
        params, balance = variables["params"], variables.get("balance", {})
        optimizer = build_optimizer(exp.optim, exp.train.steps, params, axes["params"])
        make = lambda p, b: init_state(p, b, optimizer, exp.train.seed)
        shardings = like_params_shardings(jax.eval_shape(make, params, balance), params,
                                          shardings_of(params), mesh)
        state = jax.jit(make, out_shardings=shardings)(params, balance)
    out.mkdir(parents=True, exist_ok=True)
    config = exp.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(Path(hf_dir) / "config.json", out / HF_CONFIG)
    ckpt = Checkpointer(out / "checkpoints", exp.checkpoint.keep, async_save=False, log=log)
    ckpt.save(0, state, {"config": config, "step": 0,
                         "data_position": {"batches_consumed": 0, "sequences_consumed": 0,
                                           "seed": exp.data.seed},
                         "imported_from": {"directory": str(Path(hf_dir).resolve()),
                                           "layout": layout}})
    ckpt.close()
    log(f"[from-hf] wrote {out} ({layout}, {_count(params):,} parameters)")
    return out


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


__all__ = ["ConversionError", "import_hf", "load_variables", "match_tensors", "read_config"]
