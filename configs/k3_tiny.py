"""K3 in miniature for the CPU (seconds per step): K3's layers at toy widths (MLA without its
query LoRA, which ``k3_small`` has)."""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=128, num_layers=4, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=2, head_dim=64, gate="lower_bound", lower_bound=-5.0,
                      gate_rank=32, output_gate="full", chunk_size=32),
        mla=MLAConfig(num_heads=2, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=384, activation="situ_glu"),
        moe=MoEConfig(num_experts=8, top_k=2, expert_intermediate=128, latent_dim=64,
                      latent_norm=True, shared_intermediate=256, activation="situ_glu",
                      balancing="quantile_hist"),
        residual=ResidualConfig(kind="attnres", block_size_sublayers=4),
        rms_eps=1e-5,
    )


def get_config():
    """The README's main job: ``make train`` (k3_tiny on the Python standard library, CPU)."""
    from k3jax.config.experiment import (
        CheckpointConfig,
        DataConfig,
        EvalConfig,
        ExperimentConfig,
        OptimConfig,
        TrainConfig,
    )

    return ExperimentConfig(
        model=model_config(),
        # Sized for about five minutes on an idle 2-core CPU (~0.65 s per step, ~20 s compiling).
        data=DataConfig(seq_len=128, batch_size=8),
        optim=OptimConfig(name="adamw", lr=3e-3, schedule="wsd", warmup_steps=20,
                          decay_fraction=0.3),
        train=TrainConfig(steps=400, log_every=10),
        checkpoint=CheckpointConfig(every=100, keep=3),
        eval=EvalConfig(every=100, batches=4),
    )
