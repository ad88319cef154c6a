"""KDA ops: the chunked path against the token-by-token reference, decode, dispatch, validation.

The oracle is :func:`k3jax.ops.kda_reference.kda_reference` (§3.2, fp32), itself checked against
a float64 NumPy loop. Gates are generated with the two formulas of math §3.1 step 4. Errors are the
relative RMS of math §10 (:func:`k3jax.ops.tolerance.rel_rms`).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda as kda_module
from k3jax.ops.kda import kda, kda_decode, l2_normalize
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.kda_reference import kda_reference
from k3jax.ops.tolerance import (
    BF16_GRAD_GATE_TOL,
    BF16_GRAD_QKV_TOL,
    BF16_OUT_TOL,
    FP32_TOL,
    rel_rms,
)

# math §10, by name: fp32 chunked vs recurrent <= FP32_TOL; bf16 inputs vs the fp32 reference:
# outputs/states <= BF16_OUT_TOL, dq dk dv dh0 <= BF16_GRAD_QKV_TOL, dg dbeta <= BF16_GRAD_GATE_TOL.
GRAD_TOLS_BF16 = (BF16_GRAD_QKV_TOL,) * 3 + (BF16_GRAD_GATE_TOL,) * 2 + (BF16_GRAD_QKV_TOL,)
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
H, DK, DV = 2, 16, 16
CHUNK = 16  # small chunks keep CPU tests fast while still spanning several chunks per sequence
SCALE = DK**-0.5


# ------------------------------------------------------------------------------------ inputs
def _inverse_softplus(x):
    return x + np.log(-np.expm1(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def make_gate(kind, rng, shape):
    """Log-decays ``[B, T, H, K]`` from the math §3.1 gate formulas at or beyond their init range.

    ``softplus``: ``-exp(A_log[h]) softplus(f)``, ``A_log = log U(1, 16)``, f spread around
    ``dt_bias`` (per-token log-decays ~1e-4 .. ~30). ``lower_bound``: ``-5 sigmoid(exp(A_log) f)``,
    ``A_log = 0``, f around ``dt_bias`` (weak, as at init). ``lower_bound_strong``: f pushed high,
    so g sits near the bound -5.
    """
    b, t, h, dk = shape
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (h, dk)))
    dt_bias = _inverse_softplus(np.maximum(dt, 1e-4))
    noise = rng.standard_normal(shape)
    if kind == "softplus":
        a_log = np.log(rng.uniform(1.0, 16.0, (h, 1)))
        g = -np.exp(a_log) * _softplus(dt_bias + 2.0 * noise)
    elif kind == "lower_bound":
        g = -5.0 * _sigmoid(dt_bias + noise)
    elif kind == "lower_bound_strong":
        g = -5.0 * _sigmoid(6.0 + noise)
    else:
        raise ValueError(kind)
    return jnp.asarray(g, jnp.float32)


def _unit(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def make_inputs(seed, b, t, gate="softplus", dtype=jnp.float32):
    """q, k (L2-normalised), v, g (fp32), beta, h0 (fp32) and the output/state cotangents."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape)
    q, k = _unit(normal(b, t, H, DK)), _unit(normal(b, t, H, DK))
    v = normal(b, t, H, DV)
    g = make_gate(gate, rng, (b, t, H, DK))
    beta = _sigmoid(normal(b, t, H))
    h0 = jnp.asarray(0.5 * normal(b, H, DK, DV), jnp.float32)
    do, dh = (jnp.asarray(x, jnp.float32) for x in (normal(b, t, H, DV), normal(b, H, DK, DV)))
    q, k, v, beta = (jnp.asarray(x, dtype) for x in (q, k, v, beta))
    return (q, k, v, g, beta, h0), (do, dh)


def packed_segments(b, t):
    """Row 1: resets at 7 (mid sub-block), 32 (a chunk/sub-block boundary) and ``t - 3``; row 2:
    one segment, with an id other than 0."""
    ids = np.zeros((b, t), np.int32)
    ids[0, 7:] = 1
    ids[0, 32:] = 2
    ids[0, t - 3:] = 3
    if b > 1:
        ids[1] = 5
    return jnp.asarray(ids)


