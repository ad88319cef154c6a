"""The jitted training step and the evaluation step.

One optimiser step = ``M`` micro-batches (gradient accumulation): the gradients are summed with each
micro-batch's loss scaled by its share of the step's predicted tokens, so the result equals one
full-batch step. MoE balancing statistics are added across micro-batches and the router bias moves
once, after the step (it selected with the old bias throughout). A non-finite loss or gradient
keeps the old parameters, optimiser state and bias, and counts the step in ``bad_steps``
(consecutive) and ``skipped`` (total); the loop stops the run when ``bad_steps`` grows too large.

State (a plain dict, checkpointed as is)::

    step [] int32, params, opt_state, balance (MoE router biases, {} without MoE),
    rng [2] uint32 (per-step keys are fold_in(rng, step)), bad_steps [] int32, skipped [] int32

A batch is a dict of ``[B, T]`` arrays ``tokens``, ``targets``, ``segment_ids``, ``weights``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from k3jax.ops import balancing
from k3jax.ops.cross_entropy import token_nats
from k3jax.train.optim import build_optimizer, learning_rate

MUTABLE = ["balance_stats", "diagnostics", "losses"]
BATCH_KEYS = ("tokens", "targets", "segment_ids", "weights")


def init_state(params: dict, balance: dict, optimizer: optax.GradientTransformation,
               seed: int) -> dict:
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer.init(params), "balance": balance,
            "rng": jax.random.PRNGKey(seed), "bad_steps": jnp.zeros((), jnp.int32),
            "skipped": jnp.zeros((), jnp.int32)}


def _is_stats(x) -> bool:
    return isinstance(x, dict) and "load" in x


def _variables(params, balance):
    return {"params": params, "balance": balance} if balance else {"params": params}


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One optimiser step as two functions, ``step(state, batch, schedule) -> (state, metrics)``
    when called.

    ``gradients(state, batch) -> (grads, out)``: the summed micro-batch gradients (the parameters'
    shapes, fp32) and ``out`` (``sum_nats``, ``aux``, ``tokens``, MoE ``stats``, ``diag``).
    ``update(state, grads, out, schedule) -> (state, metrics)``: the optimiser, the router biases
    and the finite-step guard. Jitted as one function they are one program; the training loop
    jits and compiles them as two (:class:`~k3jax.parallel.step.MeshStep`), at once: on an H200 the
    two compiles of ``k3_small``'s step overlap in 55 s where the single program took 80 s.
    """

    gradients: Callable
    update: Callable

    def __call__(self, state, batch, schedule):
        grads, out = self.gradients(state, batch)
        return self.update(state, grads, out, schedule)


