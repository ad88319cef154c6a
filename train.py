"""Train a K3 model from a config file.

    python train.py --config configs/k3_tiny.py --workdir runs/tiny [--set train.steps=500 ...]

The preset file's ``get_config()`` gives the experiment; ``--set`` overrides any field by its dotted
name. Running the same command again resumes from the newest checkpoint in the workdir. A mistake
in what is asked (config, workdir, data, a resume the checkpoint does not allow) is one ``error:``
line and exit status 2, before anything compiles; a run that fails later exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3jax.config import ConfigError
from k3jax.config.experiment import apply_overrides, load_config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="a preset file defining get_config(), or a preset's name (k3_tiny)")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics and plots go here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set model.d_model=256 (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = apply_overrides(load_config(args.config), args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # imports JAX: after the config is known good
    from k3jax.parallel.compile_cache import use_compilation_cache
    from k3jax.train import CheckpointSaveError, NonFiniteError, run

    # Compiled programs are cached next to the runs, so a resumed or repeated run starts at once
    # (docs/runs.md: jax's cache, the train step under a key known before tracing, and the XLA
    # autotuning results k3jax ships).
    use_compilation_cache(Path(args.workdir).resolve().parent / ".jax_cache")

    try:
        run(config, args.workdir)
    except ConfigError as e:  # a mistake in what was asked: found before anything compiled
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteError, CheckpointSaveError) as e:  # the run itself failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
