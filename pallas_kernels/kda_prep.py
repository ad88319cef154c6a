"""Token-parallel part of chunked KDA (SPEC 3.3), in plain JAX: everything but the recurrence.

For each chunk of ``C`` tokens (one head) this forms, from the cumulative log-decay ``G``:

* ``Aqk [C, C]`` = ``scale * sum_c q_rc k_jc exp(G_rc - G_jc)`` for ``r >= j``;
* ``T = (I + L)^-1`` with ``L[r, j] = beta_r sum_c k_rc k_jc exp(G_rc - G_jc)``, ``r > j``;
* ``W = T (beta Gamma K)``, ``U = T (beta V)``, ``Qg = scale Gamma Q``,
  ``Kg = exp(G_C - G) K`` and ``gamma = exp(G_C)``;

the inputs of the serial state kernels (:mod:`pallas_kernels.kda_state_fwd`). This part runs
under XLA and is differentiated by JAX's autodiff, except where ``scores`` / ``solve`` pick the
Mosaic GPU kernels for the gates' chunk cumsum and the score matrices, and for the inverse with
``W``, ``U`` (each with its own VJP).

Numerics (SPEC 3.3, PITFALLS "KDA"): the relative decay ``exp(G_r - G_j)`` is never split into
``exp(G_r) exp(-G_j)`` over a span that can grow. Scores are built on a binary tree of row blocks:
a pair ``r > j`` belongs to exactly one level ``b`` (32, 16, ..., 1) where ``r`` lies in a right
block ``[a, a + b)`` and ``j`` in its left sibling ``[a - b, a)``; there the decay factors through
the right block's *first* row ``a``: ``exp(G_r - G_a) exp(G_a - G_j)``, both factors ``<= 1`` for
any gate (softplus or lower-bound form, any magnitude). The diagonal ``r = j`` has no decay.

Packed documents (``segment_ids``): no term may cross a segment start. Intra-chunk scores are
masked by ``same_segment[r, j]``; the state entering a chunk reaches row ``r`` only if no segment
starts in the chunk at or before ``r`` (``Gamma`` and ``gamma`` masked); a key reaches the state
leaving the chunk only if no segment starts after it in the chunk (``Kg`` masked). This equals the
reference's "state set to zero at a segment's first token".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda_cumsum import chunk_cumsum
from pallas_kernels.kda_scores import CHUNK as _SCORES_CHUNK
from pallas_kernels.kda_scores import qk_kk_scores
from pallas_kernels.kda_solve import CHUNK as _SOLVE_CHUNK
from pallas_kernels.kda_solve import wy, wy_reference

_HI = lax.Precision.HIGHEST  # fp32 matmuls stay fp32 on GPUs (no TF32)


class Prepared(NamedTuple):
    """Per-chunk inputs of the state kernels, head-major ``[B, H, Tp, .]`` (``Tp`` padded to ``C``).

    qg, kg, w: ``[B, H, Tp, K]`` fp32; u: ``[B, H, Tp, V]`` fp32; aqk: ``[B, H, Tp, C]`` (row ``t``
    holds the chunk-local row of ``Aqk``), fp32, or bf16 from the Mosaic scores kernel (the state
    kernels' operand dtype); gamma: ``[B, H, NC, K]`` fp32.
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


def _segment_masks(segment_ids, b, nc, c):
    """Masks for packed documents, or None. Returns ``(same [B,NC,C,C], enter [B,NC,C], leave [B,NC,C])``.

    ``same[r, j]``: r and j in one segment; ``enter[r]``: the state entering the chunk reaches row r;
    ``leave[j]``: row j's key reaches the state leaving the chunk.
    """
    if segment_ids is None:
        return None
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], dtype=bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    starts = pad_time(starts, c, False)
    idx = jnp.cumsum(starts.astype(jnp.int32), axis=1).reshape(b, nc, c)  # segment counter
    before = idx[:, :, :1] - starts.reshape(b, nc, c)[:, :, :1].astype(jnp.int32)  # counter before chunk
    same = idx[:, :, :, None] == idx[:, :, None, :]
    enter = idx == before
    leave = idx == idx[:, :, -1:]
    return same, enter, leave


SCORES = ("xla", "mosaic")
SOLVES = ("xla", "mosaic")


