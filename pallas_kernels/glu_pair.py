"""Triton kernel (through Pallas): the input gradient of a gated activation whose two inputs are one
product's two halves (math §6).

With ``pair [N, 2, m]`` (``pair[:, 0]`` the gate, ``pair[:, 1]`` the up branch) and the output
gradient ``dh [N, m]``::

    d_pair[:, 0], d_pair[:, 1] = act.vjp(gate, up, dh)       (fp32, rounded once to pair's dtype)

Each program loads one block of rows and columns of both halves and of ``dh``, computes the
activation's two derivatives from the values they share (both need ``tanh`` of each input and the
gate's sigmoid) and stores both halves: one pass over memory. XLA's fusions of the same formula
either wrote the two derivatives and then concatenated them, or, asked for the ``[N, 2, m]`` result
in one fusion, computed the shared transcendentals twice (docs/benchmarks.md).

``act`` is the caller's static activation (the ops pass their ``GLUSpec``): ``act.vjp(gate, up,
dh) -> (dgate, dup)`` on fp32 blocks, elementwise, so its math stays with the ops (a kernel module
imports nothing from them). The plain formula is the reference of
:func:`k3jax.ops.glu_pair.glu_of_pair`'s backward.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp

from k3jax.devices import hopper_gpus

# A program's block (rows x columns of each half) and its warps: on an H100 at the shared expert's
# [65536, 2, 768], 16 x 128 with 4 warps took 0.186 ms (2.7 TB/s), 32 x 128 0.208, 64 x 128 with 8
# warps 0.211, 8 x 256 0.184 (which needs m % 256 == 0); XLA's formula with the halves stacked 0.59.
BLOCK_ROWS, BLOCK_COLS, NUM_WARPS = 16, 128, 4
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_args(pair, dh, block_rows: int = BLOCK_ROWS, block_cols: int = BLOCK_COLS) -> None:
    """ValueError naming the argument when the kernel cannot take the call."""
    if pair.ndim != 3 or pair.shape[1] != 2:
        raise ValueError(f"glu_pair_vjp: pair must be [N, 2, m], got shape {pair.shape}")
    n, _, m = pair.shape
    if jnp.dtype(pair.dtype) not in DTYPES:
        raise ValueError(f"glu_pair_vjp: pair must be bfloat16 or float32, got {pair.dtype}")
    if dh.shape != (n, m) or dh.dtype != pair.dtype:
        raise ValueError(f"glu_pair_vjp: dh must be [{n}, {m}] {pair.dtype}, got {dh.shape} "
                         f"{dh.dtype}")
    if n % block_rows or m % block_cols:
        raise ValueError(f"glu_pair_vjp: the kernel needs N % {block_rows} == 0 and "
                         f"m % {block_cols} == 0, got N={n}, m={m}")


def supports(pair, dh) -> bool:
    """True for the calls the GPU tests cover: an sm_90 GPU and arguments :func:`check_args`
    takes."""
    try:
        check_args(pair, dh)
    except ValueError:
        return False
    return hopper_gpus()


def _kernel(pair_ref, dh_ref, out_ref, *, act):
    f32 = jnp.float32
    dgate, dup = act.vjp(pair_ref[:, 0, :].astype(f32), pair_ref[:, 1, :].astype(f32),
                         dh_ref[...].astype(f32))
    out_ref[:, 0, :] = dgate.astype(out_ref.dtype)
    out_ref[:, 1, :] = dup.astype(out_ref.dtype)


def glu_pair_vjp(pair, dh, *, act, tiling: tuple[int, int, int] = (BLOCK_ROWS, BLOCK_COLS,
                                                                    NUM_WARPS),
                 interpret: bool = False):
    """``d_pair [N, 2, m]`` in ``pair.dtype``: the gradient of ``act(pair[:, 0], pair[:, 1])``
    (``[N, m]``) for its output gradient ``dh [N, m]``. ``tiling``: a program's rows, columns and
    warps (benchmarks/glu_pair.py compares them). ``interpret``: run in Pallas's interpreter
    (CPU tests)."""
    rows, cols, warps = tiling
    check_args(pair, dh, rows, cols)
    n, _, m = pair.shape
    pair_block = pl.BlockSpec((rows, 2, cols), lambda i, j: (i, 0, j))
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, act=act),
        out_shape=jax.ShapeDtypeStruct(pair.shape, pair.dtype),
        grid=(n // rows, m // cols),
        in_specs=[pair_block, pl.BlockSpec((rows, cols), lambda i, j: (i, j))],
        out_specs=pair_block, name="glu_pair_vjp_triton",
        compiler_params=plt.CompilerParams(num_warps=warps), interpret=interpret,
    )(pair, dh)


__all__ = ["BLOCK_COLS", "BLOCK_ROWS", "check_args", "glu_pair_vjp", "supports"]
