"""The K3 decoder-only model: embedding, hybrid stack, final residual read, final norm, untied head.

``K3Model(cfg).apply(variables, tokens, segment_ids=..., deterministic=...)`` returns logits in the
compute dtype (``cfg.dtype``, accumulated in fp32: ``k3jax/ops/head.py``). Everything else leaves
through explicit linen collections, never hidden state:

* ``params``: trainable weights (plain pytrees after :func:`init_variables`);
* ``balance``: the MoE router biases (non-trainable, updated by the training step);
* ``balance_stats`` / ``losses`` / ``diagnostics``: outputs of a training forward, returned when the
  caller makes them mutable.

The layer stack follows ``k3jax.stack.plan_segments``: one segment (unrolled prefix, one scanned
group ``scanned_layers``, unrolled suffix) for the plain residual; with Block AttnRes one segment
per block (scanned groups ``block_{b}_scan``), so the growing tuple of completed blocks is never a
scan carry (see ``k3jax/layers/attnres.py`` for why that keeps the memory linear in depth).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.layers.decoder import DecoderLayer
from k3jax.layers.norms import RMSNorm
from k3jax.layers.param import constrain, normal
from k3jax.layers.residual import initial_state, join_state, make_final_read, settle, split_state
from k3jax.ops.head import head_logits
from k3jax.stack import StackPlan, plan_segments

# The residual stream is split by batch only: the d axis stays whole (its "embed" rule is for
# weights).
ACTIVATION_AXES = ("batch", "length", None)
# Collections that hold one entry per scanned layer group (stacked on axis 0).
SCANNED_COLLECTIONS = ("params", "balance", "balance_stats", "losses", "diagnostics")


def _remat(cls, policy: str, static_index: bool):
    if policy == "none":
        return cls
    saveable = (None if policy == "full"
                else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    # deterministic (argument 4, counting self) is a Python bool and must stay static; so must the
    # layer index (argument 2) of an unrolled layer, which keeps the residual bookkeeping static.
    return nn.remat(cls, policy=saveable, static_argnums=(2, 4) if static_index else (4,),
                    prevent_cse=False)


class LayerGroup(nn.Module):
    """One period of the hybrid schedule; the body of a scan. Carries the residual state's
    ``carry`` part; ``invariant`` (AttnRes: the completed blocks) is broadcast to every step."""

    cfg: ModelConfig
    group: tuple[tuple[str, str], ...]

    @nn.compact
    def __call__(self, carry, first_layer, invariant, segment_ids, deterministic: bool,
                 caches=None, context=None):
        """One repeat of the group: ``carry`` (the residual state's carried part, ``[B, T, d]``)
        -> ``(carry, new caches)``; ``first_layer``: the depth of the group's first layer in this
        repeat. ``caches`` (inference): this repeat's ``{layer_k: cache}``, returned updated (None
        without)."""
        layer_cls = _remat(DecoderLayer, self.cfg.remat, static_index=False)
        new_caches = None if caches is None else {}
        for offset, (mixer, ffn) in enumerate(self.group):
            state = join_state(self.cfg, carry, invariant)
            layer = layer_cls(self.cfg, mixer, ffn, name=f"layer_{offset}")
            if caches is None:
                state = layer(state, first_layer + offset, segment_ids, deterministic)
            else:
                name = f"layer_{offset}"
                state, new_caches[name] = layer(state, first_layer + offset, segment_ids,
                                                deterministic, caches[name], context)
            carry, _ = split_state(self.cfg, state)
        return carry, new_caches


class K3Model(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]`` in ``cfg.dtype``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 deterministic: bool = True, caches: dict | None = None, context=None):
        """With ``caches`` (inference, see ``k3jax.generate``): the per-layer mixer caches, keyed
        like the parameters (``layer_i``; a scanned group's ``{layer_k: stacked}``), and their
        :class:`~k3jax.layers.cache_context.CacheContext`; returns ``(logits, new caches)``."""
        cfg = self.cfg
        cdt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        _check_tokens(tokens, segment_ids, cfg.vocab_size)
        table = self.param("embedding", normal(cfg.init_std, ("vocab", "embed")),
                           (cfg.vocab_size, cfg.d_model), pdt)
        # Materialised once: otherwise XLA fuses the fp32 table's gather into each of its
        # consumers (every AttnRes read and the norms after them), which reread it at twice the
        # bytes of the compute-dtype embedding.
        x = jax.lax.optimization_barrier(jnp.take(table, tokens, axis=0).astype(cdt))
        x = constrain(x, ACTIVATION_AXES)
        state = initial_state(cfg, x)

        new_caches = None if caches is None else {}
        for plan in plan_segments(cfg):  # the whole stack, or one AttnRes block after another
            state = self._segment(plan, state, segment_ids, deterministic, caches, new_caches,
                                  context)

        h = make_final_read(cfg)(state, RMSNorm(cfg.rms_eps, cfg.dtype, cfg.param_dtype,
                                                name="final_norm"))
        h = constrain(h, ACTIVATION_AXES)
        head = self.param("head", normal(cfg.init_std, ("embed", "vocab")),
                          (cfg.d_model, cfg.vocab_size), pdt)
        logits = head_logits(h.astype(cdt), head.astype(cdt))
        logits = constrain(logits, ("batch", "length", "vocab"))
        return logits if caches is None else (logits, new_caches)

    def _segment(self, plan: StackPlan, state, segment_ids, deterministic: bool, caches=None,
                 new_caches=None, context=None):
        """Layers ``[plan.start, plan.stop)``: unrolled prefix, scanned groups, unrolled suffix.
        With ``caches``, each layer's updated cache is stored into ``new_caches`` under its name."""
        cfg = self.cfg
        layer_cls = _remat(DecoderLayer, cfg.remat, static_index=True)

        def unrolled(i, state):
            layer = layer_cls(cfg, *plan.specs[i], name=f"layer_{i}")
            if caches is None:
                return layer(state, i, segment_ids, deterministic)
            state, new_caches[f"layer_{i}"] = layer(state, i, segment_ids, deterministic,
                                                    caches[f"layer_{i}"], context)
            return state

        for i in plan.prefix:
            state = unrolled(i, state)
        if plan.repeats:
            scanned = nn.scan(
                LayerGroup,
                variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, 0, nn.broadcast),
                length=plan.repeats,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            starts = plan.scan_start + len(plan.group) * jnp.arange(plan.repeats)
            carry, invariant = split_state(cfg, state)
            group_caches = None if caches is None else caches[plan.name]
            carry, group_caches = scanned(cfg, plan.group, name=plan.name)(
                carry, starts, invariant, segment_ids, deterministic, group_caches, context)
            if caches is not None:
                new_caches[plan.name] = group_caches
            # a traced layer index could not commit a block the scan completed: do it now
            state = settle(cfg, join_state(cfg, carry, invariant), 2 * plan.scan_stop)
        for i in plan.suffix:
            state = unrolled(i, state)
        return state


def _check_tokens(tokens, segment_ids, vocab_size: int) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T]; "
                         f"got {tokens.dtype}{tokens.shape}")
    # jnp.take clamps or fills out-of-range ids (NaN logits) without a word: reject them whenever
    # the values are known (eager calls); under jit they are not, and the data path checks them.
    concrete = not isinstance(tokens, jax.core.Tracer)
    if concrete and tokens.size and getattr(tokens, "is_fully_addressable", True):
        ids = np.asarray(tokens)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"tokens: ids must lie in [0, model.vocab_size={vocab_size}); "
                             f"got ids from {lo} to {hi}")
    if segment_ids is not None and (segment_ids.shape != tokens.shape
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids must be an integer array of tokens' shape {tokens.shape}; "
                         f"got {segment_ids.dtype}{segment_ids.shape}")


