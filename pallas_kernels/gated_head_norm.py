"""Triton kernel (through Pallas): the backward of KDA's gated head-wise output norm (math §3.1 step
7), ``y = RMSNorm_head(o) * w * sigmoid(g)``, in one pass.

With ``o``, ``g`` and the output gradient ``dy`` ``[N, H, V]`` and the weight ``w [V]`` (shared by
heads), per token and head::

    r = rsqrt(mean_V(o^2) + eps),   n = o r,   s = sigmoid(g)          (fp32)
    dn = dy w s,   do = r (dn - n mean_V(dn n)),   dg = dy n w s (1 - s),   dw = sum_N dy n s

Each program owns ``BLOCK_ROWS`` tokens of one head: it loads ``o``, ``g`` and ``dy`` once, takes
the two per-row means over the head's ``V`` channels, writes ``do`` and ``dg`` (rounded once to the
inputs' dtypes) and the block's partial column sums of ``dw``. XLA split the same formula into an
elementwise pass and two reductions that read the inputs again (docs/benchmarks.md). The plain
formula is :func:`k3jax.ops.gated_head_norm.gated_head_norm_reference`.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp

from k3jax.devices import hopper_gpus

F32 = jnp.float32
BLOCK_ROWS, NUM_WARPS = 16, 4
HEAD_DIMS = (64, 128, 256)  # a program holds one head's channels: a power of two Triton can tile
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_args(o, g, w, dy) -> None:
    """ValueError naming the argument when the kernel cannot take the call."""
    if o.ndim != 3 or o.shape[2] not in HEAD_DIMS:
        raise ValueError(f"gated_head_norm_vjp: o must be [N, H, V] with V in {HEAD_DIMS}, got "
                         f"shape {o.shape}")
    for name, a in (("o", o), ("g", g), ("dy", dy)):
        if a.shape != o.shape or jnp.dtype(a.dtype) not in DTYPES:
            raise ValueError(f"gated_head_norm_vjp: {name} must be {o.shape} bfloat16 or "
                             f"float32, got {a.shape} {a.dtype}")
    if w.shape != (o.shape[2],):
        raise ValueError(f"gated_head_norm_vjp: w must be [V={o.shape[2]}], got {w.shape}")
    if o.shape[0] % BLOCK_ROWS:
        raise ValueError(f"gated_head_norm_vjp: the kernel needs N % {BLOCK_ROWS} == 0, got "
                         f"N={o.shape[0]}")


def supports(o, g, w, dy) -> bool:
    """True for the calls the GPU tests cover: an sm_90 GPU and arguments :func:`check_args`
    takes."""
    try:
        check_args(o, g, w, dy)
    except ValueError:
        return False
    return hopper_gpus()


def _kernel(o_ref, g_ref, w_ref, dy_ref, do_ref, dg_ref, dw_ref, *, eps):
    o, g, dy = (ref[:, 0, :].astype(F32) for ref in (o_ref, g_ref, dy_ref))
    w = w_ref[...].astype(F32)[None, :]
    r = jax.lax.rsqrt(jnp.mean(o * o, axis=1, keepdims=True) + eps)
    n, s = o * r, jax.nn.sigmoid(g)
    dn = dy * w * s
    do_ref[:, 0, :] = (r * (dn - n * jnp.mean(dn * n, axis=1, keepdims=True))).astype(do_ref.dtype)
    dg_ref[:, 0, :] = (dy * n * w * s * (1.0 - s)).astype(dg_ref.dtype)
    dw_ref[0, 0, :] = jnp.sum(dy * n * s, axis=0)


def gated_head_norm_vjp(o, g, w, dy, *, eps: float, interpret: bool = False):
    """``(do, dg, dw_parts [N / BLOCK_ROWS, H, V] fp32)`` for the output gradient ``dy`` of
    ``RMSNorm_head(o) * w * sigmoid(g)`` (``o``, ``g``, ``dy`` ``[N, H, V]``; ``w [V]``): ``do``
    and ``dg`` in ``o``'s and ``g``'s dtypes, ``dw`` is ``dw_parts.sum((0, 1))``.
    ``interpret``: run in Pallas's interpreter (CPU tests)."""
    check_args(o, g, w, dy)
    n, h, v = o.shape
    block = pl.BlockSpec((BLOCK_ROWS, 1, v), lambda i, j: (i, j, 0))
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, eps=eps),
        out_shape=(jax.ShapeDtypeStruct(o.shape, o.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                   jax.ShapeDtypeStruct((n // BLOCK_ROWS, h, v), F32)),
        grid=(n // BLOCK_ROWS, h),
        in_specs=[block, block, pl.BlockSpec((v,), lambda i, j: (0,)), block],
        out_specs=(block, block, pl.BlockSpec((1, 1, v), lambda i, j: (i, j, 0))),
        name="gated_head_norm_vjp_triton",
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS), interpret=interpret,
    )(o, g, w, dy)


__all__ = ["BLOCK_ROWS", "HEAD_DIMS", "check_args", "gated_head_norm_vjp", "supports"]
