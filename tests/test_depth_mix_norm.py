"""An Attention Residuals read and the RMSNorm after it in one op (``depth_mix_norm``): the Triton
kernels' path (custom VJP: a forward kernel, a backward kernel, the weight gradients' partial
sums) against autodiff of the fp32 formula, ``rms_norm(depth_mix_reference(...))``, in Pallas's
interpreter and lowered for an H200; on an sm_90 GPU also compiled at k3_small's shape against
the formula and against the XLA path (run the GPU tests as ``JAX_PLATFORMS=cuda python -m pytest
-q tests/test_depth_mix_norm.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import small_config

import k3jax.ops.attnres as attnres_ops
import k3jax.parallel as kp
from k3jax.config import ResidualConfig
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus, hopper_target
from k3jax.model import K3Model
from k3jax.ops.attnres import (
    depth_mix_norm,
    depth_mix_norm_kernels,
    depth_mix_reference,
    kernel_depth_mix_norm,
)
from k3jax.ops.rms_norm import rms_norm
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import depth_mix_norm as kernels

EPS, NORM_EPS = 1e-5, 1e-6
# Two backward programs; d = 96 is three column chunks of 32 (not a power of two).
TILE = kernels.TOKENS_MULTIPLE  # the tokens of one backward program
N, D = 2 * TILE, 96
NAMES = ("x", "weights", "dsources", "dw", "dg", "dscale")


def _operands(n, dtype, shape=(N, D), seed=0):
    """``n`` sources of different scales, the query ``w``, key-norm weight ``g``, norm weight
    ``scale``, and gradients of the output ``dx`` and of the weights' token sums
    ``dweights [n]``."""
    keys = jax.random.split(jax.random.key(seed), n + 5)
    d = shape[-1]
    sources = tuple((jax.random.normal(keys[i], shape) * (1.0 + i)).astype(dtype)
                    for i in range(n))
    w = jax.random.normal(keys[n], (d,)) / np.sqrt(d) * 4
    g = 1.0 + 0.3 * jax.random.normal(keys[n + 1], (d,))
    scale = 1.0 + 0.3 * jax.random.normal(keys[n + 2], (d,))
    dx = jax.random.normal(keys[n + 3], shape).astype(dtype)
    return sources, w, g, scale, (dx, jax.random.normal(keys[n + 4], (n,)) * shape[0] ** 0.5)


def _formula(sources, w, g, scale, valid: bool):
    """math §5's read of the sources (without the last when ``valid`` is false), then the
    RMSNorm, on ``[N, d]`` rows in fp32; and each source's depth weight summed over the rows
    (0 for a masked source)."""
    used = [v.astype(jnp.float32) for v in (sources if valid else sources[:-1])]
    h = depth_mix_reference([v[None] for v in used], w, g, EPS)[0]
    keys = [rms_norm(v, g, EPS) for v in used]
    alpha = jax.nn.softmax(jnp.stack([k @ w for k in keys]), axis=0)      # [n, N]
    sums = jnp.sum(alpha, axis=1)
    return rms_norm(h, scale, NORM_EPS), sums if valid else jnp.append(sums, 0.0)


def _kernels(sources, w, g, scale, valid: bool):
    return kernel_depth_mix_norm(sources, w, g, scale, jnp.array([valid], jnp.int32),
                                 (EPS, NORM_EPS), not hopper_gpus())


def _values_and_grads(path, sources, w, g, scale, cts, valid):
    out, vjp = jax.vjp(lambda *a: path(*a, valid), sources, w, g, scale)
    return (*out, *vjp(cts))


def _check(sources, w, g, scale, cts, valid, tols):
    ours = jax.jit(lambda *a: _values_and_grads(_kernels, *a, valid))(sources, w, g, scale, cts)
    f32 = tuple(v.astype(jnp.float32) for v in sources)
    ref = jax.jit(lambda *a: _values_and_grads(_formula, *a, valid))(
        f32, w, g, scale, (cts[0].astype(jnp.float32), cts[1]))
    for name, a, b, tol in zip(NAMES, ref, ours, tols):
        for i, (want, got) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            if name == "dsources" and not valid and i == len(sources) - 1:
                assert not np.any(np.asarray(got)), "a masked source got a gradient"
                continue
            err = rel_rms(want, np.asarray(got, np.float32))
            assert err <= tol, f"{name}[{i}]: relative RMS {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype,n,valid", [
    (jnp.float32, 1, True), (jnp.float32, 3, True), (jnp.float32, 3, False),
    (jnp.bfloat16, 4, True), (jnp.bfloat16, 2, False)])
def test_kernels_match_formula(dtype, n, valid):
    """The output, the weights' token sums, and the gradients (through both) of the sources, the
    query, the key-norm weight and the norm's weight against autodiff of the fp32 formula (math
    §10: FP32_TOL for fp32 sources; for bf16 BF16_OUT_TOL for the outputs and BF16_GRAD_QKV_TOL
    for every gradient), with the last source (the partial sum) a source or masked out."""
    tols = ((FP32_TOL,) * 6 if dtype == jnp.float32
            else (BF16_OUT_TOL,) * 2 + (BF16_GRAD_QKV_TOL,) * 4)
    _check(*_operands(n, dtype, seed=n), valid, tols)


def test_kernels_lower_for_an_h200():
    """The kernels' path as the model runs it (jitted launchers, custom VJP) passes Triton's
    lowering for an H200 at k3_small's shape with five sources; the tests above run the kernels in
    the interpreter."""
    rows = jax.ShapeDtypeStruct((32 * 2048, 768), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((768,), jnp.float32)

    def loss(sources, w, g, scale):
        x, weights = kernel_depth_mix_norm(sources, w, g, scale, jnp.ones((1,), jnp.int32),
                                           (EPS, EPS))
        return jnp.sum(x.astype(jnp.float32) ** 2) + jnp.sum(weights ** 2)

    with hopper_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
            (rows,) * 5, vec, vec, vec).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the forward kernel, the backward one


def test_kernels_reject_what_they_do_not_cover():
    sources, w, g, scale, (dx, _) = _operands(2, jnp.bfloat16)
    ones = jnp.ones((1,), jnp.int32)
    cases = [
        (((), w * g, scale, ones), "expected 1 to"),
        (((sources[0], sources[1][:, :48]), w * g, scale, ones), "one shape"),
        (((sources[0][:40],), w * g, scale, ones), f"N % {TILE} == 0"),
        ((sources, w[:48], scale, ones), r"u must have shape \(96,\)"),
        ((sources, w * g, scale[:48], ones), r"scale must have shape \(96,\)"),
        ((sources, w * g, scale, jnp.ones((1,), jnp.float32)), "valid must be int32"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.check_args(*args)
    with pytest.raises(ValueError, match="dx must match"):
        kernels.check_args(sources, w * g, scale, ones, dx.astype(jnp.float32))


def test_op_rejects_an_unknown_impl():
    """An unknown ``impl`` is an error naming it, not the XLA path."""
    sources, w, g, scale, _ = _operands(2, jnp.float32, shape=(1, 8, 32))
    with pytest.raises(ValueError, match="depth_mix_norm: impl='triton' is invalid: expected"):
        depth_mix_norm(sources[:-1], sources[-1], w, g, scale, EPS, NORM_EPS, impl="triton")


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_runs_the_kernels_on_its_own_rows(mesh_cfg):
    """Under a mesh of 8 devices the kernels run per device (``shard_map`` over the batch axes;
    GSPMD would run the whole batch on every device): the same output, depth weights and
    gradients as on one device, to fp32 round-off (FP32_TOL)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    sources, w, g, scale, (dx, dweights) = _operands(3, jnp.float32, shape=(8, TILE, D), seed=8)
    valid = jnp.ones((1,), jnp.int32)

    def run(sources, w, g, scale):
        out, vjp = jax.vjp(lambda *a: depth_mix_norm_kernels(*a, valid, (EPS, NORM_EPS),
                                                             not hopper_gpus()),
                           sources, w, g, scale)
        return out, vjp((dx, dweights))

    one = jax.jit(run)(sources, w, g, scale)
    rows = tuple(v.reshape(-1, D) for v in sources)
    x, sums = _kernels(rows, w, g, scale, True)   # the tested kernel path: means of its sums
    assert rel_rms(x.reshape(one[0][0].shape), one[0][0]) <= FP32_TOL
    assert rel_rms(sums / rows[0].shape[0], one[0][1]) <= FP32_TOL
    per_device = jax.jit(functools.partial(run))  # traced afresh under the mesh
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        lowered = per_device.lower(sources, w, g, scale)
        many = lowered.compile()(sources, w, g, scale)
    assert "sdy.manual_computation" in lowered.as_text()  # it did run per device
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        assert rel_rms(a, b) <= FP32_TOL, rel_rms(a, b)


