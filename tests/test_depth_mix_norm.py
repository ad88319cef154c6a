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
from helpers import host_variables, small_config

import k3jax.ops.attnres as attnres_ops
import k3jax.parallel as kp
from k3jax.config import MLAConfig, MoEConfig, ResidualConfig
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus, hopper_target
from k3jax.model import K3Model, abstract_variables
from k3jax.ops.attnres import (
    depth_mix_norm,
    depth_mix_norm_kernels,
    depth_mix_reference,
    kernel_depth_mix_norm,
    rms_norm_read,
)
from k3jax.ops.rms_norm import rms_norm
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import depth_mix_norm as kernels

EPS, NORM_EPS = 1e-5, 1e-6
# Two backward programs; d = 96 is three column chunks of 32 (not a power of two).
TILE = kernels.TOKENS_MULTIPLE  # the tokens of one backward program
N, D = 2 * TILE, 96
NAMES = ("x", "weights", "handed on", "dsources", "dw", "dg", "dscale")


def _operands(n, dtype, shape=(N, D), seed=0):
    """``n`` sources of different scales, the query ``w``, key-norm weight ``g``, norm weight
    ``scale``, and gradients of the output ``dx``, of the weights' token sums ``dweights [n]``
    and of the sources handed on (``later``, each ``shape``: what later reads of them gave)."""
    keys = jax.random.split(jax.random.key(seed), 2 * n + 5)
    d = shape[-1]
    sources = tuple((jax.random.normal(keys[i], shape) * (1.0 + i)).astype(dtype)
                    for i in range(n))
    w = jax.random.normal(keys[n], (d,)) / np.sqrt(d) * 4
    g = 1.0 + 0.3 * jax.random.normal(keys[n + 1], (d,))
    scale = 1.0 + 0.3 * jax.random.normal(keys[n + 2], (d,))
    dx = jax.random.normal(keys[n + 3], shape).astype(dtype)
    later = tuple(jax.random.normal(k, shape).astype(dtype) for k in keys[n + 5:])
    return sources, w, g, scale, (dx, jax.random.normal(keys[n + 4], (n,)) * shape[0] ** 0.5,
                                  later)


def _formula(sources, w, g, scale, valid: bool):
    """math §5's read of the sources (without the last when ``valid`` is false), then the
    RMSNorm, on ``[N, d]`` rows in fp32; and each source's depth weight summed over the rows
    (0 for a masked source); and the sources handed on as they are."""
    used = [v.astype(jnp.float32) for v in (sources if valid else sources[:-1])]
    h = depth_mix_reference([v[None] for v in used], w, g, EPS)[0]
    keys = [rms_norm(v, g, EPS) for v in used]
    alpha = jax.nn.softmax(jnp.stack([k @ w for k in keys]), axis=0)      # [n, N]
    sums = jnp.sum(alpha, axis=1)
    return rms_norm(h, scale, NORM_EPS), sums if valid else jnp.append(sums, 0.0), sources


def _kernels(sources, w, g, scale, valid: bool):
    return kernel_depth_mix_norm(sources, w, g, scale, jnp.array([valid], jnp.int32),
                                 (EPS, NORM_EPS), not hopper_gpus())


def _values_and_grads(path, sources, w, g, scale, cts, valid):
    """Outputs and the gradients of the inputs for the cotangents ``cts``; without a ``later``
    cotangent (None) the handed-on sources are left unused, as a source's last read leaves
    them."""
    if cts[2] is None:
        out, vjp = jax.vjp(lambda *a: path(*a, valid)[:2], sources, w, g, scale)
        return (*out, sources, *vjp(cts[:2]))
    out, vjp = jax.vjp(lambda *a: path(*a, valid), sources, w, g, scale)
    return (*out, *vjp(cts))


