"""Pallas (Mosaic GPU) KDA kernels in the CPU interpreter against the fp32 recurrence (math §3.2).

Small shapes; inputs are bf16-representable, the reference runs in fp32 on the same values, so
the math §10 bf16 tolerances measure the kernels' own error (bf16 WGMMA operands, fp32 state).
The kernels run jitted: the interpreter is several times slower called op by op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_rows_within,
    bf16_rounded,
    gate_bias_grad_error,
    kda_bf16_case,
    kda_correlated_keys_case,
    kda_fp32_case,
)

import pallas_kernels.kda as kda_module
from k3jax.ops.kda_gate import bounded_gate
from k3jax.ops.kda_reference import kda_reference
from k3jax.ops.tolerance import (
    BF16_GRAD_GATE_TOL,
    BF16_GRAD_QKV_TOL,
    BF16_OUT_TOL,
    FP32_TOL,
    rel_rms,
)
from pallas_kernels.kda import kda_pallas, supports
from pallas_kernels.kda_prep import (
    Prepared,
    prepare,
    prepare_reference,
    state_pass_reference,
)
from pallas_kernels.kda_scores import gated_scores_reference
from pallas_kernels.kda_solve import scaled_inverse_reference, wy_reference
from pallas_kernels.kda_state_bwd import state_bwd
from pallas_kernels.kda_state_fwd import state_fwd
from pallas_kernels.kda_state_grads import chunk_products_reference, state_grads

NAMES = ("q", "k", "v", "g", "beta", "h0")


def _bf16(x):
    return x.astype(jnp.bfloat16)


# The helpers build their cases op by op; jitted, a case is one compile instead of dozens, and
# with the seed traced every seed of a shape and gate shares it.
_bf16_case = jax.jit(kda_bf16_case, static_argnums=range(1, 7))
_fp32_case = jax.jit(kda_fp32_case, static_argnums=range(1, 6))


def _values_and_grads(fn, args, do, dfin):
    """``fn``'s outputs ``(o, final)`` and the gradients of ``sum(o * do) + sum(final * dfin)``
    w.r.t. all of ``args``, from one forward."""
    (o, f), vjp = jax.vjp(fn, *args)
    return (o, f), vjp((do.astype(o.dtype), dfin))  # fp32 do rounded to o's dtype, as autodiff


@functools.partial(jax.jit, static_argnames=("inputs", "alone"))
def _reference_and_kernels(args, seg, do, dfin, gate_bias, inputs, alone=False):
    """:func:`_values_and_grads` of the reference and of ``kda_pallas`` (interpreted) in one
    program (the interpreted kernels run far slower op by op), which the cases of one shape
    share; with ``alone`` also ``kda_pallas``'s ``(o, final)`` called without a gradient to
    follow (the op may take another path then)."""
    dk = args[0].shape[-1]
    scale = dk**-0.5
    gated = gate_bias is not None
    gate = (lambda g, b: bounded_gate(g + b, -5.0)) if gated else (lambda g, b: g)  # noqa: E731
    ref = lambda q, k, v, g, beta, h0, b: kda_reference(q, k, v, gate(g, b), beta, scale=scale,
                                                        initial_state=h0, segment_ids=seg)
    ker = lambda q, k, v, g, beta, h0, b: kda_pallas(
        inputs(q), inputs(k), inputs(v), g, beta, scale=scale, initial_state=h0,
        segment_ids=seg, output_final_state=True, gate_lower_bound=-5.0 if gated else None,
        gate_bias=b, interpret=True)
    args = (*args, gate_bias)
    out = _values_and_grads(ref, args, do, dfin), _values_and_grads(ker, args, do, dfin)
    return (*out, ker(*args)) if alone else out


def _check_all(args, seg, do, dfin, inputs=_bf16, gate_bias=None, alone=False):
    """``kda_pallas`` (interpreted) on ``inputs`` of q, k, v (bf16 unless given) against the
    reference, each batch row on its own: values and all six gradients within math §10's bf16
    tolerances, o in the inputs' dtype and every gradient in its argument's. With ``gate_bias``
    (``[H, K]``) the fourth argument is K3's gate logits less that bias: the reference takes
    :func:`bounded_gate` (bound -5) of their sum, and the bias's gradient is checked as the sum of
    the logits' gradient (:func:`helpers.gate_bias_grad_error`). With ``alone``, ``kda_pallas``
    called without a gradient to follow too: its o and final state within the bf16 output
    tolerance. Returns the reference's ``(o, final)``."""
    gated = gate_bias is not None
    ((ro, rf), rg), ((o, f), kg), *fwd = _reference_and_kernels(args, seg, do, dfin, gate_bias,
                                                                inputs=inputs, alone=alone)
    args = (*args, gate_bias)
    assert o.dtype == inputs(args[0]).dtype and o.shape == ro.shape
    assert_rows_within(ro, o, BF16_OUT_TOL, "o")
    assert_rows_within(rf, f, BF16_OUT_TOL, "final")
    for o_alone, f_alone in fwd:
        assert_rows_within(ro, o_alone, BF16_OUT_TOL, "o alone")
        assert_rows_within(rf, f_alone, BF16_OUT_TOL, "final alone")
    for name, a, r, x in zip(NAMES, args, rg, kg):
        assert x.dtype == a.dtype, name
        tol = BF16_GRAD_GATE_TOL if name in ("g", "beta") else BF16_GRAD_QKV_TOL
        assert_rows_within(r, x, tol, name)
    if gated:
        assert kg[-1].dtype == gate_bias.dtype
        assert gate_bias_grad_error(kg[3], kg[-1]) <= FP32_TOL, gate_bias_grad_error(kg[3], kg[-1])
    return ro, rf


