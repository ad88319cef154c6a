"""Causal softmax attention for MLA's training path (math §4): cuDNN's fused kernel on Hopper GPUs,
XLA's composition of the formula elsewhere.

``o = softmax(scale * q k^T + mask) v`` per head, causal and within each packed document
(``segment_ids``: a document is a run of equal ids, as KDA's state and the convolutions see it;
an id that comes back after another is a new document).

* :func:`attention_reference` -- the formula in fp32, scores materialised: the oracle;
* :func:`causal_attention` -- what the model calls (with documents and several devices, each
  device on its own rows, inside ``shard_map``). On an sm_90 GPU with bf16 or fp16 inputs it is
  cuDNN's flash attention: the ``[B, H, T, T]`` scores never reach memory and the upper triangle
  is skipped. Rows of one document each (no ``segment_ids``, or ``documents="single"``) take its
  plain causal kernel. Packed documents go to cuDNN as its packed layout (each row's documents by
  offset and length, :func:`segment_runs`), so no mask is read at all; a batch whose rows hold
  more than :data:`PACKED_SEGMENTS` documents, or whose ids are not in runs, takes cuDNN's kernel
  with the mask as an additive ``[B, 1, T, T]`` bias instead (:func:`masked_causal_attention`),
  which it reads once per head (at ``k3_small``'s MLA shape, forward + backward 7.1 ms a call
  against 3.5: docs/benchmarks.md).
  That check is a ``lax.cond`` whose predicate the host reads; ``documents="single"``,
  ``"packed"`` or ``"masked"`` skip it, for a caller that knows its rows (the training loop checks
  each batch on the host, :func:`batch_documents`).
  Elsewhere XLA's attention, whose scores and probabilities are ``[B, H, T, T]`` fp32 arrays.

MLA's values are narrower than its queries (128 against 192 columns). cuDNN's plain causal kernel
takes them as they are (its MLA mode, cuDNN 9.10 and later): at ``k3_small``'s MLA call, one
document a row, forward + backward took half the time of the packed layout, which sizes its work
by :data:`PACKED_SEGMENTS` documents a row and wants the values zero-padded to the query's width
(docs/benchmarks.md). Every form but that kernel wants equal head dims: ``v`` is padded there and
the extra output columns dropped. (jax's packed layout offsets the values by the query's head
dim: with narrower values it reads and writes the wrong rows.)
"""

from __future__ import annotations

import functools
import math
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# jax's public attention API takes per-row lengths but not packed documents; the packed layout
# (offsets and lengths of each row's documents) is its cuDNN module's own entry point.
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
from jax._src.lib import cuda_versions
from jax.sharding import PartitionSpec as P

from k3jax.config.mesh import rule_axes
from k3jax.config.model import Documents
from k3jax.devices import hopper_gpus
from k3jax.ops.documents import document_index
from k3jax.ops.per_device import batch_axes

# Documents per row cuDNN's packed path is compiled for. Its backward sizes a workspace and its
# grid by rows x this number: 64 made it 2x slower than 16 at k3_small's shape.
PACKED_SEGMENTS = 16

# The first cuDNN whose fused attention takes values of another head dim than the queries'.
CUDNN_UNEQUAL_HEAD_DIMS = 91000


def attention_mask(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """Boolean ``[B, 1, T, T]``: causal, and only within one document (a run of equal ids in
    ``segment_ids [B, T]``)."""
    causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, 1, length, length))
    doc = document_index(segment_ids)
    return causal & (doc[:, None, :, None] == doc[:, None, None, :])


