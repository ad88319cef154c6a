"""The released Kimi K3 shapes (math §1): 2.78T total, 104.2B active. For shape checks and
counting with ``jax.eval_shape``; nothing here is meant to be allocated on one machine."""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=163840, d_model=7168, num_layers=93, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=96, head_dim=128, conv_size=4, gate="lower_bound",
                      lower_bound=-5.0, gate_rank=128, output_gate="full"),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=33792, activation="situ_glu"),
        moe=MoEConfig(num_experts=896, top_k=16, expert_intermediate=3072, latent_dim=3584,
                      latent_norm=True, shared_intermediate=6144, routed_scaling_factor=1.0,
                      activation="situ_glu", balancing="quantile_hist"),
        residual=ResidualConfig(kind="attnres", block_size_layers=12),
        rms_eps=1e-5, remat="full",
    )


def get_config():
    from configs._recipes import released_scale_run

    return released_scale_run(model_config())
