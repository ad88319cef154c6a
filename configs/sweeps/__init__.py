"""Sweep files: one Python file per scaling study, each with ``get_sweep()``."""
