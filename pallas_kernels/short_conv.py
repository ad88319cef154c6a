"""Triton kernels (through Pallas): KDA's short causal depthwise convolution with its SiLU, forward
and backward, for a sequence from its start (math §3.1 step 2).

With taps ``w [W, C]`` (``w[W-1]`` on the current token) and segment ids ``seg [B, T]``::

    y[t]  = sum_i  w[W-1-i] * x[t-i] * [t-i >= 0 and seg[t-i] == seg[t]]       (fp32)
    out   = silu(y)                                                           (one rounding)
    dy[s] = dout[s] * silu'(y[s])
    dx[t] = sum_j  w[W-1-j] * dy[t+j] * [t+j < T and seg[t+j] == seg[t]]
    dw[W-1-i] = sum_{b,t} dy[t] * x[t-i] * [t-i >= 0 and seg[t-i] == seg[t]]

XLA fuses the gradient of the input with the weight gradient's column sums into one multi-output
fusion, which ran at a third of memory bandwidth on an H200 (docs/benchmarks.md), and keeps the
pre-activation from the forward for the SiLU's gradient. Here the forward writes the activation
alone; the backward recomputes ``y`` in a first kernel that writes ``dy`` and per-tile partial
sums of ``dw``, and a second writes ``dx`` from ``dy`` (one kernel that recomputed ``y`` on the
rows past its tile for ``dx`` took twice as long: each program loaded ``x`` at 24 row offsets).
Each program owns a ``[BLOCK_T, BLOCK_C]`` tile of one row of the batch; the rows a few tokens
before and after it are loaded as shifted, masked windows. These are Triton kernels, not Mosaic
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
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_args(x, w, segment_ids, dout=None) -> None:
    """ValueError naming the argument when the kernels cannot take the call."""
    if x.ndim != 3:
        raise ValueError(f"conv_silu: x must be [B, T, C], got shape {x.shape}")
    b, t, c = x.shape
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
    if dout is not None and (dout.shape != x.shape or dout.dtype != x.dtype):
        raise ValueError(f"conv_silu: dout must match x {x.shape} {x.dtype}, got {dout.shape} "
                         f"{dout.dtype}")


def supports(x, w, segment_ids) -> bool:
    """True for the calls the GPU tests cover: an sm_90 GPU and arguments :func:`check_args`
    takes."""
    try:
        check_args(x, w, segment_ids)
    except ValueError:
        return False
    return hopper_gpus()


# -- pieces of both kernels: rows of one batch row, as fp32 windows ---------------------------

def _rows(ref, b, rows, cols, length):
    """``ref[b, rows, cols]`` as fp32 ``[len(rows), len(cols)]``, rows outside ``[0, length)``
    read as 0."""
    inside = (rows >= 0) & (rows < length)
    safe = jnp.clip(rows, 0, length - 1)
    return plt.load(ref.at[b, safe[:, None], cols[None, :]], mask=inside[:, None],
                    other=0).astype(F32)


def _segment(seg_ref, b, rows, length):
    """Segment ids of ``rows`` (clamped into the row: callers mask what lies outside)."""
    return plt.load(seg_ref.at[b, jnp.clip(rows, 0, length - 1)])


def _tap(w_ref, k, cols):
    """Tap ``w[k]`` on the tile's columns, ``[1, BLOCK_C]`` fp32."""
    return plt.load(w_ref.at[k, cols]).astype(F32)[None, :]


def _reaches(seg_ref, b, rows, back, length, seg_rows):
    """``[len(rows), 1]``: the tap ``back`` steps behind each of ``rows`` lies in the row and in
    the same segment (``seg_rows``: the segment ids of ``rows``)."""
    ok = (rows - back >= 0) & (rows < length)
    return (ok & (_segment(seg_ref, b, rows - back, length) == seg_rows))[:, None]


def _taps(x_ref, seg_ref, b, rows, cols, width, length):
    """What each tap reads for ``rows``: ``width`` fp32 ``[len(rows), BLOCK_C]`` windows, the
    ``i``-th the rows ``i`` steps back, zero where that crosses the row's start or a segment."""
    seg_rows = _segment(seg_ref, b, rows, length)
    return [jnp.where(_reaches(seg_ref, b, rows, back, length, seg_rows),
                      _rows(x_ref, b, rows - back, cols, length), 0.0) for back in range(width)]


def _conv(taps, w_ref, cols):
    """``y`` from :func:`_taps`' windows, summed in the reference's order."""
    y = jnp.zeros(taps[0].shape, F32)
    for back, tap in enumerate(taps):
        y = y + tap * _tap(w_ref, len(taps) - 1 - back, cols)
    return y