def attention_reference(q, k, v, mask, scale: float) -> jax.Array:
    """``q [B, T, H, Dk]``, ``k [B, S, H, Dk]``, ``v [B, S, H, Dv]``, ``mask [B, 1, T, S]`` bool
    -> ``[B, T, H, Dv]`` fp32."""
    f32 = jnp.float32
    s = jnp.einsum("bthd,bshd->bhts", q.astype(f32), k.astype(f32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(f32), precision=jax.lax.Precision.HIGHEST)


def segment_runs(segment_ids: jax.Array, max_runs: int):
    """Each row's documents in cuDNN's packed layout: ``(offsets [B, M + 1], lengths [B, M], fits)``
    for ``segment_ids [B, T]`` and ``M = max_runs``: the first token and the length of every run of
    equal ids (its documents, as the mask reads them), ``-1`` past a row's last run; ``fits`` ([]
    bool) is true when no row has more than ``M`` runs. Where it is false the offsets and lengths
    are meaningless."""
    run = document_index(segment_ids)  # [B, T]
    runs = run[:, -1] + 1  # [B]
    slot = jnp.arange(max_runs + 1)
    # offsets[b, r] = the first token of run r: the number of tokens in runs before it
    first = jnp.sum(run[:, None, :] < slot[None, :, None], axis=-1).astype(jnp.int32)
    offsets = jnp.where(slot[None] < runs[:, None], first, -1)
    lengths = jnp.where(slot[None, :-1] < runs[:, None], first[:, 1:] - first[:, :-1], -1)
    return offsets, lengths, jnp.all(runs <= max_runs)


def batch_documents(segment_ids: np.ndarray) -> str:
    """The ``documents`` setting (:func:`causal_attention`) a batch's ``segment_ids [B, T]`` can
    take, decided on the host: ``"single"`` where every row is one document, ``"packed"`` where
    cuDNN's packed layout takes every row (the device-side check of :func:`segment_runs`), else
    ``"masked"``; off Hopper GPUs always ``"masked"``, the only form there."""
    ids = np.asarray(segment_ids)
    runs = 1 + np.count_nonzero(ids[:, 1:] != ids[:, :-1], axis=1)
    if not hopper_gpus():
        return "masked"
    if np.all(runs == 1):
        return "single"
    return "packed" if np.all(runs <= PACKED_SEGMENTS) else "masked"


def causal_attention(q, k, v, segment_ids: jax.Array | None, scale: float,
                     documents: Documents = "auto") -> jax.Array:
    """Causal attention of ``q`` over ``k, v``, within the documents of ``segment_ids [B, T]`` int
    (None: one document a row): ``q [B, T, H, Dk]``, ``k [B, T, H, Dk]``, ``v [B, T, H, Dv]``;
    returns ``[B, T, H, Dv]`` in ``q``'s dtype. ``documents``: ``"auto"``, ``"single"``,
    ``"packed"`` or ``"masked"`` (:class:`~k3jax.config.model.MLAConfig`)."""
    if documents not in typing.get_args(Documents):
        raise ValueError(f"causal_attention: documents must be one of {typing.get_args(Documents)}"
                         f", got {documents!r}")
    if segment_ids is None:
        return _one_document_a_row(q, k, v, scale)
    return _per_device(functools.partial(_within_documents, scale=scale, documents=documents),
                       q, k, v, segment_ids)


def _one_document_a_row(q, k, v, scale: float) -> jax.Array:
    """Plain causal attention (no documents): cuDNN's kernel with ``v`` at its own head dim where
    cuDNN takes that, else with ``v`` padded to the query's."""
    implementation = _implementation(q)
    if (implementation == "cudnn" and v.shape[-1] != q.shape[-1]
            and cuda_versions.cudnn_get_version() >= CUDNN_UNEQUAL_HEAD_DIMS):
        return cudnn_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL)
    out = jax.nn.dot_product_attention(q, k, _padded_values(q, v), scale=scale, is_causal=True,
                                       implementation=implementation)
    return out[..., :v.shape[-1]]