def _check(sources, w, g, scale, cts, valid, tols):
    ours = jax.jit(lambda *a: _values_and_grads(_kernels, *a, valid))(sources, w, g, scale, cts)
    f32 = tuple(v.astype(jnp.float32) for v in sources)
    later = None if cts[2] is None else tuple(c.astype(jnp.float32) for c in cts[2])
    ref = jax.jit(lambda *a: _values_and_grads(_formula, *a, valid))(
        f32, w, g, scale, (cts[0].astype(jnp.float32), cts[1], later))
    for name, a, b, tol in zip(NAMES, ref, ours, tols):
        for i, (want, got) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            if name == "dsources" and not valid and i == len(sources) - 1 and later is None:
                assert not np.any(np.asarray(got)), "a masked source got a gradient"
                continue
            err = rel_rms(want, np.asarray(got, np.float32))
            assert err <= tol, f"{name}[{i}]: relative RMS {err:.2e} > {tol:.0e}"


def _tols(dtype):
    """math §10: FP32_TOL for fp32 sources; for bf16 BF16_OUT_TOL for the outputs and
    BF16_GRAD_QKV_TOL for every gradient."""
    return ((FP32_TOL,) * 7 if dtype == jnp.float32
            else (BF16_OUT_TOL,) * 3 + (BF16_GRAD_QKV_TOL,) * 4)


@pytest.mark.parametrize("dtype,n,valid,later", [
    (jnp.float32, 1, True, False), (jnp.float32, 3, True, True), (jnp.float32, 3, False, False),
    (jnp.float32, 3, False, True), (jnp.bfloat16, 4, True, True), (jnp.bfloat16, 2, False, False)])
def test_kernels_match_formula(dtype, n, valid, later):
    """The output, the weights' token sums, and the gradients (through both, and with ``later``
    through the handed-on sources, which the backward kernel adds) of the sources, the query, the
    key-norm weight and the norm's weight against autodiff of the fp32 formula (tolerances of
    :func:`_tols`), with the last source (the partial sum) a source or masked out."""
    sources, w, g, scale, (dx, dweights, handed_on) = _operands(n, dtype, seed=n)
    _check(sources, w, g, scale, (dx, dweights, handed_on if later else None), valid,
           _tols(dtype))


def _read_chain(read, sources, w, g, scale, cts, hand_on=True):
    """Three reads as a block's sub-layers make them: the second reads the sources the first
    handed on (or, without ``hand_on``, the first's own), the third those with the partial sum
    (the last source) after a sub-layer's write. A loss of the three outputs (against ``cts``)."""
    x1, _, handed = read(sources, w, g, scale, True)
    x2, _, handed = read(handed if hand_on else sources, w * 0.5, g, scale, True)
    x3, _, _ = read((*handed[:-1], handed[-1] + x2 * x1), w, g, scale * 2, True)
    return sum(jnp.sum(x * c) for x, c in zip((x1, x2, x3), cts))


def _sums_of_kernel_gradients(jaxpr) -> int:
    """How many of autodiff's cotangent sums (``add_any``) take a gradient the backward kernel
    wrote: the sums the kernel should have done in its own pass."""
    from_kernel, sums = set(), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "add_any" and any(v in from_kernel for v in eqn.invars):
            sums += 1
        # the kernel itself, or a jitted call of it
        called = str(eqn.params.get("name", "")) + str(eqn.params.get("jaxpr", ""))
        if "depth_mix_norm_bwd" in called:
            from_kernel.update(eqn.outvars)
    return sums


def test_a_chain_of_reads_sums_each_sources_gradient():
    """Three reads of :func:`_read_chain`: the sources' gradients (each the sum over the reads)
    against autodiff of the formula (FP32_TOL), summed inside the backward kernels: no sum of
    autodiff's takes a kernel's gradient, where reading the sources themselves again leaves
    one a source."""
    sources, w, g, scale, (dx, _, later) = _operands(3, jnp.float32, seed=3)
    cts = (dx, *later[:2])

    def loss(read, sources, hand_on=True):
        return _read_chain(read, sources, w, g, scale, cts, hand_on)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, _kernels)))(sources)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, _formula)))(sources)
    assert rel_rms(want[0], got[0]) <= FP32_TOL
    for i, (a, b) in enumerate(zip(want[1], got[1])):
        assert rel_rms(a, b) <= FP32_TOL, f"source {i}: relative RMS {rel_rms(a, b):.2e}"
    program = jax.make_jaxpr(jax.grad(functools.partial(loss, _kernels)))(sources)
    assert _sums_of_kernel_gradients(program.jaxpr) == 0
    not_handed_on = jax.make_jaxpr(jax.grad(functools.partial(loss, _kernels, hand_on=False)))
    assert _sums_of_kernel_gradients(not_handed_on(sources).jaxpr) == len(sources)


