"""Presets: one Python file per configuration, each with ``model_config()`` and ``get_config()``."""
