"""KDA's short convolution: causal, depthwise, segment-aware, with decode state (math §3.1 step 2).

The weight ``[W, C]`` applies ``w[W-1]`` to the current token and ``w[W-1-i]`` to the token ``i``
steps back. A tap never reads across a segment boundary, so packed documents stay independent.
The decode state holds the last ``W-1`` inputs ``[B, W-1, C]``, oldest first.

:func:`conv_silu` is the convolution and its SiLU in fp32 (for q and k also the per-head L2 norm
of step 3), rounded once; :func:`conv_silu_projections`, what the layer runs, is that of each
projection of one ``[B, T, P, C]`` product. On a Hopper GPU a sequence from its start (no state)
takes the Triton kernels of :mod:`pallas_kernels.short_conv` forward and backward, which read each
projection in place (a lone ``[B, T, C]`` input is one projection); otherwise, and with
``impl="reference"``, the formula below under JAX's autodiff, which is also the kernels'
reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops.documents import document_index
from k3jax.ops.kda import L2_EPS, l2_normalize
from k3jax.ops.kernel_launch import launcher, takes_kernels
from k3jax.ops.per_device import on_own_rows

F32 = jnp.float32


def _conv32(x, w, segment_ids, state):
    """``(y [B, T, C] fp32, new_state [B, W-1, C])``: the convolution without its activation."""
    width = w.shape[0]
    b, t, c = x.shape
    xs = _with_state(x, state, width)  # [B, W-1+T, C]
    if segment_ids is not None:
        first = segment_ids[:, :1]
        seg = jnp.concatenate([jnp.broadcast_to(first, (b, width - 1)), segment_ids], axis=1)
    y = jnp.zeros((b, t, c), F32)
    for i in range(width):  # i steps back; W is 4, so the loop stays tiny
        tap = jax.lax.dynamic_slice_in_dim(xs, width - 1 - i, t, axis=1).astype(F32)
        if segment_ids is not None:
            same = jax.lax.dynamic_slice_in_dim(seg, width - 1 - i, t, axis=1) == segment_ids
            tap = jnp.where(same[..., None], tap, 0.0)
        y = y + tap * w[width - 1 - i].astype(F32)
    return y, xs[:, t:]


def _with_state(x, state, width: int) -> jax.Array:
    """``[B, W-1+T, C]``: the ``W-1`` inputs before ``x`` (``state``, or zeros) and ``x``; its
    last ``W-1`` rows are the state after ``x``."""
    if state is None:
        state = jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype)
    return jnp.concatenate([state.astype(x.dtype), x], axis=1)


def conv_silu(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None,
              state: jax.Array | None = None, impl: str = "auto", head_dim: int | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """``(silu(conv(x)) [B, T, C] in x.dtype, new_state [B, W-1, C])``: the causal depthwise
    convolution and its SiLU, computed in fp32 and rounded once; with ``head_dim``, each head's
    ``head_dim`` channels are L2-normalised before the rounding (math §3.1 step 3, as
    :func:`k3jax.ops.kda.l2_normalize`).

    Args:
      x: ``[B, T, C]`` inputs.
      w: ``[W, C]`` taps.
      segment_ids: ``[B, T]`` int or None; taps only reach tokens of the same document (a run
        of equal ids: :mod:`k3jax.ops.documents`).
      state: ``[B, W-1, C]`` inputs preceding ``x`` (a continued sequence), or None for zeros. They
        belong to the segment of ``x``'s first token.
      impl: for a sequence from its start (no ``state``), ``"pallas"`` runs the kernels
        (ValueError when they cannot take the call) and ``"auto"`` runs them where they can (a
        Hopper GPU, tile-aligned shapes). Anything else (the KDA layer passes its own ``impl``),
        and a continued sequence, takes the formula.
    Returns:
      The activation and ``new_state``, the last ``W-1`` inputs.
    """
    _check_formula_args("conv_silu", x, w, state, head_dim, segment_ids)
    if state is None and _takes_kernels(x[:, :, None], (w,), impl, (head_dim,)):
        (out,), (new_state,) = _on_kernels(x[:, :, None], (w,), segment_ids, (head_dim,))
        return out, new_state
    # Both paths mask a tap by equal numbers: documents', not ids (which may come back).
    docs = None if segment_ids is None else document_index(segment_ids)
    y, new_state = _conv32(x, w, docs, state)
    return _activate(y, head_dim).astype(x.dtype), new_state


def _check_formula_args(fn, x, w, state, head_dim, segment_ids=None) -> None:
    """ValueError naming the argument of :func:`conv_silu` (``x [B, T, C]``) or
    :func:`conv_silu_step` (``x [B, C]``) that does not fit; the kernels check their own."""
    layout, ndim = ("[B, T, C]", 3) if fn == "conv_silu" else ("[B, C]", 2)
    if x.ndim != ndim:
        raise ValueError(f"{fn}: x must be {layout}, got shape {x.shape}")
    c = x.shape[-1]
    if w.ndim != 2 or w.shape[1] != c or w.shape[0] < 1:
        raise ValueError(f"{fn}: w must be [W, C={c}] with W >= 1, got shape {w.shape}")
    want_state = (x.shape[0], w.shape[0] - 1, c)
    if state is not None and state.shape != want_state:
        raise ValueError(f"{fn}: state must be [B, W-1, C] = {want_state}, got shape "
                         f"{state.shape}")
    if segment_ids is not None and (segment_ids.shape != x.shape[:2]
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"{fn}: segment_ids must be integer [B, T] = {x.shape[:2]}, got "
                         f"{segment_ids.shape} {segment_ids.dtype}")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)
                                 or head_dim < 1 or c % head_dim):
        raise ValueError(f"{fn}: head_dim must be None or a positive divisor of C={c}, got "
                         f"{head_dim!r}")


def _activate(y32: jax.Array, head_dim: int | None) -> jax.Array:
    """SiLU of the fp32 pre-activation ``[..., C]``, L2-normalised per head when ``head_dim``."""
    out = jax.nn.silu(y32)
    if head_dim is None:
        return out
    # Materialised before the norm: fused into its row reductions, XLA's GPU kernels ran ~10x
    # below memory bandwidth (15 ms of a k3_small step).
    out = l2_normalize(jax.lax.optimization_barrier(out).reshape(*out.shape[:-1], -1, head_dim))
    return out.reshape(*out.shape[:-2], -1)


def _launcher(name: str):
    return launcher("short_conv", name, ("norm", "part"))


def conv_silu_projections(x: jax.Array, ws: tuple, segment_ids: jax.Array | None = None,
                          states: tuple | None = None, impl: str = "auto",
                          head_dims: tuple | None = None) -> tuple[tuple, tuple]:
    """:func:`conv_silu` of each of ``P`` projections computed as one product, ``x [B, T, P, C]``,
    with taps ``ws[p] [W, C]``, states ``states[p]`` (or None) and ``head_dims[p]`` ->
    ``(activations, new_states)``, ``P`` of each.

    On the kernels' path (a sequence from its start, as :func:`conv_silu` decides) the kernels
    read each projection in place and the backward writes one ``[B, T, P, C]`` gradient (each
    part's input-gradient kernel into the buffer the previous one wrote), so the product's input
    gradient is one product. Elsewhere each part is :func:`conv_silu` of its slice."""
    p = x.shape[2] if x.ndim == 4 else 0
    if len(ws) != p:
        raise ValueError(f"conv_silu_projections: x must be [B, T, P, C] with P = len(ws) = "
                         f"{len(ws)}, got shape {x.shape}")
    head_dims = (None,) * p if head_dims is None else tuple(head_dims)
    if states is None and _takes_kernels(x, tuple(ws), impl, head_dims):
        return _on_kernels(x, tuple(ws), segment_ids, head_dims)
    outs = [conv_silu(x[:, :, i], w, segment_ids, None if states is None else states[i], impl, hd)
            for i, (w, hd) in enumerate(zip(ws, head_dims))]
    return tuple(o[0] for o in outs), tuple(o[1] for o in outs)


def _takes_kernels(x, ws, impl, head_dims) -> bool:
    """Whether the kernels convolve every projection of ``x [B, T, P, C]`` (a sequence from its
    start): :func:`~k3jax.ops.kernel_launch.takes_kernels` for each part."""
    docs = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    return all(takes_kernels(impl, "short_conv", x, w, docs, head_dim=hd, part=part)
               for part, (w, hd) in enumerate(zip(ws, head_dims)))


def _on_kernels(x, ws, segment_ids, head_dims) -> tuple[tuple, tuple]:
    """``(activations, new_states)`` of each projection of ``x [B, T, P, C]`` by the kernels."""
    docs = (jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None
            else document_index(segment_ids))
    norms = tuple(None if hd is None else (hd, L2_EPS) for hd in head_dims)
    return (conv_silu_projection_kernels(x, ws, docs, norms),
            tuple(_with_state(x[:, :, i], None, w.shape[0])[:, x.shape[1]:]
                  for i, w in enumerate(ws)))


def conv_silu_projection_kernels(x, ws, segment_ids, norms, interpret: bool = False) -> tuple:
    """:func:`kernel_conv_silu_projections` (same arguments) with each device on its own rows of
    the batch (:func:`~k3jax.ops.per_device.on_own_rows`)."""
    return on_own_rows(
        lambda x, ws, seg: kernel_conv_silu_projections(x, ws, seg, norms, interpret), x.shape[0],
        lambda rows: (P(rows), P(), P(rows)), lambda rows: P(rows))(x, ws, segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def kernel_conv_silu_projections(x, ws, segment_ids, norms, interpret: bool = False) -> tuple:
    """:func:`conv_silu_projections`' kernel path: ``x [B, T, P, C]``, ``ws`` ``P`` taps ``[W,
    C]``, ``segment_ids [B, T]`` int, required: document numbers, e.g. from
    :func:`~k3jax.ops.documents.document_index`, as the kernels mask a tap by equal numbers and
    would join two runs of an id that comes back; ``norms`` ``P`` of ``(head_dim, eps)`` to
    L2-normalise each head, or None -> ``P`` activations ``[B, T, C]``. ``interpret``: run the
    kernels in Pallas's interpreter (CPU tests)."""
    return tuple(_launcher("conv_silu")(x, w, segment_ids, norm=norm, part=part,
                                        interpret=interpret)
                 for part, (w, norm) in enumerate(zip(ws, norms)))


