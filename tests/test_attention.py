"""MLA's causal attention (k3jax/ops/attention.py) against the formula in fp32, values and
gradients, with packed segments: XLA's path on any backend; cuDNN's fused kernel on an sm_90 GPU,
through its packed layout and through the mask it falls back to (skipped elsewhere; run
``JAX_PLATFORMS=cuda python -m pytest -q tests/test_attention.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.parallel as kp
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus
from k3jax.ops.attention import (
    PACKED_SEGMENTS,
    attention_mask,
    attention_reference,
    batch_documents,
    causal_attention,
    segment_runs,
)
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms

T = 64


def _runs(lengths) -> np.ndarray:
    """A row of segment ids: ``len(lengths)`` documents of those lengths, ids 0, 1, ..."""
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


# row 0: one document; row 1: three packed documents (the mask must stop at their borders)
THREE_DOCS = np.stack([_runs([T]), _runs([20, 30, T - 50])])
# more documents than cuDNN's packed path takes: the masked kernel instead
MANY_DOCS = np.stack([_runs([T]), _runs([3] * 20 + [T - 60])])
# one document a row, under ids that differ between rows
ONE_DOC_ROWS = np.stack([_runs([T]), _runs([T]) + 7])
# one id in two places (ids not in runs): three documents, the second run of the id a new one
SPLIT_DOC = np.stack([_runs([T]), np.repeat(np.array([0, 1, 0], np.int32), [20, 20, T - 40])])


@functools.partial(jax.jit, static_argnames=("dtype", "dk", "dv"))
def _inputs(dtype, dk=48, dv=32):
    b, h = 2, 3
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(kk, (b, T, h, dk), jnp.float32).astype(dtype) for kk in keys[:2])
    v = jax.random.normal(keys[2], (b, T, h, dv), jnp.float32).astype(dtype)
    cot = jax.random.normal(keys[3], (b, T, h, dv), jnp.float32)
    return q, k, v, cot


@functools.partial(jax.jit, static_argnums=0)  # one compile each, not one per op
def _values_and_grads(fn, q, k, v, seg, cot):
    out, vjp = jax.vjp(lambda a, b_, c: fn(a, b_, c, seg, 0.125).astype(jnp.float32), q, k, v)
    return out, vjp(cot)


def _reference(q, k, v, seg, scale):
    return attention_reference(q, k, v, attention_mask(seg, q.shape[0], q.shape[1]), scale)


def _check(dtype, seg, out_tol, grad_tol, documents="auto"):
    q, k, v, cot = _inputs(dtype)
    seg = None if seg is None else jnp.asarray(seg)
    f32 = jax.jit(lambda *x: [a.astype(jnp.float32) for a in x])(q, k, v)
    ref, ref_grads = _values_and_grads(_reference, *f32, seg, cot)
    attend = functools.partial(causal_attention, documents=documents)
    out, grads = _values_and_grads(attend, q, k, v, seg, cot)
    assert rel_rms(ref, out) <= out_tol, rel_rms(ref, out)
    for name, r, g in zip("qkv", ref_grads, grads):
        assert g.dtype == dtype
        assert rel_rms(r, g) <= grad_tol, (name, rel_rms(r, g))


@pytest.mark.parametrize("seg", [THREE_DOCS, SPLIT_DOC, None], ids=["packed", "split", "one"])
def test_xla_path_matches_the_formula_fp32(seg):
    _check(jnp.float32, seg, FP32_TOL, FP32_TOL)


def test_single_document_rows_promised_match_the_formula_fp32():
    _check(jnp.float32, ONE_DOC_ROWS, FP32_TOL, FP32_TOL, documents="single")


def test_single_document_promised_for_packed_rows_gives_nan():
    q, k, v, _ = _inputs(jnp.float32)
    out = causal_attention(q, k, v, jnp.asarray(THREE_DOCS), 0.125, documents="single")
    assert bool(jnp.isnan(out).all())


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
@pytest.mark.parametrize("seg", [THREE_DOCS, MANY_DOCS, SPLIT_DOC, None],
                         ids=["packed", "many", "split", "one"])
def test_cudnn_path_matches_the_formula_bf16(seg):
    _check(jnp.bfloat16, seg, BF16_OUT_TOL, BF16_GRAD_QKV_TOL)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
@pytest.mark.parametrize("seg, documents", [(THREE_DOCS, "packed"), (MANY_DOCS, "masked"),
                                            (SPLIT_DOC, "packed"), (ONE_DOC_ROWS, "single")],
                         ids=["packed", "many", "split", "single"])
def test_cudnn_layout_chosen_ahead_matches_the_formula_bf16(seg, documents):
    """The layout the training loop picks on the host (no device-side check) for the rows it
    fits: the formula's values and gradients."""
    assert batch_documents(seg) == documents
    _check(jnp.bfloat16, seg, BF16_OUT_TOL, BF16_GRAD_QKV_TOL, documents)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_packed_layout_promised_for_rows_it_does_not_fit_gives_nan():
    q, k, v, _ = _inputs(jnp.bfloat16)
    out = causal_attention(q, k, v, jnp.asarray(MANY_DOCS), 0.125, documents="packed")
    assert bool(jnp.isnan(out.astype(jnp.float32)).all())


