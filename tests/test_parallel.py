"""Mesh, rules table, sharded initialisation and sharded training on 8 simulated CPU devices.

The training test runs a few AdamW steps of a tiny MoE model (Quantile Balancing on) on layouts of
8 devices that cover every mesh axis of the recommended layouts and every dispatch (data x fsdp x
expert with the all-to-all dispatch, fsdp x expert with the ring, fsdp alone with the ragged
dispatch on each device's tokens) and on one device with the ragged dispatch: losses, parameters
and router biases agree to fp32 round-off. :func:`tiny_moe_config` is also the model of the
two-process ``train.py`` test in ``test_distributed_train.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import numpy as np
import pytest
from helpers import init, least_squares_args, least_squares_step, small_config
from jax.sharding import PartitionSpec as P

import k3jax.parallel as kp
from k3jax.config import ConfigError, MoEConfig
from k3jax.config.experiment import OptimConfig
from k3jax.config.mesh import MeshConfig
from k3jax.model import K3Model, abstract_variables, abstract_variables_and_axes, init_variables
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from k3jax.train.optim import build_optimizer, schedule_args
from k3jax.train.step import init_state, make_train_step

STEPS, BATCH, SEQ = 3, 8, 16
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)
LR_ARGS = schedule_args(OPTIM, 10)  # the schedule's numbers, an input of every step
# Loss values after a few steps agree to round-off; fp32 sums in a different order.
LOSS_RTOL = 1e-5


def tiny_moe_config(dispatch: str, **changes):
    """One MLA layer with a Stable LatentMoE FFN (shared expert, QB histogram), fp32."""
    moe = MoEConfig(num_experts=8, top_k=2, expert_intermediate=16, latent_dim=16,
                    shared_intermediate=16, balancing="quantile_hist", qb_bins=64,
                    dispatch=dispatch)
    return small_config(num_layers=1, mla_every=1, first_k_dense=0, moe=moe, **changes)


def train_batches(steps: int = STEPS) -> list[dict]:
    rng = np.random.default_rng(0)
    shape = (BATCH, SEQ)
    return [{"tokens": rng.integers(0, 64, shape).astype(np.int32),
             "targets": rng.integers(0, 64, shape).astype(np.int32),
             "segment_ids": np.ones(shape, np.int32),
             "weights": np.ones(shape, np.float32)} for _ in range(steps)]


@functools.lru_cache(maxsize=None)
def _optimizer_and_step(cfg, micro_batches: int):
    """The optimiser and the (unjitted) train step of ``cfg``, built once per test process."""
    optimizer = build_optimizer(OPTIM, 10, abstract_variables(cfg)["params"])
    step_fn = make_train_step(K3Model(cfg), OPTIM, micro_batches, cfg.moe)
    return optimizer, step_fn


@functools.lru_cache(maxsize=None)
def _jitted_step(cfg, micro_batches: int):
    """One compiled single-device step per config: the training test's reference and the
    micro-batch test's full-batch step are the same program."""
    return jax.jit(_optimizer_and_step(cfg, micro_batches)[1])


def _initial_state(cfg):
    """The single-device start of every variant: the dispatch and the balancing rule do not
    change the variables, so one compiled initialiser serves them all."""
    v = init(tiny_moe_config("ragged"), 0)
    return init_state(v["params"], v["balance"], _optimizer_and_step(cfg, 1)[0], 0)


def train_losses(dispatch: str, mesh=None, rules=None, place=None):
    """Run :data:`STEPS` training steps -> ``(losses, final state)``; sharded when ``mesh`` is
    given (``place`` turns a host batch into global arrays; default: ``device_put``)."""
    cfg = tiny_moe_config(dispatch)
    optimizer, step_fn = _optimizer_and_step(cfg, 1)
    make_state = lambda p, b: init_state(p, b, optimizer, 0)  # noqa: E731
    if mesh is None:
        state, step, put = _initial_state(cfg), _jitted_step(cfg, 1), lambda b: b
    else:
        # As the training loop does it: the step compiled for the state's abstract shapes (on a
        # worker thread) while the state is initialised; the compiled step accepts only arrays of
        # exactly the shardings it was compiled for.
        shapes = kp.sharded_state_shapes(cfg, mesh, rules, make_state, *abstract_variables_and_axes(
            cfg, (1, 8)))
        host = train_batches(1)[0]
        compiling = kp.sharded_step(step_fn, shapes, mesh, rules).compile_async(
            shapes, kp.abstract_batch(mesh, rules, host), LR_ARGS)
        state = kp.init_sharded_state(cfg, mesh, rules, jax.random.key(0), make_state)
        assert kp.shardings_of(state) == kp.shardings_of(shapes)
        step = compiling.result().run
        put = place or (lambda b: jax.device_put(b, kp.batch_sharding(mesh, rules)))
    losses = []
    for batch in train_batches():
        state, metrics = step(state, put(batch), LR_ARGS)
        losses.append(float(metrics["loss"]))
    return losses, state


# -- config and mesh -----------------------------------------------------------------------------

