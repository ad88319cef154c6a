"""Attention Residuals: the depth aggregation over earlier sources (math §5).

For sources ``v_0..v_n`` (each ``[B, T, d]``), a pseudo-query ``w [d]`` and a key-norm weight
``g [d]``::

    score_i = w . RMSNorm_g(v_i) = r_i * <v_i, g*w>,   r_i = rsqrt(mean(v_i^2) + eps)
                                                        (no 1/sqrt(d))
    alpha   = softmax_i(score)                          per token
    h       = sum_i alpha_i v_i                         over the UN-normalised sources

all in fp32, cast back to the sources' dtype once. These forms live here, side by side:

* :func:`depth_mix_reference` -- the formula on a Python list of sources, plain autodiff: the
  oracle;
* :func:`depth_mix` -- the training form on a tuple of completed blocks (each ``[B, T, d]``) plus
  the running partial sum, which may be masked out by a traced flag (a scanned block start). Its
  custom VJP keeps only the inputs -- references to the same block arrays at every read, so a
  stack's reads together keep each block once -- and ``[n, B, T]`` statistics (autodiff of the
  formula would also keep fp32 copies and normalised keys of every source at every read);
* :func:`depth_mix_norm` -- what the model runs: the training form and the RMSNorm that follows
  every read, on a Hopper GPU in one pass of Triton kernels forward and backward (XLA's fusions of
  the two steps read the sources several times over);
* :func:`inter_block` + :func:`merge_partial` -- the two-phase inference form: a block's
  pseudo-queries batched against the completed blocks (max and log-sum-exp kept), then merged with
  the in-block partial sum by online softmax.

The drivers :func:`attnres_reference` (math §5's bookkeeping, literally),
:func:`full_attnres_reference` (every sub-layer output its own source) and :func:`attnres_two_phase`
run a whole stack of sub-layer functions; the tests hold them against each other and against the
model's rule.
"""

from __future__ import annotations

from functools import partial as _partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jax.sharding import PartitionSpec as P

from k3jax.ops.kernel_launch import launcher, takes_kernels
from k3jax.ops.per_device import on_own_rows, rows_per_device
from k3jax.ops.rms_norm import rms_norm

_F32 = jnp.float32
_PREC = jax.lax.Precision.HIGHEST  # true fp32 dots on GPUs too (not TF32)


def _inv_rms(v32: jax.Array, eps: float) -> jax.Array:
    """``rsqrt(mean(v^2) + eps)`` over the last axis: ``[..., d] -> [...]``."""
    return jax.lax.rsqrt(jnp.mean(jnp.square(v32), axis=-1) + eps)


