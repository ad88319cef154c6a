"""Triton kernels (through Pallas): KDA's short causal depthwise convolution with its SiLU, forward
and backward, for a sequence from its start (math §3.1 step 2).

With taps ``w [W, C]`` (``w[W-1]`` on the current token) and segment ids ``seg [B, T]``::

    y[t]  = sum_i  w[W-1-i] * x[t-i] * [t-i >= 0 and seg[t-i] == seg[t]]       (fp32)
    a     = silu(y)
    out   = a, or a / sqrt(sum_head a^2 + eps) per head (q and k, math §3.1 step 3; one rounding)
    dy[s] = da[s] * silu'(y[s]),  da = dout, or (dout - out * sum_head(out * dout)) / norm
    dx[t] = sum_j  w[W-1-j] * dy[t+j] * [t+j < T and seg[t+j] == seg[t]]
    dw[W-1-i] = sum_{b,t} dy[t] * x[t-i] * [t-i >= 0 and seg[t-i] == seg[t]]

XLA fuses the gradient of the input with the weight gradient's column sums into one multi-output
fusion, which ran at a third of memory bandwidth on an H200 (docs/benchmarks.md), and keeps the
pre-activation from the forward for the SiLU's gradient. Here the forward writes the activation
alone; the backward recomputes ``y`` in a first kernel that writes ``dy`` and per-tile partial
sums of ``dw``, and a second writes ``dx`` from ``dy`` (one kernel that recomputed ``y`` on the
rows past its tile for ``dx`` took twice as long: each program loaded ``x`` at 24 row offsets).
Each program owns a tile of ``BLOCK_T`` tokens of one row of the batch by ``BLOCK_C`` channels
(one head's when the kernels normalise heads); the rows a few tokens before and after it are
loaded as shifted, masked windows. These are Triton kernels, not Mosaic
GPU ones: a window shifted by one to three rows is a plain masked pointer load in Triton, while
Mosaic GPU's tiled shared-memory copies start on whole tiles (Mosaic GPU kernels for this were
slower than XLA's fusions; docs/benchmarks.md). jax 0.11.2 warns that its Pallas Triton backend is
deprecated; a later jax may need these moved to ``jax_triton``.

The plain formula is :func:`k3jax.ops.short_conv.conv_silu` with ``impl="reference"``.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp

from k3jax.devices import hopper_gpus

F32 = jnp.float32
# A program's tile, rows (tokens) x columns (channels), and its warps: the fastest forward +
# backward of a sweep at k3_small's shape on an H200 (docs/benchmarks.md).
BLOCK_T, BLOCK_C, NUM_WARPS = 32, 64, 4
MAX_WIDTH = 8  # taps the kernels unroll at most
HEAD_DIMS = (64, 128)  # heads the normalising kernels take: a tile's columns are one head
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_args(x, w, segment_ids, dout=None, head_dim=None, part=None) -> None:
    """ValueError naming the argument when the kernels cannot take the call."""
    if x.ndim == 4:
        if not isinstance(part, int) or not 0 <= part < x.shape[2]:
            raise ValueError(f"conv_silu: part must index x's projections [0, {x.shape[2]}) for "
                             f"x [B, T, P, C] {x.shape}, got {part!r}")
    elif x.ndim != 3 or part is not None:
        raise ValueError(f"conv_silu: x must be [B, T, C], or [B, T, P, C] with part given; got "
                         f"shape {x.shape} and part={part!r}")
    b, t, c = x.shape[0], x.shape[1], x.shape[-1]
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise ValueError(f"conv_silu: x must be bfloat16 or float32, got {x.dtype}")
    if w.ndim != 2 or w.shape[1] != c or not 1 <= w.shape[0] <= MAX_WIDTH:
        raise ValueError(f"conv_silu: w must be [W, {c}] with 1 <= W <= {MAX_WIDTH}, "
                         f"got shape {w.shape}")
    if segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"conv_silu: segment_ids must be integer [{b}, {t}], got "
                         f"{segment_ids.shape} {segment_ids.dtype}")
    if t % BLOCK_T or c % BLOCK_C:
        raise ValueError(f"conv_silu: the kernels need T % {BLOCK_T} == 0 and C % {BLOCK_C} == 0, "
                         f"got T={t}, C={c}")
    if head_dim is not None and (head_dim not in HEAD_DIMS or c % head_dim):
        raise ValueError(f"conv_silu: head_dim must be one of {HEAD_DIMS} and divide C={c}, got "
                         f"{head_dim}")
    if dout is not None and (dout.shape != (b, t, c) or dout.dtype != x.dtype):
        raise ValueError(f"conv_silu: dout must be [B, T, C] = {(b, t, c)} {x.dtype}, got "
                         f"{dout.shape} {dout.dtype}")


def supports(x, w, segment_ids, head_dim=None, part=None) -> bool:
    """True for the calls the GPU tests cover: an sm_90 GPU and arguments :func:`check_args`
    takes."""
    try:
        check_args(x, w, segment_ids, head_dim=head_dim, part=part)
    except ValueError:
        return False
    return hopper_gpus()


# -- pieces of both kernels: rows of one batch row, as fp32 windows ---------------------------

def _rows(ref, b, rows, cols, length, part=None):
    """``ref[b, rows, cols]`` (``ref[b, rows, part, cols]`` for a ``part``) as fp32
    ``[len(rows), len(cols)]``, rows outside ``[0, length)`` read as 0."""
    inside = (rows >= 0) & (rows < length)
    safe = jnp.clip(rows, 0, length - 1)
    at = (b, safe[:, None], cols[None, :]) if part is None else (b, safe[:, None], part,
                                                                   cols[None, :])
    return plt.load(ref.at[at], mask=inside[:, None], other=0).astype(F32)


def _segment(seg_ref, b, rows, length):
    """Segment ids of ``rows`` (clamped into the row: callers mask what lies outside)."""
    return plt.load(seg_ref.at[b, jnp.clip(rows, 0, length - 1)])


def _tap(w_ref, k, cols):
    """Tap ``w[k]`` on the tile's columns, ``[1, len(cols)]`` fp32."""
    return plt.load(w_ref.at[k, cols]).astype(F32)[None, :]


