"""The Pallas kernels of ``pallas_kernels`` as the ops call them."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def launcher(module: str, name: str, static_argnames: tuple[str, ...]):
    """``pallas_kernels.<module>.<name>`` (a kernel launcher with an ``interpret`` keyword),
    imported on first use, so GPU-only modules stay out of CPU imports, and jitted once with
    ``static_argnames`` static, so every layer's call with the same shapes shares one lowering
    (:func:`pallas_kernels._mgpu.shared_lowering`)."""
    from pallas_kernels._mgpu import shared_lowering
    kernels = importlib.import_module(f"pallas_kernels.{module}")
    return shared_lowering(getattr(kernels, name), static_argnames)


__all__ = ["launcher"]