def _score(v32: jax.Array, u: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(score, r)`` of sources ``[..., d]`` for the folded query ``u = g * w``: both ``[...]``."""
    r = _inv_rms(v32, eps)
    return r * jnp.einsum("...d,d->...", v32, u, precision=_PREC), r


def _query(w: jax.Array, g: jax.Array) -> jax.Array:
    """The pseudo-query folded with the key-norm weight: ``w . (x_hat * g) = x_hat . (g * w)``."""
    return w.astype(_F32) * g.astype(_F32)


# -- the oracle ---------------------------------------------------------------------------------

def depth_mix_reference(sources: Sequence[jax.Array], w: jax.Array, g: jax.Array,
                        eps: float) -> jax.Array:
    """math §5 aggregation over a list of ``[B, T, d]`` sources, written as the formula reads."""
    v = jnp.stack([s.astype(_F32) for s in sources])                      # [n, B, T, d]
    k = v * _inv_rms(v, eps)[..., None] * g.astype(_F32)                  # RMSNorm_g(v_i)
    alpha = jax.nn.softmax(jnp.einsum("nbtd,d->nbt", k, w.astype(_F32), precision=_PREC), axis=0)
    h = jnp.einsum("nbt,nbtd->btd", alpha, v, precision=_PREC)
    return h.astype(sources[-1].dtype)


# -- the training form: a tuple of completed blocks + the partial sum ------------------------------

def depth_mix(blocks: Sequence[jax.Array], partial: jax.Array | None, w: jax.Array, g: jax.Array,
              eps: float, partial_valid=True) -> tuple[jax.Array, jax.Array]:
    """Aggregate ``blocks`` (and ``partial``): returns ``(h [B, T, d], alpha [n, B, T])``.

    ``blocks`` is a tuple of ``[B, T, d]`` arrays, the completed blocks (embedding first), each a
    source; ``partial [B, T, d]`` (the running sum of the current block) is one more source unless
    it is ``None`` or ``partial_valid`` is false (a Python or traced bool: a scanned sub-layer at a
    block start masks the partial sum, which then gets weight exactly 0 and no gradient). ``alpha``
    holds the weights in source order (fp32, for diagnostics); ``h`` has the sources' dtype.

    The custom VJP keeps only the inputs themselves (references to the same block arrays for every
    read) and ``[n, B, T]`` statistics: no fp32 copies, no stacked ``[n, B, T, d]`` buffer.
    """
    sources, valid = _mix_inputs(blocks, partial, w, g, partial_valid)
    return _depth_mix(float(eps), sources, valid, w, g)


def _mix_inputs(blocks, partial, w, g, partial_valid) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """``(sources, valid)``: the blocks and the partial sum as one tuple of sources, and whether
    its last source counts (a bool array), after checking the arguments."""
    blocks = tuple(blocks)
    arrays = blocks + (() if partial is None else (partial,))
    if not arrays:
        raise ValueError("depth_mix: expected at least one source (blocks or partial); got none")
    ref = arrays[-1]
    if ref.ndim != 3 or any(a.shape != ref.shape or a.dtype != ref.dtype for a in arrays):
        raise ValueError("depth_mix: expected blocks and partial of one shape "
                         "[B, T, d] and dtype; "
                         f"got blocks {[(a.shape, str(a.dtype)) for a in blocks]}, partial "
                         f"{None if partial is None else (partial.shape, str(partial.dtype))}")
    d = ref.shape[-1]
    if w.shape != (d,) or g.shape != (d,):
        raise ValueError(f"depth_mix: query w and key-norm weight g must have shape ({d},); got "
                         f"w {w.shape}, g {g.shape}")
    return arrays, jnp.asarray(True if partial is None else partial_valid, jnp.bool_)


def _mix_forward(eps, sources, valid, w, g):
    """``valid`` masks the LAST source (the partial sum) only; every other source is always
    valid."""
    u = _query(w, g)
    stats = [_score(v.astype(_F32), u, eps) for v in sources]              # n x ([B, T], [B, T])
    s = jnp.stack([st[0] for st in stats])                                 # [n, B, T]
    r = jnp.stack([st[1] for st in stats])
    mask = jnp.arange(len(sources)) < len(sources) - 1
    mask = (mask | valid)[:, None, None]
    e = jnp.exp(jnp.where(mask, s, -jnp.inf) - jnp.max(jnp.where(mask, s, -jnp.inf), axis=0))
    alpha = e / jnp.sum(e, axis=0)                                         # masked: exactly 0
    h = sum(alpha[i][..., None] * v.astype(_F32) for i, v in enumerate(sources))
    # Materialised once: otherwise XLA fuses the weighted sum into each consumer of h (the norm
    # after the read, forward and backward), which then rereads every source.
    h = jax.lax.optimization_barrier(h.astype(sources[-1].dtype))
    return h, alpha, (s, r, mask)


@_partial(jax.custom_vjp, nondiff_argnums=(0,))
def _depth_mix(eps, sources, valid, w, g):
    h, alpha, _ = _mix_forward(eps, sources, valid, w, g)
    return h, alpha


def _depth_mix_fwd(eps, sources, valid, w, g):
    h, alpha, (s, r, mask) = _mix_forward(eps, sources, valid, w, g)
    # Residuals: the inputs themselves (the same arrays every read of a block refers to) and
    # [n, B, T] statistics.
    return (h, alpha), (sources, valid, w, g, alpha, s, r, mask)


def _depth_mix_bwd(eps, res, cts):
    sources, valid, w, g, alpha, s, r, mask = res
    dh, dalpha_out = cts
    d = sources[-1].shape[-1]
    u = _query(w, g)
    dh = dh.astype(_F32)
    # d(alpha_i) = <dh, v_i> (+ any cotangent on the returned weights); softmax backward ->
    # d(score).
    ga = jnp.stack([jnp.einsum("btd,btd->bt", dh, v.astype(_F32), precision=_PREC)
                    for v in sources]) + dalpha_out.astype(_F32)          # [n, B, T]
    ds = jnp.where(mask, alpha * (ga - jnp.sum(alpha * ga, axis=0)), 0.0)
    s = jnp.where(mask, s, 0.0)
    # score_i = r_i <v_i, u>:  d score_i / d v_i = r_i u - score_i r_i^2 v_i / d;  d/du = r_i v_i.
    dsources, du = [], jnp.zeros((d,), _F32)
    for i, v in enumerate(sources):
        v32 = v.astype(_F32)
        dv = (alpha[i][..., None] * dh + (ds[i] * r[i])[..., None] * u
              - (ds[i] * s[i] * r[i] * r[i] / d)[..., None] * v32)
        # Each read's cotangent of each source is materialised on its own. Otherwise XLA fuses
        # the sum over every read of a block (all the sub-layers after it) into one fusion with a
        # column sum of `du`, which ran ~6x below memory bandwidth: on an H200, AttnRes cost a
        # k3_small-shaped stack 18.3 ms a micro-batch that way, 9.4 ms this way (same numbers).
        dsources.append(jax.lax.optimization_barrier(dv.astype(v.dtype)))
        du = du + jnp.einsum("bt,btd->d", ds[i] * r[i], v32, precision=_PREC)
    return (tuple(dsources), None, (du * g.astype(_F32)).astype(w.dtype),
            (du * w.astype(_F32)).astype(g.dtype))


_depth_mix.defvjp(_depth_mix_fwd, _depth_mix_bwd)


# -- a read and the RMSNorm after it ---------------------------------------------------------------

DEPTH_MIX_NORM_IMPLS = ("auto", "pallas", "xla")


def depth_mix_norm(blocks: Sequence[jax.Array], partial: jax.Array | None, w: jax.Array,
                   g: jax.Array, scale: jax.Array, eps: float, norm_eps: float,
                   partial_valid=True, impl: str = "auto"
                   ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """``(x, weights, sources)``: ``x = rms_norm(h, scale)`` of the read ``h`` of
    :func:`depth_mix` (same arguments), the input of the sub-layer after the read, ``[B, T, d]``
    in the sources' dtype; ``weights [n]`` fp32, each source's depth weight averaged over the
    tokens (diagnostics); ``sources``, the read's sources (``blocks``, then ``partial`` if given)
    handed on, equal to them. Later reads of a source should read this copy: the kernel path's
    backward takes in the gradient the copy gets and adds the read's own to it in the pass that
    writes it, where otherwise a separate pass would sum every read's gradient of a source.
    ``scale [d]`` is the norm's weight, ``norm_eps`` its epsilon; ``h`` is rounded to the
    sources' dtype before the norm, as the two steps apart round it.

    ``impl``: ``"pallas"`` runs the Triton kernels of :mod:`pallas_kernels.depth_mix_norm`
    (ValueError when they cannot take the call), ``"auto"`` runs them where they can (a Hopper GPU,
    tile-aligned shapes), ``"xla"`` the two steps apart (:func:`depth_mix`, then the norm).
    """
    _check_impl("depth_mix_norm", impl)
    sources, valid = _mix_inputs(blocks, partial, w, g, partial_valid)
    if _takes_read_kernels(impl, sources, scale):
        return depth_mix_norm_kernels(sources, w, g, scale, valid.astype(jnp.int32)[None],
                                      (float(eps), float(norm_eps)))
    h, alpha = _depth_mix(float(eps), sources, valid, w, g)
    return rms_norm(h, scale, norm_eps), jnp.mean(alpha, axis=(1, 2)), sources


def rms_norm_read(x: jax.Array, scale: jax.Array, eps: float, impl: str = "auto") -> jax.Array:
    """``rms_norm(x, scale, eps)`` of ``x [B, ..., d]`` (in ``x.dtype``; ``B`` the batch's rows,
    as the mesh splits them), through :func:`depth_mix_norm`'s kernels where ``impl`` takes them,
    else the formula. A read of one source is that source exactly: its one depth weight is the
    softmax of one score, 1, and the score's gradient is then exactly 0. So the kernels compute
    the norm alone, in one pass over ``x`` forward and one over ``x`` and the gradient backward,
    where XLA's fusions of the norm read them two and three times (and, for the MoE's latent
    norm, the combine of the experts' slots with them)."""
    _check_impl("rms_norm_read", impl)
    if x.ndim < 2 or scale.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_read: x must be [B, ..., d] and scale [d], got {x.shape} and "
                         f"{scale.shape}")
    rows = x.reshape(x.shape[0], -1, x.shape[-1])                        # [B, T, d]
    if not _takes_read_kernels(impl, (rows,), scale):
        return rms_norm(x, scale, eps)
    no_query = jnp.zeros(x.shape[-1:], _F32)
    y, _, _ = depth_mix_norm_kernels((rows,), no_query, no_query, scale,
                                     jnp.ones((1,), jnp.int32), (float(eps), float(eps)))
    return y.reshape(x.shape)


