"""Validation helpers shared by every config dataclass.

Configs are frozen dataclasses that validate themselves in ``__post_init__``; a bad value raises
:class:`ConfigError` naming the field, the value and what is allowed, before anything is traced.
A field with a fixed set of values is annotated with a ``Literal`` type, the one place those values
are written: :func:`check_literals` validates against it, and code that needs the list reads it
with ``typing.get_args``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
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


def non_negative(owner: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(owner, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(owner, f, v, "expected an integer >= 0")


def one_of(owner: Any, field: str, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    v = getattr(owner, field)
    if v not in choices:
        fail(owner, field, v, f"expected one of {', '.join(map(repr, choices))}")


@functools.cache
def _literal_fields(cls: type) -> dict[str, tuple]:
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is typing.Literal}


def check_literals(owner: Any) -> None:
    """Every field of the dataclass ``owner`` annotated ``Literal[...]`` holds one of its values."""
    for name, choices in _literal_fields(type(owner)).items():
        one_of(owner, name, choices)


def power_of_two(owner: Any, field: str) -> None:
    v = getattr(owner, field)
    if not isinstance(v, int) or v <= 0 or v & (v - 1):
        fail(owner, field, v, "expected a power of two")


def to_dict(cfg: Any) -> dict:
    """A JSON-ready nested dict of a config (for checkpoints and logs)."""
    return dataclasses.asdict(cfg)
