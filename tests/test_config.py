"""Invalid configs fail on construction with the field, the value and what is allowed."""

import pytest

from k3jax.config import (ConfigError, FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                          ResidualConfig)


@pytest.mark.parametrize("build,pattern", [
    (lambda: KDAConfig(chunk_size=48), r"KDAConfig.chunk_size=48 .*power of two"),
    (lambda: KDAConfig(gate="tanh"), r"KDAConfig.gate='tanh' .*'softplus', 'lower_bound'"),
    (lambda: KDAConfig(num_heads=0), r"KDAConfig.num_heads=0 .*positive"),
    (lambda: KDAConfig(impl="cuda"), r"KDAConfig.impl='cuda'"),
    (lambda: FFNConfig(activation="gelu"), r"FFNConfig.activation='gelu' .*'swiglu', 'situ_glu'"),
    (lambda: MLAConfig(rope=True, qk_rope_head_dim=7), r"MLAConfig.qk_rope_head_dim=7 .*even"),
    (lambda: ModelConfig(num_layers=4, mla_layers=(1, 4)), r"ModelConfig.mla_layers=.*\[4\]"),
    (lambda: ModelConfig(first_k_dense=9), r"ModelConfig.first_k_dense=9"),
    (lambda: ModelConfig(dtype="int8"), r"ModelConfig.dtype='int8'"),
    (lambda: ResidualConfig(kind="attnres"), r"block_size_sublayers=None .*block size"),
    (lambda: ResidualConfig(kind="attnres", block_size_sublayers=4, block_size_layers=3),
     r"conflicts with block_size_layers=3"),
    (lambda: MoEConfig(num_experts=4, top_k=8), r"MoEConfig.top_k=8 .*num_experts=4"),
    (lambda: ModelConfig(d_model=64, moe=MoEConfig(latent_dim=128)),
     r"ModelConfig.moe.latent_dim=128 .*d_model=64"),
])
def test_invalid_values_name_the_field(build, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build()


def test_schedule_and_block_size_units():
    # Widths are heads x head_dim by construction; what is derived is the schedule (every r-th
    # layer MLA plus the last) and the AttnRes block size, given in either unit.
    assert ResidualConfig(kind="attnres", block_size_layers=12).block_sublayers == 24
    assert ModelConfig(num_layers=8, mla_every=4).layer_types.count("mla") == 2
    assert ModelConfig(num_layers=7, mla_every=4).layer_types[-1] == "mla"


def test_configs_are_frozen():
    with pytest.raises(Exception):
        KDAConfig().num_heads = 3