# jitted once for the module: cases of the same shapes share the compiled program
@functools.partial(jax.jit, static_argnums=0, static_argnames="chunk_size")
def run_with_grads(impl, args, cots, segment_ids=None, chunk_size=CHUNK):
    """``(o, final_state, grads)``, grads of ``sum(o * do) + sum(final * dh)`` w.r.t. all inputs."""
    def fn(q, k, v, g, beta, h0):
        kw = dict(scale=SCALE, initial_state=h0, segment_ids=segment_ids)
        if impl == "reference":
            return kda_reference(q, k, v, g, beta, **kw)
        return kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)

    (o, s), vjp = jax.vjp(fn, *args)
    return o, s, vjp((cots[0].astype(o.dtype), cots[1]))


def assert_close(name, ref, out, tol):
    assert np.all(np.isfinite(np.asarray(out, np.float32))), f"{name}: non-finite values"
    err = rel_rms(ref, out)
    assert err <= tol, f"{name}: rel_rms {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------- the reference
def numpy_recurrence(q, k, v, g, beta, h0, seg, scale):
    """math §3.2 in float64 NumPy, one token and one sequence at a time (independent of JAX)."""
    q, k, v, g, beta, h0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
    b, t, h, _ = q.shape
    o, s = np.zeros(v.shape), h0.copy()
    for i in range(b):
        for j in range(t):
            if j > 0 and seg[i, j] != seg[i, j - 1]:
                s[i] = 0.0
            for hh in range(h):
                st = s[i, hh] * np.exp(g[i, j, hh])[:, None]
                u = beta[i, j, hh] * (v[i, j, hh] - st.T @ k[i, j, hh])
                st = st + np.outer(k[i, j, hh], u)
                o[i, j, hh] = st.T @ (scale * q[i, j, hh])
                s[i, hh] = st
    return o, s


def test_reference_matches_float64_numpy():
    (q, k, v, g, beta, h0), _ = make_inputs(0, 2, 40, gate="lower_bound")
    seg = packed_segments(2, 40)
    o, s = jax.jit(kda_reference, static_argnames="scale")(  # one compile, not one per op
        q, k, v, g, beta, scale=SCALE, initial_state=h0, segment_ids=seg)
    o64, s64 = numpy_recurrence(q, k, v, g, beta, h0, np.asarray(seg), SCALE)
    assert_close("o", o64, o, FP32_TOL)
    assert_close("state", s64, s, FP32_TOL)


# ------------------------------------------------------------------ chunked vs reference, fp32
@pytest.mark.parametrize("gate,t,segments,chunk", [
    ("softplus", 40, True, 16),             # T not a multiple of the chunk, packed sequences
    ("lower_bound", 64, True, 64),          # weak K3 gate; resets in 3 of the 4 sub-blocks
    ("lower_bound_strong", 40, False, 16),  # g near -5: 80 nats per 16-row chunk
    ("lower_bound_strong", 64, True, 32),   # two sub-blocks per chunk
])
def test_chunked_matches_reference_fp32(gate, t, segments, chunk):
    args, cots = make_inputs(1, 2, t, gate=gate)
    seg = packed_segments(2, t) if segments else None
    ro, rs, rg = run_with_grads("reference", args, cots, seg)
    co, cs, cg = run_with_grads("chunked", args, cots, seg, chunk_size=chunk)
    assert_close("o", ro, co, FP32_TOL)
    assert_close("final_state", rs, cs, FP32_TOL)
    for name, r, c in zip(GRAD_NAMES, rg, cg):
        assert_close(name, r, c, FP32_TOL)
    if segments:  # the gate at a segment's first token decays a zeroed state: no gradient at all
        starts = np.asarray(seg[:, 1:] != seg[:, :-1])
        dg = np.asarray(cg[3])[:, 1:]
        assert starts.sum() == 3 and np.all(dg[starts] == 0.0)
        assert np.all(np.abs(dg[~starts]).sum(-1) > 0.0)


