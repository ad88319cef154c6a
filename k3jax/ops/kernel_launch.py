"""The Pallas kernels of ``pallas_kernels`` as the ops call them: whether an op takes them, and
their launchers."""

from __future__ import annotations

import functools
import importlib

from k3jax.devices import hopper_gpus


def takes_kernels(impl: str, module: str, *args, **kwargs) -> bool:
    """Whether an op's ``impl`` runs the kernels of ``pallas_kernels.<module>`` on ``args`` and
    ``kwargs`` (arrays or shape structs, as the module's ``check_args`` and ``supports`` take
    them): ``"pallas"`` always, once ``check_args`` passed (its ValueError names what the kernels
    cannot take, before anything compiles); ``"auto"`` where ``supports`` (a Hopper GPU, shapes
    the kernels take); any other ``impl`` never. The module is imported only then, so GPU-only
    modules stay out of CPU imports."""
    if impl == "pallas":
        importlib.import_module(f"pallas_kernels.{module}").check_args(*args, **kwargs)
        return True
    return (impl == "auto" and hopper_gpus()
            and importlib.import_module(f"pallas_kernels.{module}").supports(*args, **kwargs))


@functools.cache
def launcher(module: str, name: str, static_argnames: tuple[str, ...]):
    """``pallas_kernels.<module>.<name>`` (a kernel launcher with an ``interpret`` keyword),
    imported on first use, so GPU-only modules stay out of CPU imports, and jitted once with
    ``static_argnames`` static, so every layer's call with the same shapes shares one lowering
    (:func:`pallas_kernels._mgpu.shared_lowering`)."""
    from pallas_kernels._mgpu import shared_lowering
    kernels = importlib.import_module(f"pallas_kernels.{module}")
    return shared_lowering(getattr(kernels, name), static_argnames)


__all__ = ["launcher", "takes_kernels"]
