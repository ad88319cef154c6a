"""Kimi Linear 48B-A3B shapes (math §1): about 48B total, 3B active."""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=163840, d_model=2304, num_layers=27, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=32, head_dim=128, conv_size=4, gate="softplus", gate_rank=128,
                      output_gate="low_rank", output_gate_rank=128),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        dense_ffn=FFNConfig(intermediate_size=9216, activation="swiglu"),
        moe=MoEConfig(num_experts=256, top_k=8, expert_intermediate=1024, latent_dim=None,
                      shared_intermediate=1024, routed_scaling_factor=2.446, activation="swiglu",
                      balancing="aux_free"),
        residual=ResidualConfig(kind="plain"),
        rms_eps=1e-5, remat="full",
    )


def get_config():
    from configs._recipes import released_scale_run

    return released_scale_run(model_config())
