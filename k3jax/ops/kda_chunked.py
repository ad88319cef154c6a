"""Kimi Delta Attention, chunked (math §3.3) in pure JAX: the portable fast path.

The sequence is cut into chunks of ``C`` tokens. Inside a chunk every token-to-token interaction is
a dense ``C x C`` matrix; only the ``K x V`` state is carried from chunk to chunk by a ``lax.scan``.
For one chunk with incoming state ``S`` (rows ``r = 1..C``, ``G = cumsum(g)`` inside the chunk):

    L[r, j]    = beta_r * sum_c k_rc k_jc exp(G_rc - G_jc)        r > j
    A_qk[r, j] =          sum_c q_rc k_jc exp(G_rc - G_jc)        r >= j
    W = (I + L)^-1 (beta * exp(G) * K),   U = (I + L)^-1 (beta * V)
    Vt = U - W S,   O = (exp(G) * Q) S + A_qk Vt
    S <- exp(G_C) * S + (exp(G_C - G) * K)^T Vt

Numerics (math §3.3). A chunk of strong decays reaches ``G ~ -320`` nats, so ``exp(-G_j)``
overflows fp32 and is never formed. Relative decays ``exp(G_r - G_j)`` are built per 16-row
sub-block: pairs in different sub-blocks are factorised at the row block's first row ``a``,
``exp(G_r - G_a) * exp(G_a - G_j)`` with both exponents ``<= 0``; pairs inside one sub-block are
computed elementwise, masked before the ``exp``. Each exponent is summed from cumulative sums local
to a sub-block (or counted back from an end), never as the difference of two chunk-wide sums of
~300 nats, whose rounding would cost ~1e-5 relative accuracy in ``d(g)``. Everything runs in fp32
with true-fp32 matmuls; the output is cast to the input dtype, the state stays fp32.

Packed segments are handled exactly by masks, not by a huge negative gate (which would wipe out the
fp32 precision of every later cumulative sum in the chunk). With ``R`` the running count of segment
starts inside the chunk, a relative decay from ``j`` to ``r`` is kept only if ``R_r == R_j`` and the
incoming state reaches row ``r`` only if ``R_r == 0``. Masked exponents become ``-inf`` before the
``exp``, so their gradients are exactly zero. The gate at a segment's first token decays a state
that is zeroed anyway; it is replaced by 0, so its gradient is exactly zero, as in the recurrence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.documents import segment_starts

SUB_BLOCK = 16  # rows per sub-block of the relative-decay factorisation
_PREC = jax.lax.Precision.HIGHEST  # true fp32 dots on GPUs too (not TF32)


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_PREC)


def _masked_exp(x, keep):
    """``exp(x)`` where ``keep``, else exactly 0: masked before the exp (no overflow, zero grad)."""
    return jnp.exp(jnp.where(keep, x, -jnp.inf))


def _sum_after(g):
    """``sum_{s > r} g_s`` along axis -2, accumulated from the end (exact where it is small)."""
    suffix = jnp.cumsum(g[..., ::-1, :], axis=-2)[..., ::-1, :]          # sum_{s >= r}
    return jnp.concatenate([suffix[..., 1:, :], jnp.zeros_like(suffix[..., :1, :])], axis=-2)


def _diag_block_scores(qs, ks, Gl, Rs):
    """Scores between rows of one sub-block, elementwise.

    Args: qs, ks, Gl (local cumulative log-decay) ``[..., S, 16, K]``; Rs ``[..., S, 16]``.
    Returns: ``[..., S, 16, 16]`` for ``x = q`` (``r >= j``) and ``x = k`` (``r > j``).
    """
    diff = Gl[..., :, :, None, :] - Gl[..., :, None, :, :]                # [..., S, 16, 16, K]
    same_seg = (Rs[..., :, :, None] == Rs[..., :, None, :])[..., None]
    below = (jnp.arange(SUB_BLOCK)[:, None] > jnp.arange(SUB_BLOCK)[None, :])[..., None]
    decay = _masked_exp(diff, same_seg & below)                           # r <= j masked
    # The r == j term (decay exactly 1) does not go through g, so its gradient w.r.t. g (zero in
    # exact arithmetic) leaves no rounding residue in d(g).
    self_qk = jnp.sum(qs * ks, axis=-1)[..., None] * jnp.eye(SUB_BLOCK, dtype=qs.dtype)
    diag_qk = jnp.sum(qs[..., :, None, :] * ks[..., None, :, :] * decay, axis=-1) + self_qk
    diag_kk = jnp.sum(ks[..., :, None, :] * ks[..., None, :, :] * decay, axis=-1)
    return diag_qk, diag_kk


def _off_diag_scores(qs, ks, k, gs, Gl, Rs, R):
    """Scores from rows of sub-block ``i`` to columns of earlier sub-blocks ``b < i``.

    Factorised at ``a_i``, the first row of block ``i``: ``exp(G_r - G_a) * exp(G_a - G_j)``.
    Args: qs, ks, gs, Gl ``[..., S, 16, K]``; k ``[..., C, K]``; Rs ``[..., S, 16]``;
      R ``[..., C]``.
    Returns: ``[..., S, 16, C]`` for ``x = q`` and ``x = k`` (zero for columns ``j >= a_i``).
    """
    s, dk = gs.shape[-3], gs.shape[-1]
    c = s * SUB_BLOCK
    Ra = Rs[..., :, :1]                                                   # [..., S, 1]
    row_decay = _masked_exp(Gl - Gl[..., :, :1, :], (Rs == Ra)[..., None])  # G_r - G_a
    # G_a - G_j for j in block b < i: rest of block b after j, whole blocks b+1..i-1, g at a_i.
    rest = _sum_after(gs)                                                 # [..., S(b), 16, K]
    idx = jnp.arange(s)
    strictly_between = ((idx[None, None, :] > idx[None, :, None])         # [S(i), S(b), S(m)]
                         & (idx[None, None, :] < idx[:, None, None])).astype(gs.dtype)
    between = _einsum("ibm,...mk->...ibk", strictly_between, Gl[..., -1, :])  # [..., i, b, K]
    col_exp = gs[..., :, None, :1, :] + between[..., :, :, None, :] + rest[..., None, :, :, :]
    col_exp = col_exp.reshape(*col_exp.shape[:-4], s, c, dk)             # [..., S(i), C(j), K]
    earlier = (jnp.arange(c)[None, :] < SUB_BLOCK * idx[:, None])[..., None]  # [S, C, 1]: j < a_i
    col_keep = earlier & (Ra == R[..., None, :])[..., None]
    k_col = k[..., None, :, :] * _masked_exp(col_exp, col_keep)           # [..., S, C, K]
    off_qk = _einsum("...irk,...ijk->...irj", qs * row_decay, k_col)
    off_kk = _einsum("...irk,...ijk->...irj", ks * row_decay, k_col)
    return off_qk, off_kk


def _intra_chunk_scores(q, k, g, R):
    """Decay-weighted scores inside each chunk.

    Args:
      q, k, g: ``[..., C, K]`` (``g`` the per-token log-decay); R: ``[..., C]`` int, segment starts
        seen so far in the chunk (broadcastable to ``q``'s leading dims).

    Returns:
      ``A_qk [..., C, C]`` (``r >= j``) and ``A_kk [..., C, C]`` (``r > j``): the sums
      ``sum_c x_rc k_jc exp(G_rc - G_jc)`` for ``x = q`` and ``x = k``, zero across segment starts.
    """
    *lead, c, _ = q.shape
    s = c // SUB_BLOCK
    blk = lambda x: x.reshape(*x.shape[:-2], s, SUB_BLOCK, x.shape[-1])
    qs, ks, gs = blk(q), blk(k), blk(g)
    Rs = R.reshape(*R.shape[:-1], s, SUB_BLOCK)
    Gl = jnp.cumsum(gs, axis=-2)                                          # cumulative per sub-block
    off = _off_diag_scores(qs, ks, k, gs, Gl, Rs, R)
    diag = _diag_block_scores(qs, ks, Gl, Rs)

    def assemble(off, diag):
        # off is zero on and above the diagonal blocks; put the diagonal blocks in.
        eye = jnp.eye(s, dtype=off.dtype)[:, None, :, None]               # [S, 1, S, 1]
        full = off.reshape(*off.shape[:-1], s, SUB_BLOCK) + diag[..., :, :, None, :] * eye
        return full.reshape(*lead, c, c)

    return assemble(off[0], diag[0]), assemble(off[1], diag[1])


def _state_scan(state, w, u, k_to_end, gamma_end):
    """Carry the ``K x V`` state across chunks (the only sequential part).

    Args (chunk axis N in position 2): state ``[B, H, K, V]``; w ``[B, H, N, C, K]``;
      u ``[B, H, N, C, V]``; k_to_end = ``exp(G_C - G) * K`` ``[B, H, N, C, K]``;
      gamma_end = ``exp(G_C)`` ``[B, H, N, K]``.

    Returns:
      ``(final_state [B, H, K, V], state_in [B, H, N, K, V], vt [B, H, N, C, V])``: state_in is
      each chunk's incoming state and ``vt = U - W S``.
    """
    def step(s, xs):
        w_n, u_n, kd_n, ge_n = xs
        vt = u_n - _einsum("bhck,bhkv->bhcv", w_n, s)
        s_next = ge_n[..., None] * s + _einsum("bhck,bhcv->bhkv", kd_n, vt)
        return s_next, (s, vt)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, k_to_end, gamma_end))
    final, (state_in, vt) = jax.lax.scan(step, state, xs)
    return final, jnp.moveaxis(state_in, 0, 2), jnp.moveaxis(vt, 0, 2)


def _to_chunks(x, n, c):
    """``[B, T, H, ...]`` -> zero-padded to ``T = N*C`` -> fp32 ``[B, H, N, C, ...]``."""
    b, t, h, *rest = x.shape
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, c, h, *rest), 3, 1)


def kda_chunked(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, chunk_size=64):
    """KDA over whole sequences by the chunked algorithm (math §3.3).

    Args:
      q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; ``T`` need not be a
        multiple of ``chunk_size``.
      scale: multiplies ``q``.
      initial_state: optional ``[B, H, K, V]`` (cast to fp32).
      segment_ids: optional integer ``[B, T]``: state reset at each change of id (see module doc).
      chunk_size: ``C``, a power of two >= 16 (validated by :func:`k3jax.ops.kda.kda`).

    Returns:
      ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32)``.
    """
    b, t, h, dk = q.shape
    dv, out_dtype, c = v.shape[-1], q.dtype, chunk_size
    n = -(-t // c)
    resets = jnp.zeros((b, t), bool) if segment_ids is None else segment_starts(segment_ids)
    g = jnp.where(resets[:, :, None, None], 0.0, g.astype(jnp.float32))  # decays a zeroed state
    # Padded tokens: g = 0 (no decay), k = v = beta = 0 (no write), no reset: they change nothing.
    q, k, v, g, beta = (_to_chunks(x, n, c) for x in (q, k, v, g, beta))  # [B, H, N, C, ...]
    q = q * scale
    R = jnp.cumsum(_to_chunks(resets[:, :, None], n, c).astype(jnp.int32), axis=-1)  # [B,1,N,C]

    G = jnp.cumsum(g, axis=-2)                                           # G_r = sum_{s<=r} g_s
    R_end = R[..., -1:]
    decay_in = _masked_exp(G, (R == 0)[..., None])                       # exp(G_r): state -> r
    decay_to_end = _masked_exp(_sum_after(g), (R == R_end)[..., None])  # exp(G_C - G_r): r -> end
    gamma_end = _masked_exp(G[..., -1, :], R_end == 0)                   # exp(G_C), [B, H, N, K]

    # Recomputed in the backward pass: its [..., 16, 16, K] temporaries are the largest tensors.
    A_qk, A_kk = jax.checkpoint(_intra_chunk_scores)(q, k, g, R)
    L = beta[..., :, None] * A_kk                                        # strictly lower triangular
    rhs = jnp.concatenate([beta[..., None] * decay_in * k, beta[..., None] * v], axis=-1)
    # Exact (I + L)^-1 rhs by forward substitution; the unit diagonal is implied.
    wu = jax.scipy.linalg.solve_triangular(L, rhs, lower=True, unit_diagonal=True)
    w, u = wu[..., :dk], wu[..., dk:]

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state
    final, state_in, vt = _state_scan(state.astype(jnp.float32), w, u, decay_to_end * k, gamma_end)
    o = (_einsum("bhnck,bhnkv->bhncv", decay_in * q, state_in)
         + _einsum("bhnrj,bhnjv->bhnrv", A_qk, vt))
    o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, dv)[:, :t]
    return o.astype(out_dtype), final


__all__ = ["SUB_BLOCK", "kda_chunked"]
