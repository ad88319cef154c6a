"""Triton kernels (through Pallas): an Attention Residuals read and the RMSNorm after it, forward
and backward, in one pass over the sources (math §5, then §2's pre-norm).

Per token, for sources ``v_0..v_{n-1}`` (``[d]`` each; the last masked out when ``valid`` is 0),
the folded query ``u = g * w`` and the norm's weight ``gamma``, all in fp32::

    r_i = rsqrt(mean(v_i^2) + eps_mix),  s_i = r_i <v_i, u>,  alpha = softmax(s)
    h   = round(sum_i alpha_i v_i)                          (to the sources' dtype, as the read's
                                                             output is)
    q   = rsqrt(mean(h^2) + eps_norm),   x = round(h q gamma)

    dxh   = dx gamma,   xhat = h q
    dh    = q (dxh - xhat mean(dxh xhat))                   dgamma = sum_tokens dx xhat
    ds_i  = alpha_i (<dh, v_i> - sum_j alpha_j <dh, v_j>)
    dv_i  = later_i + alpha_i dh + ds_i r_i u - ds_i s_i r_i^2 v_i / d
    du    = sum_tokens sum_i ds_i r_i v_i

``later_i`` (optional) is the gradient source ``i`` already has from the rest of the program.

The forward also returns each source's ``alpha_i`` summed over the tokens (the depth weights the
training step logs); a cotangent ``c_i`` on those sums adds to ``<dh, v_i>`` above.

XLA runs the read and the norm as separate fusions: the scores, the weighted sum and the norm each
read the sources (or ``h``) again, and the backward's cotangents and the two weight gradients'
column sums (``du``, ``dgamma``) read them several more times; a source read by many sub-layers
then has its gradients summed in passes of their own. Here the forward reads each source from
memory once and writes ``x``; the backward reads the sources and ``dx`` once (a tile's second
looks at a source hit the cache), writes each ``dv_i`` with ``later_i`` added in the same pass,
and leaves the column sums as one fp32 row of partial sums per program. A program's rows are whole
tokens (every reduction above is over a token's ``d`` channels), held as column chunks of
:data:`CHUNK_MAX` or fewer: Triton's blocks are powers of two, ``d`` need not be.

jax 0.11.2 warns that its Pallas Triton backend is deprecated (see
:mod:`pallas_kernels.short_conv`). The plain formula is
:func:`k3jax.ops.attnres.depth_mix_reference` and then :func:`k3jax.ops.rms_norm.rms_norm`; XLA's
path is :func:`k3jax.ops.attnres.depth_mix_norm` with ``impl="xla"``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp

from k3jax.devices import hopper_gpus

F32 = jnp.float32
# Tokens a program's forward tile holds, its warps; the backward's tiles and how many a program
# loops over (one row of partial sums each): the fastest of a sweep on an H200 (docs/benchmarks.md).
FWD_ROWS, FWD_WARPS = 2, 2
BWD_ROWS, BWD_STEPS, BWD_WARPS = 4, 32, 4
TOKENS_MULTIPLE = math.lcm(FWD_ROWS, BWD_ROWS * BWD_STEPS)  # N must be a multiple: whole tiles
CHUNK_MAX = 256  # columns of one chunk of a row
# The widest token row the kernels beat XLA at: a warp holds a whole row of every operand. At
# d = 2048 they lost (forward + backward 1.18 against XLA's 0.80 ms with two sources) and the
# backward with five spilled registers, 12.9 ms a call in k3_1b's step (docs/benchmarks.md).
FAST_WIDTH = 1024
MAX_SOURCES = 16
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_args(sources, u, scale, valid, dx=None) -> None:
    """ValueError naming the argument when the kernels cannot take the call."""
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"depth_mix_norm: expected 1 to {MAX_SOURCES} sources, got "
                         f"{len(sources)}")
    ref = sources[0]
    if ref.ndim != 2 or any(v.shape != ref.shape or v.dtype != ref.dtype for v in sources):
        raise ValueError("depth_mix_norm: sources must share one shape [N, d] and dtype, got "
                         f"{[(v.shape, str(v.dtype)) for v in sources]}")
    if jnp.dtype(ref.dtype) not in INPUT_DTYPES:
        raise ValueError(f"depth_mix_norm: sources must be bfloat16 or float32, got {ref.dtype}")
    tokens, d = ref.shape
    if tokens % TOKENS_MULTIPLE:
        raise ValueError(f"depth_mix_norm: the kernels need tokens N % {TOKENS_MULTIPLE} == 0, "
                         f"got N={tokens}")
    if d % 16:
        raise ValueError(f"depth_mix_norm: d must be a multiple of 16, got d={d}")
    for name, vec in (("u", u), ("scale", scale)):
        if vec.shape != (d,):
            raise ValueError(f"depth_mix_norm: {name} must have shape ({d},), got {vec.shape}")
    if valid.shape != (1,) or valid.dtype != jnp.int32:
        raise ValueError(f"depth_mix_norm: valid must be int32 [1], got {valid.shape} "
                         f"{valid.dtype}")
    if dx is not None and (dx.shape != ref.shape or dx.dtype != ref.dtype):
        raise ValueError(f"depth_mix_norm: dx must match the sources {ref.shape} {ref.dtype}, "
                         f"got {dx.shape} {dx.dtype}")


def supports(sources, u, scale, valid) -> bool:
    """True for the calls worth the kernels: an sm_90 GPU, arguments :func:`check_args` takes, and
    ``d <= FAST_WIDTH``."""
    try:
        check_args(sources, u, scale, valid)
    except ValueError:
        return False
    return sources[0].shape[1] <= FAST_WIDTH and hopper_gpus()


def _chunk(d: int) -> int:
    """The widest power of two up to :data:`CHUNK_MAX` that divides ``d``."""
    return min(CHUNK_MAX, d & -d)


# -- a tile of whole tokens, as a list of fp32 [rows, chunk] column chunks ------------------------

def _load(ref, start, rows, d):
    c = _chunk(d)
    return [ref[pl.ds(start, rows), pl.ds(k * c, c)].astype(F32) for k in range(d // c)]


def _store(ref, start, tile) -> None:
    c = tile[0].shape[1]
    for k, part in enumerate(tile):
        ref[pl.ds(start, part.shape[0]), pl.ds(k * c, c)] = part.astype(ref.dtype)


def _vector(ref, d):
    """A ``[d]`` parameter as ``[1, chunk]`` fp32 chunks."""
    c = _chunk(d)
    return [ref[pl.ds(k * c, c)].astype(F32)[None, :] for k in range(d // c)]


def _dot(a, b):
    """Per-token ``<a, b>``: ``[rows]``."""
    return sum(jnp.sum(x * y, axis=1) for x, y in zip(a, b))


def _scale(tile, by):
    """Each token's row times ``by [rows]``."""
    return [x * by[:, None] for x in tile]