def test_a_model_reads_through_the_kernels_as_through_xla(monkeypatch):
    """A four-layer model with Block AttnRes (a block a layer: reads of one to five sources),
    its reads on the kernels (interpreted) against the same model on the XLA path: the loss and
    every parameter's gradient (FP32_TOL), as the stack wires the reads together."""
    cfg = small_config(d_model=128, num_layers=4, scan_layers=False,
                       residual=ResidualConfig(kind="attnres", block_size_layers=1))
    model = K3Model(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, TILE // 2), 0, cfg.vocab_size)
    params = model.init(jax.random.key(0), tokens)
    # away from the zero-initialised queries' uniform mixing, so the scores' gradients count
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape),
                          params)

    def value_and_grads():
        def loss(p):
            return jnp.mean(jnp.square(model.apply(p, tokens)))
        return jax.jit(jax.value_and_grad(loss))(params)

    xla = value_and_grads()
    monkeypatch.setattr(attnres_ops, "takes_kernels",
                        lambda impl, module, *args, **kwargs: module == "depth_mix_norm")
    monkeypatch.setattr(attnres_ops, "depth_mix_norm_kernels",
                        functools.partial(depth_mix_norm_kernels, interpret=True))
    through_kernels = value_and_grads()
    assert rel_rms(xla[0], through_kernels[0]) <= FP32_TOL
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(xla[1])[0],
                                 jax.tree.leaves(through_kernels[1])):
        err = rel_rms(want, got)
        assert err <= FP32_TOL, f"{jax.tree_util.keystr(path)}: relative RMS {err:.2e}"


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_compiled_kernels_at_k3_small_shape():
    """Compiled kernels at k3_small's shape (32 x 2048 tokens, d = 768), five sources with the
    partial sum valid and masked, against the fp32 formula (math §10 bf16 tolerances)."""
    operands = _operands(5, jnp.bfloat16, shape=(32 * 2048, 768), seed=9)
    for valid in (True, False):
        _check(*operands, valid, (BF16_OUT_TOL,) * 2 + (BF16_GRAD_QKV_TOL,) * 4)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_op_routes_blocks_and_partial_to_the_kernels():
    """``depth_mix_norm`` on ``[B, T, d]`` blocks and a partial sum takes the kernels on the GPU
    and agrees with its XLA path (the read, then the norm), values and gradients (bf16; math §10
    output and gradient tolerances)."""
    sources, w, g, scale, (dx, dweights) = _operands(4, jnp.bfloat16, shape=(4, 512, 256), seed=4)

    def run(impl):
        def f(blocks, partial, w, g, scale):
            return depth_mix_norm(blocks, partial, w, g, scale, EPS, NORM_EPS, impl=impl)
        out, vjp = jax.vjp(f, sources[:-1], sources[-1], w, g, scale)
        return out, vjp((dx, dweights))

    lowered = jax.jit(lambda: run("pallas")).lower().as_text()
    assert "__gpu$xla.gpu.triton" in lowered
    (out_k, grads_k), (out_x, grads_x) = (jax.jit(lambda: run("pallas"))(),
                                          jax.jit(lambda: run("xla"))())
    for want, got in zip(out_x, out_k):
        assert rel_rms(np.asarray(want, np.float32), np.asarray(got, np.float32)) <= BF16_OUT_TOL
    for want, got in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_k)):
        assert rel_rms(np.asarray(want, np.float32),
                       np.asarray(got, np.float32)) <= BF16_GRAD_QKV_TOL


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_wide_rows_take_the_xla_path():
    """Rows wider than ``FAST_WIDTH`` (where the kernels lose to XLA) are not routed to them."""
    def routed(d):
        sources, w, g, scale, _ = _operands(2, jnp.bfloat16, shape=(TILE, d))
        return kernels.supports(sources, w * g, scale, jnp.ones((1,), jnp.int32))

    assert routed(kernels.FAST_WIDTH) and not routed(2 * kernels.FAST_WIDTH)