def _tile():
    """This program's batch row, token rows and channel columns."""
    b, tb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return b, tb, tb * BLOCK_T + jnp.arange(BLOCK_T), cb * BLOCK_C + jnp.arange(BLOCK_C)


def _out_block(tb):
    return pl.ds(tb * BLOCK_T, BLOCK_T), pl.ds(pl.program_id(2) * BLOCK_C, BLOCK_C)


# -- kernels ------------------------------------------------------------------------------------

def _forward_kernel(x_ref, w_ref, seg_ref, out_ref, *, width, length):
    b, tb, rows, cols = _tile()
    y = _conv(_taps(x_ref, seg_ref, b, rows, cols, width, length), w_ref, cols)
    out_ref[(b, *_out_block(tb))] = (y * jax.nn.sigmoid(y)).astype(out_ref.dtype)


def _dy_kernel(x_ref, w_ref, seg_ref, dout_ref, dy_ref, dw_ref, *, width, length):
    """``dy = dout * silu'(y)`` on the tile, rounded to the inputs' dtype, and the tile's partial
    sums of ``dw`` (from ``dy`` in fp32 and the windows that gave ``y``)."""
    b, tb, rows, cols = _tile()
    taps = _taps(x_ref, seg_ref, b, rows, cols, width, length)
    y = _conv(taps, w_ref, cols)
    sig = jax.nn.sigmoid(y)
    dy = _rows(dout_ref, b, rows, cols, length) * sig * (1.0 + y * (1.0 - sig))
    dy_ref[(b, *_out_block(tb))] = dy.astype(dy_ref.dtype)
    part = b * pl.num_programs(1) + tb
    for back, tap in enumerate(taps):
        dw_ref[part, width - 1 - back, _out_block(tb)[1]] = jnp.sum(dy * tap, axis=0)


def _dx_kernel(w_ref, seg_ref, dy_ref, dx_ref, *, width, length):
    """``dx`` on the tile: each later output's gradient through the tap that reads these rows."""
    b, tb, rows, cols = _tile()
    seg_rows = _segment(seg_ref, b, rows, length)
    dx = jnp.zeros((BLOCK_T, BLOCK_C), F32)
    for ahead in range(width):
        later = rows + ahead
        same = (later < length) & (_segment(seg_ref, b, later, length) == seg_rows)
        dy = _rows(dy_ref, b, later, cols, length)
        dx = dx + jnp.where(same[:, None], dy, 0.0) * _tap(w_ref, width - 1 - ahead, cols)
    dx_ref[(b, *_out_block(tb))] = dx.astype(dx_ref.dtype)


def _call(kernel, shape, width, out_shape, *operands, interpret: bool, name: str):
    """``kernel`` over the grid of tiles of ``shape`` ``[B, T, C]``; its name ends in ``_triton``,
    which is how the step profiler (``benchmarks/_trace.py``) tells these kernels apart."""
    b, t, c = shape
    return pl.pallas_call(
        functools.partial(kernel, width=width, length=t), out_shape=out_shape,
        grid=(b, t // BLOCK_T, c // BLOCK_C), name=f"{name}_triton",
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS), interpret=interpret,
    )(*operands)


def conv_silu(x, w, segment_ids, *, interpret: bool = False):
    """``silu(y)`` for ``x [B, T, C]``, taps ``w [W, C]``, ``segment_ids [B, T]`` int -> ``[B, T,
    C]`` in ``x.dtype`` (fp32 math, one rounding)."""
    check_args(x, w, segment_ids)
    return _call(_forward_kernel, x.shape, w.shape[0], jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                 w, segment_ids.astype(jnp.int32), interpret=interpret, name="conv_silu")


def conv_silu_vjp(x, w, segment_ids, dout, *, interpret: bool = False):
    """``(dx [B, T, C] in x.dtype, dw_parts [B * T / BLOCK_T, W, C] fp32)`` for output gradient
    ``dout``: ``dw`` is ``dw_parts.sum(0)``, one partial sum per row tile."""
    check_args(x, w, segment_ids, dout)
    (b, t, c), width = x.shape, w.shape[0]
    seg = segment_ids.astype(jnp.int32)
    like_x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    parts = jax.ShapeDtypeStruct((b * (t // BLOCK_T), width, c), F32)
    dy, dw_parts = _call(_dy_kernel, x.shape, width, (like_x, parts), x, w, seg, dout,
                         interpret=interpret, name="conv_silu_dy")
    dx = _call(_dx_kernel, x.shape, width, like_x, w, seg, dy, interpret=interpret,
               name="conv_silu_dx")
    return dx, dw_parts


__all__ = ["BLOCK_C", "BLOCK_T", "check_args", "conv_silu", "conv_silu_vjp", "supports"]
