"""Validation helpers shared by every config dataclass.

Configs are frozen dataclasses that validate themselves in ``__post_init__``; a bad value raises
:class:`ConfigError` naming the field, the value and what is allowed, before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable


class ConfigError(ValueError):
    """An invalid configuration value (names the field, the value and what is allowed)."""


def fail(owner: Any, field: str, value: Any, allowed: str) -> None:
    name = type(owner).__name__ if not isinstance(owner, str) else owner
    raise ConfigError(f"{name}.{field}={value!r} is invalid: {allowed}")


def require(cond: bool, owner: Any, field: str, allowed: str) -> None:
    if not cond:
        fail(owner, field, getattr(owner, field, "?"), allowed)


def positive(owner: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(owner, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            fail(owner, f, v, "expected a positive integer")


def one_of(owner: Any, field: str, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    v = getattr(owner, field)
    if v not in choices:
        fail(owner, field, v, f"expected one of {', '.join(map(repr, choices))}")


def power_of_two(owner: Any, field: str) -> None:
    v = getattr(owner, field)
    if not isinstance(v, int) or v <= 0 or v & (v - 1):
        fail(owner, field, v, "expected a power of two")


def divides(owner: Any, field: str, value: int, by: int, what: str) -> None:
    if by <= 0 or value % by:
        fail(owner, field, getattr(owner, field), f"{what} ({value}) must be divisible by {by}")


def to_dict(cfg: Any) -> dict:
    """A JSON-ready nested dict of a config (for checkpoints and logs)."""
    return dataclasses.asdict(cfg)