def _softplus_segments_case():
    """A softplus gate whose 16-token decays exceed fp32's exp range, packed segments, T = 90
    (two chunks, the second padded), two heads."""
    args, _, _ = _bf16_case(0, 1, 90, 2, 64, 64, "softplus")
    assert np.min(np.sum(np.asarray(args[3])[:, :16], axis=1)) < -88.0  # the overflow regime
    seg = jax.jit(lambda key: jnp.cumsum(jax.random.bernoulli(key, 0.05, (1, 90)), axis=1))(
        jax.random.PRNGKey(9))
    assert 0 < np.max(np.asarray(seg)) < 89  # segments start inside the sequence
    return args, seg


@jax.jit
def _chunked_reference(q, k, v, g, beta, h0, segment_ids=None):
    """The token-parallel part's reference, then the plain-JAX state pass (chunks of 64):
    ``(o [B, H, Tp, V], final state)``."""
    p = prepare_reference(q, k, v, g, beta, scale=0.125, chunk_size=64, segment_ids=segment_ids)
    return state_pass_reference(p, h0, 64)


_recurrence = jax.jit(functools.partial(kda_reference, scale=0.125))


def test_prep_reference_matches_recurrence_fp32_softplus_segments():
    """The token-parallel part's reference plus the plain-JAX state pass equals the recurrence
    (fp32), for a softplus gate whose 16-token decays exceed fp32's exp range, with packed
    segments: the chunked form the kernels implement, in fp32."""
    (q, k, v, g, beta, h0), seg = _softplus_segments_case()
    ro, rf = _recurrence(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    o, f = _chunked_reference(q, k, v, g, beta, h0, seg)
    assert rel_rms(ro, np.swapaxes(o, 1, 2)[:, :90]) <= FP32_TOL
    assert rel_rms(rf, f) <= FP32_TOL


def test_prep_reference_matches_recurrence_fp32_correlated_keys():
    """The token-parallel part's reference plus the plain-JAX state pass equals the recurrence
    (fp32) where powers of ``L`` blow up (:func:`kda_correlated_keys_case`)."""
    (q, k, v, g, beta, h0), _, _ = jax.jit(kda_correlated_keys_case)()
    chunk = np.asarray(k[0, :64, 0], np.float64)
    lower = np.tril(chunk @ chunk.T, -1) * 0.99
    assert np.abs(np.linalg.matrix_power(lower, 32)).max() > 1e12  # the hard regime is exercised
    ro, rf = _recurrence(q, k, v, g, beta, initial_state=h0)
    o, f = _chunked_reference(q, k, v, g, beta, h0)
    assert rel_rms(ro, np.swapaxes(o, 1, 2)) <= FP32_TOL
    assert rel_rms(rf, f) <= FP32_TOL


@jax.jit
def _state_pass_case(args):
    """The state kernels' operands from the token-parallel part's reference (bf16-rounded where
    the kernels take bf16), the plain-JAX state pass's outputs, random cotangents of them and
    their VJP."""
    p = prepare_reference(*args[:5], scale=0.125, chunk_size=64)
    p = p._replace(qg=bf16_rounded(p.qg), kg=bf16_rounded(p.kg), w=bf16_rounded(p.w),
                   aqk=bf16_rounded(p.aqk))
    (ro, rf), vjp = jax.vjp(lambda p, h0: state_pass_reference(p, h0, 64), p, args[5])
    do = jax.random.normal(jax.random.PRNGKey(3), ro.shape)
    dfin = jax.random.normal(jax.random.PRNGKey(4), rf.shape)
    return p, (ro, rf), (do, dfin), vjp((do, dfin))


# V = 128 for all: the cases share one reference (the 64-wide tile of a 64-column head runs the
# code of the first case's first tile).
@pytest.mark.parametrize("dv,block_v", [(128, 64), (128, 32), (128, 128)],
                         ids=["two_value_tiles", "four_narrow_value_tiles", "one_wide_value_tile"])
def test_state_kernels_match_plain_jax(dv, block_v):
    """Forward and backward state kernels against the plain-JAX state pass and its VJP, on the
    same bf16-rounded operands (isolates the kernels from the token-parallel part), two and four
    value tiles (the 32-wide tiles of few chains); one 128-wide tile (many chains; the forward
    then has one chunk in flight)."""
    # five chunks: both slots reused
    args, _, _ = _bf16_case(1, 1, 320, 1, 64, dv, "lower_bound")
    p, (ro, rf), (do, dfin), (rp, rh0) = _state_pass_case(args)
    h0 = args[5]
    fwd = jax.jit(lambda p, h0, save: state_fwd(_bf16(p.qg), _bf16(p.kg), _bf16(p.w), p.u,
                                                _bf16(p.aqk), p.gamma, h0, chunk_size=64,
                                                save=save, block_v=block_v, interpret=True),
                  static_argnums=2)
    o, f, st, vt = fwd(p, h0, True)
    assert o.dtype == jnp.bfloat16  # [B, Tp, H, V], the caller's layout
    for saved, alone in zip((o, f), fwd(p, h0, False), strict=True):  # no backward: same outputs
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(alone))
    assert rel_rms(ro, np.swapaxes(o, 1, 2)) <= BF16_OUT_TOL and rel_rms(rf, f) <= BF16_OUT_TOL
    bwd = jax.jit(lambda p, st, vt, do, dfin: state_bwd(
        _bf16(p.qg), _bf16(p.kg), _bf16(p.w), _bf16(p.aqk), p.gamma, st, vt,
        _bf16(jnp.swapaxes(do, 1, 2)), dfin, chunk_size=64, block_v=block_v, interpret=True))
    dqg, dkg, dw, da, dgam, du, dh0 = bwd(p, st, vt, do, dfin)
    pairs = [(rp.qg, dqg), (rp.kg, dkg), (rp.w, dw), (rp.aqk, da),
             (rp.gamma, dgam), (rp.u, du), (rh0, dh0)]
    for r, x in pairs:
        assert rel_rms(r, x) <= BF16_GRAD_QKV_TOL


