"""Typed, frozen, self-validating configuration."""

from k3jax.config.base import ConfigError, to_dict
from k3jax.config.model import FFNConfig, KDAConfig, MLAConfig, ModelConfig, ResidualConfig
from k3jax.config.moe import MoEConfig

__all__ = ["ConfigError", "FFNConfig", "KDAConfig", "MLAConfig", "MoEConfig", "ModelConfig",
           "ResidualConfig", "to_dict"]