def prepare(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None, scores: str = "xla",
            solve: str = "xla", interpret: bool = False) -> Prepared:
    """Token-parallel chunk quantities (module docstring) from FLA-layout inputs.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; any float dtype (computed
    in fp32). ``T`` is padded to a multiple of ``chunk_size`` with zero keys, values, queries, beta
    and gates, which leave the state unchanged.

    ``scores`` picks how ``Aqk`` and ``Akk`` are built: ``"xla"`` (default, :func:`_tree_scores`) or
    ``"mosaic"`` (:func:`pallas_kernels.kda_scores.qk_kk_scores`, a Mosaic GPU kernel pair with bf16
    tensor-core operands, and the gates' chunk cumsum by
    :func:`pallas_kernels.kda_cumsum.chunk_cumsum`; chunk 64, K in {64, 128}; ``interpret`` runs
    them in the CPU interpreter).
    ``solve`` picks how ``T = (I + L)^-1`` and ``W``, ``U`` are formed: ``"xla"`` (default, a batched
    triangular solve and fp32 matmuls) or ``"mosaic"`` (:func:`pallas_kernels.kda_solve.wy`, one
    kernel per direction; chunk 64).
    """
    if scores not in SCORES:
        raise ValueError(f"prepare: scores must be one of {SCORES}, got {scores!r}")
    if scores == "mosaic" and chunk_size != _SCORES_CHUNK:
        raise ValueError(f"prepare: scores='mosaic' needs chunk_size={_SCORES_CHUNK}, got {chunk_size}")
    if solve not in SOLVES:
        raise ValueError(f"prepare: solve must be one of {SOLVES}, got {solve!r}")
    if solve == "mosaic" and chunk_size != _SOLVE_CHUNK:
        raise ValueError(f"prepare: solve='mosaic' needs chunk_size={_SOLVE_CHUNK}, got {chunk_size}")
    f32, c = jnp.float32, chunk_size
    b, t, h, dk = q.shape
    q, k, v, g, beta = (pad_time(x.astype(f32), c) for x in (q, k, v, g, beta))
    nc = q.shape[1] // c

    def chunks(x):  # [B, Tp, H, D] -> [B, H, NC, C, D]
        return jnp.moveaxis(x.reshape(b, nc, c, h, -1), 3, 1)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    bc = chunks(beta[..., None])  # [B, H, NC, C, 1]
    if scores == "mosaic":  # the Mosaic cumsum reads g in its layout and writes G head-major
        g_cum = chunk_cumsum(g, interpret=interpret).reshape(b, h, nc, c, dk)
    else:
        # A product with a lower-triangular ones matrix (fp32): XLA lowers jnp.cumsum to an
        # associative scan, 1.11 ms forward + backward at (8, 4096, 16, 128) on the H200 against
        # 0.82 ms for the product (relative difference 5e-7).
        g_cum = jnp.einsum("rc,...ck->...rk", jnp.tril(jnp.ones((c, c), f32)), chunks(g), precision=_HI)
    g_last = g_cum[..., -1:, :]  # [B, H, NC, 1, K]

    if scores == "mosaic":
        heads_major = lambda x: x.reshape(b, h, nc * c, dk)  # noqa: E731  [B, H, NC, C, K] -> [B, H, Tp, K]
        # Aqk in bf16, the state kernels' operand dtype; Akk in fp32 for the inverse.
        aqk, akk = qk_kk_scores(heads_major(qc * scale), heads_major(kc), heads_major(g_cum),
                                out_dtype=(jnp.bfloat16, f32), interpret=interpret)
        aqk, akk = aqk.reshape(b, h, nc, c, c), akk.reshape(b, h, nc, c, c)
    else:
        aqk, akk = _tree_scores(qc * scale, kc, g_cum), _tree_scores(kc, kc, g_cum)
    gamma_rows = jnp.exp(g_cum)
    kdecay = jnp.exp(g_last - g_cum)
    gamma = jnp.exp(g_last[..., 0, :])  # [B, H, NC, K]
    masks = _segment_masks(segment_ids, b, nc, c)
    if masks is not None:
        same, enter, leave = (m[:, None].astype(f32) for m in masks)  # broadcast over heads
        aqk, akk = aqk * same.astype(aqk.dtype), akk * same
        gamma_rows = gamma_rows * enter[..., None]
        kdecay = kdecay * leave[..., None]
        gamma = gamma * enter[..., -1:]
    lower = akk * bc  # L[r, j] = beta_r * akk[r, j]; both WY paths read only r > j

    def flat(x):  # [B, H, NC, C, D] -> [B, H, Tp, D]
        return x.reshape(b, h, nc * c, x.shape[-1])

    wy_transform = functools.partial(wy, interpret=interpret) if solve == "mosaic" else wy_reference
    w, u = wy_transform(flat(lower), flat(bc * gamma_rows * kc), flat(bc * vc))

    return Prepared(qg=flat(qc * scale * gamma_rows), kg=flat(kc * kdecay), w=w, u=u,
                    aqk=flat(aqk), gamma=gamma)


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