def _column_sums(tile):
    return [jnp.sum(x, axis=0) for x in tile]


# -- the math of one tile --------------------------------------------------------------------------

def _weights(src_refs, start, rows, d, u, valid, eps):
    """``(alpha, s, r)``: per-source ``[rows]`` weights, scores (unmasked) and inverse RMS."""
    s, r = [], []
    for ref in src_refs:
        v = _load(ref, start, rows, d)
        r.append(jax.lax.rsqrt(_dot(v, v) / d + eps))
        s.append(r[-1] * _dot(v, u))
    masked = s[:-1] + [jnp.where(valid, s[-1], -jnp.inf)]   # the partial sum at a block start
    m = masked[0]
    for si in masked[1:]:
        m = jnp.maximum(m, si)
    e = [jnp.exp(si - m) for si in masked]
    z = sum(e)
    return [ei / z for ei in e], s, r


def _read(src_refs, start, rows, d, alpha, dtype):
    """``h`` on the tile, rounded to the sources' dtype (the read's output), back in fp32."""
    h = None
    for ref, a in zip(src_refs, alpha):
        part = _scale(_load(ref, start, rows, d), a)
        h = part if h is None else [x + y for x, y in zip(h, part)]
    return [x.astype(dtype).astype(F32) for x in h]


def _normalised(h, d, eps):
    """``(xhat, q)``: ``h`` RMS-normalised and its per-token ``1/rms``."""
    q = jax.lax.rsqrt(_dot(h, h) / d + eps)
    return _scale(h, q), q