def test_overflow_full_chunk_of_strongest_decay():
    """Lower-bound gate at ~-5 everywhere over one 64-token chunk: ``G`` reaches -320 nats, where
    ``exp(-G)`` overflows fp32; values and every gradient must stay finite and accurate."""
    args, cots = make_inputs(2, 1, 64, gate="lower_bound_strong")
    q, k, v, g, beta, h0 = args
    g = np.full(g.shape, -5.0, np.float32)                     # the bound itself
    args = (q, k, v, g, beta, h0)
    ro, rs, rg = run_with_grads("reference", args, cots)
    co, cs, cg = run_with_grads("chunked", args, cots, chunk_size=64)
    assert_close("o", ro, co, FP32_TOL)
    assert_close("final_state", rs, cs, FP32_TOL)
    for name, r, c in zip(GRAD_NAMES, rg, cg):
        assert_close(name, r, c, FP32_TOL)


# ------------------------------------------------------------------ chunked vs reference, bf16
@pytest.mark.parametrize("gate,t,segments,chunk", [
    ("softplus", 64, False, 32),
    ("lower_bound_strong", 40, True, 16),
])
def test_chunked_bf16_inputs_vs_fp32_reference(gate, t, segments, chunk):
    args, cots = make_inputs(4, 2, t, gate=gate, dtype=jnp.bfloat16)
    seg = packed_segments(2, t) if segments else None
    ref_args = tuple(x.astype(jnp.float32) for x in args)  # the same (bf16-valued) inputs in fp32
    ro, rs, rg = run_with_grads("reference", ref_args, cots, seg)
    co, cs, cg = run_with_grads("chunked", args, cots, seg, chunk_size=chunk)
    assert co.dtype == jnp.bfloat16 and cs.dtype == jnp.float32
    assert_close("o", ro, co, BF16_OUT_TOL)
    assert_close("final_state", rs, cs, BF16_OUT_TOL)
    for name, r, c, tol in zip(GRAD_NAMES, rg, cg, GRAD_TOLS_BF16):
        assert c.dtype == args[GRAD_NAMES.index(name)].dtype
        assert_close(name, r, c, tol)


# ------------------------------------------------------------------- state carry and decode
@jax.jit
def _chunked_with_state(q, k, v, g, beta, h0):
    return kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=CHUNK,
               impl="chunked")


def test_split_run_with_carried_state_equals_one_run():
    args, _ = make_inputs(5, 2, 40, gate="lower_bound")
    q, k, v, g, beta, h0 = map(np.asarray, args)  # host arrays: slicing them compiles nothing
    full, s_full = _chunked_with_state(q, k, v, g, beta, h0)
    cut = 24  # the second part starts in the middle of a chunk of the whole run
    o1, s1 = _chunked_with_state(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], h0)
    o2, s2 = _chunked_with_state(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    assert_close("o", full, np.concatenate([o1, o2], axis=1), FP32_TOL)
    assert_close("final_state", s_full, s2, FP32_TOL)


@pytest.mark.parametrize("logits", [False, True], ids=["log_decay", "gate_logits"])
def test_decode_steps_match_recurrence(logits):
    """Token by token, as the sequence op; with ``logits`` both take K3's gate logits and their
    bias (``gate_lower_bound``, ``gate_bias``) in place of the log-decay."""
    args, _ = make_inputs(6, 2, 12, gate="softplus")
    q, k, v, g, beta, h0 = map(np.asarray, args)  # host arrays: slicing them compiles nothing
    gate = {}
    if logits:
        rng = np.random.default_rng(6)
        g = rng.standard_normal(g.shape).astype(np.float32)
        gate = dict(gate_lower_bound=-5.0, gate_bias=rng.standard_normal(g.shape[2:]).astype(
            np.float32))
    ro, rs = jax.jit(lambda *a: kda(*a, initial_state=h0, output_final_state=True,
                                    impl="reference", **gate))(q, k, v, g, beta)
    step = jax.jit(lambda *a: kda_decode(*a, **gate))
    state, outs = h0, []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    assert state.dtype == jnp.float32
    assert_close("o", ro, np.stack(outs, axis=1), FP32_TOL)
    assert_close("state", rs, state, FP32_TOL)


# ---------------------------------------------------------------------------- the public API
def test_public_api_defaults_and_qk_normalisation():
    (q, k, v, g, beta, _), _ = make_inputs(7, 1, 20, gate="lower_bound")
    raw_q, raw_k = 3.0 * np.asarray(q) + 0.1, -2.0 * np.asarray(k)
    run = jax.jit(kda, static_argnames=("chunk_size", "impl", "use_qk_l2norm"))
    o, none = run(raw_q, raw_k, v, g, beta, use_qk_l2norm=True, chunk_size=CHUNK, impl="chunked")
    assert none is None
    q_n, k_n = jax.jit(lambda q, k: (l2_normalize(q), l2_normalize(k)))(raw_q, raw_k)
    want, _ = jax.jit(kda_reference, static_argnames="scale")(q_n, k_n, v, g, beta,
                                                               scale=DK**-0.5)
    assert_close("o", want, o, FP32_TOL)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(q_n), axis=-1), 1.0, rtol=1e-5)
    # "auto" on a CPU is the chunked path, bit for bit.
    auto, _ = run(raw_q, raw_k, v, g, beta, use_qk_l2norm=True, chunk_size=CHUNK)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(o))