def _reaches(seg_ref, b, rows, back, length, seg_rows):
    """``[len(rows), 1]``: the tap ``back`` steps behind each of ``rows`` lies in the row and in
    the same segment (``seg_rows``: the segment ids of ``rows``)."""
    ok = (rows - back >= 0) & (rows < length)
    return (ok & (_segment(seg_ref, b, rows - back, length) == seg_rows))[:, None]


def _taps(x_ref, seg_ref, b, rows, cols, width, length, part):
    """What each tap reads for ``rows``: ``width`` fp32 ``[len(rows), len(cols)]`` windows, the
    ``i``-th the rows ``i`` steps back, zero where that crosses the row's start or a segment."""
    seg_rows = _segment(seg_ref, b, rows, length)
    return [jnp.where(_reaches(seg_ref, b, rows, back, length, seg_rows),
                      _rows(x_ref, b, rows - back, cols, length, part), 0.0)
            for back in range(width)]


def _conv(taps, w_ref, cols):
    """``y`` from :func:`_taps`' windows, summed in the reference's order."""
    y = jnp.zeros(taps[0].shape, F32)
    for back, tap in enumerate(taps):
        y = y + tap * _tap(w_ref, len(taps) - 1 - back, cols)
    return y


def _tile(block_c):
    """This program's batch row, row tile, token rows and channel columns."""
    b, tb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return b, tb, tb * BLOCK_T + jnp.arange(BLOCK_T), cb * block_c + jnp.arange(block_c)


