"""k3_small's recipe at width 2048 (1.09B total, 0.57B active parameters): the largest K3-shaped
preset that trains on one H200 (32 x 2048 tokens per step in 2 micro-batches, 82 GiB peak).

On the GPUs of one host, shard its state over ``fsdp`` and its experts over ``expert`` (the
tokens travel to their experts' devices by the ring dispatch), e.g. on 8 GPUs::

    --set mesh.data=1 --set mesh.fsdp=4 --set mesh.expert=2 --set model.moe.dispatch=ring

``python -m k3jax.train.memory --config k3_1b --mesh fsdp=4,expert=2`` sizes its state per
device (4.8 GiB there, against 12.4 GiB on one device); ``make bench-scale`` measures such
layouts."""

import dataclasses

from configs import k3_small
from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=16384, d_model=2048, num_layers=12, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=16, head_dim=128, gate="lower_bound", lower_bound=-5.0,
                      gate_rank=128, output_gate="full"),
        mla=MLAConfig(num_heads=16, q_lora_rank=1024, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=5632, activation="situ_glu"),
        moe=MoEConfig(num_experts=16, top_k=2, expert_intermediate=1024, latent_dim=1024,
                      grouped_matmul="mosaic", latent_norm=True, shared_intermediate=2048,
                      activation="situ_glu", balancing="quantile_hist"),
        residual=ResidualConfig(kind="attnres", block_size_layers=3),
        rms_eps=1e-5,
        scan_layers=False,  # as k3_small: blocks of 3 layers leave only 2-repeat scans
    )


def get_config():
    """k3_small's experiment (data, Muon + WSD, schedule) with this model in 2 micro-batches: 4
    took 4% longer a step on an H200, and one does not fit."""
    cfg = k3_small.get_config()
    return dataclasses.replace(cfg, model=model_config(),
                               optim=dataclasses.replace(cfg.optim, lr=2e-3),
                               train=dataclasses.replace(cfg.train, micro_batches=2))
