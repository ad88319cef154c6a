"""k3jax variables or checkpoint -> a Hugging Face Kimi Linear directory transformers loads.

Writes ``config.json`` (:func:`~k3jax.convert.hf_config.config_to_hf`) and the released tensor
layout (:mod:`k3jax.convert.names`), in bf16 by default with the router, its bias and the KDA
``dt_bias`` kept in fp32 as transformers keeps them, sharded with an index. Tensors are produced one
at a time from the (device) variables and each shard is written once it is complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert.files import write_sharded
from k3jax.convert.hf_config import config_to_hf
from k3jax.convert.names import layer_places, place, tensor_map

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30
HF_CONFIG = "hf_config.json"  # an imported workdir's copy of the source config.json


def _check_out(out: Path) -> None:
    """A FileExistsError unless ``out`` is absent or an empty directory: shards or an index that
    an earlier export left there would be read with (an index: instead of) the new files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} is not empty; export into a new or empty directory "
                              "(files of an earlier export there would be read with the new ones)")


def export_variables(variables: dict, cfg: ModelConfig, out: str | Path, dtype: str = "bfloat16",
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     original_config: dict | None = None) -> list[str]:
    """Write ``variables`` (``{'params', 'balance'}``, scanned layout) of ``cfg`` to ``out``;
    ``original_config`` (an imported file's config.json) supplies the token ids."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    out = Path(out)
    _check_out(out)
    # fails naming what the layout cannot hold, before any write
    hf_config = config_to_hf(cfg, original_config)
    entries, places = tensor_map(cfg, "kimi_linear"), layer_places(cfg)
    kinds = {e.name: np.float32 if e.keep_fp32 else DTYPES[dtype] for e in entries}
    sizes = {e.name: int(np.prod(e.shape)) * np.dtype(kinds[e.name]).itemsize for e in entries}

    variables = jax.device_get(variables)  # host arrays: slicing them compiles nothing

    def tensors():
        for e in entries:
            path, index = place(e, places)
            leaf = variables
            for k in path:
                leaf = leaf[k]
            part = np.asarray(leaf[index] if index else leaf, np.float32)
            yield e.name, np.ascontiguousarray(e.to_hf(part)).astype(kinds[e.name])

    out.mkdir(parents=True, exist_ok=True)
    files = write_sharded(out, tensors(), sizes, max_shard_bytes)
    (out / "config.json").write_text(json.dumps({**hf_config, "dtype": dtype}, indent=2))
    return files


def export_hf(workdir: str | Path, out: str | Path, dtype: str = "bfloat16",
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, log=print) -> list[str]:
    """The newest checkpoint of a k3jax workdir -> a Hugging Face Kimi Linear directory (token ids
    from the workdir's ``hf_config.json`` when it was imported)."""
    from k3jax.config.experiment import load_config
    from k3jax.evaluate import restore_workdir

    workdir = Path(workdir)
    _check_out(Path(out))
    original = workdir / HF_CONFIG
    original_config = json.loads(original.read_text()) if original.is_file() else None
    if (workdir / "config.json").is_file():  # else restoring says what is missing
        # a model the layout cannot hold is refused before its checkpoint is read
        config_to_hf(load_config(workdir / "config.json").model, original_config)
    cfg, state, meta = restore_workdir(workdir, log=log)
    files = export_variables({"params": state["params"], "balance": state["balance"]}, cfg.model,
                             out, dtype, max_shard_bytes, original_config)
    log(f"[to-hf] step {meta['step']} of {workdir} -> {out} ({len(files)} file(s), {dtype})")
    return files


__all__ = ["export_hf", "export_variables"]