def _out_block(tb, block_c, part=None):
    """The tile's ``(rows, cols)`` slices of an output, ``(rows, part, cols)`` for a ``part``."""
    rows, cols = pl.ds(tb * BLOCK_T, BLOCK_T), pl.ds(pl.program_id(2) * block_c, block_c)
    return (rows, cols) if part is None else (rows, part, cols)


def _activate(y, eps):
    """``(out, sig, norm)``: the SiLU of ``y``, L2-normalised over the tile's columns (one head)
    unless ``eps`` is None, with the sigmoid and the per-row ``1/norm`` (or None) it took."""
    sig = jax.nn.sigmoid(y)
    out = y * sig
    if eps is None:
        return out, sig, None
    inv = jax.lax.rsqrt(jnp.sum(out * out, axis=1, keepdims=True) + eps)
    return out * inv, sig, inv


# -- kernels ------------------------------------------------------------------------------------

def _forward_kernel(x_ref, w_ref, seg_ref, out_ref, *, width, length, block_c, eps, part):
    b, tb, rows, cols = _tile(block_c)
    y = _conv(_taps(x_ref, seg_ref, b, rows, cols, width, length, part), w_ref, cols)
    out_ref[(b, *_out_block(tb, block_c))] = _activate(y, eps)[0].astype(out_ref.dtype)


def _dy_kernel(x_ref, w_ref, seg_ref, dout_ref, dy_ref, dw_ref, *, width, length, block_c, eps,
               part):
    """``dy`` (the pre-activation's gradient) on the tile, rounded to the inputs' dtype, and the
    tile's partial sums of ``dw`` (from ``dy`` in fp32 and the windows that gave ``y``)."""
    b, tb, rows, cols = _tile(block_c)
    taps = _taps(x_ref, seg_ref, b, rows, cols, width, length, part)
    y = _conv(taps, w_ref, cols)
    out, sig, inv = _activate(y, eps)
    dout = _rows(dout_ref, b, rows, cols, length)
    if inv is not None:  # through the head's L2 norm
        dout = inv * (dout - out * jnp.sum(out * dout, axis=1, keepdims=True))
    dy = dout * sig * (1.0 + y * (1.0 - sig))
    dy_ref[(b, *_out_block(tb, block_c))] = dy.astype(dy_ref.dtype)
    tile = b * pl.num_programs(1) + tb
    for back, tap in enumerate(taps):
        dw_ref[tile, width - 1 - back, _out_block(tb, block_c)[1]] = jnp.sum(dy * tap, axis=0)


def _dx_kernel(w_ref, seg_ref, dy_ref, *dx_refs, width, length, block_c, part):
    """``dx`` on the tile: each later output's gradient through the tap that reads these rows
    (any norm is behind ``dy`` already, so its tiles need no whole heads). ``dx_refs``: the
    output, after the buffer it aliases when other parts' gradients are in it already (unread:
    this kernel writes its own part alone)."""
    dx_ref = dx_refs[-1]
    b, tb, rows, cols = _tile(block_c)
    seg_rows = _segment(seg_ref, b, rows, length)
    dx = jnp.zeros((BLOCK_T, block_c), F32)
    for ahead in range(width):
        later = rows + ahead
        same = (later < length) & (_segment(seg_ref, b, later, length) == seg_rows)
        dy = _rows(dy_ref, b, later, cols, length)
        dx = dx + jnp.where(same[:, None], dy, 0.0) * _tap(w_ref, width - 1 - ahead, cols)
    dx_ref[(b, *_out_block(tb, block_c, part))] = dx.astype(dx_ref.dtype)


def _norm_args(norm) -> dict:
    """The forward and ``dy`` kernels' ``block_c`` and ``eps`` for ``norm = (head_dim, eps)``
    (tiles one head wide) or None (tiles of ``BLOCK_C``, no norm)."""
    block_c, eps = (BLOCK_C, None) if norm is None else norm
    return {"block_c": block_c, "eps": eps}