@pytest.mark.parametrize("seg, fits", [(THREE_DOCS, True), (MANY_DOCS, False), (SPLIT_DOC, True),
                                       (ONE_DOC_ROWS, True)],
                         ids=["packed", "many", "split", "one"])
def test_host_choice_of_layout_is_the_device_check(seg, fits, monkeypatch):
    """:func:`batch_documents` (numpy, on the host) says "packed" exactly where
    :func:`segment_runs` (on the device) finds that the rows fit, "single" where each row is one
    document; off Hopper GPUs, "masked"."""
    import k3jax.ops.attention as attention

    assert bool(segment_runs(jnp.asarray(seg), PACKED_SEGMENTS)[2]) == fits
    monkeypatch.setattr(attention, "hopper_gpus", lambda: True)
    one = bool((seg == seg[:, :1]).all())
    assert batch_documents(seg) == ("single" if one else "packed" if fits else "masked")
    monkeypatch.setattr(attention, "hopper_gpus", lambda: False)
    assert batch_documents(seg) == "masked"


def _runs_by_loop(row):
    """(offsets, lengths) of one row's runs of equal ids, a token at a time."""
    offsets = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
    return offsets, [e - s for s, e in zip(offsets, offsets[1:] + [len(row)])]


@pytest.mark.parametrize("seg, fits", [(THREE_DOCS, True), (MANY_DOCS, False), (SPLIT_DOC, True)],
                         ids=["packed", "many", "split"])
def test_segment_runs_are_the_rows_documents(seg, fits):
    offsets, lengths, ok = jax.device_get(segment_runs(jnp.asarray(seg), PACKED_SEGMENTS))
    assert bool(ok) == fits
    assert offsets.shape == (2, PACKED_SEGMENTS + 1) and lengths.shape == (2, PACKED_SEGMENTS)
    for row, offs, lens in zip(seg, offsets, lengths):
        want_offs, want_lens = _runs_by_loop(list(row))
        if len(want_offs) > PACKED_SEGMENTS:
            continue  # does not fit: ``ok`` says so, the layout is not used
        n = len(want_offs)
        assert list(offs[:n]) == want_offs and list(lens[:n]) == want_lens
        assert (offs[n:] == -1).all() and (lens[n:] == -1).all()


def test_unknown_documents_setting_is_refused():
    q, k, v, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="documents must be one of .* got 'packd'"):
        causal_attention(q, k, v, jnp.asarray(THREE_DOCS), 0.25, documents="packd")


def test_value_head_wider_than_query_is_refused():
    q, k, v, _ = _inputs(jnp.float32, dk=16, dv=32)
    with pytest.raises(ValueError, match="value head dim 32"):
        causal_attention(q, k, v, None, 0.25)


@pytest.mark.parametrize("documents", ["auto", "single"])
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_attends_over_its_own_rows(mesh_cfg, documents):
    """Under a mesh of 8 devices the attention runs per device (``shard_map`` over the batch axes,
    and the tensor axis over the heads where it divides them): the same values and gradients as
    on one device, to fp32 round-off."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    b, h = 8, 4
    keys = jax.random.split(jax.random.key(1), 4)
    q, k = (jax.random.normal(kk, (b, T, h, 16), jnp.float32) for kk in keys[:2])
    v = jax.random.normal(keys[2], (b, T, h, 8), jnp.float32)
    cot = jax.random.normal(keys[3], (b, T, h, 8), jnp.float32)
    rows = ([ONE_DOC_ROWS] * 4 if documents == "single"
            else [THREE_DOCS, SPLIT_DOC, MANY_DOCS, THREE_DOCS[::-1]])
    seg = jnp.asarray(np.concatenate(rows))
    attend = functools.partial(causal_attention, documents=documents)
    one = _values_and_grads(attend, q, k, v, seg, cot)
    per_device = jax.jit(_values_and_grads.__wrapped__, static_argnums=0)  # traced afresh
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        lowered = per_device.lower(attend, q, k, v, seg, cot)
        many = lowered.compile()(q, k, v, seg, cot)
    assert "sdy.manual_computation" in lowered.as_text()  # it did run per device
    for a, b_ in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        assert rel_rms(a, b_) <= FP32_TOL, rel_rms(a, b_)
