"""Host memory and time of ``from-hf``'s streaming import on a Kimi-Linear-shaped model.

Builds a random model of the released Kimi Linear recipe at a smaller width (``--d-model``,
``--layers``, ``--experts``, ``--vocab``), writes it in the released layout (bf16, shards of
``--shard-mb``), then imports it in a fresh process and prints one JSON line::

    {"params": N, "file_bytes": ..., "shards": ..., "largest_tensor_bytes": ...,
     "variables_bytes": ..., "import_s": ..., "import_cpu_s": ..., "rss_before_bytes": ...,
     "peak_rss_bytes": ...,
     "host_numpy_peak_bytes": ..., "backend": ...}

``variables_bytes`` is what the imported variables occupy on the devices (on a CPU backend the
devices are host memory, so they are part of the RSS); ``host_numpy_peak_bytes`` is the peak of the
host buffers the import itself allocates (tracemalloc: numpy reports its buffers there, XLA's
device buffers are not counted), i.e. what streaming keeps beyond the target arrays;
``import_cpu_s`` is the CPU time of the importing process (all threads), a better guide than the
wall clock on a shared machine.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/convert_import.py
    PYTHONPATH=. python benchmarks/convert_import.py --d-model 2304 --layers 8 --experts 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def build(args, directory: Path) -> dict:
    import jax
    import numpy as np

    from configs.kimi_linear_48b import model_config
    from k3jax.convert import export_variables
    from k3jax.convert.files import HFDirectory
    from k3jax.model import init_variables

    base = model_config()
    cfg = base.replace(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                       moe=dataclasses.replace(base.moe, num_experts=args.experts),
                       dense_ffn=dataclasses.replace(base.dense_ffn,
                                                     intermediate_size=4 * args.d_model))
    variables = init_variables(cfg, jax.random.key(0))
    export_variables(variables, cfg, directory, max_shard_bytes=args.shard_mb * 2**20)
    files = HFDirectory(directory)
    sizes = {n: int(np.prod(s)) * (4 if files.dtypes[n] == "F32" else 2)
             for n, s in files.shapes.items()}
    return {"params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"])),
            "file_bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors")),
            "shards": len(files.shards()), "largest_tensor_bytes": max(sizes.values())}


def _status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process (Linux). Unlike ``ru_maxrss``, the high-water mark
    starts afresh at ``exec``, so the parent's memory does not leak into the measurement."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(directory: Path) -> dict:
    import jax

    from k3jax.convert import load_variables, read_config

    cfg, layout = read_config(directory)
    rss_before = _status_bytes("VmRSS")
    tracemalloc.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    variables = jax.block_until_ready(load_variables(directory, cfg, layout))
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    _, host_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"import_s": seconds, "import_cpu_s": cpu_seconds, "rss_before_bytes": rss_before,
            "peak_rss_bytes": _status_bytes("VmHWM"),
            "host_numpy_peak_bytes": host_peak,
            "variables_bytes": sum(x.nbytes for x in jax.tree.leaves(variables)),
            "backend": jax.default_backend()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # the fresh import process
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        record = build(args, Path(tmp))
        child = subprocess.run([sys.executable, __file__, "--measure", tmp], check=True,
                               capture_output=True, text=True)
        record.update(json.loads(child.stdout.strip().splitlines()[-1]))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
