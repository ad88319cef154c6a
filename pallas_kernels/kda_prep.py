"""Token-parallel part of chunked KDA (SPEC 3.3), in plain JAX: everything but the recurrence.

For each chunk of ``C`` tokens (one head) this forms, from the cumulative log-decay ``G``:

* ``Aqk [C, C]`` = ``scale * sum_c q_rc k_jc exp(G_rc - G_jc)`` for ``r >= j``;
* ``T = (I + L)^-1`` with ``L[r, j] = beta_r sum_c k_rc k_jc exp(G_rc - G_jc)``, ``r > j``;
* ``W = T (beta Gamma K)``, ``U = T (beta V)``, ``Qg = scale Gamma Q``,
  ``Kg = exp(G_C - G) K`` and ``gamma = exp(G_C)``;

the inputs of the serial state kernels (:mod:`pallas_kernels.kda_state_fwd`). This part runs under
XLA and is differentiated by JAX's autodiff, except for two pieces with hand-written VJPs (the
diagonal score blocks and the triangular inverse), whose autodiff would store or replay far more.

GPU-friendly form (few large fusions, tensor-core matmuls):

* Scores on 16-row sub-blocks ``I, J`` of the chunk. Off-diagonal blocks (``I > J``) are one batched
  matmul: the decay factors through the first row ``a`` of block ``I`` as
  ``exp(G_r - G_a) exp(G_a - G_j)``, both factors ``<= 1`` for any gate. Diagonal blocks are exact
  elementwise sums ``sum_c a_rc b_jc exp(G_rc - G_jc)`` (``r >= j``, exponent ``<= 0``), one fused
  reduction. No exponent is ever positive, so nothing overflows (SPEC 3.3, PITFALLS "KDA").
* ``T`` blockwise: the four 16x16 diagonal blocks ``D`` by the exact product
  ``(I+N)(I+N^2)(I+N^4)(I+N^8)``, ``N = -L_II``; then with ``M = D^-1 L_off`` (nilpotent, ``M^4 = 0``)
  ``T = (I - M)(I + M^2) D^-1``. Its VJP is ``dL = -T^T dT T^T`` (strictly lower part).
* ``mixed=True`` (the kernels' path): matmul operands in bf16 with fp32 accumulation and the kernel
  operands ``qg, kg, w, aqk`` stored in bf16 (the kernels read them in bf16 anyway); the inverse's
  own products run at ``Precision.HIGH`` (fp32 on CPUs, TF32 on the GPU). ``mixed=False`` is all
  fp32 (HIGHEST) for the exactness test.

Packed documents (``segment_ids``): no term may cross a segment start. Intra-chunk scores are
masked by ``same_segment[r, j]``; the state entering a chunk reaches row ``r`` only if no segment
starts in the chunk at or before ``r`` (``Gamma`` and ``gamma`` masked); a key reaches the state
leaving the chunk only if no segment starts after it in the chunk (``Kg`` masked). This equals the
reference's "state set to zero at a segment's first token".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST  # fp32 matmuls stay fp32 on GPUs (no TF32)
SUB = 16  # sub-block rows: the span over which decays are factorised


class Prepared(NamedTuple):
    """Per-chunk inputs of the state kernels, head-major ``[B, H, Tp, .]`` (``Tp`` padded to ``C``).

    qg, kg, w: ``[B, H, Tp, K]``; u: ``[B, H, Tp, V]`` fp32; aqk: ``[B, H, Tp, C]`` (row ``t`` holds
    the chunk-local row of ``Aqk``); gamma: ``[B, H, NC, K]`` fp32. qg, kg, w, aqk are bf16 when
    prepared with ``mixed=True``, else fp32.
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


def _diag_terms(a, b, g):
    """Shared part of the diagonal blocks: ``exp(G_rc - G_jc)`` for ``r >= j``, else 0.

    a, b, g: ``[..., n, S, K]``. Returns ``E [..., n, S(r), S(j), K]`` (exponent <= 0 or -inf).
    """
    s = a.shape[-2]
    tri = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[:, :, None]
    return jnp.exp(jnp.where(tri, g[..., :, None, :] - g[..., None, :, :], -jnp.inf))