def test_kernels_lower_for_an_h200():
    """The kernels' path as the model runs it (jitted launchers, custom VJP) passes Triton's
    lowering for an H200 at k3_small's shape with five sources; the tests above run the kernels in
    the interpreter."""
    rows = jax.ShapeDtypeStruct((32 * 2048, 768), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((768,), jnp.float32)

    def loss(sources, w, g, scale):
        def read(sources):
            return kernel_depth_mix_norm(sources, w, g, scale, jnp.ones((1,), jnp.int32),
                                         (EPS, EPS))

        x, weights, handed_on = read(sources)
        y = read(handed_on)[0]  # a second read of the same sources: gradients taken in
        return jnp.sum(x.astype(jnp.float32) ** 2) + jnp.sum(weights ** 2) + jnp.sum(y)

    with hopper_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
            (rows,) * 5, vec, vec, vec).lower(lowering_platforms=("cuda",)).as_text()
    # the forward kernel once, the backward with and without the gradients taken in
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_kernels_reject_what_they_do_not_cover():
    sources, w, g, scale, (dx, dweights, later) = _operands(2, jnp.bfloat16)
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
    with pytest.raises(ValueError, match="later must hold 2 entries, each None or"):
        kernels.depth_mix_norm_vjp(sources, w * g, scale, ones, dx, dweights, (later[0],),
                                   eps_mix=EPS, eps_norm=NORM_EPS, interpret=True)


def test_op_rejects_an_unknown_impl():
    """An unknown ``impl`` is an error naming it, not the XLA path."""
    sources, w, g, scale, _ = _operands(2, jnp.float32, shape=(1, 8, 32))
    with pytest.raises(ValueError, match="depth_mix_norm: impl='triton' is invalid: expected"):
        depth_mix_norm(sources[:-1], sources[-1], w, g, scale, EPS, NORM_EPS, impl="triton")


