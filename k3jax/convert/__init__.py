"""Hugging Face checkpoints in and out: Kimi Linear and Kimi K3 safetensors <-> k3jax.

``python -m k3jax.convert from-hf HF_DIR --out WORKDIR`` and ``to-hf WORKDIR --out HF_DIR``; the
library functions are :func:`import_hf`, :func:`load_variables`, :func:`export_hf` and the config
mapping :func:`config_from_hf` / :func:`config_to_hf`.
"""

from k3jax.convert.errors import ConversionError
from k3jax.convert.exporter import export_hf, export_variables
from k3jax.convert.hf_config import config_from_hf, config_to_hf
from k3jax.convert.importer import import_hf, load_variables, read_config

__all__ = ["ConversionError", "config_from_hf", "config_to_hf", "export_hf", "export_variables",
           "import_hf", "load_variables", "read_config"]
