"""Token-parallel part of chunked KDA (math §3.3): everything but the recurrence over chunks.

For each chunk of ``C = 64`` tokens (one head) this forms, from the cumulative log-decay ``G``:

* ``Aqk [C, C]`` = ``scale * sum_c q_rc k_jc exp(G_rc - G_jc)`` for ``r >= j``;
* ``T = (I + L)^-1`` with ``L[r, j] = beta_r Akk[r, j]`` for ``r > j``,
  ``Akk[r, j] = sum_c k_rc k_jc exp(G_rc - G_jc)``;
* ``W = T (beta Xk)``, ``U = T (beta V)`` with ``Xk = exp(G) K``; ``Qg = scale exp(G) Q``,
  ``Kg = exp(G_C - G) K`` and ``gamma = exp(G_C)``;

the inputs of the serial state kernels (:mod:`pallas_kernels.kda_state_fwd`), in two steps with
their own VJPs: the gates' chunk cumsum with the gated operands and the score matrices
(:func:`pallas_kernels.kda_scores.gated_scores`; kernels in :mod:`pallas_kernels.kda_cumsum` and
:mod:`pallas_kernels.kda_scores`, helpers in :mod:`pallas_kernels.kda_gates`), then the chunk
inverse with ``W``, ``U`` (:mod:`pallas_kernels.kda_solve`). :func:`prepare_reference` computes the
same quantities in plain fp32 JAX from the kernels' references (differentiated by autodiff).

Numerics (math §3.3): the relative decay ``exp(G_r - G_j)`` is never split into
``exp(G_r) exp(-G_j)`` over a span that can grow: K3's gate takes a chunk ~320 nats down, far past
fp32's ``exp`` range (the scores kernels' anchored levels, :mod:`pallas_kernels.kda_scores`).

Packed documents (``segment_ids``): no term may cross a segment start. Intra-chunk scores are
masked by ``same_segment[r, j]``; the state entering a chunk reaches row ``r`` only if no segment
starts in the chunk at or before ``r`` (``exp(G)`` and ``gamma`` masked by ``enter``); a key reaches
the state leaving the chunk only if no segment starts after it in the chunk (``Kg`` masked by
``leave``). This equals the reference's "state set to zero at a segment's first token".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import CHUNK
from pallas_kernels.kda_gates import SegmentMasks
from pallas_kernels.kda_scores import gated_scores, gated_scores_reference
from pallas_kernels.kda_solve import scaled_inverse, wy, wy_reference

_HI = lax.Precision.HIGHEST  # fp32 matmuls stay fp32 on GPUs (no TF32)


class Prepared(NamedTuple):
    """Per-chunk inputs of the state kernels, head-major ``[B, H, Tp, .]`` (``Tp`` padded to ``C``).

    qg, kg, w: ``[B, H, Tp, K]``; u: ``[B, H, Tp, V]`` fp32; aqk: ``[B, H, Tp, C]`` (row ``t`` holds
    the chunk-local row of ``Aqk``); gamma: ``[B, H, NC, K]`` fp32. ``qg, kg, aqk`` are bf16 from
    the scores kernels and ``w`` from the solve kernel (the state kernels' operand dtype), fp32 from
    :func:`prepare_reference`.
    """

    qg: jax.Array
    kg: jax.Array
    w: jax.Array
    u: jax.Array
    aqk: jax.Array
    gamma: jax.Array


def pad_time(x, multiple: int, value=0):
    """Pad axis 1 (time) of ``x`` up to a multiple of ``multiple``."""
    t = x.shape[1]
    extra = (-t) % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def segment_masks(segment_ids, chunk_size: int) -> SegmentMasks | None:
    """Per-token masks of packed documents, padded to a multiple of ``chunk_size`` (module
    docstring), or None without ``segment_ids`` (``[B, T]`` integers; a segment starts where the id
    changes)."""
    if segment_ids is None:
        return None
    c = chunk_size
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], dtype=bool), seg[:, 1:] != seg[:, :-1]],
                             axis=1)
    starts = pad_time(starts, c, False)
    b, tp = starts.shape
    idx = jnp.cumsum(starts.astype(jnp.int32), axis=1)  # segment counter
    chunked = idx.reshape(b, tp // c, c)
    # the counter before the chunk
    before = chunked[:, :, :1] - starts.reshape(b, tp // c, c)[:, :, :1].astype(jnp.int32)
    enter = (chunked == before).reshape(b, tp).astype(jnp.float32)
    leave = (chunked == chunked[:, :, -1:]).reshape(b, tp).astype(jnp.float32)
    return SegmentMasks(idx, enter, leave)


def _pad_gate(g, lower_bound):
    """``g`` in fp32 padded with tokens that leave the state as it is: a log-decay of 0, or
    logits of -inf under a ``lower_bound`` (whose gate is 0 there)."""
    return pad_time(g.astype(jnp.float32), CHUNK, 0.0 if lower_bound is None else -jnp.inf)


def _check_chunk(fn: str, chunk_size: int) -> None:
    if chunk_size != CHUNK:
        raise ValueError(f"{fn}: chunk_size must be {CHUNK}, got {chunk_size}")


def prepare(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None, lower_bound=None,
            bias=None, interpret: bool = False) -> Prepared:
    """Token-parallel chunk quantities (module docstring) from FLA-layout inputs, by the kernels.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; any float dtype. ``T`` is
    padded to a multiple of ``chunk_size`` (64) with zero keys, values, queries, beta and gates,
    which leave the state unchanged. The scores kernels take q and k rounded to bf16 (their
    tensor-core operands; K in {64, 128}); v goes to the solve kernel in bf16 or fp32. With
    ``lower_bound`` and ``bias``, ``g`` holds the gate's logits less their bias
    (:func:`~pallas_kernels.kda_scores.gated_scores`). ``interpret`` runs the kernels in the CPU
    interpreter.
    """
    _check_chunk("prepare", chunk_size)
    s, beta = _scores(q, k, g, beta, scale, segment_ids, lower_bound, bias, interpret)
    v = pad_time(v if v.dtype in (jnp.bfloat16, jnp.float32) else v.astype(jnp.float32), CHUNK)
    w, u = wy(s.akk, beta, s.xk, v, w_dtype=jnp.bfloat16, interpret=interpret)
    return Prepared(qg=s.qg, kg=s.kg, w=w, u=u, aqk=s.aqk, gamma=s.gamma)


def prepare_applying_inverse(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None,
                             lower_bound=None, bias=None, interpret: bool = False
                             ) -> tuple[Prepared, jax.Array]:
    """:func:`prepare` for a state pass that applies the chunk inverse itself (forward only):
    ``(Prepared with w = xk and u = v, padded and token-major bf16; T diag(beta))``, the second
    from :func:`~pallas_kernels.kda_solve.scaled_inverse` (see
    :func:`~pallas_kernels.kda_state_fwd.state_fwd`'s ``inverse``). Not differentiable."""
    _check_chunk("prepare_applying_inverse", chunk_size)
    s, beta = _scores(q, k, g, beta, scale, segment_ids, lower_bound, bias, interpret)
    v = pad_time(v.astype(jnp.bfloat16), CHUNK)
    inverse = scaled_inverse(s.akk, beta, interpret=interpret)
    return Prepared(qg=s.qg, kg=s.kg, w=s.xk, u=v, aqk=s.aqk, gamma=s.gamma), inverse


def _scores(q, k, g, beta, scale, segment_ids, lower_bound, bias, interpret):
    """:func:`~pallas_kernels.kda_scores.gated_scores` of the padded inputs, and ``beta``
    padded and head-major ``[B, H, Tp]`` fp32 (tiny: the kernels' layout)."""
    f32, bf16, pad = jnp.float32, jnp.bfloat16, functools.partial(pad_time, multiple=CHUNK)
    s = gated_scores(pad(q.astype(bf16)), pad(k.astype(bf16)), _pad_gate(g, lower_bound),
                     scale=scale, masks=segment_masks(segment_ids, CHUNK),
                     lower_bound=lower_bound, bias=bias, interpret=interpret)
    return s, jnp.swapaxes(pad(beta.astype(f32)), 1, 2)


def prepare_reference(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None) -> Prepared:
    """:func:`prepare` in plain fp32 JAX: the kernels' references in the same order
    (:func:`~pallas_kernels.kda_scores.gated_scores_reference`, whose pairwise decays make it for
    small inputs only, then :func:`~pallas_kernels.kda_solve.wy_reference`). Same arguments."""
    _check_chunk("prepare_reference", chunk_size)
    pad = functools.partial(pad_time, multiple=CHUNK)
    q, k, v, g, beta = (pad(x.astype(jnp.float32)) for x in (q, k, v, g, beta))
    s = gated_scores_reference(q, k, g, scale=scale, masks=segment_masks(segment_ids, CHUNK))
    w, u = wy_reference(s.akk, jnp.swapaxes(beta, 1, 2), s.xk, v)
    return Prepared(qg=s.qg, kg=s.kg, w=w, u=u, aqk=s.aqk, gamma=s.gamma)


def state_pass_reference(p: Prepared, h0, chunk_size):
    """The serial part in plain JAX (what the state kernels compute), fp32:
    ``(o [B,H,Tp,V], final)``.

    Per chunk with entering state ``S``: ``Vt = U - W S``; ``O = Qg S + Aqk Vt``;
    ``S <- gamma * S + Kg^T Vt``.
    """
    b, h, tp, dk = p.qg.shape
    dv = p.u.shape[-1]
    c = chunk_size
    nc = tp // c

    def split(x):  # [B, H, Tp, D] -> [NC, B, H, C, D]
        return jnp.moveaxis(x.reshape(b, h, nc, c, x.shape[-1]), 2, 0)

    xs = (split(p.qg), split(p.kg), split(p.w), split(p.u), split(p.aqk),
          jnp.moveaxis(p.gamma, 2, 0))

    def step(s, x):
        qg, kg, w, u, aqk, gam = x
        vt = u - jnp.matmul(w, s, precision=_HI)
        o = jnp.matmul(qg, s, precision=_HI) + jnp.matmul(aqk, vt, precision=_HI)
        s = gam[..., None] * s + jnp.matmul(jnp.swapaxes(kg, -1, -2), vt, precision=_HI)
        return s, o

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if h0 is None else h0.astype(jnp.float32)
    final, o = lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 2).reshape(b, h, tp, dv), final