def test_one_source_read_is_the_rms_norm(monkeypatch):
    """``rms_norm_read`` through the kernels (interpreted) is ``rms_norm``: the value and the
    gradients of the input and the weight against autodiff of the formula, bf16 rows of three
    32-column chunks (math §10 output and gradient tolerances)."""
    (x,), _, _, scale, (dy, _, _) = _operands(1, jnp.bfloat16, shape=(2, TILE // 2, D), seed=5)
    monkeypatch.setattr(attnres_ops, "takes_kernels",
                        lambda impl, module, *args, **kwargs: module == "depth_mix_norm")
    monkeypatch.setattr(attnres_ops, "depth_mix_norm_kernels",
                        functools.partial(depth_mix_norm_kernels, interpret=True))

    def value_and_grads(norm, x, scale):
        y, vjp = jax.vjp(lambda x, scale: norm(x, scale, NORM_EPS), x, scale)
        return (y, *vjp(dy.astype(y.dtype)))

    ours = jax.jit(functools.partial(value_and_grads, rms_norm_read))(x, scale)
    want = jax.jit(functools.partial(value_and_grads, rms_norm))(x.astype(jnp.float32), scale)
    for name, a, b, tol in zip(("y", "dx", "dscale"), want, ours,
                               (BF16_OUT_TOL, BF16_GRAD_QKV_TOL, BF16_GRAD_QKV_TOL)):
        assert b.dtype == (x.dtype if name != "dscale" else scale.dtype), name
        err = rel_rms(a, np.asarray(b, np.float32))
        assert err <= tol, f"{name}: relative RMS {err:.2e} > {tol:.0e}"
    with pytest.raises(ValueError, match="rms_norm_read: x must be"):
        rms_norm_read(x[0, 0], scale, NORM_EPS)
    with pytest.raises(ValueError, match="rms_norm_read: impl='triton' is invalid"):
        rms_norm_read(x, scale, NORM_EPS, impl="triton")


def test_a_models_norms_take_the_read_kernels(monkeypatch):
    """Where the kernels take a call, every RMSNorm of ``[B, T, d]`` rows in a model goes to them:
    the plain residual's pre-norms and final norm, MLA's latent norms and the MoE's latent norm
    (traced only: the kernels' numbers are the test above's). The widths are this test's own, so
    no other test's trace of a layer (which flax's lifted jit reuses) hides a call."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_intermediate=16, latent_dim=48,
                    shared_intermediate=16)
    mla = MLAConfig(num_heads=2, q_lora_rank=80, kv_lora_rank=112, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8)
    cfg = small_config(d_model=144, num_layers=2, mla_every=2, first_k_dense=0, moe=moe, mla=mla,
                       scan_layers=False)
    variables = abstract_variables(cfg)  # traced on its own few tokens, before the kernels
    widths = []

    def traced_kernels(sources, *args, **kwargs):
        widths.append(sources[0].shape[-1])
        return depth_mix_norm_kernels(sources, *args, interpret=True, **kwargs)

    monkeypatch.setattr(attnres_ops, "takes_kernels",
                        lambda impl, module, *args, **kwargs: module == "depth_mix_norm")
    monkeypatch.setattr(attnres_ops, "depth_mix_norm_kernels", traced_kernels)
    tokens = jax.ShapeDtypeStruct((2, TILE // 2), jnp.int32)
    jax.eval_shape(lambda v, t: K3Model(cfg).apply(v, t), variables, tokens)
    assert sorted(set(widths)) == [48, 80, 112, 144], widths


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_runs_the_kernels_on_its_own_rows(mesh_cfg):
    """Under a mesh of 8 devices the kernels run per device (``shard_map`` over the batch axes;
    GSPMD would run the whole batch on every device): the same output, depth weights and
    gradients as on one device, to fp32 round-off (FP32_TOL)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    sources, w, g, scale, cts = _operands(3, jnp.float32, shape=(8, TILE, D), seed=8)
    valid = jnp.ones((1,), jnp.int32)

    def run(sources, w, g, scale):
        out, vjp = jax.vjp(lambda *a: depth_mix_norm_kernels(*a, valid, (EPS, NORM_EPS),
                                                             not hopper_gpus()),
                           sources, w, g, scale)
        return out, vjp(cts)

    one = jax.jit(run)(sources, w, g, scale)
    rows = tuple(v.reshape(-1, D) for v in sources)
    x, sums, _ = _kernels(rows, w, g, scale, True)   # the tested kernel path: means of its sums
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
    every parameter's gradient (FP32_TOL), as the stack wires the reads together. MLA mixers: the
    reads do not depend on the mixer, and KDA's would dominate the compile time."""
    cfg = small_config(d_model=128, num_layers=4, scan_layers=False, mla_layers=(0, 1, 2, 3),
                       residual=ResidualConfig(kind="attnres", block_size_layers=1))
    model = K3Model(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, TILE // 2), 0, cfg.vocab_size)
    # random queries, away from the initialiser's zero queries' uniform mixing, so the scores'
    # gradients count
    params = host_variables(cfg, 0)

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
        _check(*operands, valid, _tols(jnp.bfloat16))


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_op_routes_blocks_and_partial_to_the_kernels():
    """``depth_mix_norm`` on ``[B, T, d]`` blocks and a partial sum takes the kernels on the GPU
    and agrees with its XLA path (the read, then the norm), values and gradients (bf16; math §10
    output and gradient tolerances)."""
    sources, w, g, scale, cts = _operands(4, jnp.bfloat16, shape=(4, 512, 256), seed=4)

    def run(impl):
        def f(blocks, partial, w, g, scale):
            return depth_mix_norm(blocks, partial, w, g, scale, EPS, NORM_EPS, impl=impl)
        out, vjp = jax.vjp(f, sources[:-1], sources[-1], w, g, scale)
        return out, vjp(cts)

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