def test_mesh_config_validation():
    with pytest.raises(ConfigError, match="MeshConfig.expert=0"):
        MeshConfig(expert=0)
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="not mesh axes"):
        MeshConfig(rules=(("embed", "model"),))
    with pytest.raises(ConfigError, match="must also split the tokens"):
        MeshConfig(rules=(("batch", "data"), ("exp", "expert")))
    with pytest.raises(ConfigError, match="tensor"):
        MeshConfig(rules=(("batch", ("data", "tensor")),))
    # JSON round trips give lists; they are normalised to tuples.
    cfg = MeshConfig(rules=[["batch", ["data", "expert"]], ["exp", "expert"]])
    assert cfg.rules == (("batch", ("data", "expert")), ("exp", "expert"))
    assert MeshConfig(expert=4).resolve(8) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}


def test_make_mesh_and_errors():
    mesh = kp.make_mesh(MeshConfig(data=-1, expert=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"data=3 x fsdp=1 x expert=4.*12 devices; 8 devices"):
        kp.make_mesh(MeshConfig(data=3, expert=4))
    with pytest.raises(ConfigError, match=r"multiple of 3 devices; 8 devices exist"):
        kp.make_mesh(MeshConfig(expert=3))
    with pytest.raises(ConfigError, match=r"num_experts=6 .*expert axis size 4"):
        kp.check_experts_fit(kp.make_mesh(MeshConfig(data=2, expert=4)), MeshConfig().rules, 6)


def test_start_devices_puts_one_array_on_each_local_device(monkeypatch):
    import k3jax.parallel.mesh as mesh_module

    mesh = kp.make_mesh(MeshConfig(data=-1))
    sent, put = [], jax.device_put

    def device_put(x, device):
        sent.append(device)
        return put(x, device)

    monkeypatch.setattr(mesh_module.jax, "device_put", device_put)
    thread = kp.start_devices(mesh)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert sorted(d.id for d in sent) == sorted(d.id for d in mesh.local_devices)


def test_batch_sharding_and_constraint():
    cfg = MeshConfig(data=2, expert=4)
    mesh = kp.make_mesh(cfg)
    sh = kp.batch_sharding(mesh, cfg.rules)
    assert sh.spec == P(("data", "fsdp", "expert"), None)
    assert kp.batch_shards(mesh, cfg.rules) == 8
    assert kp.local_batch_rows(sh, (16, 4)) == slice(0, 16)          # one process holds all
    x = np.ones((8, 4), np.float32)
    assert kp.constrain(x, ("batch", None)) is x                       # no mesh: a no-op
    with kp.use_mesh(mesh, cfg.rules):
        y = jax.jit(lambda x: kp.constrain(x * 2, ("batch", None)))(x)
    assert y.sharding.is_equivalent_to(sh, 2)


def test_the_update_donates_the_state_alone_and_jax_warns_of_nothing():
    """The loop donates the state to the update on accelerators (the CPU runs donation too): its
    buffers become the new state's, and nothing donated is left without an output to become, which
    jax would list in a warning at every start. One device, as on one GPU: over several, jax
    leaves the donations to XLA and says nothing."""
    cfg = MeshConfig()
    mesh = kp.make_mesh(cfg, jax.devices()[:1])
    (state, batch, schedule), abstract = least_squares_args(mesh, cfg.rules)
    # Copies: a zero-copy view of the state on the CPU would keep its buffer from being donated.
    w, x, y = (np.array(a) for a in (state["params"]["w"], batch["x"], batch["y"]))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers")
        step = kp.sharded_step(least_squares_step(), abstract[0], mesh, cfg.rules, donate=True)
        compiled = step.compile_async(*abstract).result()
    new, _ = compiled.run(state, batch, schedule)
    assert state["params"]["w"].is_deleted()
    expected = w - 0.1 * 2 * x.T @ (x @ w - y) / y.size  # one SGD step, in numpy
    assert rel_rms(expected, new["params"]["w"]) <= FP32_TOL  # math §10: fp32, another order



def test_a_background_compile_waits_for_the_program_it_comes_after(monkeypatch):
    """``compile_in_background(..., after=f)`` lowers at once but compiles (XLA and the Mosaic
    kernels) only once ``f`` is done, whatever its outcome; jit then runs what it compiled."""
    import concurrent.futures
    import threading

    import jax.numpy as jnp

    from k3jax.parallel import step as parallel_step

    cfg = MeshConfig()
    mesh = kp.make_mesh(cfg)
    started = threading.Event()
    monkeypatch.setattr(parallel_step, "compile_kernels_async", lambda lowered: started.set())
    gate = concurrent.futures.Future()
    compiling = parallel_step.compile_in_background(
        jax.jit(jnp.tanh), mesh, cfg.rules, jax.ShapeDtypeStruct((8, 4), jnp.float32), after=gate)
    assert not started.wait(0.5) and not compiling.done()
    gate.set_exception(RuntimeError("the earlier compile failed"))  # its waiter's concern
    compiled = compiling.result(timeout=60)
    assert started.is_set()
    x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(8, 4)
    assert rel_rms(np.tanh(x), np.asarray(compiled(x))) <= FP32_TOL  # math §10: fp32

# -- sharded initialisation ----------------------------------------------------------------------

def test_init_sharded_layout_and_memory():
    cfg = tiny_moe_config("all_to_all", d_model=64, vocab_size=256)
    mc = MeshConfig(data=1, fsdp=2, expert=2, tensor=2)
    mesh = kp.make_mesh(mc)
    shardings = kp.variable_shardings(cfg, mesh, mc.rules)
    # What init_sharded runs: the initialiser jitted with out_shardings.
    compiled = jax.jit(lambda r: init_variables(cfg, r), out_shardings=shardings).lower(
        jax.random.key(0)).compile()
    variables = compiled(jax.random.key(0))
    ffn = variables["params"]["layer_0"]["ffn"]
    assert ffn["expert_gate"].sharding.spec == P("expert", None, "tensor")
    assert ffn["expert_down"].sharding.spec == P("expert", "tensor", None)
    assert variables["params"]["embedding"].sharding.spec == P("tensor", "fsdp")
    shard = ffn["expert_gate"].addressable_shards[0].data
    assert shard.shape == (8 // 2, 16, 16 // 2)                        # no full copy per device
    # (Its values equal the single-device init's: the training test starts from both.)
    # The compiled initialiser never holds the whole model on one device (outputs + temporaries).
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_variables(cfg)))
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.output_size_in_bytes < total / 2
        assert mem.output_size_in_bytes + mem.temp_size_in_bytes < total