def make_train_step(model, optim_cfg, micro_batches: int, moe_cfg=None, axes=None) -> TrainStep:
    """-> the :class:`TrainStep` ``step(state, batch, schedule) -> (state, metrics)``, to be jitted
    by the caller.

    ``model`` is a ``K3Model``; ``optim_cfg`` the OptimConfig (the optimiser of
    :func:`~k3jax.train.optim.build_optimizer`; ``axes`` the parameters' logical axis names, for
    Muon); ``moe_cfg`` the MoEConfig when the model has one (bias updates). ``schedule`` is
    :func:`~k3jax.train.optim.schedule_args` of the run: data, so the compiled step does not depend
    on the learning rate or the number of steps.
    """

    def micro_loss(params, balance, mb, total_tokens, rng):
        logits, mut = model.apply(_variables(params, balance), mb["tokens"],
                                  segment_ids=mb["segment_ids"], deterministic=False,
                                  mutable=MUTABLE, rngs={"dropout": rng})
        sum_nats = jnp.sum(token_nats(logits, mb["targets"]) * mb["weights"])
        aux = sum((jnp.sum(x) for x in jax.tree.leaves(mut.get("losses", {}))), jnp.float32(0))
        # Scaled so the micro-batch gradients add up to the full batch's mean-token gradient.
        loss = sum_nats / total_tokens + aux / micro_batches
        return loss, {"sum_nats": sum_nats, "aux": aux,
                      "stats": mut.get("balance_stats", {}), "diag": mut.get("diagnostics", {})}

    # jit: the scan path traces it for shapes and again in the scan body; the second is a cache hit.
    grad_fn = jax.jit(jax.grad(micro_loss, has_aux=True))
    # Exact QB keeps every margin, so its statistics grow per micro-batch: no scan carry for it.
    scan_micro = micro_batches > 1 and not (moe_cfg is not None and moe_cfg.balancing == "quantile")

    def gradients(state, batch):
        params, balance = state["params"], state["balance"]
        mbs = {k: split_micro(batch[k], micro_batches) for k in BATCH_KEYS}
        total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        rng = jax.random.fold_in(state["rng"], state["step"])
        keys = jax.random.split(rng, micro_batches)

        if scan_micro:
            def body(carry, xs):
                (mb, key) = xs
                g, o = grad_fn(params, balance, mb, total, key)
                with jax.named_scope("accumulate"):
                    return (jax.tree.map(jnp.add, carry[0], g), _add_out(carry[1], o)), None
            # Every micro-batch runs inside the scan, from a zero carry: one copy of the model's
            # forward and backward in the program (compile time), not one more for the first.
            shapes = jax.eval_shape(grad_fn, params, balance, _index(mbs, 0), total, keys[0])
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (grads, out), _ = jax.lax.scan(body, zeros, (mbs, keys))
        else:
            grads, out = grad_fn(params, balance, _index(mbs, 0), total, keys[0])
            for i in range(1, micro_batches):
                g, o = grad_fn(params, balance, _index(mbs, i), total, keys[i])
                grads, out = jax.tree.map(jnp.add, grads, g), _add_out(out, o)
        if micro_batches > 1:
            out["diag"] = jax.tree.map(lambda x: x / micro_batches, out["diag"])
        return grads, {**out, "tokens": total}

    # The named scopes label the update's parts in a profile (benchmarks/step_profile.py): outside
    # the model, its fusions would otherwise all read as their bare op (reduce_sum, add, select_n).
    def update(state, grads, out, schedule):
        params, balance = state["params"], state["balance"]
        # The optimiser's own count, which the finite guard below holds back on a skipped step.
        count = state["step"] - state["skipped"]
        optimizer = build_optimizer(optim_cfg, None, params, axes, args=schedule)
        loss = out["sum_nats"] / out["tokens"]
        with jax.named_scope("grad_norm"):
            grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(out["aux"]) & jnp.isfinite(grad_norm)
        with jax.named_scope("optimizer"):
            updates, opt_state = optimizer.update(grads, state["opt_state"], params)
            new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
        with jax.named_scope("router_bias"):
            new["balance"] = (balancing.update_balance(balance, out["stats"], moe_cfg)
                              if balance else balance)
        with jax.named_scope("finite_guard"):
            new = jax.tree.map(lambda n, o: jnp.where(ok, n, o),
                               new, {k: state[k] for k in new})
        state = {**state, **new, "step": state["step"] + 1,
                 "bad_steps": jnp.where(ok, 0, state["bad_steps"] + 1),
                 "skipped": state["skipped"] + (~ok).astype(jnp.int32)}
        metrics = {"loss": loss, "aux_loss": out["aux"], "sum_nats": out["sum_nats"],
                   "tokens": out["tokens"], "grad_norm": grad_norm,
                   "lr": learning_rate(optim_cfg.schedule, count, schedule),
                   "finite": ok, "bad_steps": state["bad_steps"],
                   "maxvio": balancing.balance_metrics(out["stats"]), "diag": out["diag"]}
        return state, metrics

    return TrainStep(gradients, update)


def make_eval_step(model):
    """-> ``eval_step(params, balance, batch) -> sums`` (nats, tokens, correct answers, diag)."""

    def eval_step(params, balance, batch):
        logits, mut = model.apply(_variables(params, balance), batch["tokens"],
                                  segment_ids=batch["segment_ids"], deterministic=True,
                                  mutable=["diagnostics"])
        w = batch["weights"]
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        return {"sum_nats": jnp.sum(token_nats(logits, batch["targets"]) * w),
                "tokens": jnp.sum(w), "correct": jnp.sum(correct * w),
                "diag": mut.get("diagnostics", {})}

    return eval_step


def split_micro(x: jax.Array, micro_batches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]."""
    return x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])


def _index(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _add_out(a: dict, b: dict) -> dict:
    stats = jax.tree.map(balancing.add_stats, a["stats"], b["stats"], is_leaf=_is_stats)
    return {"sum_nats": a["sum_nats"] + b["sum_nats"], "aux": a["aux"] + b["aux"],
            "stats": stats, "diag": jax.tree.map(jnp.add, a["diag"], b["diag"])}