@jax.jit
def _applying_inverse_case(args):
    """The forward state kernel's operands when it applies the chunk inverse (bf16), the inverse
    ``T diag(beta)``, and the plain-JAX state pass through ``W`` and ``U`` on the same
    operands."""
    q, k, v, g, beta, h0 = args
    s = gated_scores_reference(q, k, g, scale=0.125)
    beta = jnp.swapaxes(beta, 1, 2)
    inverse = _bf16(scaled_inverse_reference(s.akk, beta))
    qg, kg, xk, aqk = (_bf16(x) for x in (s.qg, s.kg, s.xk, s.aqk))
    w, u = wy_reference(s.akk, beta, xk, v)
    ref = state_pass_reference(Prepared(qg, kg, w, u, aqk, s.gamma), h0, 64)
    return (qg, kg, xk, _bf16(v), aqk, s.gamma, h0), inverse, ref


@pytest.mark.parametrize("block_v", [32, 64, 128])
def test_state_pass_applying_inverse_matches_plain_jax(block_v):
    """The forward state kernel given ``xk``, ``v`` and ``T diag(beta)`` (it forms
    ``Vt = T diag(beta) (v - xk S)`` itself) against the plain-JAX state pass of
    ``W = T diag(beta) xk``, ``U = T diag(beta) v`` on the same bf16 operands: ``o`` and the final
    state within math §10's bf16 output tolerance, at each value tile width."""
    args, _, _ = _bf16_case(2, 1, 320, 1, 64, 128, "lower_bound")
    kernel_args, inverse, (ro, rf) = _applying_inverse_case(args)
    o, f = jax.jit(lambda a, t: state_fwd(*a, chunk_size=64, save=False, block_v=block_v,
                                          inverse=t, interpret=True))(kernel_args, inverse)
    assert rel_rms(ro, np.swapaxes(o, 1, 2)) <= BF16_OUT_TOL and rel_rms(rf, f) <= BF16_OUT_TOL


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128)])
def test_state_grads_kernel_matches_its_products(dk, dv):
    """The per-chunk products kernel against the same einsums in plain JAX, on shared bf16 operands,
    two heads and two batch rows so a wrong chunk, head or row index fails. The four bf16 outputs
    are held to math §10's bf16 output tolerance (their rounding), fp32 ``dgamma`` to FP32_TOL (the
    same sums in another order)."""
    b, h, nc, c = 2, 2, 3, 64
    keys = jax.random.split(jax.random.PRNGKey(7), 5)
    shapes = ((b, h, nc, dk, dv), (b, h, nc, dk, dv), (b, h, nc * c, dv), (b, h, nc * c, dv),
              (b, nc * c, h, dv))
    ins = jax.jit(lambda keys: [jax.random.normal(key, shape).astype(jnp.bfloat16)
                                for key, shape in zip(keys, shapes)])(keys)
    got = jax.jit(functools.partial(state_grads, interpret=True))(*ins)
    want = jax.jit(chunk_products_reference)(*ins)
    tols = (BF16_OUT_TOL,) * 4 + (FP32_TOL,)
    for name, r, x, tol in zip(("dqg", "dkg", "dw", "daqk", "dgamma"), want, got, tols):
        assert x.shape == r.shape, name
        x = np.asarray(x, np.float32)
        assert rel_rms(r, x) <= tol, (name, rel_rms(r, x))