def _fake_path(name, calls):
    def run(q, k, v, g, beta, **kw):
        calls.append((name, kw))
        return jnp.zeros(v.shape, q.dtype), None

    return run


def _fake_pallas(supported, calls):
    return types.SimpleNamespace(kda_pallas=_fake_path("pallas", calls),
                                 supports=lambda *a, **kw: supported)


def test_gate_logits_take_the_lower_bound_gate():
    """``gate_lower_bound`` and ``gate_bias``: on the chunked path the op on K3's gate logits
    ``z`` (less their bias ``b``) is the recurrence on ``-5 sigmoid(z + b)``, values and the
    gradients of ``z`` and ``b`` within FP32_TOL."""
    (q, k, v, g, beta, _), _ = make_inputs(9, 1, 40, gate="lower_bound")
    rng = np.random.default_rng(9)
    z = jnp.asarray(rng.standard_normal(g.shape) * 3.0, jnp.float32)
    b = jnp.asarray(rng.standard_normal(g.shape[2:]), jnp.float32)

    @jax.jit
    def values_and_grads(z, b):
        on_logits = lambda z, b: kda(q, k, v, z, beta, gate_lower_bound=-5.0,  # noqa: E731
                                     gate_bias=b, chunk_size=CHUNK, impl="chunked")[0]
        on_gate = lambda z, b: kda_reference(  # noqa: E731
            q, k, v, -5.0 * jax.nn.sigmoid(z + b), beta, scale=DK**-0.5)[0]
        return [jax.value_and_grad(lambda z, b: jnp.sum(jnp.sin(f(z, b))), (0, 1))(z, b)
                for f in (on_logits, on_gate)]

    (got, (got_dz, got_db)), (want, (want_dz, want_db)) = values_and_grads(z, b)
    assert_close("loss", want, got, FP32_TOL)
    assert_close("dz", want_dz, got_dz, FP32_TOL)
    assert_close("dbias", want_db, got_db, FP32_TOL)


def test_dispatch_is_fail_closed(monkeypatch):
    """Which path runs, with the real paths replaced by recorders (no computation). The op's
    compiled programs are dropped before each call, so every call traces, i.e. calls a recorder."""
    (q, k, v, g, beta, _), _ = make_inputs(8, 1, 16)
    calls = []
    monkeypatch.setattr(kda_module, "kda_chunked", _fake_path("chunked", calls))

    def path():
        return calls[-1][0]

    def kda(*args, **kw):
        kda_module._kda_compiled.clear_cache()
        return kda_module.kda(*args, **kw)

    kda(q, k, v, g, beta)                                # a CPU: chunked
    assert path() == "chunked"
    monkeypatch.setattr(kda_module, "hopper_gpus", lambda: True)
    monkeypatch.setattr(kda_module, "_pallas_module", lambda: _fake_pallas(False, calls))
    kda(q, k, v, g, beta)                                # the kernel declines the call
    assert path() == "chunked"
    monkeypatch.setattr(kda_module, "_pallas_module", lambda: _fake_pallas(True, calls))
    kda(q, k, v, g, beta, output_final_state=True)       # the kernel accepts it
    assert path() == "pallas"
    assert set(calls[-1][1]) == {"scale", "initial_state", "output_final_state", "segment_ids",
                                 "chunk_size", "gate_lower_bound", "gate_bias"}

    def missing():
        raise ImportError("No module named 'pallas_kernels.kda'")

    monkeypatch.setattr(kda_module, "_pallas_module", missing)
    kda(q, k, v, g, beta)                                # kernels missing: "auto" still works
    assert path() == "chunked"
    with pytest.raises(ImportError, match="impl='pallas' needs the module pallas_kernels.kda"):
        kda(q, k, v, g, beta, impl="pallas")


