"""What Attention Residuals add to a training step: plain residual vs AttnRes on one preset.

One JSON line per variant (residual rule x remat policy) with the compiled step's memory
(``memory_analysis()``: temporaries, arguments, outputs), the seconds of each compile stage (trace,
lower, XLA's compile, their total) and the median step time, then one line per remat policy with
AttnRes over plain. The step is ``value_and_grad`` of the mean next-token loss with respect to all
parameters (no optimiser), jitted; the model and its weights are identical apart from the residual
rule (the AttnRes queries and key-norm weights exist only in the AttnRes model). A throw-away
compile of the first variant comes first: the process's first compile carries one-off costs that
would otherwise count against whichever variant is measured first.

    python benchmarks/attnres.py [--config k3_small] [--batch 1] [--seq 256] [--no-moe]
                                 [--remat none,full] [--block-layers N] [--set model.KEY=VALUE]
                                 [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from _timing import compile_stages, output, timed

from k3jax.config import ResidualConfig
from k3jax.config.experiment import apply_overrides, load_config
from k3jax.model import K3Model
from k3jax.ops.cross_entropy import token_nats
from k3jax.parallel import init_on_one_device
from k3jax.stack import plan_segments


def variant_config(base, residual: str, remat: str, block_layers: int | None, no_moe: bool):
    cfg = base.replace(remat=remat)
    if no_moe:
        cfg = cfg.replace(moe=None, first_k_dense=cfg.num_layers)
    if residual == "plain":
        return cfg.replace(residual=ResidualConfig(kind="plain"))
    if block_layers is not None:
        return cfg.replace(residual=ResidualConfig(kind="attnres", block_size_layers=block_layers))
    if cfg.residual.kind != "attnres":
        raise SystemExit("the preset has no AttnRes block size: pass --block-layers")
    return cfg


def make_step(cfg):
    model = K3Model(cfg)

    def loss(params, balance, tokens):
        variables = {"params": params, **({"balance": balance} if balance else {})}
        return jnp.mean(token_nats(model.apply(variables, tokens[:, :-1]), tokens[:, 1:]))

    return jax.jit(jax.value_and_grad(loss))


def compile_step(cfg, batch: int, seq: int):
    """The step compiled for a random batch -> ``(compiled, its arguments, compile_stages' seconds
    by stage)``."""
    variables = init_on_one_device(cfg, jax.random.key(0))
    args = (variables["params"], variables.get("balance", {}),
            jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size))
    step = make_step(cfg)
    compiled, stages = compile_stages(lambda: step.trace(*args))
    del stages["temp_GiB"]  # in MiB below, with the other sizes
    return compiled, args, stages


def measure(cfg, batch: int, seq: int, repeats: int) -> dict:
    compiled, args, stages = compile_step(cfg, batch, seq)
    mem = compiled.memory_analysis()
    return {"params": int(sum(x.size for x in jax.tree.leaves(args[0]))), **stages,
            "step_ms": round(timed(compiled, args, 1, repeats), 2),
            "temp_MiB": round(mem.temp_size_in_bytes / 2**20, 2),
            "argument_MiB": round(mem.argument_size_in_bytes / 2**20, 2),
            "output_MiB": round(mem.output_size_in_bytes / 2**20, 2)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3_small", help="a preset's name or a config file")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--remat", default="none,full")
    p.add_argument("--block-layers", type=int, default=None,
                   help="AttnRes block size in decoder layers (default: the preset's)")
    p.add_argument("--no-moe", action="store_true", help="make every FFN dense")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override as in train.py, e.g. model.num_layers=2 "
                        "(repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base = apply_overrides(load_config(args.config), args.overrides).model
    remats = args.remat.split(",")
    configs = {(remat, residual): variant_config(base, residual, remat, args.block_layers,
                                                 args.no_moe)
               for remat in remats for residual in ("plain", "attnres")}
    # The throw-away compile: the same program as the first one measured, so that it pays every
    # one-off cost that program would (a persistent compilation cache would turn the measured
    # compile into a load, hence it is off). On a GPU, XLA also keeps its autotuning results for
    # the process, so there the fusions a variant shares with one compiled before it are not
    # tuned again.
    jax.config.update("jax_enable_compilation_cache", False)
    compile_step(configs[remats[0], "plain"], args.batch, args.seq)
    with output(args.out) as emit:
        for remat in remats:
            row = {}
            for residual in ("plain", "attnres"):
                cfg = configs[remat, residual]
                plans = plan_segments(cfg)
                row[residual] = {
                    "bench": "attnres", "preset": args.config, "backend": jax.default_backend(),
                    "residual": residual, "block_sublayers": cfg.residual.block_sublayers,
                    "remat": remat, "moe": cfg.moe is not None, "batch": args.batch,
                    "seq": args.seq, "dtype": cfg.dtype, "scans": sum(p.repeats > 0 for p in plans),
                    "scanned_layers": sum(p.scan_stop - p.scan_start for p in plans),
                    **measure(cfg, args.batch, args.seq, args.repeats)}
                emit(row[residual])
            a, b = row["attnres"], row["plain"]
            emit({"bench": "attnres_vs_plain", "remat": remat,
                  "step_time_ratio": round(a["step_ms"] / b["step_ms"], 3),
                  "compile_time_ratio": round(a["total_s"] / b["total_s"], 3),
                  "extra_temp_MiB": round(a["temp_MiB"] - b["temp_MiB"], 2),
                  "temp_ratio": round(a["temp_MiB"] / max(b["temp_MiB"], 1e-9), 3),
                  "extra_params": a["params"] - b["params"]})


if __name__ == "__main__":
    main(sys.argv[1:])
