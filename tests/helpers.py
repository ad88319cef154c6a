"""Small builders shared by the model-level tests."""

from __future__ import annotations

import dataclasses

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, ResidualConfig


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
