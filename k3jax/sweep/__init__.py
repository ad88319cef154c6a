"""Scaling sweeps: a spec file -> a plan of ordinary runs -> a resumable runner -> fits and plots.

``spec`` (the typed sweep), ``ladder`` (model sizes from one knob), ``plan`` (the points),
``runner`` (run directories and executors), ``fits`` (scaling-law fits with bootstrap intervals),
``report`` (tables, plots, summary). ``python -m k3jax.sweep`` is the command line.
"""

from k3jax.sweep.spec import (
                              Budget,
                              Executor,
                              Ladder,
                              Sweep,
                              SweepError,
                              Variant,
                              WidthRule,
                              load_sweep,
)

__all__ = ["Budget", "Executor", "Ladder", "Sweep", "SweepError", "Variant", "WidthRule",
           "load_sweep"]
