"""KDA on Hopper: chunked forward and backward with the serial state pass as Mosaic GPU kernels.

``kda_pallas`` computes what :func:`k3jax.ops.kda_reference.kda_reference` computes (math §3.2) by
the chunked form of math §3.3, in three parts:

1. :func:`pallas_kernels.kda_prep.prepare` (the token-parallel part): the gates' chunk cumsum with
   the gated operands ``Qg``, ``Kg``, ``Xk``, ``gamma`` and the intra-chunk score matrices
   (:func:`pallas_kernels.kda_scores.gated_scores`) and the chunk inverse with ``W, U``
   (:mod:`pallas_kernels.kda_solve`), Mosaic GPU kernels with their own VJPs that read and write the
   caller's ``[B, T, H, K]`` layout where it is theirs. Only padding, the segment masks and
   ``beta``'s transpose are left to XLA.
2. :func:`pallas_kernels.kda_state_fwd.state_fwd` (Mosaic GPU kernel): the recurrence over chunks
   and the outputs; it saves the per-chunk states and ``Vt`` for the backward.
3. :func:`pallas_kernels.kda_state_bwd.state_bwd`: the reverse recurrence (Mosaic GPU kernel), then
   the per-chunk products of the state gradients (:mod:`pallas_kernels.kda_state_grads`, one Mosaic
   GPU kernel over all chunks, bf16 operands, fp32 accumulation).

Parts 2 and 3 are joined by ``jax.custom_vjp``; JAX's autodiff chains them with the VJPs of part
1's kernels (each intermediate has one consumer, so XLA adds no cotangents), so every input (q, k,
v, g, beta, initial_state) gets its gradient. State and accumulation are fp32; the kernels' matmul
operands are bf16 (WGMMA), which bounds accuracy at bf16 level: fp32 inputs are therefore not
claimed by :func:`supports` (the caller falls back to the chunked JAX op).

A forward with no gradient to follow and more than ``INVERSE_CHAINS`` (batch, head) chains skips
``W`` and ``U``: the solve kernel writes only ``T diag(beta)``
(:func:`pallas_kernels.kda_solve.scaled_inverse`) and the state kernel forms
``U - W S = T diag(beta) (v - Xk S)`` itself: one more product on its serial chain, so with very
few chains, where the chain's steps are the kernel's time, the forward keeps ``W`` and ``U``. A
differentiated call takes the path above, whose kernels the backward needs (``jax.custom_vjp``
at the op's level).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.devices import hopper_gpus
from pallas_kernels._mgpu import CHUNK, HEAD_DIMS, shared_lowering
from pallas_kernels.kda_prep import prepare, prepare_applying_inverse
from pallas_kernels.kda_state_bwd import state_bwd
from pallas_kernels.kda_state_fwd import BLOCK_V, state_fwd

# (batch, head) chains above which a forward without backward applies T diag(beta) in its state
# pass: at 16 chains that is 2-4% faster than writing and rereading W and U (docs/benchmarks.md).
INVERSE_CHAINS = 8

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16),)


_state_fwd_jit = shared_lowering(state_fwd, ("chunk_size", "save", "keep_final"))
_state_bwd_jit = shared_lowering(state_bwd, ("chunk_size", "initial_grad"))


def _bf16(x):
    return x.astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _state_pass(qg, kg, w, u, aqk, gamma, h0, chunk_size, keep_final, interpret):
    """The state kernels: ``(o, final)``, ``final`` None unless ``keep_final`` (then the backward
    has no cotangent of it to read); ``h0`` None for a zero initial state. ``qg, kg, w, aqk``
    bf16 (their cotangents come back bf16), the rest fp32."""
    return _state_fwd_jit(qg, kg, w, u, aqk, gamma, h0, chunk_size=chunk_size, save=False,
                          keep_final=keep_final, interpret=interpret)


def _state_pass_fwd(qg, kg, w, u, aqk, gamma, h0, chunk_size, keep_final, interpret):
    o, final, states, vt = _state_fwd_jit(qg, kg, w, u, aqk, gamma, h0, chunk_size=chunk_size,
                                          keep_final=keep_final, interpret=interpret)
    return (o, final), (qg, kg, w, aqk, gamma, states, vt, h0)


def _state_pass_bwd(chunk_size, keep_final, interpret, res, cts):
    qg, kg, w, aqk, gamma, states, vt, h0 = res
    do, dfinal = cts
    dqg, dkg, dw, daqk, dgam, du, dh0 = _state_bwd_jit(
        qg, kg, w, aqk, gamma, states, vt, do,
        None if dfinal is None else dfinal.astype(jnp.float32), chunk_size=chunk_size,
        initial_grad=h0 is not None, interpret=interpret)
    return dqg, dkg, dw, du, daqk, dgam, dh0


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    """Raise a ValueError naming the argument when the inputs are malformed (before tracing)."""
    if q.ndim != 4:
        raise ValueError(f"kda_pallas: q must be [B, T, H, K], got shape {q.shape}")
    b, t, h, dk = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda_pallas: k and g must have q's shape {q.shape}, "
                         f"got {k.shape} and {g.shape}")
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"kda_pallas: v must be [B, T, H, V] with B, T, H = {(b, t, h)}, "
                         f"got {v.shape}")
    if beta.shape != (b, t, h):
        raise ValueError(f"kda_pallas: beta must be [B, T, H] = {(b, t, h)}, got {beta.shape}")
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError("kda_pallas: initial_state must be [B, H, K, V] = "
                         f"{(b, h, dk, v.shape[-1])}, "
                         f"got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"kda_pallas: segment_ids must be [B, T] = {(b, t)}, "
                         f"got {segment_ids.shape}")
    if chunk_size != CHUNK:
        raise ValueError(f"kda_pallas: chunk_size must be {CHUNK}, got {chunk_size}")
    if dk not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"kda_pallas: head dims K, V must be in {HEAD_DIMS}, "
                         f"got K={dk}, V={v.shape[-1]}")


def kda_pallas(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
               segment_ids=None, chunk_size=CHUNK, gate_lower_bound=None, gate_bias=None,
               interpret=False):
    """Chunked KDA with Mosaic GPU state kernels, differentiable in every input.

    Args:
      q, k, g: ``[B, T, H, K]`` (q, k already L2-normalised; ``g`` the log-decay, ``<= 0``).
      v: ``[B, T, H, V]``.  beta: ``[B, T, H]``.
      scale: multiplies q inside the op.
      initial_state: optional ``[B, H, K, V]`` (taken in fp32).
      output_final_state: return the final state (else ``None``).
      segment_ids: optional integer ``[B, T]``; the state restarts from zero where the id changes.
      chunk_size: the chunk length, only ``CHUNK`` (64).
      gate_lower_bound: None, or K3's gate bound: then ``g`` holds the gate's logits less their
        bias and the cumsum kernels form the log-decay
        ``gate_lower_bound * sigmoid(g + gate_bias)`` (the gradient of ``g`` is then the
        logits').
      gate_bias: ``[H, K]``, the logits' bias under ``gate_lower_bound`` (zero if None).
      interpret: run the kernels in the Mosaic GPU interpreter (CPU tests).

    Returns:
      ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32 or None)``.
    """
    _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    b, t, h, _ = q.shape
    h0 = None if initial_state is None else initial_state.astype(jnp.float32)
    op = (_kda_applying_inverse if b * h > INVERSE_CHAINS and v.dtype == jnp.bfloat16
          else _kda_through_wy)
    bound, bias = None, None
    if gate_lower_bound is not None:
        bound = float(gate_lower_bound)
        bias = (jnp.zeros(g.shape[-2:], jnp.float32) if gate_bias is None
                else gate_bias.astype(jnp.float32))
    o, final = op(q, k, v, g, beta, h0, bias, segment_ids, scale, bound, output_final_state,
                  interpret)
    return o[:, :t].astype(q.dtype), final  # o: bf16 [B, Tp, H, V] from the kernel


def _kda_through_wy(q, k, v, g, beta, h0, bias, segment_ids, scale, lower_bound, keep_final,
                    interpret):
    """``(o [B, Tp, H, V] bf16, final or None)`` through ``W`` and ``U`` (differentiable)."""
    p = prepare(q, k, v, g, beta, scale=scale, chunk_size=CHUNK, segment_ids=segment_ids,
                lower_bound=lower_bound, bias=bias, interpret=interpret)
    return _state_pass(_bf16(p.qg), _bf16(p.kg), _bf16(p.w), p.u, _bf16(p.aqk), p.gamma, h0,
                       CHUNK, keep_final, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _kda_applying_inverse(q, k, v, g, beta, h0, bias, segment_ids, scale, lower_bound,
                          keep_final, interpret):
    """:func:`_kda_through_wy`'s values; without a gradient to follow, the state pass applies
    the chunk inverse itself and ``W``, ``U`` are never formed (the backward needs them, so a
    differentiated call takes the other path)."""
    p, inverse = prepare_applying_inverse(q, k, v, g, beta, scale=scale, chunk_size=CHUNK,
                                          segment_ids=segment_ids, lower_bound=lower_bound,
                                          bias=bias, interpret=interpret)
    return _state_fwd_jit(p.qg, p.kg, p.w, p.u, p.aqk, p.gamma, h0, chunk_size=CHUNK,
                          save=False, keep_final=keep_final, inverse=inverse, interpret=interpret)


def _applying_inverse_fwd(q, k, v, g, beta, h0, bias, segment_ids, scale, lower_bound,
                          keep_final, interpret):
    through_wy = functools.partial(_kda_through_wy, segment_ids=segment_ids, scale=scale,
                                   lower_bound=lower_bound, keep_final=keep_final,
                                   interpret=interpret)
    return jax.vjp(through_wy, q, k, v, g, beta, h0, bias)


def _applying_inverse_bwd(scale, lower_bound, keep_final, interpret, vjp, cts):
    return (*vjp(cts), None)  # segment_ids: integers


_kda_applying_inverse.defvjp(_applying_inverse_fwd, _applying_inverse_bwd)


def supports(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size=CHUNK) -> bool:
    """True only for calls the GPU tests cover: an sm_90 GPU, bf16 q/k/v, K and V in {64, 128},
    chunk 64, well-formed shapes (with or without an initial state and segment_ids)."""
    try:
        _check(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    except ValueError:
        return False
    dtypes_ok = all(jnp.dtype(x.dtype) in INPUT_DTYPES for x in (q, k, v))
    return dtypes_ok and v.shape[-1] % BLOCK_V == 0 and hopper_gpus()


__all__ = ["kda_pallas", "supports"]