def _call(kernel, shape, out_shape, *operands, interpret: bool, name: str, block_c=BLOCK_C,
          aliases=None, **static):
    """``kernel`` over the grid of ``[BLOCK_T, block_c]`` tiles of ``shape`` ``[B, T, (P,) C]``,
    with the keywords ``static`` (``aliases``: pallas_call's ``input_output_aliases``). Its name
    ends in ``_l2`` when it normalises heads (``eps`` given), then in ``_triton``, which is how
    the step profiler (``benchmarks/_trace.py``) tells these kernels apart."""
    b, t, c = shape[0], shape[1], shape[-1]
    suffix = "_triton" if static.get("eps") is None else "_l2_triton"
    return pl.pallas_call(
        functools.partial(kernel, length=t, block_c=block_c, **static), out_shape=out_shape,
        grid=(b, t // BLOCK_T, c // block_c), name=name + suffix,
        input_output_aliases=aliases or {},
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS), interpret=interpret,
    )(*operands)


def conv_silu(x, w, segment_ids, *, norm=None, part=None, interpret: bool = False):
    """``silu(y)`` for ``x [B, T, C]`` (or the ``part``-th projection of ``x [B, T, P, C]``),
    taps ``w [W, C]``, ``segment_ids [B, T]`` int -> ``[B, T, C]`` in ``x.dtype`` (fp32 math, one
    rounding); with ``norm = (head_dim, eps)`` each head's ``head_dim`` channels L2-normalised."""
    check_args(x, w, segment_ids, head_dim=None if norm is None else norm[0], part=part)
    b, t, c = x.shape[0], x.shape[1], x.shape[-1]
    return _call(_forward_kernel, x.shape, jax.ShapeDtypeStruct((b, t, c), x.dtype), x, w,
                 segment_ids.astype(jnp.int32), interpret=interpret, name="conv_silu",
                 width=w.shape[0], part=part, **_norm_args(norm))


def conv_silu_vjp(x, w, segment_ids, dout, *, norm=None, part=None, dx_into=None,
                  interpret: bool = False):
    """``(dx, dw_parts [B * T / BLOCK_T, W, C] fp32)`` for output gradient ``dout [B, T, C]`` of
    :func:`conv_silu` with the same ``norm`` and ``part``: ``dw`` is ``dw_parts.sum(0)``, one
    partial sum per row tile. ``dx`` is like ``x``: for a ``part``, ``x [B, T, P, C]``'s gradient
    with this projection's at ``part`` and the other parts ``dx_into``'s (an array like ``x``,
    written in place: the parts' calls in turn fill one gradient) or unspecified."""
    check_args(x, w, segment_ids, dout, head_dim=None if norm is None else norm[0], part=part)
    if dx_into is not None and (part is None or dx_into.shape != x.shape
                                or dx_into.dtype != x.dtype):
        raise ValueError(f"conv_silu: dx_into must be like x {x.shape} {x.dtype} with part given, "
                         f"got {dx_into.shape} {dx_into.dtype} and part={part!r}")
    (b, t, c), width = dout.shape, w.shape[0]
    seg = segment_ids.astype(jnp.int32)
    like_dout = jax.ShapeDtypeStruct(dout.shape, x.dtype)
    tiles = jax.ShapeDtypeStruct((b * (t // BLOCK_T), width, c), F32)
    dy, dw_parts = _call(_dy_kernel, x.shape, (like_dout, tiles), x, w, seg, dout,
                         interpret=interpret, name="conv_silu_dy", width=width, part=part,
                         **_norm_args(norm))
    operands, aliases = (w, seg, dy), None
    if dx_into is not None:
        operands, aliases = (*operands, dx_into), {3: 0}
    dx = _call(_dx_kernel, x.shape, jax.ShapeDtypeStruct(x.shape, x.dtype), *operands,
               interpret=interpret, name="conv_silu_dx", width=width, part=part, aliases=aliases)
    return dx, dw_parts


__all__ = ["BLOCK_C", "BLOCK_T", "check_args", "conv_silu", "conv_silu_vjp", "supports"]