# ------------------------------------------------------------------------------- validation
S = jax.ShapeDtypeStruct  # shapes only: validation must reject these before any tracing
F32, BF16 = jnp.float32, jnp.bfloat16
Q = S((2, 8, H, DK), F32)
V_ = S((2, 8, H, DV), F32)
BETA = S((2, 8, H), F32)
GOOD = dict(q=Q, k=Q, v=V_, g=Q, beta=BETA)


@pytest.mark.parametrize("change,argument", [
    (dict(q=S((2, 8, DK), F32)), "q.shape"),                     # wrong rank
    (dict(k=S((2, 8, H, DK + 1), F32)), "k.shape"),              # mismatched head dim
    (dict(g=S((2, 8, H + 1, DK), F32)), "g.shape"),              # mismatched heads
    (dict(v=S((2, 9, H, DV), F32)), "v.shape"),                  # mismatched T
    (dict(beta=S((2, 8, H, 1), F32)), "beta.shape"),             # wrong rank
    (dict(q=S((2, 8, H, DK), jnp.int32)), "q.dtype"),            # bad dtype
    (dict(g=S((2, 8, H, DK), jnp.float64)), "g.dtype"),
    (dict(k=S((2, 8, H, DK), BF16)), "k.dtype/v.dtype"),         # q, k, v must share a dtype
    (dict(impl="triton"), "impl"),
    (dict(chunk_size=48), "chunk_size"),
    (dict(chunk_size=8), "chunk_size"),
    (dict(segment_ids=S((2, 8), F32)), "segment_ids.dtype"),
    (dict(segment_ids=S((2, 7), jnp.int32)), "segment_ids.shape"),
    (dict(initial_state=S((2, H, DV, DK + 1), F32)), "initial_state.shape"),
    (dict(scale=-1.0), "scale"),
    (dict(scale=float("inf")), "scale"),
    (dict(output_final_state=1), "output_final_state"),
    (dict(use_qk_l2norm=1), "use_qk_l2norm"),
    (dict(gate_lower_bound=5.0), "gate_lower_bound"),            # a bound is negative
    (dict(gate_lower_bound=True), "gate_lower_bound"),
    (dict(gate_bias=S((H, DK), F32)), "gate_bias"),              # without gate_lower_bound
    (dict(gate_lower_bound=-5.0, gate_bias=S((H, DK + 1), F32)), "gate_bias.shape"),
])
def test_validation_names_the_argument(change, argument):
    kw = {**GOOD, **change}
    with pytest.raises(ValueError, match=f"kda: {argument}=.* is invalid: expected"):
        kda(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


@pytest.mark.parametrize("change,argument", [
    (dict(q=S((2, H, DK, 1), F32)), "q.shape"),
    (dict(v=S((2, H + 1, DV), F32)), "v.shape"),
    (dict(state=S((2, H, DK, DV + 1), F32)), "state.shape"),
    (dict(beta=S((2, H), jnp.int8)), "beta.dtype"),
    (dict(state=None), "state"),
    (dict(scale=float("inf")), "scale"),
    (dict(use_qk_l2norm="yes"), "use_qk_l2norm"),
    (dict(gate_lower_bound=0.0), "gate_lower_bound"),
    (dict(gate_bias=S((H, DK), F32)), "gate_bias"),              # without gate_lower_bound
    (dict(gate_lower_bound=-5.0, gate_bias=S((H + 1, DK), F32)), "gate_bias.shape"),
])
def test_decode_validation_names_the_argument(change, argument):
    kw = {**dict(q=S((2, H, DK), F32), k=S((2, H, DK), F32), v=S((2, H, DV), F32),
                 g=S((2, H, DK), F32), beta=S((2, H), F32), state=S((2, H, DK, DV), F32)), **change}
    with pytest.raises(ValueError, match=f"kda_decode: {argument}=.* is invalid: expected"):
        kda_decode(**kw)
