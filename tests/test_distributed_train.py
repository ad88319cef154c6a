"""``train.py`` itself as two ``jax.distributed`` processes on localhost (CPU collectives).

Two processes with four CPU devices each form one (fsdp 2, expert 4) mesh and train a one-layer
MoE model (Quantile Balancing on) with the all-to-all dispatch: the fsdp axis is split across the
processes, the expert axis within each. Each process loads only its rows of every batch, holds and
checkpoints only its own shards of the parameters and optimiser moments, and only process 0 writes
metrics. The losses must equal a one-device run of the same config with the ragged dispatch, and a
second launch must resume from the processes' shared checkpoint. (A constant learning rate: the
schedule does not depend on the number of steps, so the longer second launch runs the first one's
compiled step, from the compilation cache.) Run as a script, this file is a process of the job:
``train.py``'s ``main`` with the given arguments, then one JSON line with the devices it saw and
the batch rows and fsdp-sharded parameters it held.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers import free_port, wait_all
from suite_env import subprocess_env
from test_parallel import LOSS_RTOL, tiny_moe_config

ROOT = Path(__file__).resolve().parents[1]
PROCESSES, DEVICES_PER_PROCESS = 2, 4
BATCH, SEQ = 8, 32
TIMEOUT_S = 600  # a hang guard only; a loaded 2-core machine needs minutes
PRESET = """
from k3jax.config import *
from k3jax.config.experiment import *

def get_config():
    return ExperimentConfig(
        model={model!r},
        data=DataConfig(task="mqar", seq_len={seq}, batch_size={batch}),
        optim=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
        train=TrainConfig(steps=4, log_every=1, micro_batches=1),
        checkpoint=CheckpointConfig(every=2, keep=3),
        eval=EvalConfig(every=1000, batches=1))
"""


def _launch(preset: Path, workdir: Path, steps: int, devices: int, *sets: str, **env):
    env = subprocess_env(devices, PYTHONPATH=str(ROOT), **env)
    args = ["--config", str(preset), "--workdir", str(workdir), "--set", f"train.steps={steps}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen([sys.executable, __file__, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _two_processes(preset: Path, workdir: Path, steps: int) -> list[str]:
    port = free_port()
    procs = [_launch(preset, workdir, steps, DEVICES_PER_PROCESS, "mesh.fsdp=2", "mesh.expert=4",
                     JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                     JAX_NUM_PROCESSES=str(PROCESSES), JAX_PROCESS_ID=str(i))
             for i in range(PROCESSES)]
    return wait_all(procs, TIMEOUT_S)


def _report(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_two_process_training_matches_one_device_and_resumes(tmp_path):
    preset = tmp_path / "preset.py"
    preset.write_text(PRESET.format(model=tiny_moe_config("all_to_all", vocab_size=256),
                                    seq=SEQ, batch=BATCH))

    single = _launch(preset, tmp_path / "one", 4, 1, "mesh.data=1", "model.moe.dispatch=ragged")
    outs = _two_processes(preset, tmp_path / "two", 4)
    wait_all([single], TIMEOUT_S)

    for out in outs:
        report = _report(out)
        assert report["devices"] == PROCESSES * DEVICES_PER_PROCESS
        assert report["local_rows"] == BATCH // PROCESSES                 # each loads its half
        assert report["partly_held"] > 0                    # parameters split across processes
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]                                    # one writer of metrics
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                               rtol=LOSS_RTOL)
    assert (tmp_path / "two" / "checkpoints" / "4").is_dir()

    outs = _two_processes(preset, tmp_path / "two", 6)  # the same command, more steps: resumes
    assert any("resumed from" in out for out in outs), outs[0][-2000:]
    assert sorted(_losses(tmp_path / "two")) == [1, 2, 3, 4, 5, 6]


def _held_in_part(sharding, shape) -> bool:
    """Whether this process holds only some of the array's distinct shards."""
    distinct = lambda m: {str(i) for i in m.values()}  # noqa: E731
    return (distinct(sharding.addressable_devices_indices_map(shape))
            < distinct(sharding.devices_indices_map(shape)))


def _process(argv: list[str]) -> int:
    """``train.py``'s ``main``, then ``{"devices", "local_rows", "partly_held"}`` of the mesh it
    trained on (the last: how many parameter arrays this process holds only part of)."""
    sys.path.insert(0, str(ROOT))
    import train

    rc = train.main(argv)
    if rc == 0:
        import jax

        import k3jax.parallel as kp
        from k3jax.config.experiment import apply_overrides, load_config
        from k3jax.model import abstract_variables

        args = train.parse_args(argv)
        cfg = apply_overrides(load_config(args.config), args.overrides)
        mesh = kp.make_mesh(cfg.mesh)
        rows = kp.local_batch_rows(kp.batch_sharding(mesh, cfg.mesh.rules), (BATCH, SEQ))
        shardings = kp.variable_shardings(cfg.model, mesh, cfg.mesh.rules)["params"]
        shapes = abstract_variables(cfg.model)["params"]
        split = sum(_held_in_part(sh, x.shape) for sh, x in
                    zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)))
        print(json.dumps({"devices": jax.device_count(), "local_rows": rows.stop - rows.start,
                          "partly_held": split}))
    return rc


if __name__ == "__main__":
    sys.exit(_process(sys.argv[1:]))
