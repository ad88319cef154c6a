"""Evaluate the latest checkpoint of a run: held-out loss and bits per byte, synthetic tasks.

    python -m k3jax.evaluate --workdir runs/tiny [--tasks mqar,palindrome,stack,parity]

Prints a table and writes ``WORKDIR/eval.json``. The run's own config (``config.json``) says what
model and data to use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from k3jax.config.base import ConfigError
from k3jax.config.experiment import ExperimentConfig, from_dict
from k3jax.files import write_atomically


def recorded_config(workdir: str | Path) -> dict:
    """A training workdir's ``config.json`` as the run recorded it: the resolved config with
    ``data.corpus``, the built corpus it trained on (its directory, tokenizer kind and vocabulary
    size), which the config dataclass does not keep."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{workdir}: no config.json; is this a training workdir?")
    return json.loads(path.read_text())


def restore_workdir(workdir: str | Path, log=print) -> tuple[ExperimentConfig, dict, dict]:
    """``(config, state, meta)`` of the newest restorable checkpoint of a training workdir, every
    array on one device (no topology guess from the files)."""
    import jax

    from k3jax.train.checkpoint import Checkpointer, verify_newest_ahead

    workdir = Path(workdir)
    config = recorded_config(workdir)
    cfg: ExperimentConfig = from_dict(ExperimentConfig, config, where=str(workdir / "config.json"))
    if not (workdir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{workdir / 'checkpoints'}: no checkpoint in this workdir")
    verified = verify_newest_ahead(workdir / "checkpoints")  # hashed while the model is traced
    micro = cfg.data.batch_size // cfg.train.micro_batches
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
        _state_shapes(cfg, micro))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint.keep, log=log, verified=verified)
    restored = ckpt.restore_latest(abstract, config, move_aside=False)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{workdir / 'checkpoints'}: no checkpoint in this workdir")
    return cfg, *restored


def evaluate_workdir(workdir: str | Path, tasks: list[str], log=print) -> dict:
    import jax

    from k3jax.data import make_data
    from k3jax.model import K3Model
    from k3jax.train.evaluation import evaluate_batches, task_batches
    from k3jax.train.step import make_eval_step

    workdir = Path(workdir)
    cfg, state, meta = restore_workdir(workdir, log)
    eval_step = jax.jit(make_eval_step(K3Model(cfg.model)))
    # The checkpoint records the config as config.json does, the corpus it trained on included.
    data = make_data(_trained_on(cfg.data, meta["config"], log), cfg.model.vocab_size, workdir,
                     cfg.eval.batches, log=log)
    results = {"heldout": evaluate_batches(eval_step, state["params"], state["balance"],
                                           data.heldout)}
    for name, batches in task_batches(tasks, cfg.data.seq_len, cfg.data.batch_size,
                                      cfg.eval.batches, cfg.model.vocab_size).items():
        results[name] = evaluate_batches(eval_step, state["params"], state["balance"], batches)
    # Bits per byte only where the tokens are text (the held-out split of a corpus).
    out = {"step": int(meta["step"]), "workdir": str(workdir),
           "results": {k: {m: v[m] for m in ("loss", "bpb", "accuracy", "tokens")
                           if m != "bpb" or (k == "heldout" and data.has_bytes)}
                       for k, v in results.items()}}
    write_atomically(workdir / "eval.json", json.dumps(out, indent=1))
    return out


def _trained_on(data_cfg, config: dict, log):
    """``data_cfg`` reading the corpus the run trained on, where its recorded directory still
    holds one: a corpus built again from the sources would hold another held-out split if a
    source changed since, and a newly trained BPE."""
    corpus = (config["data"].get("corpus") or {}).get("corpus")
    if corpus is None or data_cfg.task != "corpus":
        return data_cfg
    if not (Path(corpus) / "meta.json").is_file():
        log(f"[data] the corpus the run trained on ({corpus}) is gone; building it again from "
            "the config's data fields")
        return data_cfg
    return dataclasses.replace(data_cfg, data_dir=corpus)


def _state_shapes(cfg, micro: int) -> dict:
    """The training state of ``cfg`` as shapes, from one trace of the initialiser."""
    import jax

    from k3jax.model import abstract_variables_and_axes
    from k3jax.train.optim import build_optimizer
    from k3jax.train.step import init_state

    variables, axes = abstract_variables_and_axes(cfg.model, (micro, cfg.data.seq_len))
    params = variables["params"]
    opt = build_optimizer(cfg.optim, cfg.train.steps, params, axes["params"])
    return jax.eval_shape(lambda p, b: init_state(p, b, opt, cfg.train.seed), params,
                          variables.get("balance", {}))


def format_table(out: dict) -> str:
    rows = [("eval set", "loss (nats/tok)", "bits/byte", "accuracy", "tokens")]
    for name, r in out["results"].items():
        bpb = f"{r['bpb']:.4f}" if "bpb" in r else "-"
        rows.append((name, f"{r['loss']:.4f}", bpb, f"{r['accuracy']:.4f}",
                     f"{int(r['tokens']):,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"checkpoint step {out['step']} of {out['workdir']}"]
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.evaluate", description=__doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tasks", default="", help="comma-separated synthetic tasks "
                        "(mqar, palindrome, stack, parity)")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    from k3jax.data.synthetic import TASKS

    bad = [t for t in tasks if t not in TASKS]
    if bad:
        print(f"error: --tasks {bad}: unknown; expected from {sorted(TASKS)}", file=sys.stderr)
        return 2
    try:
        out = evaluate_workdir(args.workdir, tasks, log=lambda m: print(m, file=sys.stderr))
    except (FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(out))
    print(f"wrote {Path(args.workdir) / 'eval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
