"""Small builders shared by the model-level tests."""

from __future__ import annotations

import dataclasses
import functools

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def small_config(**changes) -> ModelConfig:
    """A dense fp32 hybrid small enough for exactness tests on the CPU."""
    base = ModelConfig(
        vocab_size=64, d_model=32, num_layers=4, mla_every=4, first_k_dense=4,
        kda=KDAConfig(num_heads=2, head_dim=16, gate_rank=8, chunk_size=16),
        mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=8, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=48),
        residual=ResidualConfig(kind="plain"),
        dtype="float32",
    )
    return dataclasses.replace(base, **changes)


# Tiny models for the inference tests (k3jax.generate), one per covered combination.
_MOE = MoEConfig(num_experts=4, top_k=2, expert_intermediate=16, latent_dim=16,
                 shared_intermediate=16, balancing="quantile_hist")
GENERATION_CASES = {
    "hybrid": dict(num_layers=4, mla_every=2, moe=_MOE, first_k_dense=0,
                   residual=ResidualConfig(kind="attnres", block_size_layers=4)),
    "kda": dict(num_layers=3, mla_layers=(), first_k_dense=3, dtype="bfloat16"),
    "mla": dict(num_layers=2, mla_every=1, moe=_MOE, first_k_dense=1, scan_layers=False,
                mla=MLAConfig(num_heads=2, q_lora_rank=None, kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                              rope=True)),
}


def host_draw(shapes, seed: int):
    """Values for a tree of shape structs, drawn on the host, nothing compiled: every weight
    N(0, 0.1^2), every norm scale N(1, 0.1^2). For tests that compare two computations on the same
    variables, whatever their values: a compiled initialiser (one random draw per parameter) costs
    more than a small model's forward. Tests whose point needs the initialiser's own values (zero
    queries, realistic scales) use :func:`init`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        mean = 1.0 if getattr(path[-1], "key", None) == "scale" else 0.0
        return jnp.asarray(mean + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def host_variables(cfg: ModelConfig, seed: int) -> dict:
    """The model's variables for ``cfg``, drawn on the host (:func:`host_draw`)."""
    from k3jax.model import abstract_variables

    return host_draw(abstract_variables(cfg), seed)


def host_module_variables(module, *args, seed: int = 0, **kwargs) -> dict:
    """A flax module's variables for ``module.init(key, *args, **kwargs)``, unboxed and drawn on
    the host (:func:`host_draw`): only the initialiser's shapes are traced."""
    import flax.linen as nn
    import jax

    return host_draw(jax.eval_shape(
        lambda: nn.meta.unbox(module.init(jax.random.key(0), *args, **kwargs))), seed)


@functools.lru_cache(maxsize=None)
def _jitted_init():
    import jax

    from k3jax.model import init_variables

    return jax.jit(init_variables, static_argnums=(0, 2))


def init(cfg: ModelConfig, seed: int = 0, batch_shape: tuple[int, int] = (1, 8)) -> dict:
    """``init_variables(cfg, key(seed), batch_shape)``, jitted: compiled once per config and batch
    shape in a test process (configs are hashable), then any seed costs one run. (Initialisers
    compile slowly on the CPU: one random draw per parameter.)"""
    import jax

    return _jitted_init()(cfg, jax.random.key(seed), batch_shape)


@functools.lru_cache(maxsize=None)
def generation_case(name: str):
    """``(cfg, variables)`` of a case, built once per test session; the variables drawn on the
    host (the generation tests hold cached steps to the full forward on the same variables)."""
    cfg = small_config(**GENERATION_CASES[name])
    return cfg, host_variables(cfg, 1)


