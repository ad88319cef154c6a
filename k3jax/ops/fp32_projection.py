"""Projections the spec keeps in fp32 (the router's logits, the KDA gate's and beta's inputs) of
bf16 activations by fp32 weights, on bf16 tensor cores.

Every product of a bf16 ``x`` with an fp32 weight is exact in fp32 once the weight is written as
the sum of three bf16 parts (8 + 8 + 8 significand bits cover fp32's 24): ``x W = x W_1 + x W_2
+ x W_3``, one bf16 matmul against the parts side by side, accumulated in fp32. That is the fp32
product (``Precision.HIGHEST``) up to the order of the sums, where an fp32 matmul of these
shapes (many tokens, few columns: the experts, the gate's rank and heads) runs far below the
memory bandwidth on a GPU. The gradients split
the same way: ``dW = x^T dY`` exactly (``dY`` in three parts), and ``dx = dY W^T`` from the
three largest cross terms (relative error ~2^-16, under the bf16 ``dx``'s own rounding).

Activations in another dtype (an fp32 model) take the plain fp32 product. A product of two fp32
operands computed in the layer (the KDA gate's low-rank up-projection) is :func:`fp32_product`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bf16_parts(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``a`` (fp32) as three bf16 arrays whose sum is ``a``: each the rounding of what the ones
    before it leave. Exact for finite ``|a|`` from ~1e-31 (the last part's smallest normal) to
    ~3.4e38 (above it the first part rounds to inf).

    The roundings are ``reduce_precision`` in fp32, each cast to bf16 only once it is exact:
    XLA's GPU compiler drops an ``f32 -> bf16 -> f32`` round trip as excess precision, which
    would leave the first part alone."""
    def bf16_rounded(v):
        return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)

    hi = bf16_rounded(a)
    rest = a - hi
    mid = bf16_rounded(rest)
    return tuple(p.astype(jnp.bfloat16) for p in (hi, mid, rest - mid))


def fp32_projection(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in fp32: ``x [..., d]`` (bf16 takes the tensor-core path), ``w [d, n]`` ->
    ``[..., n]`` fp32."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp32_projection: w must be [d={x.shape[-1]}, n], got {w.shape}")
    w = w.astype(jnp.float32)
    if x.dtype != jnp.bfloat16:
        return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    lead = x.shape[:-1]
    return _bf16_by_fp32(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[1])


def _sum_of_thirds(y: jax.Array) -> jax.Array:
    """``[m, 3n]`` -> ``[m, n]``: the three column blocks added."""
    n = y.shape[-1] // 3
    return y[:, :n] + y[:, n:2 * n] + y[:, 2 * n:]


@jax.custom_vjp
def _bf16_by_fp32(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [m, d]`` bf16, ``w [d, n]`` fp32 -> ``[m, n]`` fp32 (module docstring)."""
    return _sum_of_thirds(jnp.dot(x, jnp.concatenate(bf16_parts(w), axis=-1),
                                  preferred_element_type=jnp.float32))


def _fwd(x, w):
    return _bf16_by_fp32(x, w), (x, w)


def _bwd(res, dy):
    x, w = res
    dy_parts = bf16_parts(dy)
    d1, d2, _ = dy_parts
    w1, w2, _ = bf16_parts(w)
    # dY W^T from d1 w1 + d1 w2 + d2 w1, as one matmul over the three pairs side by side.
    dx = jnp.dot(jnp.concatenate([d1, d1, d2], axis=-1), jnp.concatenate([w1, w2, w1], axis=-1).T,
                 preferred_element_type=jnp.float32)
    dw = _sum_of_thirds(jnp.dot(x.T, jnp.concatenate(dy_parts, axis=-1),
                                preferred_element_type=jnp.float32))
    return dx.astype(x.dtype), dw


_bf16_by_fp32.defvjp(_fwd, _bwd)

def fp32_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` of two fp32 operands (the KDA gate's rank-``r`` up-projection) to within math
    §10's fp32 tolerance: each operand split into two bf16 parts, three bf16 products of them
    (XLA's ``BF16_BF16_F32_X3``). A GPU's default fp32 product is TF32, which rounds both operands
    to 10 significand bits. For the gate's up-projection (``[65536, 64] @ [64, 768]``, one H100,
    forward and backward): TF32 0.27 ms and 3e-4 off, these 0.32 ms and 4e-6 off,
    ``Precision.HIGHEST`` (fp32 cores) 0.53 ms and 1e-7 off."""
    return jnp.dot(a, b, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)


__all__ = ["bf16_parts", "fp32_product", "fp32_projection"]
