"""Which ``jax.distributed`` arguments a process takes from its arguments and its environment.

The multi-process run itself (two processes training through ``train.py``) is
``test_distributed_train.py``.
"""

from __future__ import annotations

import pytest

from k3jax.config import ConfigError
from k3jax.parallel.distributed import distributed_args


def test_distributed_args_precedence():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed_args(env={}) is None                            # one process
    assert distributed_args(env=env) == {"coordinator_address": "h:1", "num_processes": 4,
                                         "process_id": 3}
    assert distributed_args("x:2", 2, 0, env=env) == {"coordinator_address": "x:2",
                                                      "num_processes": 2, "process_id": 0}
    assert distributed_args(env={"SLURM_NTASKS": "8"}) == {}           # jax detects SLURM itself
    assert distributed_args(env={"SLURM_NTASKS": "1"}) is None
    with pytest.raises(ConfigError, match="num_processes"):
        distributed_args(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ConfigError, match="process_id=2 must be in"):
        distributed_args("h:1", 2, 2, env={})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two'"):
        distributed_args(env={**env, "JAX_NUM_PROCESSES": "two"})
