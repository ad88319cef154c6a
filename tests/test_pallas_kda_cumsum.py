"""Mosaic GPU chunk cumsum of the KDA gates (math §3.3) and its reverse, in the CPU interpreter,
against the fp32 sequential cumsum and its autodiff. (The gated operands the forward kernel also
writes are checked with their chain rule through ``gated_scores``:
tests/test_pallas_kda_scores.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.devices import hopper_gpus
from k3jax.ops.kda_gate import bounded_gate
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from pallas_kernels import kda_cumsum
from pallas_kernels.kda_cumsum import (
    chunk_cumsum_reference,
    cumsum_and_gates,
    reverse_cumsum,
    reverse_cumsum_through_gate,
)
from pallas_kernels.kda_gates import bounded_chunks

ON_GPU = pytest.param(False, id="gpu", marks=pytest.mark.skipif(
    not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU"))


def _chunks_on_both_sides_of_the_bound(key, dk):
    """Gates ``[2, 128, 2, dk]`` (batch, chunk and head each change the flags): head 0's chunks
    are, batch row by row, K3's lower-bound gate (bounded) and a gate of -4.9 a token with one
    channel of the last tile at -5.1 (81.6 nats from a 32-row block's row 0 to its row 16: not
    bounded); K3's gate with one channel of a softplus gate (not bounded) and -4.9 at every token
    (78.4 nats: bounded). Head 1 takes softplus-sized gates (several nats a token: not
    bounded)."""
    kf, ks, kc = jax.random.split(key, 3)
    shape = (2, 128, 2, dk)
    g = -jnp.exp(1.5) * jax.nn.softplus(2.0 * jax.random.normal(ks, shape))
    g = g.at[:, :, 0].set(-5.0 * jax.nn.sigmoid(jax.random.normal(kf, (2, 128, dk))))
    g = g.at[0, 64:, 0].set(-4.9).at[0, 64:, 0, dk - 1].set(-5.1)
    g = g.at[1, :64, 0, 3].set(-20.0 * jax.nn.softplus(jax.random.normal(kc, (64,))))
    return g.at[1, 64:, 0].set(-4.9)


BOTH_SIDES_FLAGS = [[[1, 0], [0, 0]], [[0, 1], [0, 0]]]  # [B, H, NC] of the gates above


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreter"), ON_GPU])
@pytest.mark.parametrize("dk", [64, 128])
def test_cumsum_flags_and_reverse_match_sequential_cumsum(dk, interpret):
    """``G`` (layout [B, T, H, K] -> [B, H, T, K]) and the reverse cumsum (back) against the fp32
    sequential cumsum and its VJP, a random cotangent, within FP32_TOL, and bit for bit against
    numpy's running fp32 sums down (up) each chunk, the kernels' order of additions; the
    kernel's per-chunk flags (the scores' fast path) equal ``bounded_chunks`` of the sequential
    cumsum, on chunks at either side of ``BOUND`` (:func:`_chunks_on_both_sides_of_the_bound`);
    in the interpreter and, where there is one, compiled for the GPU."""
    @jax.jit  # inputs, the reference's value and VJP in one compile
    def reference(key):
        kg, kq, kc = jax.random.split(key, 3)
        g = _chunks_on_both_sides_of_the_bound(kg, dk)
        qk = jax.random.normal(kq, g.shape).astype(jnp.bfloat16)
        ref, ref_vjp = jax.vjp(chunk_cumsum_reference, g)
        ct = jax.random.normal(kc, ref.shape)
        return g, qk, ref, ct, ref_vjp(ct)[0]

    g, qk, ref, ct, ref_back = reference(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(bounded_chunks(ref), BOTH_SIDES_FLAGS)
    # jitted: the interpreter is far slower op by op
    @jax.jit
    def cumsum_and_flags(g, qk):
        outs = cumsum_and_gates(g, qk, qk, scale=1.0, interpret=interpret)
        return outs[0], outs[-1]

    out, flags = cumsum_and_flags(g, qk)
    assert out.shape == (2, 2, 128, dk) and out.dtype == jnp.float32
    assert rel_rms(ref, out) <= FP32_TOL
    np.testing.assert_array_equal(flags, BOTH_SIDES_FLAGS)
    back = jax.jit(lambda ct: reverse_cumsum(ct, interpret=interpret))(ct)
    assert back.shape == g.shape and rel_rms(ref_back, back) <= FP32_TOL
    chunks = np.asarray(g).reshape(2, 2, 64, 2, dk)  # [B, NC, C, H, K]
    running = np.cumsum(chunks, axis=2, dtype=np.float32).reshape(g.shape)
    np.testing.assert_array_equal(out, np.swapaxes(running, 1, 2))
    ct_chunks = np.swapaxes(np.asarray(ct), 1, 2).reshape(2, 2, 64, 2, dk)
    upward = np.flip(np.cumsum(np.flip(ct_chunks, 2), axis=2, dtype=np.float32), 2)
    np.testing.assert_array_equal(back, upward.reshape(g.shape))


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpreter"), ON_GPU])
@pytest.mark.parametrize("dk", [64, 128])
def test_cumsum_and_its_reverse_through_the_bounded_gate(dk, interpret):
    """With a ``lower_bound`` the forward takes the gate's logits ``z`` less their bias ``b`` and
    sums ``lower_bound * sigmoid(z + b)``, and the reverse (given ``z`` and ``b``) returns ``dz``
    and ``db`` (the sums over the chunks' rows): against the fp32 sequential cumsum of
    :func:`bounded_gate` and its VJP (autodiff through the gate), within FP32_TOL (the kernels'
    ``exp`` is the fast approximate one); in the interpreter and, where there is one, compiled
    for the GPU."""
    bound = -5.0

    @jax.jit
    def reference(key):
        kz, kb, kq, kc = jax.random.split(key, 4)
        # two batch rows of two chunks (the bias's gradient sums per-chunk parts of each), one
        # head (the bias's rows per head: tests/test_pallas_kda.py, end to end)
        z = 2.0 * jax.random.normal(kz, (2, 128, 1, dk))
        b = jax.random.normal(kb, (1, dk))
        qk = jax.random.normal(kq, z.shape).astype(jnp.bfloat16)
        ref, ref_vjp = jax.vjp(lambda z, b: chunk_cumsum_reference(bounded_gate(z + b, bound)),
                               z, b)
        ct = jax.random.normal(kc, ref.shape)
        return z, b, qk, ref, ct, ref_vjp(ct)

    z, b, qk, ref, ct, (ref_dz, ref_db) = reference(jax.random.PRNGKey(2))
    out = jax.jit(lambda z, b, qk: cumsum_and_gates(z, qk, qk, scale=1.0, lower_bound=bound,
                                                    bias=b, interpret=interpret)[0])(z, b, qk)
    assert rel_rms(ref, out) <= FP32_TOL
    dz, db = jax.jit(lambda ct, z, b: reverse_cumsum_through_gate(
        ct, z, b, lower_bound=bound, interpret=interpret))(ct, z, b)
    assert dz.shape == z.shape and db.shape == b.shape
    assert rel_rms(ref_dz, dz) <= FP32_TOL and rel_rms(ref_db, db) <= FP32_TOL


@pytest.mark.parametrize("dk", [64, 128])
def test_kernels_lower_for_cuda(dk):
    """Both kernels pass Mosaic GPU's lowering for an sm_90 target (at K = 64 the running sums
    load two rows a step), with and without K3's gate."""
    fwd_in = jax.ShapeDtypeStruct((1, 256, 2, dk), jnp.float32)
    qk = jax.ShapeDtypeStruct((1, 256, 2, dk), jnp.bfloat16)
    bwd_in = jax.ShapeDtypeStruct((1, 2, 256, dk), jnp.float32)
    fwd = jax.jit(kda_cumsum._cumsum_gates_call,
                  static_argnames=("scale", "lower_bound", "interpret"))
    bwd = jax.jit(kda_cumsum._reverse_call, static_argnames=("lower_bound", "interpret"))
    cuda = {"lowering_platforms": ("cuda",)}
    fwd.trace(fwd_in, qk, qk, (), (), scale=1.0, lower_bound=None, interpret=False).lower(**cuda)
    bwd.trace(bwd_in, lower_bound=None, interpret=False).lower(**cuda)
    # K3's gate: the forward on its logits and bias rows, the reverse reading them
    rows = jax.ShapeDtypeStruct((2, 128 // dk, dk), jnp.float32)
    fwd.trace(fwd_in, qk, qk, (), (rows,), scale=1.0, lower_bound=-5.0, interpret=False).lower(
        **cuda)
    bwd.trace(bwd_in, fwd_in, rows, lower_bound=-5.0, interpret=False).lower(**cuda)
