"""Multi-process training with ``jax.distributed`` on localhost (CPU collectives).

Two processes with four CPU devices each form one (data 2, expert 4) mesh; each loads only its own
rows of every batch. A few training steps with the all-to-all dispatch give the single-device
losses (ragged dispatch, computed here while the workers run). Run as a script, this file is the
worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3jax.config import ConfigError
from helpers import free_port, wait_all
from k3jax.parallel.distributed import distributed_args

ROOT = Path(__file__).resolve().parents[1]
PROCESSES, DEVICES_PER_PROCESS = 2, 4
WORKER_TIMEOUT_S = 240


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


def test_two_processes_train_to_single_device_losses(tmp_path):
    from test_parallel import LOSS_RTOL, train_losses

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(pid), str(port), str(tmp_path)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for pid in range(PROCESSES)]
    reference = []
    wait_all(procs, WORKER_TIMEOUT_S,  # meanwhile, the same steps on one device
             while_waiting=lambda: reference.extend(train_losses("ragged")[0]))
    for pid in range(PROCESSES):
        result = json.loads((tmp_path / f"worker{pid}.json").read_text())
        assert result["devices"] == PROCESSES * DEVICES_PER_PROCESS
        assert result["local_rows"] == result["batch"] // PROCESSES    # each loads its half
        np.testing.assert_allclose(result["losses"], reference, rtol=LOSS_RTOL)


def _worker(pid: int, port: int, out_dir: str) -> None:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import k3jax.parallel as kp
    from k3jax.config.mesh import MeshConfig
    from test_parallel import BATCH, SEQ, train_losses

    kp.initialize_distributed(f"localhost:{port}", PROCESSES, pid)
    cfg = MeshConfig(data=2, expert=4)
    mesh = kp.make_mesh(cfg)
    sharding = kp.batch_sharding(mesh, cfg.rules)
    rows = kp.local_batch_rows(sharding, (BATCH, SEQ))

    def place(batch):
        return kp.make_global_batch({k: v[rows] for k, v in batch.items()}, sharding, BATCH)

    losses, _ = train_losses("all_to_all", mesh, cfg.rules, place)
    result = {"losses": losses, "devices": jax.device_count(), "batch": BATCH,
              "local_rows": rows.stop - rows.start}
    Path(out_dir, f"worker{pid}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