def _within_documents(q, k, v, segment_ids, scale: float, documents: Documents) -> jax.Array:
    """:func:`causal_attention` with documents, on the rows at hand. A layout promised by
    ``documents`` that the rows break gives NaN outputs rather than attention across documents."""
    if documents == "single":
        one = jnp.all(segment_ids[:, 1:] == segment_ids[:, :-1])
        return jnp.where(one, _one_document_a_row(q, k, v, scale), jnp.nan)
    v_in = _padded_values(q, v)
    if _implementation(q) is None or documents == "masked":
        return masked_causal_attention(q, k, v_in, segment_ids, scale)[..., :v.shape[-1]]
    offsets, lengths, fits = segment_runs(segment_ids, PACKED_SEGMENTS)

    def packed(q, k, v):
        return cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                               kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL)

    def masked(q, k, v):
        return masked_causal_attention(q, k, v, segment_ids, scale)

    if documents == "packed":
        out = jnp.where(fits, packed(q, k, v_in), jnp.nan)
    else:
        out = lax.cond(fits, packed, masked, q, k, v_in)
    return out[..., :v.shape[-1]]


def masked_causal_attention(q, k, v, segment_ids, scale: float) -> jax.Array:
    """Causal attention within documents under their ``[B, 1, T, T]`` mask (cuDNN reads it as a
    bias where it runs): :func:`causal_attention`'s fallback, and its only form off Hopper GPUs.
    ``v`` already has ``q``'s head dim."""
    mask = attention_mask(segment_ids, *segment_ids.shape)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        implementation=_implementation(q))


def _per_device(attend, q, k, v, segment_ids) -> jax.Array:
    """``attend(q, k, v, segment_ids)`` on each device's rows: under a current mesh of several
    devices (:func:`k3jax.parallel.mesh.use_mesh`), inside one ``shard_map`` over the mesh axes
    that split the batch, and those that split the heads where they divide them. Each row's
    document offsets then stay with the row, whatever XLA would propagate to them, and each device
    picks the packed or the masked kernel for its own rows."""
    rows = batch_axes(q.shape[0])
    if not rows:
        return attend(q, k, v, segment_ids)  # one device, or rows XLA must pad to split
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    heads = tuple(a for a in rule_axes(nn.get_logical_axis_rules(), "heads") if a not in rows)
    if q.shape[2] % math.prod(sizes[a] for a in heads):
        heads = ()  # every device of those axes runs all the heads
    spec = P(rows, None, heads or None, None)
    return jax.shard_map(attend, in_specs=(spec, spec, spec, P(rows, None)),
                         out_specs=spec)(q, k, v, segment_ids)


def masked_attention(q, k, v, mask, scale: float) -> jax.Array:
    """XLA's attention of ``q [B, Tq, H, Dk]`` over ``k [B, S, H, Dk]``, ``v [B, S, H, Dv]`` under
    ``mask [B, 1, Tq, S]`` bool (new tokens over a cache) -> ``[B, Tq, H, Dv]``."""
    return jax.nn.dot_product_attention(q, k, _padded_values(q, v), mask=mask,
                                        scale=scale)[..., :v.shape[-1]]


def _padded_values(q, v) -> jax.Array:
    """``v`` with zero columns up to the query's head dim, which jax's attention wants for both."""
    pad = q.shape[-1] - v.shape[-1]
    if pad < 0:
        raise ValueError(f"attention: value head dim {v.shape[-1]} larger than the query's "
                         f"{q.shape[-1]} is not supported")
    return jnp.pad(v, ((0, 0),) * 3 + ((0, pad),)) if pad else v


def _implementation(q) -> str | None:
    """``"cudnn"`` where cuDNN's flash attention takes ``q`` (sm_90, half-precision inputs, a
    head dim <= 256 and a multiple of 8, an even sequence length (with a bias)), else None
    (XLA's attention)."""
    cudnn = (hopper_gpus() and q.dtype in (jnp.bfloat16, jnp.float16)
             and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and q.shape[1] % 2 == 0)
    return "cudnn" if cudnn else None
