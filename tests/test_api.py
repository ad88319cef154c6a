"""The public API of ``k3jax``: every exported name resolves to the object its module defines, and
``import k3jax`` alone loads neither JAX, the Pallas kernels nor matplotlib."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import k3jax

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", k3jax.__all__)
def test_exported_name_is_its_modules_object(name):
    module, attr = k3jax._EXPORTS[name]
    assert getattr(k3jax, name) is getattr(importlib.import_module(module), attr)
    assert name in dir(k3jax)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        k3jax.no_such_name  # noqa: B018


def test_import_k3jax_loads_nothing_heavy():
    code = ("import sys, k3jax; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'pallas_kernels', 'matplotlib')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
