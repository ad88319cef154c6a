"""Small helpers shared by the Mosaic GPU KDA kernels (jax 0.11.2 ``plgpu`` API)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

F32, BF16 = jnp.float32, jnp.bfloat16
CHUNK = 64  # tokens per chunk of the chunked form: the rows of every KDA kernel's tiles
HEAD_DIMS = (64, 128)  # the key and value head dims K, V the KDA kernels are built for
WG = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout tile
WARPGROUP = 128  # threads of one warpgroup (a CTA runs one or, with num_threads, several)
KT = 64  # columns of one tile: the bf16 width of the 128-byte swizzle (see ``tiles``)
SPLITS = 3  # bf16 parts that hold an fp32 value exactly (8 + 8 + 8 significant bits; store_split)


def tiles(shape: tuple[int, ...], dtype=BF16, swizzle: int = 128) -> plgpu.SMEM:
    """SMEM with (8, ``swizzle``-byte) tiles and that swizzle: in bf16 a WGMMA operand, plain or
    transposed; in fp32 a tile that WGMMA-layout registers load and store without bank conflicts
    (a plain row-major fp32 tile puts the eight rows a warp touches on the same banks).

    WGMMA needs the two operands of a product to share a swizzle. Every bf16 operand has a minor
    dimension that is a multiple of 64 (128 bytes), except the state kernels' 32-wide value tiles,
    whose products take the 64-byte swizzle on both sides.
    """
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def column_tiles(n: int) -> list:
    """Slices of ``n`` columns (a multiple of :data:`KT`) into tiles of :data:`KT`."""
    return [pl.ds(i * KT, KT) for i in range(n // KT)]


def over_tiles(n: int, body, init=None):
    """``body(cols, carry) -> carry`` folded over the tiles of :data:`KT` of ``n`` columns as a
    loop in the kernel, not unrolled: an unrolled tile is thousands of register loads and stores
    in the module, each copy compiled again by ptxas. Without ``init`` the body returns nothing."""
    return lax.fori_loop(0, n // KT, lambda i, carry: body(pl.ds(i * KT, KT), carry), init)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
    """Row (``dim=0``) or column (``dim=1``) indices of a WGMMA-layout int32 tile."""
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), WG)


def zeros(shape: tuple[int, ...], layout=WG) -> jax.Array:
    """fp32 zeros in ``layout`` (an accumulator's or a recurrence's start)."""
    return plgpu.layout_cast(jnp.zeros(shape, F32), layout)


def optional_refs(refs, present: bool) -> tuple[tuple, tuple]:
    """``(refs[:1], refs[1:])`` if an optional operand or result is ``present``, else
    ``((), refs)``: a kernel body's next ref where that array is passed (or returned) only when
    present."""
    return (tuple(refs[:1]), tuple(refs[1:])) if present else ((), tuple(refs))


def per_row(vec, shape: tuple[int, int]) -> jax.Array:
    """A per-row vector (``ROW`` layout) broadcast over the columns of a ``shape`` tile."""
    return lax.broadcast_in_dim(vec, shape, (0,))


def per_col(vec, shape: tuple[int, int]) -> jax.Array:
    """A per-column vector (``COL`` layout) broadcast over the rows of a ``shape`` tile."""
    return lax.broadcast_in_dim(vec, shape, (1,))


def store_split(value, parts) -> None:
    """Write fp32 ``value`` as ``len(parts)`` bf16 parts whose sum is ``value`` to ~8 significant
    bits a part (two: ~16 bits, what a split-bf16 tensor-core product needs; three: exact)."""
    for i, part_ref in enumerate(parts):
        part = value.astype(BF16)
        part_ref[...] = part
        if i + 1 < len(parts):
            value = value - part.astype(F32)


def store_result(value, out, tile) -> None:
    """Write fp32 WGMMA-layout ``value`` to the GMEM view ``out`` in ``out``'s dtype. A bf16 result
    goes through ``tile`` (a free swizzled SMEM tile of its shape) and TMA: stored from registers,
    a warp's 4-byte bf16 pieces half-fill the 32-byte sectors they touch (fp32's 8-byte pieces fill
    them, so fp32 goes straight). The caller waits (``plgpu.wait_smem_to_gmem``) before it writes
    ``tile`` again and before the kernel ends."""
    if out.dtype != BF16:
        out[...] = value.astype(out.dtype)
        return
    tile[...] = value.astype(BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, out)


def part_views(stacked) -> list:
    """The parts of a split tile stacked on its leading axis (``tiles((n, ...))``) as the list of
    refs that :func:`store_split` and the split products take."""
    return [stacked.at[i] for i in range(stacked.shape[0])]


def load(ref, layout=WG) -> jax.Array:
    return plgpu.load(ref, layout=layout, optimized=False)


class Registers(NamedTuple):
    """A bf16 WGMMA-layout register array as a product's left operand: the tensor cores read it
    from registers, so it needs no SMEM tile, store and commit before the product."""

    value: jax.Array


def products(*specs, interpret: bool = False) -> tuple[jax.Array, ...]:
    """Independent tensor-core products, issued back to back and waited for once (the latency of
    one round, not of each): every spec ``(shape, (a, b), ...)`` gives ``sum(a @ b)`` in an fp32
    accumulator of ``shape``, returned in order. ``b`` is an SMEM ref, ``a`` one or
    :class:`Registers`."""
    if interpret and any(isinstance(a, Registers) for _, *pairs in specs for a, _ in pairs):
        return _products_staged(specs)

    def scoped(*accs):
        for acc, (_, *pairs) in zip(accs, specs):
            for a, b in pairs:
                plgpu.wgmma(acc, a.value if isinstance(a, Registers) else a, b)
        return tuple(acc[...] for acc in accs)  # the first read waits for every product

    return pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for shape, *_ in specs))


def _products_staged(specs) -> tuple[jax.Array, ...]:
    """:func:`products` with each :class:`Registers` operand stored once to a scoped SMEM tile:
    the interpreter's WGMMA reads SMEM refs only."""
    operands = list({id(a): a for _, *pairs in specs for a, _ in pairs
                     if isinstance(a, Registers)}.values())

    def scoped(*bufs):
        for operand, buf in zip(operands, bufs):
            buf[...] = operand.value
        plgpu.commit_smem()
        ref = {id(operand): buf for operand, buf in zip(operands, bufs)}
        return products(*[(shape, *[(ref.get(id(a), a), b) for a, b in pairs])
                          for shape, *pairs in specs])

    return pl.run_scoped(scoped, *(tiles(operand.value.shape) for operand in operands))