def _projections_fwd(x, ws, segment_ids, norms, interpret):
    return kernel_conv_silu_projections(x, ws, segment_ids, norms, interpret), (x, ws, segment_ids)


def _projections_bwd(norms, interpret, res, douts):
    x, ws, segment_ids = res
    dx, dws = None, []
    for part, (w, norm, dout) in enumerate(zip(ws, norms, douts)):
        dx, dw_parts = _launcher("conv_silu_vjp")(x, w, segment_ids, dout.astype(x.dtype),
                                                  norm=norm, part=part, dx_into=dx,
                                                  interpret=interpret)
        dws.append(jnp.sum(dw_parts, axis=0).astype(w.dtype))
    return dx, tuple(dws), None


kernel_conv_silu_projections.defvjp(_projections_fwd, _projections_bwd)


def conv_silu_step(x: jax.Array, w: jax.Array, state: jax.Array, head_dim: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """One decode token of :func:`conv_silu`: ``x [B, C]``, taps ``w [W, C]``, ``state
    [B, W-1, C]`` (the last ``W-1`` inputs, oldest first) -> ``(activation [B, C] in x.dtype,
    new_state [B, W-1, C] in x.dtype)``; ``head_dim`` as in :func:`conv_silu`."""
    _check_formula_args("conv_silu_step", x, w, state, head_dim)
    # The sequence formula on one token: a sum of W shifted taps, elementwise. (As an einsum over
    # the taps, XLA made a one-row batch a reduction fusion that took 0.67 ms a layer on an H200:
    # 6.0 of a 6.8 ms decode step at batch 1.)
    y, new_state = _conv32(x[:, None], w, None, state)
    return _activate(y[:, 0], head_dim).astype(x.dtype), new_state


__all__ = ["conv_silu", "conv_silu_projection_kernels", "conv_silu_projections", "conv_silu_step",
           "kernel_conv_silu_projections"]