def _check_impl(op: str, impl: str) -> None:
    if impl not in DEPTH_MIX_NORM_IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is invalid: expected one of "
                         f"{', '.join(map(repr, DEPTH_MIX_NORM_IMPLS))}")


def _takes_read_kernels(impl: str, sources, scale) -> bool:
    """Whether ``impl`` runs the read kernels on ``sources`` (a tuple of ``[B, T, d]``) as each
    device holds its rows."""
    b, t, d = sources[0].shape
    rows = (jax.ShapeDtypeStruct((rows_per_device(b) * t, d), sources[0].dtype),) * len(sources)
    u = jax.ShapeDtypeStruct((d,), _F32)  # the folded query's shape: nothing traced to ask
    return takes_kernels(impl, "depth_mix_norm", rows, u, scale,
                         jax.ShapeDtypeStruct((1,), jnp.int32))


def depth_mix_norm_kernels(sources, w, g, scale, valid, eps: tuple[float, float],
                           interpret: bool = False
                           ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """:func:`depth_mix_norm`'s kernel path on ``sources`` (a tuple of ``[B, T, d]``, the last
    masked unless ``valid [1]`` int32 is nonzero), each device on its own rows of the batch
    (:func:`~k3jax.ops.per_device.on_own_rows`): ``(x [B, T, d], weights [n], sources)``."""
    def on_rows(sources, w, g, scale, valid):
        shape = sources[0].shape
        x, weight_sums, handed_on = kernel_depth_mix_norm(
            tuple(v.reshape(-1, v.shape[-1]) for v in sources), w, g, scale, valid, eps, interpret)
        return (x.reshape(shape), weight_sums[None],   # one row of sums a device
                tuple(v.reshape(shape) for v in handed_on))

    b, t, _ = sources[0].shape
    x, weight_sums, handed_on = on_own_rows(
        on_rows, b, lambda rows: ((P(rows),) * len(sources), P(), P(), P(), P()),
        lambda rows: (P(rows), P(rows), (P(rows),) * len(sources)))(sources, w, g, scale, valid)
    return x, jnp.sum(weight_sums, axis=0) / (b * t), handed_on


@_partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def kernel_depth_mix_norm(sources, w, g, scale, valid, eps: tuple[float, float],
                          interpret: bool = False):
    """:func:`depth_mix_norm`'s kernel path on ``sources`` (a tuple of ``[N, d]``, the last masked
    unless ``valid [1]`` int32 is nonzero), with the kernels' gradients: ``(x [N, d], weight_sums
    [n], sources)``, the depth weights summed over the tokens and the sources handed on (their
    gradient enters the backward kernel, which adds the read's own). ``eps``: the read's and the
    norm's. ``interpret``: run the kernels in Pallas's interpreter (CPU tests)."""
    x, weight_parts = _launcher("depth_mix_norm")(sources, _query(w, g), scale, valid,
                                                  eps_mix=eps[0], eps_norm=eps[1],
                                                  interpret=interpret)
    return x, jnp.sum(weight_parts, axis=0), sources


def _kernel_fwd(sources, w, g, scale, valid, eps, interpret):
    args = custom_vjp_primal_tree_values((sources, w, g, scale, valid))
    return kernel_depth_mix_norm(*args, eps, interpret), args


def _kernel_bwd(eps, interpret, res, cts):
    sources, w, g, scale, valid = res
    dx, dweights, later = cts
    # Symbolic zeros: the weights feed only diagnostics, and a source's last read has no later
    # gradient, which the kernel then does not read.
    dx, dweights = _instantiate(dx), _instantiate(dweights)
    later = tuple(None if isinstance(c, SymbolicZero) else c for c in later)
    dsources, du_parts, dscale_parts = _launcher("depth_mix_norm_vjp")(
        sources, _query(w, g), scale, valid, dx.astype(sources[0].dtype), dweights.astype(_F32),
        later, eps_mix=eps[0], eps_norm=eps[1], interpret=interpret)
    du = jnp.sum(du_parts, axis=0)
    return (dsources, (du * g.astype(_F32)).astype(w.dtype), (du * w.astype(_F32)).astype(g.dtype),
            jnp.sum(dscale_parts, axis=0).astype(scale.dtype), None)


def _instantiate(ct) -> jax.Array:
    """A cotangent as an array: zeros of its shape and dtype for a symbolic zero."""
    return jnp.zeros(ct.aval.shape, ct.aval.dtype) if isinstance(ct, SymbolicZero) else ct


kernel_depth_mix_norm.defvjp(_kernel_fwd, _kernel_bwd, symbolic_zeros=True)


def _launcher(name: str):
    return launcher("depth_mix_norm", name, ("eps_mix", "eps_norm"))


# -- the two-phase inference form ---------------------------------------------------------------

def inter_block(completed: jax.Array, w: jax.Array, g: jax.Array,
                eps: float) -> tuple[jax.Array, jax.Array]:
    """Phase 1: ``S`` queries ``w, g [S, d]`` against ``completed [n, B, T, d]`` in one pass.

    Returns the normalised partial outputs ``o [S, B, T, d]`` and their log-sum-exp
    ``lse [S, B, T]`` (both fp32), ready to be merged with more sources by :func:`merge_partial`.
    """
    v = completed.astype(_F32)
    r = _inv_rms(v, eps)                                                   # shared by the queries
    u = _query(w, g)                                                       # [S, d]
    s = r[None] * jnp.einsum("nbtd,sd->snbt", v, u, precision=_PREC)       # [S, n, B, T]
    m = jnp.max(s, axis=1)
    p = jnp.exp(s - m[:, None])
    z = jnp.sum(p, axis=1)
    o = jnp.einsum("snbt,nbtd->sbtd", p, v, precision=_PREC) / z[..., None]
    return o, m + jnp.log(z)


def merge_partial(o: jax.Array, lse: jax.Array, partial: jax.Array, w: jax.Array, g: jax.Array,
                  eps: float) -> jax.Array:
    """Phase 2: fold one more source ``partial [B, T, d]`` into ``(o, lse)`` by online softmax.

    Returns ``h [B, T, d]`` in ``partial``'s dtype.
    """
    vp = partial.astype(_F32)
    sp, _ = _score(vp, _query(w, g), eps)
    m = jnp.maximum(lse, sp)
    a, b = jnp.exp(lse - m), jnp.exp(sp - m)
    h = (a[..., None] * o + b[..., None] * vp) / (a + b)[..., None]
    return h.astype(partial.dtype)


# -- whole-stack drivers (sub-layers given as functions ``h -> out``) ----------------------------

SubLayer = Callable[[jax.Array], jax.Array]


def _check_driver(sublayers, queries, norms) -> None:
    n = len(sublayers) + 1
    if queries.shape[0] != n or norms.shape[0] != n:
        raise ValueError("expected one query and key-norm weight per sub-layer "
                         "plus the final read "
                         f"({n}); got queries {queries.shape}, norms {norms.shape}")


def attnres_reference(embedding: jax.Array, sublayers: Sequence[SubLayer], queries: jax.Array,
                      norms: jax.Array, block: int, eps: float) -> jax.Array:
    """math §5's Block AttnRes bookkeeping as written there; returns the input of the final norm,
    ``[B, T, d]``.

    ``embedding [B, T, d]``; ``sublayers``: ``L`` functions ``[B, T, d] -> [B, T, d]``, each
    given its read; ``queries``/``norms [L + 1, d]``: one per sub-layer, the last for the final
    aggregation; ``block``: sub-layers per block.
    """
    _check_driver(sublayers, queries, norms)
    partial, blocks = embedding, []
    for j, f in enumerate(sublayers):
        x = partial if not blocks else depth_mix_reference(blocks + [partial], queries[j], norms[j],
                                                           eps)
        if j % block == 0:            # j = 0 commits the embedding
            blocks.append(partial)
            partial = None
        out = f(x)
        partial = out if partial is None else partial + out
    return depth_mix_reference(blocks + [partial], queries[-1], norms[-1], eps)


def full_attnres_reference(embedding: jax.Array, sublayers: Sequence[SubLayer], queries: jax.Array,
                           norms: jax.Array, eps: float) -> jax.Array:
    """Full AttnRes without block bookkeeping: every sub-layer output is its own source.

    Arguments and result as :func:`attnres_reference` (``embedding [B, T, d]``, ``queries``/
    ``norms [L + 1, d]``; returns ``[B, T, d]``), without ``block``.
    """
    _check_driver(sublayers, queries, norms)
    sources = [embedding]
    for j, f in enumerate(sublayers):
        sources.append(f(depth_mix_reference(sources, queries[j], norms[j], eps)))
    return depth_mix_reference(sources, queries[-1], norms[-1], eps)


def attnres_two_phase(embedding: jax.Array, sublayers: Sequence[SubLayer], queries: jax.Array,
                      norms: jax.Array, block: int, eps: float) -> jax.Array:
    """Block AttnRes computed block by block in the two-phase form; equals
    :func:`attnres_reference`, whose arguments it takes (``embedding [B, T, d]``, ``L``
    sub-layers, ``queries``/``norms [L + 1, d]``) and whose ``[B, T, d]`` result it returns.

    Sub-layer ``j = cS + t`` of block ``c`` reads the completed sources (embedding and blocks
    ``< c``, plus, for ``t = 0``, the block that just closed) merged, for ``t >= 1``, with the
    block's own partial sum. Phase 1 runs once per block for all of its queries.
    """
    _check_driver(sublayers, queries, norms)
    completed, partial = [embedding], None
    for start in range(0, len(sublayers), block):
        js = list(range(start, min(start + block, len(sublayers))))
        o, lse = inter_block(jnp.stack(completed), queries[js[0]:js[-1] + 1],
                             norms[js[0]:js[-1] + 1], eps)
        partial = None
        for t, j in enumerate(js):
            if partial is None:
                h = o[t].astype(embedding.dtype)
            else:
                h = merge_partial(o[t], lse[t], partial, queries[j], norms[j], eps)
            out = sublayers[j](h)
            partial = out if partial is None else partial + out
        completed.append(partial)
    o, lse = inter_block(jnp.stack(completed[:-1]), queries[-1:], norms[-1:], eps)
    return merge_partial(o[0], lse[0], completed[-1], queries[-1], norms[-1], eps)


__all__ = ["DEPTH_MIX_NORM_IMPLS", "attnres_reference", "attnres_two_phase", "depth_mix",
           "depth_mix_norm", "depth_mix_norm_kernels", "depth_mix_reference",
           "full_attnres_reference", "inter_block", "kernel_depth_mix_norm", "merge_partial"]
