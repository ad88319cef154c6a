"""The error every conversion step raises for a file that does not fit the model (the command line
prints it as one line)."""

from __future__ import annotations


class ConversionError(ValueError):
    """Tensors that do not fit the model: names them, with the expected and found shapes, dtypes
    or values."""


__all__ = ["ConversionError"]
