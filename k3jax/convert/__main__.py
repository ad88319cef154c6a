"""Hugging Face checkpoints in and out.

    python -m k3jax.convert from-hf HF_DIR --out WORKDIR [--config PRESET] [--set KEY=VALUE ...]
    python -m k3jax.convert to-hf WORKDIR --out HF_DIR [--dtype bfloat16] [--max-shard-gb 5]

``from-hf`` reads a Kimi Linear or Kimi K3 directory (``config.json`` and safetensors, sharded or
not) and writes a k3jax training workdir: ``config.json`` and the step-0 checkpoint. The preset
gives everything but the model (data, optimiser, mesh); ``--set`` overrides any field, e.g.
``--set model.dtype=float32``. ``to-hf`` writes the newest checkpoint of a workdir as a Kimi Linear
directory that transformers loads.
"""

from __future__ import annotations

import argparse
import sys

from k3jax.config import ConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.convert",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory -> k3jax workdir")
    a.add_argument("hf_dir")
    a.add_argument("--out", required=True, help="the new workdir")
    a.add_argument("--config", help="preset name (k3_small), preset file or config.json giving "
                   "data, optimiser and mesh")
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    b = sub.add_parser("to-hf", help="k3jax workdir -> Hugging Face Kimi Linear directory")
    b.add_argument("workdir")
    b.add_argument("--out", required=True, help="a new or empty directory")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    b.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)
    from k3jax.convert import ConversionError, export_hf, import_hf

    try:
        if args.command == "from-hf":
            from k3jax.config.experiment import load_config

            base = load_config(args.config) if args.config else None
            import_hf(args.hf_dir, args.out, base, args.overrides, log=log)
        else:
            if not args.max_shard_gb > 0:
                raise ConfigError(f"--max-shard-gb={args.max_shard_gb!r} is invalid: expected a "
                                  "positive size in GiB")
            export_hf(args.workdir, args.out, args.dtype, int(args.max_shard_gb * 2**30), log=log)
    except (ConfigError, ConversionError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
