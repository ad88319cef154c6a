"""Token-parallel part of chunked KDA (SPEC 3.3): everything but the recurrence over chunks.

For each chunk of ``C = 64`` tokens (one head) this forms, from the cumulative log-decay ``G``:

* ``Aqk [C, C]`` = ``scale * sum_c q_rc k_jc exp(G_rc - G_jc)`` for ``r >= j``;
* ``T = (I + L)^-1`` with ``L[r, j] = beta_r Akk[r, j]`` for ``r > j``,
  ``Akk[r, j] = sum_c k_rc k_jc exp(G_rc - G_jc)``;
* ``W = T (beta Xk)``, ``U = T (beta V)`` with ``Xk = exp(G) K``; ``Qg = scale exp(G) Q``,
  ``Kg = exp(G_C - G) K`` and ``gamma = exp(G_C)``;

the inputs of the serial state kernels (:mod:`pallas_kernels.kda_state_fwd`), in two steps with
their own VJPs: the gates' chunk cumsum with the gated operands and the score matrices
(:func:`pallas_kernels.kda_scores.gated_scores`; kernels in :mod:`pallas_kernels.kda_cumsum` and
:mod:`pallas_kernels.kda_scores`, helpers in :mod:`pallas_kernels.kda_gates`), then the chunk inverse
with ``W``, ``U`` (:mod:`pallas_kernels.kda_solve`). ``scores="xla"`` / ``solve="xla"`` compute the
same quantities in plain JAX (differentiated by autodiff): the reference structure the kernels are
tested against.

Numerics (SPEC 3.3, PITFALLS "KDA"): the relative decay ``exp(G_r - G_j)`` is never split into
``exp(G_r) exp(-G_j)`` over a span that can grow. Scores are built on a binary tree of row blocks:
a pair ``r > j`` belongs to exactly one level ``b`` (32, 16, ..., 1) where ``r`` lies in a right
block ``[a, a + b)`` and ``j`` in its left sibling ``[a - b, a)``; there the decay factors through
the right block's *first* row ``a``: ``exp(G_r - G_a) exp(G_a - G_j)``, both factors ``<= 1`` for
any gate (softplus or lower-bound form, any magnitude). The diagonal ``r = j`` has no decay.

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

from pallas_kernels.kda_gates import CHUNK, SegmentMasks, gate_products
from pallas_kernels.kda_gates import same_segment_reference as _same_segment
from pallas_kernels.kda_scores import GatedScores, gated_scores
from pallas_kernels.kda_solve import wy, wy_reference

_HI = lax.Precision.HIGHEST  # fp32 matmuls stay fp32 on GPUs (no TF32)


class Prepared(NamedTuple):
    """Per-chunk inputs of the state kernels, head-major ``[B, H, Tp, .]`` (``Tp`` padded to ``C``).

    qg, kg, w: ``[B, H, Tp, K]``; u: ``[B, H, Tp, V]`` fp32; aqk: ``[B, H, Tp, C]`` (row ``t`` holds
    the chunk-local row of ``Aqk``); gamma: ``[B, H, NC, K]`` fp32. ``qg, kg, aqk`` are bf16 from the
    Mosaic scores kernel and ``w`` from the Mosaic solve (the state kernels' operand dtype), fp32
    from the XLA paths.
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


def _tree_scores(a, b, g_cum):
    """``sum_c a_rc b_jc exp(G_rc - G_jc)`` for ``r >= j`` (0 above the diagonal), per chunk.

    a, b, g_cum: ``[..., C, K]`` fp32 (``g_cum`` chunk-local cumulative log-decay). Returns
    ``[..., C, C]``. Every exponential has a non-positive argument (module docstring).
    """
    c = a.shape[-2]
    lead = a.shape[:-2]
    out = jnp.zeros(lead + (c, c), jnp.float32)
    # Diagonal: no decay.
    diag = jnp.sum(a * b, axis=-1)
    out = out + diag[..., :, None] * jnp.eye(c, dtype=jnp.float32)
    blk = c // 2
    while blk >= 1:
        n = c // (2 * blk)
        shp = lead + (n, 2, blk) + a.shape[-1:]
        ar, bl = a.reshape(shp)[..., 1, :, :], b.reshape(shp)[..., 0, :, :]
        gr, gl = g_cum.reshape(shp)[..., 1, :, :], g_cum.reshape(shp)[..., 0, :, :]
        anchor = gr[..., :1, :]  # first row of the right block
        left = jnp.einsum("...rc,...jc->...rj", ar * jnp.exp(gr - anchor), bl * jnp.exp(anchor - gl),
                          precision=_HI)  # [..., n, blk, blk]
        # Place block i at rows (2i+1)blk.., columns (2i)blk.. of the [C, C] matrix.
        eye = jnp.eye(n, dtype=jnp.float32)
        full = jnp.einsum("...irj,im->...irmj", left, eye)  # [..., n, blk, n, blk]
        full = jnp.stack([jnp.zeros_like(full), full], axis=-4)  # row half: [..., n, 2, blk, n, blk]
        full = jnp.stack([full, jnp.zeros_like(full)], axis=-2)  # col half: [..., n, 2, blk, n, 2, blk]
        out = out + full.reshape(lead + (c, c))
        blk //= 2
    return out


def segment_masks(segment_ids, chunk_size: int) -> SegmentMasks | None:
    """Per-token masks of packed documents, padded to a multiple of ``chunk_size`` (module docstring),
    or None without ``segment_ids`` (``[B, T]`` integers; a segment starts where the id changes)."""
    if segment_ids is None:
        return None
    c = chunk_size
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], dtype=bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    starts = pad_time(starts, c, False)
    b, tp = starts.shape
    idx = jnp.cumsum(starts.astype(jnp.int32), axis=1)  # segment counter
    chunked = idx.reshape(b, tp // c, c)
    # the counter before the chunk
    before = chunked[:, :, :1] - starts.reshape(b, tp // c, c)[:, :, :1].astype(jnp.int32)
    enter = (chunked == before).reshape(b, tp).astype(jnp.float32)
    leave = (chunked == chunked[:, :, -1:]).reshape(b, tp).astype(jnp.float32)
    return SegmentMasks(idx, enter, leave)


def _xla_gated_scores(q, k, g, scale: float, masks: SegmentMasks | None) -> GatedScores:
    """:func:`pallas_kernels.kda_scores.gated_scores` in plain fp32 JAX (anchored tree, not pairwise):
    q, k, g ``[B, Tp, H, K]`` (``g`` the per-token log-decay, not yet summed)."""
    b, tp, h, dk = q.shape
    c, nc = CHUNK, tp // CHUNK
    chunks = lambda x: jnp.moveaxis(x.reshape(b, nc, c, h, dk), 3, 1)  # noqa: E731  [B, H, NC, C, K]
    qc, kc = chunks(q), chunks(k)
    # A product with a lower-triangular ones matrix: XLA lowers jnp.cumsum to an associative scan,
    # which is slower on a GPU for 64-row chunks.
    g_cum = jnp.einsum("rc,...ck->...rk", jnp.tril(jnp.ones((c, c), jnp.float32)), chunks(g), precision=_HI)
    flat = lambda x: x.reshape(b, h, tp, x.shape[-1])  # noqa: E731
    same = _same_segment(masks, (b, h, tp, dk))
    aqk = flat(_tree_scores(qc * scale, kc, g_cum)) * same
    akk = flat(_tree_scores(kc, kc, g_cum)) * same
    return GatedScores(aqk, akk, *gate_products(flat(qc), flat(kc), flat(g_cum), scale, masks))


SCORES = ("xla", "mosaic")
SOLVES = ("xla", "mosaic")


def prepare(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None, scores: str = "xla",
            solve: str = "xla", interpret: bool = False) -> Prepared:
    """Token-parallel chunk quantities (module docstring) from FLA-layout inputs.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; any float dtype. ``T`` is
    padded to a multiple of ``chunk_size`` (64) with zero keys, values, queries, beta and gates, which
    leave the state unchanged.

    ``scores`` picks how ``Aqk``, ``Akk`` and the gated operands are built: ``"xla"`` (default, plain
    fp32 JAX) or ``"mosaic"`` (:func:`pallas_kernels.kda_scores.gated_scores`: the gates' cumsum and
    the scores as Mosaic GPU kernels with bf16 tensor-core operands: q and k are rounded to bf16; K
    in {64, 128}). ``solve`` picks how ``T = (I + L)^-1``
    and ``W``, ``U`` are formed: ``"xla"`` (default, a batched triangular solve and fp32 matmuls) or
    ``"mosaic"`` (:func:`pallas_kernels.kda_solve.wy`). ``interpret`` runs the kernels in the CPU
    interpreter.
    """
    if scores not in SCORES:
        raise ValueError(f"prepare: scores must be one of {SCORES}, got {scores!r}")
    if solve not in SOLVES:
        raise ValueError(f"prepare: solve must be one of {SOLVES}, got {solve!r}")
    if chunk_size != CHUNK:
        raise ValueError(f"prepare: chunk_size must be {CHUNK}, got {chunk_size}")
    f32, pad = jnp.float32, functools.partial(pad_time, multiple=CHUNK)
    masks = segment_masks(segment_ids, CHUNK)
    g = pad(g.astype(f32))
    if scores == "mosaic":
        q, k = (pad(x.astype(jnp.bfloat16)) for x in (q, k))
        s = gated_scores(q, k, g, scale=scale, masks=masks, interpret=interpret)
    else:
        s = _xla_gated_scores(pad(q.astype(f32)), pad(k.astype(f32)), g, scale, masks)
    beta = jnp.swapaxes(pad(beta.astype(f32)), 1, 2)  # [B, H, Tp]: tiny, the kernels' layout
    v = pad(v if v.dtype in (jnp.bfloat16, f32) else v.astype(f32))
    if solve == "mosaic":
        w, u = wy(s.akk, beta, s.xk, v, w_dtype=jnp.bfloat16, interpret=interpret)
    else:
        w, u = wy_reference(s.akk, beta, s.xk, v)
    return Prepared(qg=s.qg, kg=s.kg, w=w, u=u, aqk=s.aqk, gamma=s.gamma)


def state_pass_reference(p: Prepared, h0, chunk_size):
    """The serial part in plain JAX (what the state kernels compute), fp32: ``(o [B,H,Tp,V], final)``.

    Per chunk with entering state ``S``: ``Vt = U - W S``; ``O = Qg S + Aqk Vt``;
    ``S <- gamma * S + Kg^T Vt``.
    """
    b, h, tp, dk = p.qg.shape
    dv = p.u.shape[-1]
    c = chunk_size
    nc = tp // c

    def split(x):  # [B, H, Tp, D] -> [NC, B, H, C, D]
        return jnp.moveaxis(x.reshape(b, h, nc, c, x.shape[-1]), 2, 0)

    xs = (split(p.qg), split(p.kg), split(p.w), split(p.u), split(p.aqk), jnp.moveaxis(p.gamma, 2, 0))

    def step(s, x):
        qg, kg, w, u, aqk, gam = x
        vt = u - jnp.matmul(w, s, precision=_HI)
        o = jnp.matmul(qg, s, precision=_HI) + jnp.matmul(aqk, vt, precision=_HI)
        s = gam[..., None] * s + jnp.matmul(jnp.swapaxes(kg, -1, -2), vt, precision=_HI)
        return s, o

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if h0 is None else h0.astype(jnp.float32)
    final, o = lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 2).reshape(b, h, tp, dv), final
