"""Typed configuration of the device mesh and the logical-axis rules table (math §8).

The mesh has four named axes, outermost first: ``data`` (pure data parallelism: parameters
replicated), ``fsdp`` (data parallelism with parameters sharded, gathered for compute), ``expert``
(MoE experts split across devices; the tokens are split over it too) and ``tensor`` (matrix
dimensions split, tokens replicated). A size of ``-1`` means "all remaining devices".

The rules table maps the logical axis names that every parameter carries (``k3jax.layers.param``)
and those of the main activations (``batch``, ``length``) onto mesh axes, MaxText style: sharding
changes live here, never in the layers. For each logical name the first rule whose mesh axes are
still free in that array is used (flax's ``logical_to_mesh_axes`` semantics); a name without a rule
is replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from k3jax.config.base import ConfigError, fail

MESH_AXES = ("data", "fsdp", "expert", "tensor")

MeshAxes = Union[None, str, tuple[str, ...]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations: every axis that holds different tokens splits the batch
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("latent", None),
    ("rank", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),
)


def _as_axes(value) -> MeshAxes:
    """Normalise a rule's right-hand side (JSON gives lists) to None, a name or a tuple of names."""
    if value is None or isinstance(value, str):
        return value
    return tuple(value)


def rule_axes(rules: Sequence[tuple[str, MeshAxes]], logical: str) -> tuple[str, ...]:
    """The mesh axes of the first rule for ``logical`` as a tuple (``()`` when unmapped)."""
    for name, axes in rules:
        if name == logical:
            if axes is None:
                return ()
            return (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


@dataclass(frozen=True)
class MeshConfig:
    """Axis sizes of the device mesh and the logical -> mesh rules table.

    The default (``data=-1``) is plain data parallelism over every device. Expert parallelism:
    e.g. ``data=2, expert=4`` on 8 devices; the MoE's ``num_experts`` must then be divisible by 4.
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    rules: tuple[tuple[str, Optional[tuple[str, ...]]], ...] = DEFAULT_RULES

    def __post_init__(self):
        for name in MESH_AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or (v <= 0 and v != -1):
                fail(self, name, v, "expected a positive integer or -1 (all remaining devices)")
        if sum(getattr(self, n) == -1 for n in MESH_AXES) > 1:
            raise ConfigError(f"MeshConfig: at most one axis may be -1 (all remaining devices); "
                              f"got {self.sizes()}")
        try:
            rules = tuple((str(name), _as_axes(axes)) for name, axes in self.rules)
        except (TypeError, ValueError):
            fail(self, "rules", self.rules,
                 "expected a sequence of (logical name, mesh axes) pairs")
        object.__setattr__(self, "rules", rules)
        for name, axes in rules:
            unknown = [a for a in rule_axes(((name, axes),), name) if a not in MESH_AXES]
            if unknown:
                fail(self, "rules", (name, axes),
                     f"mesh axes {unknown} are not mesh axes; expected from {MESH_AXES}")
        batch, exp = rule_axes(rules, "batch"), rule_axes(rules, "exp")
        if not set(exp) <= set(batch):
            fail(self, "rules", rules,
                 f"the expert-parallel axes {exp} (rule 'exp') must also split the tokens "
                 f"(rule 'batch' = {batch}); the dispatch exchanges tokens over them")
        if "tensor" in batch:
            fail(self, "rules", rules, "the 'tensor' axis holds replicas of the same tokens; it "
                 "must not appear in the 'batch' rule")

    def sizes(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Concrete axis sizes for ``num_devices`` devices (``-1`` filled in); a clear error if the
        sizes asked for cannot tile them."""
        sizes = self.sizes()
        fixed = math.prod(v for v in sizes.values() if v != -1)
        asked = " x ".join(f"{n}={v}" for n, v in sizes.items())
        rest = [n for n, v in sizes.items() if v == -1]
        if rest:
            if num_devices % fixed:
                raise ConfigError(f"MeshConfig({asked}): the fixed axes need a multiple of {fixed} "
                                  f"devices; {num_devices} devices exist")
            sizes[rest[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(f"MeshConfig({asked}) asks for {fixed} devices; "
                              f"{num_devices} devices exist")
        return sizes


def parse_sizes(text: str, arg: str) -> dict[str, int]:
    """``"fsdp=4,expert=2"`` -> every mesh axis's size (those left out 1); for anything else a
    ``ValueError`` naming the command-line argument ``arg`` and the expected form."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{arg}: {text!r} is not a mesh; expected axis=size items joined "
                             f"by commas, axes among {MESH_AXES}, sizes >= 1 (e.g. "
                             f"fsdp=4,expert=2)")
        sizes[name] = int(value)
    return sizes


__all__ = ["DEFAULT_RULES", "MESH_AXES", "MeshConfig", "parse_sizes", "rule_axes"]