def least_squares_step():
    """A :class:`~k3jax.train.step.TrainStep` small enough to compile in a second: the gradient
    of ``mean((x w - y)^2)`` for ``state["params"]["w"]``, then SGD at ``schedule["lr"]``."""
    import jax
    import jax.numpy as jnp

    from k3jax.train.step import TrainStep

    def gradients(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state["params"])
        return grads, {"loss": loss}

    def update(state, grads, out, schedule):
        params = jax.tree.map(lambda p, g: p - schedule["lr"] * g, state["params"], grads)
        return {**state, "params": params}, {"loss": out["loss"]}

    return TrainStep(gradients, update)


def least_squares_args(mesh, rules, rows: int = 16):
    """``(args, abstract)`` for :func:`least_squares_step` over ``mesh``: ``(state, batch,
    schedule)`` as arrays (state and schedule replicated, the batch split as the loop splits it;
    ``w [4, 3]``, ``x [rows, 4]``, ``y [rows, 3]``, ``lr = 0.1``) and as their abstract shapes."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from k3jax.parallel import batch_sharding

    replicated = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(0)
    state = jax.device_put({"params": {"w": rng.normal(size=(4, 3)).astype(np.float32)}},
                           replicated)
    batch = jax.device_put({"x": rng.normal(size=(rows, 4)).astype(np.float32),
                            "y": rng.normal(size=(rows, 3)).astype(np.float32)},
                           batch_sharding(mesh, rules))
    schedule = jax.device_put({"lr": np.float32(0.1)}, replicated)
    args = (state, batch, schedule)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            args)
    return args, abstract


def free_port() -> int:
    """A TCP port on localhost that is free right now (for a jax.distributed coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def wait_all(procs, timeout_s: float, while_waiting=None) -> list[str]:
    """Outputs of subprocesses (stdout+stderr piped), asserting each exited 0; every process still
    running is killed if anything fails. ``while_waiting()`` runs first, e.g. a reference run."""
    try:
        if while_waiting is not None:
            while_waiting()
        outs = [p.communicate(timeout=timeout_s)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
    return outs


def bf16_rounded(x):
    """``x`` rounded to bf16 and back: inputs both a bf16 kernel and an fp32 reference see
    exactly."""
    import jax.numpy as jnp

    return x.astype(jnp.bfloat16).astype(jnp.float32)


def kda_bf16_case(seed: int, b: int, t: int, h: int, dk: int, dv: int, gate: str):
    """Random KDA inputs on the bf16 grid: ``((q, k, v, g, beta, h0), d_out, d_final_state)``.

    q, k are L2-normalised; ``gate`` is ``"lower_bound"`` (K3, -5), ``"softplus"`` (strong enough
    that decays pass 88 nats within a chunk) or ``"weak"`` (a lower bound of -0.05: a chunk of 64
    tokens decays by about 1.6 nats, so the state carried from chunk to chunk and the initial
    state weigh in the outputs and their gradients, where the others' chunks forget it entirely).
    """
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = bf16_rounded(unit(jax.random.normal(ks[0], (b, t, h, dk))))
    k = bf16_rounded(unit(jax.random.normal(ks[1], (b, t, h, dk))))
    v = bf16_rounded(jax.random.normal(ks[2], (b, t, h, dv)))
    f = jax.random.normal(ks[3], (b, t, h, dk))
    g = {"lower_bound": lambda: -5.0 * jax.nn.sigmoid(f),
         "weak": lambda: -0.05 * jax.nn.sigmoid(f),
         "softplus": lambda: -jnp.exp(1.5) * jax.nn.softplus(2.0 * f)}[gate]()
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    h0 = jax.random.normal(ks[5], (b, h, dk, dv))
    do = jax.random.normal(ks[6], (b, t, h, dv))
    dfin = jax.random.normal(ks[7], (b, h, dk, dv))
    return (q, k, v, bf16_rounded(g), bf16_rounded(beta), h0), do, dfin


def assert_rows_within(ref, out, tol: float, name: str = "") -> None:
    """``rel_rms`` of every batch row (axis 0) of ``out`` against ``ref`` within ``tol``: when a
    test runs separate cases as the rows of one call, one row's larger values must not hide
    another's error."""
    from k3jax.ops.tolerance import rel_rms

    for row, (r, o) in enumerate(zip(ref, out, strict=True)):
        assert rel_rms(r, o) <= tol, (name, row, rel_rms(r, o))


def gate_bias_grad_error(dz, dbias) -> float:
    """Relative RMS of a KDA gate bias's gradient ``dbias [H, K]`` against the sum over the tokens
    of the same call's logit gradient ``dz [B, T, H, K]``, which it is however it is formed.

    Kernels are held to the fp32 recurrence through ``dz`` (math §10's bf16 gate tolerance); the
    bias's gradient is then checked as that sum (fp32 sums in another order), not against the
    recurrence's: summed over many tokens, ``dz``'s bf16 roundings stay while its values cancel,
    so the sum is 10% off the recurrence's at 2 x 256 tokens (kernels' sums and XLA's alike)."""
    import jax.numpy as jnp

    from k3jax.ops.tolerance import rel_rms

    return rel_rms(jnp.sum(dz.astype(jnp.float32), axis=(0, 1)), dbias)


def kda_fp32_case(seed: int, b: int, t: int, h: int, dk: int, dv: int):
    """:func:`kda_bf16_case` (lower-bound gate) with q, k, v moved off the bf16 grid by ~1e-3 noise:
    fp32 inputs that a kernel with bf16 tensor-core operands has to round. Traceable (a test may
    jit it with the sizes static); the caller checks that the inputs are off the grid."""
    import jax

    args, do, dfin = kda_bf16_case(seed, b, t, h, dk, dv, "lower_bound")
    noise = jax.random.split(jax.random.PRNGKey(seed + 100), 3)
    q, k, v = (x + 1e-3 * jax.random.normal(key, x.shape) for x, key in zip(args[:3], noise))
    return (q, k, v, *args[3:]), do, dfin


def kda_correlated_keys_case(t: int = 128, d: int = 64):
    """Nearly parallel keys, ``beta = 0.99`` and almost no decay (bf16 grid): the strictly lower
    ``L`` of a chunk has entries near 1 and ``L^32`` reaches ~1e16 although ``(I + L)^-1`` stays
    bounded by 1 -- the regime where an inverse built from powers of ``L`` (Neumann or product
    formulas, even in fp32) loses every digit, so a triangular solve or substitution is required.
    Returns ``((q, k, v, g, beta, h0), d_out, d_final_state)``, one sequence and one head."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.PRNGKey(5), 7)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    shared = jax.random.normal(ks[0], (1, 1, 1, d))
    k = bf16_rounded(unit(shared + 0.3 * jax.random.normal(ks[1], (1, t, 1, d))))
    q = bf16_rounded(unit(jax.random.normal(ks[2], (1, t, 1, d))))
    v = bf16_rounded(jax.random.normal(ks[3], (1, t, 1, d)))
    g = bf16_rounded(jnp.full((1, t, 1, d), -1e-3))
    beta = bf16_rounded(jnp.full((1, t, 1), 0.99))
    h0 = jax.random.normal(ks[4], (1, 1, d, d))
    do, dfin = jax.random.normal(ks[5], (1, t, 1, d)), jax.random.normal(ks[6], (1, 1, d, d))
    return (q, k, v, g, beta, h0), do, dfin


def documents_of(seg_row):
    """The token indices of each document of one row of segment ids: a document is a run of
    equal ids (math §2), so an id that comes back starts a new one."""
    import numpy as np

    return np.split(np.arange(len(seg_row)), np.flatnonzero(np.diff(seg_row)) + 1)


def document_numbers(seg):
    """``[B, T]``: the document each token is in, counted from 0 in each row (numpy, the test
    oracle of :func:`k3jax.ops.documents.document_index`)."""
    import numpy as np

    return np.stack([np.repeat(np.arange(len(docs)), [len(d) for d in docs])
                     for docs in map(documents_of, seg)])