# -- kernels ---------------------------------------------------------------------------------------

def _forward_kernel(*refs, n, d, eps_mix, eps_norm):
    src_refs, (u_ref, scale_ref, valid_ref, x_ref, weights_ref) = refs[:n], refs[n:]
    program = pl.program_id(0)
    start = program * FWD_ROWS
    valid = valid_ref[0] != 0
    alpha, _, _ = _weights(src_refs, start, FWD_ROWS, d, _vector(u_ref, d), valid, eps_mix)
    xhat, _ = _normalised(_read(src_refs, start, FWD_ROWS, d, alpha, src_refs[0].dtype), d,
                          eps_norm)
    _store(x_ref, start, [x * g for x, g in zip(xhat, _vector(scale_ref, d))])
    for k, a in enumerate(alpha):
        weights_ref[program, k] = jnp.sum(a)


def _backward_kernel(*refs, n, d, eps_mix, eps_norm, later):
    src_refs, rest = refs[:n], refs[n:]
    u_ref, scale_ref, valid_ref, dx_ref, dweights_ref = rest[:5]
    taken, rest = iter(rest[5:5 + sum(later)]), rest[5 + sum(later):]
    later_refs = [next(taken) if has else None for has in later]   # None: nothing to add
    dv_refs, (du_ref, dscale_ref) = rest[:n], rest[n:]
    u, gamma = _vector(u_ref, d), _vector(scale_ref, d)
    valid = valid_ref[0] != 0
    first = pl.program_id(0) * BWD_ROWS * BWD_STEPS

    def step(i, sums):
        du, dscale = sums  # per-token terms, summed over tokens after the loop
        start = first + i * BWD_ROWS
        alpha, s, r = _weights(src_refs, start, BWD_ROWS, d, u, valid, eps_mix)
        xhat, q = _normalised(_read(src_refs, start, BWD_ROWS, d, alpha, src_refs[0].dtype), d,
                              eps_norm)
        dx = _load(dx_ref, start, BWD_ROWS, d)
        dscale = [acc + y * x for acc, y, x in zip(dscale, dx, xhat)]
        dxh = [y * g for y, g in zip(dx, gamma)]
        proj = (_dot(dxh, xhat) / d)[:, None]
        dh = _scale([y - x * proj for y, x in zip(dxh, xhat)], q)
        ga = [_dot(dh, _load(ref, start, BWD_ROWS, d)) + dweights_ref[k]
              for k, ref in enumerate(src_refs)]
        mean_ga = sum(a * g for a, g in zip(alpha, ga))
        for k, ref in enumerate(src_refs):
            ds = alpha[k] * (ga[k] - mean_ga)              # 0 for a masked source
            on_u = (ds * r[k])[:, None]                    # d score / d v = r u - s r^2 v / d
            on_v = (ds * s[k] * r[k] * r[k] / d)[:, None]
            v = _load(ref, start, BWD_ROWS, d)
            dv = [alpha[k][:, None] * y + on_u * ux - on_v * x for y, ux, x in zip(dh, u, v)]
            if later_refs[k] is not None:
                dv = [x + y for x, y in zip(dv, _load(later_refs[k], start, BWD_ROWS, d))]
            _store(dv_refs[k], start, dv)
            du = [acc + x * on_u for acc, x in zip(du, v)]
        return du, dscale

    # The token sums accumulate elementwise and are reduced across the tile's rows once: a
    # reduction over rows crosses warps, and one per source and step made the kernel 2x slower.
    zeros = [jnp.zeros((BWD_ROWS, _chunk(d)), F32)] * (d // _chunk(d))
    du, dscale = jax.lax.fori_loop(0, BWD_STEPS, step, (zeros, zeros))
    program = pl.program_id(0)
    for ref, sums in ((du_ref, du), (dscale_ref, dscale)):
        for k, part in enumerate(_column_sums(sums)):
            ref[program, pl.ds(k * _chunk(d), _chunk(d))] = part


def _call(kernel, sources, operands, out_shape, *, grid, warps, name, interpret, **static):
    tokens, d = sources[0].shape
    return pl.pallas_call(
        functools.partial(kernel, n=len(sources), d=d, **static), out_shape=out_shape,
        grid=(grid,), name=f"{name}{len(sources)}_triton",
        compiler_params=plt.CompilerParams(num_warps=warps), interpret=interpret,
    )(*sources, *operands)


def depth_mix_norm(sources, u, scale, valid, *, eps_mix: float, eps_norm: float,
                   interpret: bool = False):
    """``(x [N, d] in the sources' dtype, weight_parts [P, n] fp32)``: the read of ``sources`` (a
    tuple of ``n`` ``[N, d]``, the last masked unless ``valid [1]`` int32 is nonzero) with folded
    query ``u [d]``, RMS-normalised with weight ``scale [d]``; and each source's depth weight
    summed over a program's tokens (``weight_parts.sum(0)``: over all tokens)."""
    check_args(sources, u, scale, valid)
    ref = sources[0]
    programs = ref.shape[0] // FWD_ROWS
    return _call(_forward_kernel, sources, (u, scale, valid),
                 (jax.ShapeDtypeStruct(ref.shape, ref.dtype),
                  jax.ShapeDtypeStruct((programs, len(sources)), F32)), grid=programs,
                 warps=FWD_WARPS, name="depth_mix_norm", interpret=interpret,
                 eps_mix=eps_mix, eps_norm=eps_norm)


def depth_mix_norm_vjp(sources, u, scale, valid, dx, dweights, later=None, *, eps_mix: float,
                       eps_norm: float, interpret: bool = False):
    """``(dsources, du_parts [P, d], dscale_parts [P, d])`` for the gradients ``dx [N, d]`` of
    :func:`depth_mix_norm`'s output and ``dweights [n]`` fp32 of its weights' token sums: each
    source's gradient in its dtype, and the fp32 partial sums of ``u``'s and ``scale``'s
    gradients, one row per program (``du = du_parts.sum(0)``).

    ``later`` (a tuple of ``n`` entries, each ``[N, d]`` or None): the gradient each source has
    already received from the rest of the program (the later reads of it), added to the read's
    own in the pass that writes it, so that no separate pass sums a source's cotangents."""
    check_args(sources, u, scale, valid, dx)
    if dweights.shape != (len(sources),) or dweights.dtype != F32:
        raise ValueError(f"depth_mix_norm: dweights must be float32 [{len(sources)}], got "
                         f"{dweights.shape} {dweights.dtype}")
    ref = sources[0]
    later = (None,) * len(sources) if later is None else tuple(later)
    if len(later) != len(sources) or any(
            g is not None and (g.shape != ref.shape or g.dtype != ref.dtype) for g in later):
        raise ValueError(f"depth_mix_norm: later must hold {len(sources)} entries, each None or "
                         f"{ref.shape} {ref.dtype}, got "
                         f"{[None if g is None else (g.shape, str(g.dtype)) for g in later]}")
    programs = ref.shape[0] // (BWD_ROWS * BWD_STEPS)
    parts = jax.ShapeDtypeStruct((programs, ref.shape[1]), F32)
    like = jax.ShapeDtypeStruct(ref.shape, ref.dtype)
    out = _call(_backward_kernel, sources,
                (u, scale, valid, dx, dweights, *[g for g in later if g is not None]),
                (*[like] * len(sources), parts, parts), grid=programs, warps=BWD_WARPS,
                name="depth_mix_norm_bwd", interpret=interpret, eps_mix=eps_mix,
                eps_norm=eps_norm, later=tuple(g is not None for g in later))
    return tuple(out[:len(sources)]), out[-2], out[-1]


__all__ = ["check_args", "depth_mix_norm", "depth_mix_norm_vjp", "supports"]
