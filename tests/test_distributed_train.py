"""``train.py`` itself as two ``jax.distributed`` processes on localhost (CPU collectives).

Each process owns two CPU devices of one ``data=4`` mesh, loads only its rows of every batch, writes
and reads only its own shards of every checkpoint, and only process 0 writes metrics. The losses
must equal a one-process run of the same config, and a second launch must resume from the
processes' shared checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from helpers import free_port, wait_all
from test_train import PRESET

ROOT = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-5  # fp32, same math; only the order of the data-parallel reduction differs
TIMEOUT_S = 300
COMMON = ["--set", "data.task=mqar", "--set", "train.log_every=1", "--set", "eval.every=1000",
          "--set", "eval.tasks=", "--set", "checkpoint.every=2", "--set", "train.micro_batches=1"]


def _env(devices: int, **extra) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **extra}


def _train(preset: Path, workdir: Path, steps: int, mesh_data: int, env: dict):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(preset), "--workdir",
           str(workdir), "--set", f"train.steps={steps}", "--set", f"mesh.data={mesh_data}",
           *COMMON]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _two_processes(preset, workdir, steps):
    port = free_port()
    procs = [_train(preset, workdir, steps, 4, _env(2, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                                                    JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    return wait_all(procs, TIMEOUT_S)


def _losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_two_process_training_matches_one_process_and_resumes(tmp_path):
    preset = tmp_path / "preset.py"
    preset.write_text(PRESET.format(source=str(tmp_path)))  # the corpus source is unused (mqar)

    single = _train(preset, tmp_path / "one", 4, 1, _env(1))
    _two_processes(preset, tmp_path / "two", 4)
    wait_all([single], TIMEOUT_S)

    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                               rtol=LOSS_RTOL)
    assert (tmp_path / "two" / "checkpoints" / "4").is_dir()

    outs = _two_processes(preset, tmp_path / "two", 6)  # the same command, more steps: resumes
    assert any("resumed from" in out for out in outs), outs[0][-2000:]
    assert sorted(_losses(tmp_path / "two")) == [1, 2, 3, 4, 5, 6]