@jax.custom_vjp
def diag_scores(a, b, g):
    """``sum_c a_rc b_jc exp(G_rc - G_jc)`` for ``r >= j`` inside each sub-block, fp32.

    a, b, g: ``[..., n, S, K]`` fp32. Returns ``[..., n, S, S]`` (zero above the diagonal). Its VJP
    recomputes the decays instead of storing the ``[.., S, S, K]`` tensor.
    """
    return jnp.sum(a[..., :, None, :] * b[..., None, :, :] * _diag_terms(a, b, g), axis=-1)


def _diag_fwd(a, b, g):
    return diag_scores(a, b, g), (a, b, g)


def _diag_bwd(res, ds):
    a, b, g = res
    e = _diag_terms(a, b, g) * ds[..., None]
    da = jnp.sum(e * b[..., None, :, :], axis=-2)  # over j
    db = jnp.sum(e * a[..., :, None, :], axis=-3)  # over r
    return da, db, a * da - b * db  # G enters as +G_r and -G_j


diag_scores.defvjp(_diag_fwd, _diag_bwd)


def _scores(a, b, g_cum, mm_dtype, precision):
    """``sum_c a_rc b_jc exp(G_rc - G_jc)`` for ``r >= j`` (0 above the diagonal), per chunk.

    a, b, g_cum: ``[..., C, K]`` fp32. Returns ``[..., C, C]`` fp32 (module docstring: sub-blocks).
    """
    c, dk = a.shape[-2:]
    lead, ns = a.shape[:-2], c // SUB
    a4, b4, g4 = (x.reshape(lead + (ns, SUB, dk)) for x in (a, b, g_cum))
    anchor = g4[..., :, :1, :]  # [.., I, 1, K]: first row of each sub-block
    ar = (a4 * jnp.exp(g4 - anchor)).astype(mm_dtype)  # [.., I, r, K]
    below = (jnp.arange(ns)[None, :] < jnp.arange(ns)[:, None])[:, :, None, None]  # J < I
    expo = jnp.where(below, anchor[..., :, None, :, :] - g4[..., None, :, :, :], -jnp.inf)
    bl = (b4[..., None, :, :, :] * jnp.exp(expo)).astype(mm_dtype)  # [.., I, J, j, K]
    off = jnp.einsum("...irc,...ijsc->...irjs", ar, bl, precision=precision,
                     preferred_element_type=jnp.float32)  # [.., I, r, J, j]
    diag = diag_scores(a4, b4, g4)  # [.., I, r, j]
    eye = jnp.eye(ns, dtype=jnp.float32)[:, None, :, None]
    return (off + eye * diag[..., :, :, None, :]).reshape(lead + (c, c))


def _blocks_diag(x, ns):
    """``[..., C, C] -> [..., ns, S, S]``: the diagonal sub-blocks."""
    s = x.shape[-1] // ns
    x = x.reshape(x.shape[:-2] + (ns, s, ns, s))
    return jnp.stack([x[..., i, :, i, :] for i in range(ns)], axis=-3)


def _block_diag(blocks):
    """``[..., ns, S, S] -> [..., C, C]`` with the blocks on the diagonal, zeros elsewhere."""
    ns, s = blocks.shape[-3], blocks.shape[-1]
    eye = jnp.eye(ns, dtype=blocks.dtype)[:, None, :, None]
    return (eye * blocks[..., :, :, None, :]).reshape(blocks.shape[:-3] + (ns * s, ns * s))


def _tri_inv_impl(lower):
    c = lower.shape[-1]
    ns = c // SUB
    mm = lambda x, y: jnp.matmul(x, y, precision=lax.Precision.HIGH)
    n = -_blocks_diag(lower, ns)  # [.., ns, S, S], strictly lower
    eye_s = jnp.eye(SUB, dtype=jnp.float32)
    dinv = eye_s + n
    for _ in range(3):  # (I+N)(I+N^2)(I+N^4)(I+N^8); N^16 = 0
        n = mm(n, n)
        dinv = mm(dinv, eye_s + n)
    dinv = _block_diag(dinv)
    off = lower - _block_diag(_blocks_diag(lower, ns))
    m = mm(dinv, off)  # strictly block-lower: M^4 = 0
    x = dinv + mm(mm(m, m), dinv)  # (I + M^2) D^-1
    return x - mm(m, x)  # (I - M)(I + M^2) D^-1


