"""k3jax: the Kimi K3 architecture in pure-functional JAX/Flax.

The public API, by what it is for::

    import jax
    import jax.numpy as jnp
    import k3jax

    cfg = k3jax.load_config("configs/k3_tiny.py")             # ExperimentConfig of a preset
    variables = k3jax.init_variables(cfg.model, jax.random.key(0))
    tokens = jnp.zeros((1, 16), jnp.int32)
    logits = k3jax.K3Model(cfg.model).apply(variables, tokens)   # [1, 16, vocab] bf16

- model: :class:`K3Model`, :func:`init_variables`, :func:`abstract_variables`
- ops: :func:`kda`, :func:`kda_decode`, :func:`kda_reference` (the token-by-token oracle);
  AttnRes :func:`depth_mix`, :func:`attnres_two_phase`, :func:`attnres_reference`; routing
  :func:`route`, :func:`router_scores`; balancing :func:`update_balance`, :func:`max_vio`
- configs: :class:`ModelConfig`, :class:`KDAConfig`, :class:`MLAConfig`, :class:`FFNConfig`,
  :class:`MoEConfig`, :class:`ResidualConfig`, :class:`ExperimentConfig`, :func:`load_config`,
  :func:`apply_overrides`, :class:`ConfigError`
- training: :func:`run_training` (the loop ``train.py`` runs)
- generation: :func:`init_cache`, :func:`prefill`, :func:`decode`, :func:`generate_tokens`,
  :class:`SamplingConfig`, :class:`PrefixCache`
- Hugging Face checkpoints: :func:`import_hf`, :func:`export_hf`, :func:`config_from_hf`,
  :func:`config_to_hf`
- scaling sweeps: :func:`load_sweep`, :func:`plan_sweep`, :func:`run_sweep`, :func:`write_report`
- accounting: :func:`count_params`, :func:`forward_flops_per_token`,
  :func:`train_flops_per_token`, :func:`kv_cache_bytes_per_token`, :func:`kda_state_bytes`

Each name is imported from its module on first use (no name is also a subpackage's, which
importing that subpackage would shadow), so ``import k3jax`` loads neither JAX nor the
Pallas kernels; ``from k3jax.ops.kda import kda`` and the like keep working.
"""

from __future__ import annotations

import importlib

# public name -> (module, attribute in that module)
_EXPORTS = {
    "K3Model": ("k3jax.model", "K3Model"),
    "init_variables": ("k3jax.model", "init_variables"),
    "abstract_variables": ("k3jax.model", "abstract_variables"),
    "kda": ("k3jax.ops.kda", "kda"),
    "kda_decode": ("k3jax.ops.kda", "kda_decode"),
    "kda_reference": ("k3jax.ops.kda_reference", "kda_reference"),
    "depth_mix": ("k3jax.ops.attnres", "depth_mix"),
    "attnres_two_phase": ("k3jax.ops.attnres", "attnres_two_phase"),
    "attnres_reference": ("k3jax.ops.attnres", "attnres_reference"),
    "router_scores": ("k3jax.ops.routing", "router_scores"),
    "route": ("k3jax.ops.routing", "route"),
    "update_balance": ("k3jax.ops.balancing", "update_balance"),
    "max_vio": ("k3jax.ops.balancing", "max_vio"),
    "ModelConfig": ("k3jax.config", "ModelConfig"),
    "KDAConfig": ("k3jax.config", "KDAConfig"),
    "MLAConfig": ("k3jax.config", "MLAConfig"),
    "FFNConfig": ("k3jax.config", "FFNConfig"),
    "MoEConfig": ("k3jax.config", "MoEConfig"),
    "ResidualConfig": ("k3jax.config", "ResidualConfig"),
    "ConfigError": ("k3jax.config", "ConfigError"),
    "ExperimentConfig": ("k3jax.config.experiment", "ExperimentConfig"),
    "load_config": ("k3jax.config.experiment", "load_config"),
    "apply_overrides": ("k3jax.config.experiment", "apply_overrides"),
    "run_training": ("k3jax.train.loop", "run"),
    "init_cache": ("k3jax.generate.cache", "init_cache"),
    "prefill": ("k3jax.generate.steps", "prefill"),
    "decode": ("k3jax.generate.steps", "decode"),
    "generate_tokens": ("k3jax.generate.loop", "generate"),
    "SamplingConfig": ("k3jax.generate.sampling", "SamplingConfig"),
    "PrefixCache": ("k3jax.generate.prefix_cache", "PrefixCache"),
    "import_hf": ("k3jax.convert.importer", "import_hf"),
    "export_hf": ("k3jax.convert.exporter", "export_hf"),
    "config_from_hf": ("k3jax.convert.hf_config", "config_from_hf"),
    "config_to_hf": ("k3jax.convert.hf_config", "config_to_hf"),
    "load_sweep": ("k3jax.sweep.spec", "load_sweep"),
    "plan_sweep": ("k3jax.sweep.plan", "plan_sweep"),
    "run_sweep": ("k3jax.sweep.runner", "run_sweep"),
    "write_report": ("k3jax.sweep.report", "write_report"),
    "count_params": ("k3jax.accounting", "count_params"),
    "forward_flops_per_token": ("k3jax.accounting", "forward_flops_per_token"),
    "train_flops_per_token": ("k3jax.accounting", "train_flops_per_token"),
    "kv_cache_bytes_per_token": ("k3jax.accounting", "kv_cache_bytes_per_token"),
    "kda_state_bytes": ("k3jax.accounting", "kda_state_bytes"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