def test_state_kernels_lower_for_cuda():
    """The state kernels (the backward's two included) pass Mosaic GPU's lowering for an sm_90
    target at benchmark sizes (K = V = 128, 64 chunks), with 64- and 32-wide value tiles (the
    interpreter accepts layouts and copies that do not lower)."""
    b, h, nc, d, c = 2, 4, 64, 128, 64
    sd = jax.ShapeDtypeStruct
    rows = lambda n, dt: sd((b, h, nc * c, n), dt)  # noqa: E731
    bf, f32 = jnp.bfloat16, jnp.float32
    fwd_in = (rows(d, bf), rows(d, bf), rows(d, bf), rows(d, f32), rows(c, bf),
              sd((b, h, nc, d), f32), sd((b, h, d, d), f32))
    for save, block_v in ((True, 64), (False, 64), (True, 32), (False, 32), (True, 128),
                          (False, 128)):
        jax.jit(lambda *a: state_fwd(*a, chunk_size=c, save=save, block_v=block_v)).trace(
            *fwd_in).lower(lowering_platforms=("cuda",))
    applying_in = (*fwd_in[:3], sd((b, nc * c, h, d), bf), *fwd_in[4:])  # v token-major, bf16
    inverse = rows(c, bf)
    for block_v in (32, 64, 128):
        jax.jit(lambda a, t: state_fwd(*a, chunk_size=c, save=False, block_v=block_v,
                                       inverse=t)).trace(applying_in, inverse).lower(
            lowering_platforms=("cuda",))
    bwd_in = (rows(d, bf), rows(d, bf), rows(d, bf), rows(c, bf), sd((b, h, nc, d), f32),
              sd((b, h, nc, d, d), bf), rows(d, bf), sd((b, nc * c, h, d), bf),
              sd((b, h, d, d), f32))
    for block_v in (64, 32, 128):
        jax.jit(lambda *a: state_bwd(*a, chunk_size=c, block_v=block_v)).trace(*bwd_in).lower(
            lowering_platforms=("cuda",))
    # no initial state (nothing read, no gradient written), no final state (none written) and
    # no final state's cotangent
    jax.jit(lambda *a: state_fwd(*a, None, chunk_size=c, keep_final=False)).trace(
        *fwd_in[:-1]).lower(lowering_platforms=("cuda",))
    jax.jit(lambda *a: state_bwd(*a, None, chunk_size=c, initial_grad=False)).trace(
        *bwd_in[:-1]).lower(lowering_platforms=("cuda",))


