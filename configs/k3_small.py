"""K3 in miniature for one GPU (100-200M total parameters): the K3 recipe (3 KDA : 1 MLA with the
last layer MLA, lower-bound gate, dense layer 0, Stable LatentMoE with shared MLP, Quantile
Balancing, Block AttnRes) at widths a single H200 trains quickly."""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=16384, d_model=768, num_layers=12, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=6, head_dim=128, gate="lower_bound", lower_bound=-5.0,
                      gate_rank=64, output_gate="full"),
        mla=MLAConfig(num_heads=6, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=2048, activation="situ_glu"),
        moe=MoEConfig(num_experts=16, top_k=2, expert_intermediate=384, latent_dim=384,
                      grouped_matmul="mosaic",
                      latent_norm=True, shared_intermediate=768, activation="situ_glu",
                      balancing="quantile_hist"),
        residual=ResidualConfig(kind="attnres", block_size_layers=3),
        rms_eps=1e-5,
        # Blocks of 3 layers leave scans of only 2 repeats, whose stacked residuals and loop
        # copies took a fifth of the step on an H200 (docs/benchmarks.md): all 12 layers unrolled.
        scan_layers=False,
    )


def get_config():
    """One-GPU experiment: a byte-level BPE of the model's vocabulary, Muon + WSD.

    The corpus is yours: ``--set data.sources=FILES_OR_DIRS`` (built and cached on first use) or
    ``--set data.data_dir=DIR`` (built with
    ``python -m k3jax.data build ... --tokenizer bpe --vocab 16384``). Without either the run trains
    on the Python standard library, with a note saying so: it runs anywhere, but it is a small
    corpus of code, not English.
    """
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
        data=DataConfig(tokenizer="bpe", seq_len=2048, batch_size=32, heldout_fraction=0.01,
                        max_doc_bytes=65536),
        optim=OptimConfig(name="muon", lr=3e-3, schedule="wsd", warmup_steps=200,
                          decay_fraction=0.2, weight_decay=0.1, clip_norm=1.0),
        # The whole 32 x 2048 batch at once (57 GiB peak on an H200): the step is 4% faster than in
        # 2 micro-batches (29 GiB), which were 5% faster than 4 (17 GiB; docs/benchmarks.md).
        train=TrainConfig(steps=3000, log_every=10, micro_batches=1),
        checkpoint=CheckpointConfig(every=500, keep=3),
        eval=EvalConfig(every=250, batches=16, tasks=("mqar",)),
    )
