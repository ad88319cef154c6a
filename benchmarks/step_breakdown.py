"""Where a preset's train step spends its time: each kind of sub-layer alone, then the whole step.

Every part is timed forward + backward (gradients with respect to its parameters and its input) at
the shape one micro-batch of the preset feeds it, jitted, median of ``--repeats`` x ``--iters``
calls. One JSON line per part::

    {"part": "kda_mixer", "count": 9, "ms": ..., "ms_all": count * ms, "share_of_grad": ...,
     "gflop": ..., "tflops": ...}

``count`` is how many of that part one micro-batch runs; ``share_of_grad`` divides ``ms_all`` by
the model gradient's time (the parts leave out AttnRes, norms and the residual mixing, so the
shares add up to less than 1: the rest is the remainder line). ``gflop`` is XLA's own count for the
compiled function (``cost_analysis``), so ``tflops`` is what the part achieves, to set against the
MFU that ``train.py`` reports (which counts model FLOPs the same way for every run). XLA counts a
custom call (the Mosaic KDA and grouped-matmul kernels) as no FLOPs and a loop body once, so parts
with kernels or scans under-report ``gflop``; their ``ms`` is exact. Parts:

- ``kda_op``: the KDA op alone (``k3jax.ops.kda.kda``, ``impl`` as configured), layer shapes;
- ``kda_mixer`` / ``mla_mixer``: the token-mixer layers (projections, convs, gates, norms, output);
- ``moe_ffn`` / ``dense_ffn``: the FFN sub-layers (router, dispatch, experts, shared MLP);
- ``lm_head``: final logits and the cross-entropy (the embedding gather is left out);
- ``optimizer``: the optimiser update on all parameters (once per step, not per micro-batch);
- ``model_grad``: the whole model's loss gradient for one micro-batch;
- ``train_step``: what ``train.py`` jits (all micro-batches, the update, the balancing).

    PYTHONPATH=. python benchmarks/step_breakdown.py                       # k3_small, its batch
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_breakdown.py --preset k3_tiny \
        --batch 2 --seq 64
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

import jax
import jax.numpy as jnp
from _timing import emit, timed
from compile_time import loss_fn

from k3jax.config.experiment import apply_overrides
from k3jax.layers.ffn import GLUMLP
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.layers.moe import MoEBlock
from k3jax.model import K3Model, init_variables, logical_axes
from k3jax.ops.kda import kda
from k3jax.train.optim import build_optimizer, schedule
from k3jax.train.step import init_state, make_train_step


def sublayer_grad(module, x, *extra, **kwargs):
    """Jitted gradient of ``mean(module(x)^2)`` w.r.t. its params and ``x``, and its arguments."""
    variables = module.init(jax.random.key(0), x, *extra, **kwargs)

    def loss(params, x):
        y, _ = module.apply({**variables, "params": params}, x, *extra, mutable=True, **kwargs)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (variables["params"], x)


def kda_op_grad(cfg, b: int, t: int):
    """The KDA op at one layer's shapes: bf16 q, k, v (q, k unit norm), the gate at its bound."""
    h, d = cfg.kda.num_heads, cfg.kda.head_dim
    keys = jax.random.split(jax.random.key(1), 3)
    unit = lambda k: (lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True))(
        jax.random.normal(k, (b, t, h, d), jnp.float32)).astype(jnp.bfloat16)
    q, k = unit(keys[0]), unit(keys[1])
    v = jax.random.normal(keys[2], (b, t, h, d), jnp.bfloat16)
    g = jnp.full((b, t, h, d), cfg.kda.lower_bound or -1.0, jnp.float32)
    beta = jnp.full((b, t, h), 0.5, jnp.float32)
    seg = jnp.zeros((b, t), jnp.int32)

    def loss(q, k, v, g, beta):
        o, _ = kda(q, k, v, g, beta, scale=d**-0.5, segment_ids=seg, impl=cfg.kda.impl)
        return jnp.mean(jnp.square(o.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), (q, k, v, g, beta)


def lm_head_grad(cfg, b: int, t: int):
    """Logits ``h W_vocab`` and the mean cross-entropy, gradient w.r.t. ``h`` and ``W_vocab``."""
    h = jax.random.normal(jax.random.key(2), (b, t, cfg.d_model), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (cfg.d_model, cfg.vocab_size), jnp.float32) * 0.02
    targets = jax.random.randint(jax.random.key(4), (b, t), 0, cfg.vocab_size)

    def loss(h, w):
        logits = (h @ w.astype(h.dtype)).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (h, w)


def parts(cfg_exp, b: int, t: int):
    """``(name, count, jitted fn, args)`` for every part (built lazily: one compiles at a time)."""
    cfg = cfg_exp.model
    n_kda = sum(x == "kda" for x in cfg.layer_types)
    n_moe = sum(x == "moe" for x in cfg.mlp_types)
    x = jax.random.normal(jax.random.key(5), (b, t, cfg.d_model), jnp.bfloat16)
    seg = jnp.zeros((b, t), jnp.int32)
    yield "kda_op", n_kda, lambda: kda_op_grad(cfg, b, t)
    yield "kda_mixer", n_kda, lambda: sublayer_grad(KDALayer(cfg), x, seg)
    yield "mla_mixer", cfg.num_layers - n_kda, lambda: sublayer_grad(MLALayer(cfg), x, seg)
    if cfg.moe is not None:
        yield "moe_ffn", n_moe, lambda: sublayer_grad(MoEBlock(cfg), x, deterministic=False)
    dense = cfg.dense_ffn
    yield "dense_ffn", cfg.num_layers - n_moe, lambda: sublayer_grad(
        GLUMLP(cfg.d_model, dense.intermediate_size, dense.activation, dtype=cfg.dtype,
               param_dtype=cfg.param_dtype), x)
    yield "lm_head", 1, lambda: lm_head_grad(cfg, b, t)


def whole(cfg_exp, b: int, t: int, micro: int):
    """The optimiser update, the model gradient (one micro-batch) and the train step, as parts."""
    cfg = cfg_exp.model
    model = K3Model(cfg)
    variables = jax.jit(init_variables, static_argnums=(0,))(cfg, jax.random.key(0))
    params, balance = variables["params"], variables.get("balance", {})
    tokens = jax.random.randint(jax.random.key(6), (b * micro, t), 0, cfg.vocab_size)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1),
             "segment_ids": jnp.zeros_like(tokens), "weights": jnp.ones(tokens.shape, jnp.float32)}
    axes = logical_axes(cfg, (b, t))["params"]
    optimizer = build_optimizer(cfg_exp.optim, cfg_exp.train.steps, params, axes)
    state = init_state(params, balance, optimizer, cfg_exp.train.seed)

    def update(grads, opt_state, params):
        return optimizer.update(grads, opt_state, params)

    yield "optimizer", 1, lambda: (jax.jit(update), (params, state["opt_state"], params))
    micro_batch = {k: v[:b] for k, v in batch.items()}
    yield "model_grad", micro, lambda: (jax.jit(jax.grad(loss_fn(model))),
                                        (params, balance, micro_batch))
    step = make_train_step(model, optimizer, schedule(cfg_exp.optim, cfg_exp.train.steps),
                           micro, cfg.moe)
    yield "train_step", 1, lambda: (jax.jit(step), (state, batch))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k3_small", help="module in configs/ (get_config())")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the preset's)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = apply_overrides(importlib.import_module(f"configs.{args.preset}").get_config(),
                          args.overrides)
    global_b = args.batch or cfg.data.batch_size
    t = args.seq or cfg.data.seq_len
    micro = cfg.train.micro_batches
    if global_b % micro:
        ap.error(f"--batch {global_b} is not divisible by train.micro_batches={micro}")
    b = global_b // micro
    skip = set(filter(None, args.skip.split(",")))
    emit({"bench": "setup", "preset": args.preset, "batch": global_b, "micro_batches": micro,
          "seq": t, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
          "overrides": args.overrides})
    rows, grad_ms = [], None
    for name, count, build in (*parts(cfg, b, t), *whole(cfg, b, t, micro)):
        if name in skip or count == 0:
            continue
        row = {"part": name, "count": count}
        try:
            fn, fn_args = build()
            cost = fn.lower(*fn_args).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            row["ms"] = round(timed(fn, fn_args, args.iters, args.repeats), 3)
            row["ms_all"] = round(row["ms"] * count, 3)
            flops = (cost or {}).get("flops")
            if flops:
                row["gflop"] = round(flops / 1e9, 2)
                row["tflops"] = round(flops / row["ms"] / 1e9, 2)
        except Exception as e:  # noqa: BLE001 - report and go on with the other parts
            traceback.print_exc(file=sys.stderr)
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        if name == "model_grad" and "ms_all" in row:
            grad_ms = row["ms_all"]
        rows.append(row)
    for row in rows:
        per_micro_batch = row["part"] not in ("model_grad", "train_step", "optimizer")
        if grad_ms and "ms_all" in row and per_micro_batch:
            row["share_of_grad"] = round(row["ms_all"] / grad_ms, 3)
        emit(row)
    covered = sum(r.get("ms_all", 0) for r in rows
                  if r["part"] in ("kda_mixer", "mla_mixer", "moe_ffn", "dense_ffn", "lm_head"))
    if grad_ms:
        emit({"part": "remainder", "ms_all": round(grad_ms - covered, 3),
              "share_of_grad": round(1 - covered / grad_ms, 3),
              "note": "AttnRes, norms, embedding, residual mixing and what the parts miss"})


if __name__ == "__main__":
    main()