def init_variables(cfg: ModelConfig, rng: jax.Array, batch_shape: tuple[int, int] = (1, 8)) -> dict:
    """Plain (unboxed) variables ``{'params': ..., 'balance': ...}`` of a freshly initialised
    model."""
    tokens = jnp.zeros(batch_shape, jnp.int32)
    variables = K3Model(cfg).init({"params": rng}, tokens)
    return nn.meta.unbox(dict(variables))


def abstract_variables(cfg: ModelConfig, batch_shape: tuple[int, int] = (1, 8)) -> dict:
    """Shapes and dtypes of the variables (``jax.ShapeDtypeStruct``), allocating nothing."""
    return jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0), batch_shape))


def logical_axes(cfg: ModelConfig, batch_shape: tuple[int, int] = (1, 8)) -> dict:
    """The logical axis names of every variable as a tree of ``PartitionSpec`` (nothing
    allocated)."""
    return nn.get_partition_spec(_boxed_shapes(cfg, batch_shape))


def abstract_variables_and_axes(cfg: ModelConfig,
                                batch_shape: tuple[int, int] = (1, 8)) -> tuple[dict, dict]:
    """Shapes and dtypes (without shardings) and axis names of the variables, from one trace of
    the initialiser: tracing the full-size model takes seconds."""
    boxed = _boxed_shapes(cfg, batch_shape)
    # The boxes' values directly: unboxing outside a trace would apply their sharding constraints.
    shapes = jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) else x, boxed,
                          is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return shapes, nn.get_partition_spec(boxed)


def _boxed_shapes(cfg: ModelConfig, batch_shape: tuple[int, int]) -> dict:
    """The initialiser's output as shapes inside flax's axis-name boxes. The key and the tokens
    are made inside the trace: made outside, they would be the process's first transfer to the
    device, which on a GPU sets up its allocator and streams (seconds) before anything else."""
    return jax.eval_shape(lambda: K3Model(cfg).init({"params": jax.random.key(0)},
                                                    jnp.zeros(batch_shape, jnp.int32)))
