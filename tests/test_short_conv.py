"""KDA's short convolution with its SiLU (for q and k also the per-head L2 norm): the Triton
kernels' path (custom VJP: forward kernel, two backward kernels, the weight gradient's partial sums)
against JAX's autodiff of the fp32 formula, in Pallas's interpreter and lowered for an H200; on an
sm_90 GPU also compiled, at k3_small's shape (run the GPU test as ``JAX_PLATFORMS=cuda python -m
pytest -q tests/test_short_conv.py``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.parallel as kp
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus, hopper_target
from k3jax.ops.kda import L2_EPS
from k3jax.ops.short_conv import (
    conv_silu,
    conv_silu_projection_kernels,
    conv_silu_projections,
    conv_silu_step,
    kernel_conv_silu_projections,
)
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import short_conv as kernels

BT, BC = kernels.BLOCK_T, kernels.BLOCK_C


def _segments(b: int, t: int, docs: int, seed: int) -> np.ndarray:
    """``[b, t]`` runs of ids, ``docs`` documents a row at random cuts: boundaries fall inside
    tiles and on their edges, and a document may be shorter than the convolution."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
        cuts[0] = BT  # one boundary exactly on a tile edge
        for cut in cuts:
            seg[row, cut:] += 1
    return seg


def _operands(b, t, c, width, dtype, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (b, t, c), jnp.float32)
    w = jax.random.normal(kw, (width, c), jnp.float32) / np.sqrt(width)
    dout = jax.random.normal(kd, (b, t, c), jnp.float32)
    return x.astype(dtype), w, dout.astype(dtype)


def _one_projection(x, w, seg, head_dim=None, interpret=False):
    """The kernels on ``x [B, T, C]`` as a product of one projection, as :func:`conv_silu` runs
    them."""
    norm = None if head_dim is None else (head_dim, L2_EPS)
    return kernel_conv_silu_projections(x[:, :, None], (w,), seg, (norm,), interpret)[0]


def _values_and_grads(x, w, seg, dout, path, head_dim=None):
    """``(out, dx, dw)`` of one path: ``"kernels"`` (interpreted on the CPU) or ``"formula"``;
    with ``head_dim`` each head's activation L2-normalised."""
    def f(x, w):
        if path == "formula":
            return conv_silu(x, w, seg, impl="reference", head_dim=head_dim)[0]
        return _one_projection(x, w, seg, head_dim, not hopper_gpus())

    out, vjp = jax.vjp(f, x, w)
    return (out, *vjp(dout))


def _check(x, w, seg, dout, tols, head_dim=None):
    kernels_run = jax.jit(lambda *a: _values_and_grads(*a, "kernels", head_dim))(x, w, seg, dout)
    formula = jax.jit(lambda *a: _values_and_grads(*a, "formula", head_dim))(
        x.astype(jnp.float32), w, seg, dout.astype(jnp.float32))
    for name, ours, ref, tol in zip(("out", "dx", "dw"), kernels_run, formula, tols):
        err = rel_rms(ref, np.asarray(ours, np.float32))
        assert err <= tol, f"{name}: relative RMS {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype,width,head_dim", [
    (jnp.float32, 4, None), (jnp.bfloat16, 4, None), (jnp.float32, 3, None),
    (jnp.float32, 4, 64), (jnp.bfloat16, 4, 128)])
def test_kernels_match_formula(dtype, width, head_dim):
    """Values, input and weight gradients of the kernels' path (with ``head_dim``: each head's
    activation L2-normalised, as for q and k) against autodiff of the fp32 formula (math §10:
    FP32_TOL for fp32 inputs; BF16_OUT_TOL and BF16_GRAD_QKV_TOL for bf16), over two row tiles
    and two column blocks of two batch rows with packed documents."""
    x, w, dout = _operands(2, 2 * BT, 2 * BC, width, dtype)
    seg = _segments(2, 2 * BT, 6, seed=1)
    tols = (FP32_TOL,) * 3 if dtype == jnp.float32 else (BF16_OUT_TOL, BF16_GRAD_QKV_TOL,
                                                           BF16_GRAD_QKV_TOL)
    _check(x, w, seg, dout, tols, head_dim)


def test_kernels_keep_documents_apart():
    """Each document's outputs and input gradients equal those of the document run alone (the
    other's inputs and output gradients zeroed, one segment): nothing crosses a boundary in
    either direction. Exact comparison of the interpreted kernels."""
    x, w, dout = _operands(1, 2 * BT, BC, 4, jnp.float32, seed=3)
    seg = np.zeros((1, 2 * BT), np.int32)
    seg[0, BT - 2:] = 1  # the second document starts two rows before the tile edge
    run = jax.jit(lambda *a: _values_and_grads(*a, "kernels")[:2])
    both = run(x, w, seg, dout)
    for doc in (0, 1):
        keep = jnp.asarray(seg == doc)[..., None]
        alone = run(jnp.where(keep, x, 0.0), w, np.zeros_like(seg), jnp.where(keep, dout, 0.0))
        rows = seg[0] == doc
        for ours, want in zip(both, alone):
            np.testing.assert_array_equal(np.asarray(ours)[:, rows], np.asarray(want)[:, rows])


