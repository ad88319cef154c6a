"""``train.py`` itself as two ``jax.distributed`` processes on localhost (CPU collectives).

Two processes with four CPU devices each form one (fsdp 2, expert 4) mesh and train a one-layer
MoE model (Quantile Balancing on) with the all-to-all dispatch: the fsdp axis is split across the
processes, the expert axis within each. Each process loads only its rows of every batch, holds and
checkpoints only its own shards of the parameters and optimiser moments, and only process 0 writes
metrics. The losses must equal a one-device run of the same config with the ragged dispatch, and a
second launch must resume from the processes' shared checkpoint. (The schedule's numbers are step
data, so the longer second launch runs the first one's compiled step, from the compilation
cache.) Run as a script, this file is a process of the job:
``train.py``'s ``main`` with the given arguments, then one JSON line with the devices it saw and
the batch rows it held.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
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
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]                                    # one writer of metrics
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                               rtol=LOSS_RTOL)
    split = _split_over_fsdp(tmp_path / "two" / "checkpoints" / "4" / "state")
    assert split["params"] and split["opt_state"], split  # each process saved only its part

    outs = _two_processes(preset, tmp_path / "two", 6)  # the same command, more steps: resumes
    assert any("resumed from" in out for out in outs), outs[0][-2000:]
    assert sorted(_losses(tmp_path / "two")) == [1, 2, 3, 4, 5, 6]


def _split_over_fsdp(state_dir: Path) -> dict[str, int]:
    """Per top-level entry of a saved state, how many arrays were saved split over ``fsdp``, as
    the checkpoint records their shardings; the mesh lays that axis across the two processes."""
    tree = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree
    split: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        sharding = leaf.sharding  # the mesh (data, fsdp, expert, tensor) it was saved from
        assert list(sharding.shape) == [1, PROCESSES, 4, 1], sharding
        named = {a for axes in sharding.partition_spec if axes for a in
                 ((axes,) if isinstance(axes, str) else axes)}
        split[path[0].key] = split.get(path[0].key, 0) + ("fsdp" in named)
    return split


def _process(argv: list[str]) -> int:
    """``train.py``'s ``main``, then ``{"devices", "local_rows"}`` of the mesh it trained on."""
    sys.path.insert(0, str(ROOT))
    import train

    rc = train.main(argv)
    if rc == 0:
        import jax

        import k3jax.parallel as kp
        from k3jax.config.experiment import apply_overrides, load_config

        args = train.parse_args(argv)
        mesh_cfg = apply_overrides(load_config(args.config), args.overrides).mesh
        sharding = kp.batch_sharding(kp.make_mesh(mesh_cfg), mesh_cfg.rules)
        rows = kp.local_batch_rows(sharding, (BATCH, SEQ))
        print(json.dumps({"devices": jax.device_count(), "local_rows": rows.stop - rows.start}))
    return rc


if __name__ == "__main__":
    sys.exit(_process(sys.argv[1:]))