# -- sharded training ----------------------------------------------------------------------------

def _split_axes(x) -> set[str]:
    """The mesh axes of more than one device that ``x``'s sharding splits it over."""
    named = {a for axes in x.sharding.spec if axes
             for a in ((axes,) if isinstance(axes, str) else axes)}
    return {a for a in named if x.sharding.mesh.shape[a] > 1}


@functools.cache
def _one_device_run():
    """The single-device reference every layout is compared with, trained once per process."""
    return train_losses("ragged")


# The layouts the docs recommend on one 8-GPU host are data x expert (the model fits one device),
# fsdp x expert (it does not; k3_1b's docstring and make bench-scale take the ring dispatch) and
# fsdp alone (a dense or few-expert model). Each compiles a sharded step of its own, so data x
# expert and fsdp x expert with the all-to-all dispatch are one layout here: all three axes split
# the tokens the dispatch exchanges, fsdp the parameters besides (each recommended layout's
# shardings are the rules table's, the same for any sizes of these axes).
LAYOUTS = {"data2_fsdp2_expert2": (MeshConfig(data=2, fsdp=2, expert=2), "all_to_all"),
           "fsdp4_expert2_ring": (MeshConfig(data=1, fsdp=4, expert=2), "ring"),
           "fsdp8": (MeshConfig(data=1, fsdp=8), "ragged")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_training_equals_one_device(layout):
    cfg, dispatch = LAYOUTS[layout]
    ref_losses, ref_state = _one_device_run()
    losses, state = train_losses(dispatch, kp.make_mesh(cfg), cfg.rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert ref_losses[-1] < ref_losses[0]                              # it does train
    for a, b in zip(jax.tree.leaves(ref_state["params"]), jax.tree.leaves(state["params"])):
        assert rel_rms(a, b) <= FP32_TOL
    for a, b in zip(jax.tree.leaves(ref_state["balance"]), jax.tree.leaves(state["balance"])):
        assert rel_rms(a, b) <= FP32_TOL
    moments = jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
    gate_mu = [x for p, x in moments if "expert_gate" in jax.tree_util.keystr(p)]
    assert gate_mu
    for x in gate_mu:  # the optimiser's moments are laid out as their parameters
        assert ("expert" in _split_axes(x)) == (cfg.expert > 1), x.sharding.spec
    split = [x for x in jax.tree.leaves(state["params"]) if "fsdp" in _split_axes(x)]
    assert bool(split) == (cfg.fsdp > 1)


@pytest.mark.parametrize("balancing", ["quantile_hist", "quantile"])
def test_micro_batches_equal_one_full_batch(balancing):
    """Two micro-batches (a scan for the histogram rule; unrolled for exact QB, whose margins grow)
    give the full batch's step: loss, updated parameters and router biases, to fp32 round-off."""
    cfg = tiny_moe_config("ragged")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, balancing=balancing))
    state = _initial_state(cfg)
    batch = train_batches(1)[0]
    out = {m: _jitted_step(cfg, m)(state, batch, LR_ARGS) for m in (1, 2)}
    (one, m1), (two, m2) = out[1], out[2]
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=LOSS_RTOL)
    for part in ("params", "balance"):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one[part]),
                                jax.tree.leaves(two[part])):
            assert rel_rms(np.asarray(a), np.asarray(b)) < FP32_TOL, (
                part, jax.tree_util.keystr(path))