@jax.custom_vjp
def tri_inv(lower):
    """``(I + L)^-1`` for strictly lower ``L [..., C, C]`` (fp32), ``C`` a multiple of 16."""
    return _tri_inv_impl(lower)


def _tri_inv_fwd(lower):
    t = _tri_inv_impl(lower)
    return t, t


def _tri_inv_bwd(t, dt):
    mm = lambda x, y: jnp.matmul(x, y, precision=lax.Precision.HIGH)
    tt = jnp.swapaxes(t, -1, -2)
    c = t.shape[-1]
    strict = jnp.tril(jnp.ones((c, c), jnp.float32), -1)
    return (-mm(mm(tt, dt), tt) * strict,)


tri_inv.defvjp(_tri_inv_fwd, _tri_inv_bwd)


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


def prepare(q, k, v, g, beta, *, scale, chunk_size, segment_ids=None, mixed=True) -> Prepared:
    """Token-parallel chunk quantities (module docstring) from FLA-layout inputs.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; any float dtype (elementwise
    work in fp32). ``T`` is padded to a multiple of ``chunk_size`` with zero keys, values, queries,
    beta and gates, which leave the state unchanged. ``mixed``: bf16 matmul operands and outputs
    (module docstring); ``False`` keeps everything fp32.
    """
    if chunk_size % SUB:
        raise ValueError(f"prepare: chunk_size must be a multiple of {SUB}, got {chunk_size}")
    f32, c = jnp.float32, chunk_size
    mm_dtype, prec = (jnp.bfloat16, None) if mixed else (f32, _HI)
    out_dtype = jnp.bfloat16 if mixed else f32
    b, t, h, dk = q.shape
    q, k, v, g, beta = (pad_time(x, c) for x in (q, k, v, g, beta))
    nc = q.shape[1] // c

    def chunks(x):  # [B, Tp, H, D] -> [B, H, NC, C, D] fp32
        return jnp.moveaxis(x.reshape(b, nc, c, h, -1), 3, 1).astype(f32)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
    bc = chunks(beta[..., None])  # [B, H, NC, C, 1]
    g_cum = jnp.cumsum(gc, axis=-2)
    g_last = g_cum[..., -1:, :]  # [B, H, NC, 1, K]

    aqk = _scores(qc * scale, kc, g_cum, mm_dtype, prec)
    akk = _scores(kc, kc, g_cum, mm_dtype, prec) * (1.0 - jnp.eye(c, dtype=f32))
    gamma_rows = jnp.exp(g_cum)
    kdecay = jnp.exp(g_last - g_cum)
    gamma = jnp.exp(g_last[..., 0, :])  # [B, H, NC, K]
    masks = _segment_masks(segment_ids, b, nc, c)
    if masks is not None:
        same, enter, leave = (m[:, None].astype(f32) for m in masks)  # broadcast over heads
        aqk, akk = aqk * same, akk * same
        gamma_rows = gamma_rows * enter[..., None]
        kdecay = kdecay * leave[..., None]
        gamma = gamma * enter[..., -1:]
    tinv = tri_inv(akk * bc)  # L[r, j] = beta_r * akk[r, j]
    x = jnp.concatenate([bc * gamma_rows * kc, bc * vc], axis=-1).astype(mm_dtype)
    wu = jnp.matmul(tinv.astype(mm_dtype), x, precision=prec, preferred_element_type=f32)

    def flat(x, dtype):  # [B, H, NC, C, D] -> [B, H, Tp, D]
        return x.reshape(b, h, nc * c, x.shape[-1]).astype(dtype)

    return Prepared(qg=flat(qc * scale * gamma_rows, out_dtype), kg=flat(kc * kdecay, out_dtype),
                    w=flat(wu[..., :dk], out_dtype), u=flat(wu[..., dk:], f32), aqk=flat(aqk, out_dtype),
                    gamma=gamma)


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