def test_projection_kernels_equal_each_projection_alone():
    """Three projections of one ``[B, T, 3, C]`` product (two L2-normalised per head of 64, as q
    and k): the kernels that read each in place, and the backward whose input-gradient kernels
    fill one gradient in turn, give exactly each projection's own kernels' values and gradients
    (interpreted), so no part's gradient overwrites another's."""
    x, _, _ = _operands(2, 2 * BT, 3 * BC, 4, jnp.float32, seed=5)
    x = x.reshape(2, 2 * BT, 3, BC)
    ws = tuple(_operands(1, BT, BC, 4, jnp.float32, seed=6 + i)[1] for i in range(3))
    douts = tuple(_operands(2, 2 * BT, BC, 4, jnp.float32, seed=9 + i)[2] for i in range(3))
    seg = _segments(2, 2 * BT, 4, seed=2)
    norms = ((64, L2_EPS), (64, L2_EPS), None)
    interpret = not hopper_gpus()

    def merged(x, ws):
        return kernel_conv_silu_projections(x, ws, seg, norms, interpret)

    def apart(x, ws):
        return tuple(_one_projection(x[:, :, i], w, seg, norm and norm[0], interpret)
                     for i, (w, norm) in enumerate(zip(ws, norms)))

    run = jax.jit(lambda f, x, ws: (lambda out, vjp: (out, vjp(douts)))(*jax.vjp(f, x, ws)),
                  static_argnums=0)
    for ours, want in zip(jax.tree.leaves(run(merged, x, ws)), jax.tree.leaves(run(apart, x, ws))):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))


def test_projection_kernels_lower_for_an_h200():
    """KDA's q, k and v convolutions as the layer runs them from one ``[B, T, 3, C]`` product
    pass Triton's lowering for an H200 at k3_small's shape: three forward kernels and two
    backward ones a projection, the input-gradient kernels writing one buffer in turn."""
    x = jax.ShapeDtypeStruct((2, 2048, 3, 768), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct((4, 768), jnp.float32),) * 3
    seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32)

    def loss(x, ws, seg):
        outs, _ = conv_silu_projections(x, ws, seg, impl="pallas", head_dims=(128, 128, None))
        return sum(jnp.sum(out.astype(jnp.float32) ** 2) for out in outs)

    with hopper_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, ws, seg).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 9


