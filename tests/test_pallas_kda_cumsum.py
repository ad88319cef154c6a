"""Mosaic GPU chunk cumsum of the KDA gates (SPEC 3.3) in the CPU interpreter against jnp.cumsum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from k3jax.ops.tolerance import FP32_TOL, rel_rms
from pallas_kernels import kda_cumsum
from pallas_kernels.kda_cumsum import chunk_cumsum, chunk_cumsum_reference


@pytest.mark.parametrize("dk", [64, 128])
def test_values_and_gradient_match_sequential_cumsum(dk):
    """Forward (layout [B, T, H, K] -> [B, H, T, K]) and its VJP against the fp32 sequential cumsum,
    softplus-sized gates (tens of nats a chunk) and a random cotangent, within FP32_TOL."""
    kg, kc = jax.random.split(jax.random.PRNGKey(0))
    g = -jnp.exp(1.5) * jax.nn.softplus(2.0 * jax.random.normal(kg, (2, 128, 3, dk)))
    ref, ref_vjp = jax.vjp(chunk_cumsum_reference, g)
    out, ker_vjp = jax.vjp(lambda g: chunk_cumsum(g, interpret=True), g)
    assert out.shape == (2, 3, 128, dk) and out.dtype == jnp.float32
    assert rel_rms(ref, out) <= FP32_TOL
    ct = jax.random.normal(kc, ref.shape)
    assert rel_rms(ref_vjp(ct)[0], ker_vjp(ct)[0]) <= FP32_TOL


def test_kernels_lower_for_cuda():
    """Both directions pass Mosaic GPU's lowering for an sm_90 target (K = 128)."""
    fwd_in = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.float32)
    bwd_in = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
    call = jax.jit(kda_cumsum._triangular_call, static_argnames=("upper", "interpret"))
    call.trace(fwd_in, upper=False, interpret=False).lower(lowering_platforms=("cuda",))
    call.trace(bwd_in, upper=True, interpret=False).lower(lowering_platforms=("cuda",))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_cumsum(jnp.zeros((1, 40, 1, 64)))
    with pytest.raises(ValueError, match="K in"):
        chunk_cumsum(jnp.zeros((1, 64, 1, 32)))
    with pytest.raises(ValueError, match="float32"):
        chunk_cumsum(jnp.zeros((1, 64, 1, 64), jnp.bfloat16))