def test_kernels_run_on_each_devices_rows_under_a_mesh():
    """Under a mesh of 8 H200s (data 4 x tensor 2; lowered on the CPU) ``kda(impl="pallas")`` and
    its gradient run inside a ``shard_map``: every Mosaic GPU call takes its own device's 2 of the
    batch's 8 rows, where GSPMD would run all 8 on every device. (The Mosaic GPU interpreter
    cannot run several devices' kernels at once, so this checks the lowering; the convolution's
    and the AttnRes reads' kernels, which run in the Triton interpreter, are compared with one
    device by value.)"""
    import flax.linen as nn

    from k3jax.config.mesh import DEFAULT_RULES
    from k3jax.devices import hopper_target
    from k3jax.ops.kda import kda

    b, t, h, d = 8, 128, 2, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, d), jnp.bfloat16),) * 3 + (sd((b, t, h, d), jnp.float32),
                                                  sd((b, t, h), jnp.bfloat16))

    def loss(*a):
        return jnp.sum(kda(*a, impl="pallas")[0].astype(jnp.float32))

    mesh = {"data": 4, "fsdp": 1, "expert": 1, "tensor": 2}
    with hopper_target(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        text = jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert "sdy.manual_computation" in text and len(calls) >= 5
    assert all(f"tensor<2x{t}x{h}x{d}x" in line and f"tensor<{b}x{t}" not in line
               for line in calls), calls[0][-300:]


def test_prepare_kernels_match_their_reference():
    """The token-parallel kernels (interpreted) against :func:`prepare_reference` on the same
    bf16-representable inputs: every output within math §10's bf16 output tolerance and the
    gradients of q, k, v, g, beta through all of them within its bf16 gradient tolerances (softplus
    gate past the fp32 exp range, packed segments, T padded)."""
    (q, k, v, g, beta, _), seg = _softplus_segments_case()
    kw = {"scale": 0.125, "chunk_size": 64, "segment_ids": seg}

    @jax.jit
    def reference(args):
        ref, ref_vjp = jax.vjp(lambda *a: prepare_reference(*a, **kw), *args)
        # A random cotangent per element (a constant one would check only the gradient of sums),
        # the same bf16 values for both, each in its output's dtype.
        keys = jax.random.split(jax.random.PRNGKey(4), len(ref))
        cts = [(jax.random.normal(key, r.shape) / np.sqrt(r.size)).astype(jnp.bfloat16)
               for key, r in zip(keys, ref)]
        return ref, cts, ref_vjp(type(ref)(*(c.astype(r.dtype) for c, r in zip(cts, ref))))

    ref, cts, ref_grads = reference((q, k, v, g, beta))

    def kernels(args, cts):
        out, vjp = jax.vjp(lambda *a: prepare(*a, **kw, interpret=True), *args)
        return out, vjp(type(out)(*(c.astype(x.dtype) for c, x in zip(cts, out))))

    out, grads = jax.jit(kernels)((q, k, v, g, beta), cts)
    for name, r, x in zip(ref._fields, ref, out):
        assert rel_rms(r, x) <= BF16_OUT_TOL, (name, rel_rms(r, x))
    for name, r, x in zip(("q", "k", "v", "g", "beta"), ref_grads, grads):
        tol = BF16_GRAD_GATE_TOL if name in ("g", "beta") else BF16_GRAD_QKV_TOL
        assert rel_rms(r, x) <= tol, (name, rel_rms(r, x))


# (batch, head) chains of the tests of the path taken above ``INVERSE_CHAINS`` chains, which
# ``few_inverse_chains`` lowers below them: the interpreter's time grows with the chains. Up to 16
# chains the state kernels take the same 32-wide value tiles.
INVERSE_PATH_CHAINS = 2


@pytest.fixture()
def few_inverse_chains(monkeypatch):
    """``INVERSE_CHAINS`` lowered below ``INVERSE_PATH_CHAINS``; returns a list that gets an entry
    each time the op takes its path above it (so a test can check that it took that path)."""
    calls = []
    above = kda_module._kda_applying_inverse
    monkeypatch.setattr(kda_module, "INVERSE_CHAINS", INVERSE_PATH_CHAINS - 1)
    monkeypatch.setattr(kda_module, "_kda_applying_inverse",
                        lambda *args: calls.append(None) or above(*args))
    return calls


@jax.jit
def _gates_and_correlated_keys_case():
    """Three batch rows, T = 90, one head, K = V = 64 (bf16 grid): a softplus gate (decays past
    fp32's exp range in 16 tokens: the scores' exact levels) with the segment ids of packed
    documents, a weak gate (the state carried from chunk to chunk and the initial state weigh
    in) and correlated keys (:func:`kda_correlated_keys_case`: powers of ``L`` blow up), the last
    two one document each. (K3's lower-bound gate, the scores' bounded path at these sizes, is
    ``test_kda_pallas_takes_the_gate_logits_and_fp32_inputs``'s.)"""
    cases = [kda_bf16_case(2, 1, 90, 1, 64, 64, gate) for gate in ("softplus", "weak")]
    cases.append(kda_correlated_keys_case(90, 64))
    args, do, dfin = (jax.tree.map(lambda *rows: jnp.concatenate(rows), *parts)
                      for parts in zip(*cases))
    seg = jnp.zeros((3, 90), jnp.int32).at[0].set(jnp.repeat(jnp.arange(3), jnp.array([30, 45, 15]),
                                                              total_repeat_length=90))
    return args, seg, do, dfin


def test_kda_pallas_gates_and_correlated_keys_through_both_paths(few_inverse_chains):
    """End to end on :func:`_gates_and_correlated_keys_case` (T = 90 padded to 128, initial and
    final state, packed segments), more than ``INVERSE_CHAINS`` (batch, head) chains, every row
    on its own. Differentiated, the call goes through ``W`` and ``U`` (the backward needs them)
    by way of the op's custom VJP, which hands on the initial state's gradient and the final
    state's cotangent: values and all six gradients within math §10's bf16 tolerances. The
    forward alone takes the state pass that applies the chunk inverse (at 32-wide value tiles):
    o and the final state within the bf16 output tolerance."""
    args, seg, do, dfin = _gates_and_correlated_keys_case()
    assert np.min(np.sum(np.asarray(args[3][0])[:16], axis=0)) < -88.0  # past exp's range
    keys = np.asarray(args[1][2, :64, 0], np.float64)
    lower = np.tril(keys @ keys.T, -1) * 0.99
    assert np.abs(np.linalg.matrix_power(lower, 32)).max() > 1e12  # the hard regime
    _check_all(args, seg, do, dfin, alone=True)
    assert len(few_inverse_chains) == 2  # the differentiated call and the forward alone


def test_kda_pallas_takes_the_gate_logits_and_fp32_inputs():
    """``gate_lower_bound`` and ``gate_bias``: the op takes K3's gate logits ``z`` less their bias
    and its cumsum kernels form the log-decay ``-5 sigmoid(z + bias)`` (and the reverse cumsum
    returns ``dz`` and the bias's gradient): values and all seven gradients against the
    recurrence on :func:`bounded_gate` of ``z + bias``; T = 40 padded to 64 (padding logits of
    -inf: no decay, so the final state against the reference's checks them), two heads and
    packed segments. q, k, v are fp32 off the bf16 grid and go through the kernels as they are
    (q, k rounded to bf16 for the scores, v read in fp32 by the WY kernels): o comes back fp32,
    all within math §10's bf16 tolerances of the fp32 recurrence (the bf16 tensor-core operands
    bound the error)."""
    args, do, dfin = _fp32_case(3, 1, 40, 2, 64, 64)
    assert not any(np.all(bf16_rounded(x) == x) for x in args[:3])  # off the bf16 grid
    # spread as the case's own (its log-decays are -5 sigmoid of standard normal logits)
    kz, kb = jax.random.split(jax.random.PRNGKey(11))
    logits, bias = jax.jit(lambda kz, kb: (jax.random.normal(kz, args[3].shape),
                                           0.5 * jax.random.normal(kb, args[3].shape[2:])))(kz, kb)
    seg = jnp.array([[0] * 25 + [1] * 15])
    _check_all((*args[:3], logits, *args[4:]), seg, do, dfin, inputs=lambda x: x,
               gate_bias=bias)


def test_kda_pallas_head_dim_128_training_call(few_inverse_chains):
    """K = V = 128 (four 32-wide value tiles per head: the backward sums their partial
    products), two heads, the training call: no initial state and no final state returned, so
    the state kernels read neither an initial state nor the final state's cotangent and write no
    initial-state gradient. More than ``INVERSE_CHAINS`` chains: the values through both forward
    paths and the five gradients within math §10's bf16 tolerances."""
    args, do, _ = _bf16_case(5, 1, 64, INVERSE_PATH_CHAINS, 128, 128, "lower_bound")
    ker = lambda q, k, v, g, beta: kda_pallas(  # noqa: E731
        _bf16(q), _bf16(k), _bf16(v), g, beta, scale=128**-0.5, interpret=True)
    ref = lambda *a: (kda_reference(*a, scale=128**-0.5)[0], None)  # noqa: E731

    @jax.jit  # one compile for the reference, both kernel paths and the gradients
    def run(a):
        return _values_and_grads(ref, a, do, None), _values_and_grads(ker, a, do, None), ker(*a)

    ((ro, _), rg), ((o, final), kg), (alone, final_alone) = run(args[:5])
    assert len(few_inverse_chains) == 2  # the differentiated call and the forward alone
    assert final is None and final_alone is None  # without a gradient to follow: the other path
    assert o.dtype == jnp.bfloat16
    assert rel_rms(ro, o) <= BF16_OUT_TOL and rel_rms(ro, alone) <= BF16_OUT_TOL
    for name, a, r, x in zip(NAMES, args, rg, kg):
        assert x.dtype == a.dtype, name
        tol = BF16_GRAD_GATE_TOL if name in ("g", "beta") else BF16_GRAD_QKV_TOL
        assert rel_rms(r, x) <= tol, (name, rel_rms(r, x))


def test_bad_inputs_raise_and_supports_is_fail_closed():
    q = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
    v = jnp.zeros((1, 8, 1, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        kda_pallas(q, q, v, q, jnp.zeros((1, 8, 1)), scale=1.0)
    with pytest.raises(ValueError, match="beta"):
        kda_pallas(q, q, q, q, jnp.zeros((1, 8)), scale=1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_pallas(q, q, q, q, jnp.zeros((1, 8, 1)), scale=1.0, chunk_size=32)
    assert not supports(q, q, v, q, jnp.zeros((1, 8, 1)))
    assert not supports(q.astype(jnp.float32), q, q, q, jnp.zeros((1, 8, 1)))  # fp32 not claimed
    rows = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="inverse is for a forward without backward"):
        state_fwd(rows, rows, rows, rows, rows, jnp.zeros((1, 1, 1, 64)), jnp.zeros((1, 1, 64, 64)),
                  chunk_size=64, save=True, inverse=rows)
    if jax.devices()[0].platform == "cpu":
        assert not supports(q, q, q, q, jnp.zeros((1, 8, 1)))  # kernels need an sm_90 GPU