def matmul(shape: tuple[int, int], *pairs, interpret: bool = False) -> jax.Array:
    """``sum(a @ b for a, b in pairs)`` on the tensor cores, fp32 accumulator (operands as in
    :func:`products`)."""
    return products((shape, *pairs), interpret=interpret)[0]


def matmul_onto(init: jax.Array, *pairs, interpret: bool) -> jax.Array:
    """``init + sum(a @ b for a, b in pairs)`` with ``init`` (fp32, WGMMA layout) as the
    accumulator's starting value: its registers become the accumulator's, where adding a separate
    product would hold both at once (what a 128-wide state tile cannot afford). The interpreter
    has no initialised accumulators, so there the product is added after."""
    if interpret:
        return init + matmul(init.shape, *pairs, interpret=True)

    def accumulate(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a.value if isinstance(a, Registers) else a, b)

    return pl.run_state(accumulate)(plgpu.ACC.init(init))


def copy_all(srcs, slots, slot, barrier) -> None:
    """Start TMA copies of the GMEM views ``srcs`` into slot ``slot`` of the double-buffered SMEM
    refs ``slots``, all arriving on ``barrier``."""
    for src, dst in zip(srcs, slots, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier)


def finish_together(done) -> None:
    """Every warpgroup of the CTA arrives at ``done`` (a ``Barrier(num_arrivals=warpgroups)``) and
    waits for the others: no warpgroup exits while another may still issue WGMMAs, which
    jax-linear-attention reports as illegal-instruction faults on sm_90 with jax 0.11.2."""
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def kernel(body, name: str, interpret: bool, *, approx_math: bool = False, **kwargs):
    """``plgpu.kernel`` with Lane semantics; ``approx_math`` lets exp and friends use the fast
    approximate instructions (``ex2.approx``: ~2 ulp, against the bf16 tolerances of every
    caller)."""
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=approx_math)
    return plgpu.kernel(body, kernel_name=name, compiler_params=params,
                        interpret=plgpu.InterpretGPUParams() if interpret else None, **kwargs)


def shared_lowering(fn, static_argnames: tuple[str, ...]):
    """``fn`` (a kernel launcher with an ``interpret`` keyword) under ``jax.jit``, with
    ``static_argnames`` and ``interpret`` static.

    A model calls each kernel once per layer: jitted, every call site with the same shapes shares
    one lowered Mosaic module instead of lowering and compiling its own copy. In the interpreter
    (CPU tests) ``fn`` runs as it is: jitted interpreted kernels deadlocked the CPU runtime when
    earlier interpreted kernels had run in the same process.
    """
    jitted = jax.jit(fn, static_argnames=(*static_argnames, "interpret"))

    def call(*args, interpret: bool = False, **kwargs):
        return (fn if interpret else jitted)(*args, interpret=interpret, **kwargs)

    return call
