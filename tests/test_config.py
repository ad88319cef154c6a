"""Invalid configs fail on construction with the field, the value and what is allowed."""

import dataclasses
import typing

import pytest

from k3jax.config import (
    ConfigError,
    FFNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    ResidualConfig,
)
from k3jax.config.experiment import DataConfig, OptimConfig


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
    (lambda: ModelConfig(dtype="float16"), r"ModelConfig.dtype='float16'"),
    (lambda: MLAConfig(rope=True, rope_theta=0.0), r"MLAConfig.rope_theta=0.0 .*finite"),
    (lambda: ResidualConfig(kind="attnres"), r"block_size_sublayers=None .*block size"),
    (lambda: ResidualConfig(kind="attnres", block_size_sublayers=4, block_size_layers=3),
     r"conflicts with block_size_layers=3"),
    (lambda: MoEConfig(num_experts=4, top_k=8), r"MoEConfig.top_k=8 .*num_experts=4"),
    (lambda: MoEConfig(capacity_factor=float("inf")),
     r"MoEConfig.capacity_factor=inf.*finite number > 0"),
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


def test_an_moe_set_after_construction_takes_its_layers():
    """A dense model (no ``moe``) keeps ``first_k_dense`` as given, so an MoE added later by
    ``replace`` or ``--set`` starts where it says; without one every layer is dense."""
    from k3jax.config.experiment import ExperimentConfig, apply_overrides

    dense = ModelConfig(num_layers=4, first_k_dense=1)
    assert dense.mlp_types == ("dense",) * 4
    assert dense.replace(moe=MoEConfig()).mlp_types == ("dense", "moe", "moe", "moe")
    assert dense.replace(num_layers=2).mlp_types == ("dense",) * 2
    cfg = apply_overrides(ExperimentConfig(), ["model.moe.num_experts=8"]).model
    assert cfg.mlp_types == ("dense", "moe", "moe", "moe")


def test_mla_layers_given_as_a_list_keep_the_config_hashable():
    assert hash(ModelConfig(num_layers=4, mla_layers=[1, 3])) == hash(
        ModelConfig(num_layers=4, mla_layers=(1, 3)))


def test_configs_are_frozen():
    with pytest.raises(Exception):
        KDAConfig().num_heads = 3


@pytest.mark.parametrize("cls", [KDAConfig, FFNConfig, ResidualConfig, ModelConfig, MoEConfig,
                                 DataConfig, OptimConfig])
def test_every_literal_field_is_validated_against_its_literal(cls):
    """A field annotated ``Literal[...]`` (the one list of its values) rejects anything else."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)
              if typing.get_origin(hints[f.name]) is typing.Literal]
    assert fields
    for name in fields:
        allowed = ", ".join(map(repr, typing.get_args(hints[name])))
        with pytest.raises(ConfigError, match=f"{cls.__name__}.{name}='bogus' .*{allowed}"):
            cls(**{name: "bogus"})
