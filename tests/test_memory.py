"""Per-device training-state memory over a mesh (k3jax/train/memory.py), sized on abstract meshes:
the count at one device equals the parameters' and optimiser moments' own bytes, FSDP divides
what it shards, and a mesh that cannot hold the state is refused with the smallest that can."""

from __future__ import annotations

import json
import math

import jax
import pytest

from k3jax.config.base import ConfigError
from k3jax.config.experiment import load_config
from k3jax.train.memory import abstract_state, check_state_fits, state_bytes_per_device


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("k3_tiny")
    return cfg, abstract_state(cfg)


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_one_device_holds_everything(tiny):
    cfg, abstract = tiny
    params, _, opt_state = abstract
    one = state_bytes_per_device(cfg, {}, abstract)
    assert one.params == one.grads == _bytes(params)
    assert one.optimizer == _bytes(opt_state)


def test_fsdp_divides_the_sharded_weights(tiny):
    cfg, abstract = tiny
    one = state_bytes_per_device(cfg, {"fsdp": 1}, abstract)
    two = state_bytes_per_device(cfg, {"fsdp": 2}, abstract)
    # every weight with an "embed" axis is halved; norms, gates and biases stay whole
    assert one.params / 2 < two.params < one.params
    assert one.optimizer / 2 < two.optimizer < one.optimizer
    assert state_bytes_per_device(cfg, {"fsdp": 3}, abstract) is None  # 128 is not divisible by 3


def test_a_mesh_too_small_is_refused_with_the_smallest_that_fits(tiny):
    cfg, abstract = tiny
    need = state_bytes_per_device(cfg, {}, abstract).total
    check_state_fits(cfg, {"fsdp": 1}, device_bytes=need / 0.5, abstract=abstract)
    check_state_fits(cfg, {"fsdp": 1}, device_bytes=None, abstract=abstract)
    refused = (r"fsdp=1.*iB \(parameters .*\) per device.*"
               r"smallest mesh that fits: mesh.fsdp=\d+, mesh.expert=\d+")
    with pytest.raises(ConfigError, match=refused):
        check_state_fits(cfg, {"fsdp": 1}, device_bytes=need * 0.9, abstract=abstract)
    with pytest.raises(ConfigError, match="no fsdp x expert mesh"):
        check_state_fits(cfg, {"fsdp": 1}, device_bytes=1.0, abstract=abstract)


def test_unknown_axes_are_named():
    cfg = load_config("k3_tiny")
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        state_bytes_per_device(cfg, {"pipeline": 2})


def test_cli_sizes_the_state_on_a_mesh_and_names_what_is_wrong(capsys):
    """``python -m k3jax.train.memory``: the count of :func:`state_bytes_per_device` on the mesh
    asked for; a device too small is refused as train.py refuses it, and a bad mesh is named."""
    from k3jax.train.memory import main

    assert main(["--config", "k3_tiny", "--mesh", "fsdp=2,expert=2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    need = state_bytes_per_device(load_config("k3_tiny"), {"fsdp": 2, "expert": 2})
    assert (row["params"], row["grads"], row["optimizer"], row["total"]) == (
        need.params, need.grads, need.optimizer, need.total)
    assert main(["--config", "k3_tiny", "--mesh", "expert=2"]) == 0
    assert "k3_tiny (expert=2): training state" in capsys.readouterr().out
    for args, expected in [(["--mesh", "fsdp=3"], "does not divide"),
                           (["--mesh", "pipeline=2"], "--mesh: 'pipeline=2' is not a mesh"),
                           (["--mesh", "data=1", "--device-gib", f"{need.total / 2**30:.9f}"],
                            "smallest mesh that fits")]:
        assert main(["--config", "k3_tiny", *args]) == 2
        assert expected in capsys.readouterr().err, args