def test_projections_name_a_bad_argument():
    x = jnp.zeros((1, BT, 3, BC), jnp.bfloat16)
    w, seg = jnp.zeros((4, BC)), jnp.zeros((1, BT), jnp.int32)
    with pytest.raises(ValueError, match="P = len"):
        conv_silu_projections(x, (w, w), seg)
    with pytest.raises(ValueError, match="part must index"):
        kernels.check_args(x, w, seg, part=3)
    with pytest.raises(ValueError, match="with part given"):
        kernels.check_args(x[:, :, 0], w, seg, part=0)
    with pytest.raises(ValueError, match="dx_into must be like x"):
        kernels.conv_silu_vjp(x, w, seg, x[:, :, 0], part=0, dx_into=x[:, :, :2])


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_runs_the_kernels_on_its_own_rows(mesh_cfg):
    """Under a mesh of 8 devices the kernels run per device (``shard_map`` over the batch axes;
    GSPMD would run the whole batch on every device): two projections of one product (the first
    L2-normalised per head of 64) give one device's values and gradients (the taps' summed over
    the devices), to fp32 round-off (FP32_TOL)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    x, _, _ = _operands(8, BT, 2 * BC, 4, jnp.float32, seed=11)
    x = x.reshape(8, BT, 2, BC)
    ws = tuple(_operands(1, BT, BC, 4, jnp.float32, seed=12 + i)[1] for i in range(2))
    douts = tuple(_operands(8, BT, BC, 4, jnp.float32, seed=14 + i)[2] for i in range(2))
    seg = _segments(8, BT, 3, seed=13)
    norms = ((64, L2_EPS), None)

    def run(x, ws):
        outs, vjp = jax.vjp(lambda x, ws: conv_silu_projection_kernels(
            x, ws, seg, norms, not hopper_gpus()), x, ws)
        return outs, vjp(douts)

    one = jax.jit(run)(x, ws)
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        lowered = jax.jit(run).lower(x, ws)  # traced afresh under the mesh
        many = lowered.compile()(x, ws)
    assert "sdy.manual_computation" in lowered.as_text()  # it did run per device
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        assert rel_rms(a, b) <= FP32_TOL, rel_rms(a, b)


@pytest.mark.parametrize("name,shape,expected", [
    ("x", (2, 2 * BT), "must be [B, T, C]"),
    ("T", (2, BT + 8, BC), f"T % {BT} == 0"),
    ("C", (2, BT, BC + 8), f"C % {BC} == 0"),
])
def test_kernels_reject_shapes_they_do_not_cover(name, shape, expected):
    x = jnp.zeros(shape, jnp.bfloat16)
    c = shape[-1]
    seg = jnp.zeros(shape[:2], jnp.int32)
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        kernels.check_args(x, jnp.zeros((4, c)), seg)


def test_kernels_reject_bad_taps_and_ids():
    x = jnp.zeros((2, BT, BC), jnp.bfloat16)
    with pytest.raises(ValueError, match="w must be"):
        kernels.check_args(x, jnp.zeros((4, BC + 1)), jnp.zeros((2, BT), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        kernels.check_args(x, jnp.zeros((4, BC)), jnp.zeros((2, BT), jnp.float32))
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        conv_silu(x, jnp.zeros((4, BC)), jnp.zeros((2, BT + 1), jnp.int32), impl="pallas")
    with pytest.raises(ValueError, match="head_dim must be one of"):
        conv_silu(x, jnp.zeros((4, BC)), impl="pallas", head_dim=32)  # divides C: the kernels' own


@pytest.mark.parametrize("change,expected", [
    (dict(x=jnp.zeros((2, 8 * 16))), "x must be [B, T, C]"),
    (dict(w=jnp.zeros((4, 8))), "w must be [W, C=16] with W >= 1"),
    (dict(w=jnp.zeros((4, 16, 1))), "w must be [W, C=16]"),
    (dict(w=jnp.zeros((0, 16))), "w must be [W, C=16] with W >= 1"),
    (dict(state=jnp.zeros((2, 4, 16))), "state must be [B, W-1, C] = (2, 3, 16)"),
    (dict(segment_ids=jnp.zeros((2, 7), jnp.int32)), "segment_ids must be integer [B, T]"),
    (dict(segment_ids=jnp.zeros((2, 8))), "segment_ids must be integer [B, T]"),
    (dict(head_dim=6), "head_dim must be None or a positive divisor of C=16, got 6"),
    (dict(head_dim=0), "head_dim must be None or a positive divisor of C=16, got 0"),
])
def test_formula_path_names_the_bad_argument(change, expected):
    """The formula path (any call the kernels do not take) checks its arguments too."""
    kw = dict(x=jnp.zeros((2, 8, 16)), w=jnp.zeros((4, 16)), segment_ids=None, state=None,
              head_dim=None)
    kw.update(change)
    with pytest.raises(ValueError, match="conv_silu: " + re.escape(expected)):
        conv_silu(kw.pop("x"), kw.pop("w"), impl="reference", **kw)


@pytest.mark.parametrize("change,expected", [
    (dict(x=jnp.zeros((2, 1, 16))), "x must be [B, C]"),
    (dict(w=jnp.zeros((4, 8))), "w must be [W, C=16]"),
    (dict(state=jnp.zeros((2, 3, 8))), "state must be [B, W-1, C] = (2, 3, 16)"),
    (dict(head_dim=5), "head_dim must be None or a positive divisor of C=16, got 5"),
])
def test_decode_step_names_the_bad_argument(change, expected):
    kw = dict(x=jnp.zeros((2, 16)), w=jnp.zeros((4, 16)), state=jnp.zeros((2, 3, 16)),
              head_dim=None)
    kw.update(change)
    with pytest.raises(ValueError, match="conv_silu_step: " + re.escape(expected)):
        conv_silu_step(**kw)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_compiled_kernels_at_k3_small_shape():
    """Compiled kernels at k3_small's per-layer shape (8 rows of the batch, 12 documents a row)
    against the fp32 formula, math §10 bf16 tolerances, every value finite."""
    x, w, dout = _operands(8, 2048, 768, 4, jnp.bfloat16, seed=5)
    for head_dim in (None, 128):
        _check(x, w, _segments(8, 2048, 12, seed=6), dout,
               (BF16_OUT_TOL, BF16_GRAD_QKV_TOL, BF16_GRAD_QKV_TOL), head_dim)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_kda_layer_on_the_kernels_continues_from_its_cache():
    """A KDA layer's sequence from its start takes the kernels (q and k normalised in them); a
    continuation from its cache takes the formula with the convolutions' state. The two halves
    equal one run (bf16; math §10 output tolerance)."""
    from helpers import small_config

    from k3jax.config import KDAConfig
    from k3jax.layers.kda import KDALayer

    cfg = small_config(d_model=256, dtype="bfloat16",
                       kda=KDAConfig(num_heads=2, head_dim=128, gate_rank=16))
    layer = KDALayer(cfg)
    x = jax.random.normal(jax.random.key(7), (2, 4 * BT, cfg.d_model), jnp.bfloat16)
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    run = jax.jit(layer.apply, static_argnames="return_cache")
    assert "__gpu$xla.gpu.triton" in run.lower(variables, x).as_text()
    full = run(variables, x)
    first, cache = run(variables, x[:, :2 * BT], return_cache=True)
    second = run(variables, x[:, 2 * BT:], cache=cache)
    both = np.concatenate([np.asarray(first, np.float32), np.asarray(second, np.float32)], 1)
    assert rel_rms(np.asarray(full, np.float32), both) <= BF16_OUT_TOL
