"""Run a planned sweep: one ordinary run directory per point, resumable, on several executors.

Layout of a sweep directory::

    plan.json            the points (with their whole configs) and WSD groups; fixed at first run
    runs/NAME/           each point: the training loop's own run directory (config.json,
                         metrics.jsonl, checkpoints/, summary.json), plus failed.json if it failed
    stable/GROUP/        each WSD group's shared stable phase (a run directory too)
    logs/JOB.log         output of each job run in a separate process
    .jax_cache/          the persistent compilation cache every point shares

Running again skips finished points (``summary.json`` at the planned step count), resumes the others
from their newest checkpoint (the loop's own resume) and retries failed ones. A failure is recorded
in its point's ``failed.json`` and does not stop the other points.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3jax.config.experiment import ExperimentConfig, from_dict
from k3jax.files import write_atomically
from k3jax.sweep.plan import Plan
from k3jax.sweep.spec import Executor, SweepError

PLAN_FILE = "plan.json"
FAILED_FILE = "failed.json"
# [[start, end], ...] of each launch of a point, start-up included. A WSD branch's launch first
# trains the shared stable phase as far as the branch's step where no earlier point did: such a
# span reads [start, end, stable steps it trained].
TIMING_FILE = "timing.json"


# -- the sweep directory ------------------------------------------------------------------------

def plan_record(plan: Plan) -> dict:
    s = plan.sweep
    return {"sweep": s.name, "baseline": s.baseline_name, "knob": s.ladder.knob,
            "budget_kind": s.budget.kind, "reference_compute": s.reference_compute,
            "points": [{**p.row(), "config": p.config.to_dict()} for p in plan.points],
            "groups": [{"name": g.name, "config": g.config.to_dict(), "points": list(g.points)}
                       for g in plan.groups],
            "jobs": [[job, list(names)] for job, names in plan.jobs()]}


def write_plan(plan: Plan, root: Path) -> dict:
    """Write ``plan.json``; a directory holding another plan is an error (resuming needs the
    same points)."""
    record = json.loads(json.dumps(plan_record(plan)))
    path = root / PLAN_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        if old["points"] != record["points"] or old["groups"] != record["groups"]:
            changed = sorted({p["name"] for p in old["points"]} ^
                             {p["name"] for p in record["points"]})[:4]
            raise SweepError(f"{root} holds a different plan "
                             f"(points differ{': ' if changed else ''}"
                             f"{', '.join(changed)}); use another --dir or the same sweep file")
        return old
    root.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(record, indent=1))
    return record


def read_plan(root: Path) -> dict:
    path = Path(root) / PLAN_FILE
    if not path.is_file():
        raise SweepError(f"{root}: no {PLAN_FILE}; run `python -m k3jax.sweep run SPEC --dir "
                         f"{root}` first")
    return json.loads(path.read_text())


def run_dir(root: Path, name: str) -> Path:
    return Path(root) / "runs" / name


def point_status(root: Path, row: dict) -> str:
    """``done``, ``failed``, ``started`` (checkpoints exist) or ``pending``."""
    d = run_dir(root, row["name"])
    summary = d / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("steps") == row["steps"]:
        return "done"
    if (d / FAILED_FILE).is_file():
        return "failed"
    return "started" if _latest_step(d / "checkpoints") is not None else "pending"


def _latest_step(ckpt_dir: Path) -> int | None:
    steps = [int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit()] \
        if ckpt_dir.is_dir() else []
    return max(steps) if steps else None


def _record_failure(root: Path, name: str, error: str) -> None:
    d = run_dir(root, name)
    d.mkdir(parents=True, exist_ok=True)
    write_atomically(d / FAILED_FILE, json.dumps({"error": error, "time": time.time()}, indent=1))


# -- one job, in this process -------------------------------------------------------------------

def _config(d: dict) -> ExperimentConfig:
    return from_dict(ExperimentConfig, d)


def _train(cfg: ExperimentConfig, workdir: Path) -> None:
    from k3jax.train import run

    run(cfg, workdir)


def run_job(root: str | Path, job: str, started: float | None = None) -> dict[str, str]:
    """Run job ``job`` of the sweep at ``root`` in this process; returns each point's status.
    ``started``: when this process started (its start-up counts towards the first point)."""
    root = Path(root)
    t0 = started or time.time()
    record = read_plan(root)
    from k3jax.parallel.compile_cache import use_compilation_cache

    use_compilation_cache(Path(root).resolve() / ".jax_cache")
    rows = {p["name"]: p for p in record["points"]}
    names = {j: n for j, n in record["jobs"]}[job]
    group = next((g for g in record["groups"] if g["name"] == job), None)
    for name in names:
        row = rows[name]
        if point_status(root, row) == "done":
            continue
        (run_dir(root, name) / FAILED_FILE).unlink(missing_ok=True)
        stable_from = _stable_step(root, group)
        try:
            if group is not None:
                _seed_branch(root, group, row)
            _train(_config(row["config"]), run_dir(root, name))
        except Exception as e:  # noqa: BLE001 - recorded; the other points go on
            _record_failure(root, name, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            # Steps up to the stable phase's newest checkpoint: those past it (a launch cut
            # short) are trained again, so they are not this launch's work.
            _add_timing(run_dir(root, name), t0, time.time(),
                        max(0, _stable_step(root, group) - stable_from))
            t0 = time.time()
    return {n: point_status(root, rows[n]) for n in names}


def _seed_branch(root: Path, group: dict, row: dict) -> None:
    """Give a branch point the stable phase's checkpoint at its branch step (training the stable
    phase that far first); a branch that already has checkpoints resumes from its own."""
    ckpts = run_dir(root, row["name"]) / "checkpoints"
    if _latest_step(ckpts) is not None:
        return
    b = row["branch_step"]
    stable = _stable_dir(root, group["name"])
    src = stable / "checkpoints" / str(b)
    if not src.is_dir():
        reached = _latest_step(stable / "checkpoints")
        if reached is not None and reached > b:
            raise SweepError(f"the stable phase {stable} is past step {b} without a checkpoint "
                             f"there; delete {stable} to retrain it")
        cfg = _config(group["config"])
        _train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=b)), stable)
    tmp = ckpts.parent / f".copy-{b}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    ckpts.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, ckpts / str(b))  # whole or absent: a copy cut short is never restored


def _stable_dir(root: Path, group: str) -> Path:
    return Path(root) / "stable" / group


def _stable_step(root: Path, group: dict | None) -> int:
    """The step of the newest checkpoint of ``group``'s stable phase; 0 without one or a group."""
    if group is None:
        return 0
    return _latest_step(_stable_dir(root, group["name"]) / "checkpoints") or 0


def _add_timing(d: Path, start: float, end: float, stable_steps: int = 0) -> None:
    path = d / TIMING_FILE
    spans = json.loads(path.read_text()) if path.is_file() else []
    d.mkdir(parents=True, exist_ok=True)
    span = [start, end, stable_steps] if stable_steps else [start, end]
    write_atomically(path, json.dumps([*spans, span]))


# -- executors ----------------------------------------------------------------------------------

def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True)
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU")]


def check_executor(ex: Executor) -> None:
    """A named error when ``ex`` cannot run here (before anything trains)."""
    if ex.kind in ("slurm", "submitit-local"):
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise SweepError(f"executor {ex.kind!r} needs submitit (pip install "
                             f"'k3jax[sweep]')") from None
    if ex.kind == "slurm" and shutil.which("sbatch") is None:
        raise SweepError("executor 'slurm' is not available: sbatch is not on PATH (no SLURM "
                         "cluster here); use 'local', 'inline' or 'submitit-local'")
    if ex.kind == "local" and ex.devices == "gpu" and not visible_gpus():
        raise SweepError("executor 'local' with devices='gpu': no GPU is visible "
                         "(CUDA_VISIBLE_DEVICES / nvidia-smi -L); use devices='cpu'")


def _slots(ex: Executor) -> list[dict[str, str]]:
    """Environment of each concurrent local slot."""
    if ex.devices == "cpu":
        return [{"JAX_PLATFORMS": "cpu"} for _ in range(ex.per_device)]
    share = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
             "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / ex.per_device:.3f}"}
    return [{"CUDA_VISIBLE_DEVICES": g, **(share if ex.per_device > 1 else {})}
            for g in visible_gpus() for _ in range(ex.per_device)]


def _run_local(root: Path, jobs: list[tuple[str, list[str]]], ex: Executor, log) -> None:
    slots: queue.Queue = queue.Queue()
    for env in _slots(ex):
        slots.put(env)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)

    def one(job: tuple[str, list[str]]) -> None:
        env = slots.get()
        try:
            path = logs / f"{job[0]}.log"
            log(f"[sweep] {job[0]}: started ({' '.join(f'{k}={v}' for k, v in env.items())}); "
                f"log {path}")
            with open(path, "a") as out:
                cmd = [sys.executable, "-m", "k3jax.sweep.runner", str(root), job[0]]
                rc = subprocess.run(cmd, check=False, env={**os.environ, **env}, stdout=out,
                                    stderr=subprocess.STDOUT).returncode
        finally:
            slots.put(env)
        if rc != 0:
            _fail_unfinished(root, job[1], f"the job's process exited with code {rc}; see {path}")
        log(f"[sweep] {job[0]}: finished (exit code {rc})")

    with ThreadPoolExecutor(slots.qsize()) as pool:
        list(pool.map(one, jobs))


def _run_submitit(root: Path, jobs: list[tuple[str, list[str]]], ex: Executor, log) -> None:
    import submitit

    folder = root / "submitit"
    executor = (submitit.AutoExecutor(folder=folder, cluster="slurm") if ex.kind == "slurm"
                else submitit.LocalExecutor(folder=folder))
    executor.update_parameters(timeout_min=ex.timeout_min, **dict(ex.parameters))
    submitted = [(job, executor.submit(run_job, str(root), job[0])) for job in jobs]
    for job, handle in submitted:
        log(f"[sweep] {job[0]}: submitted as {ex.kind} job {handle.job_id}")
    for job, handle in submitted:
        try:
            handle.result()
        except Exception as e:  # noqa: BLE001 - the job died (timeout, node failure, ...)
            _fail_unfinished(root, job[1], f"{ex.kind} job {handle.job_id} failed: "
                             f"{type(e).__name__}: {str(e)[-2000:]}")
        log(f"[sweep] {job[0]}: {ex.kind} job {handle.job_id} finished")


def _fail_unfinished(root: Path, names: list[str], error: str) -> None:
    rows = {p["name"]: p for p in read_plan(root)["points"]}
    for name in names:
        if point_status(root, rows[name]) not in ("done", "failed"):
            _record_failure(root, name, error)


def _prepare_data(record: dict, root: Path, log) -> None:
    """Build (or open) each distinct corpus once, before points start in parallel."""
    from k3jax.data import make_data

    seen = set()
    for p in record["points"]:
        cfg = _config(p["config"])
        key = json.dumps(dataclasses.asdict(cfg.data), sort_keys=True)
        if key not in seen:
            seen.add(key)
            make_data(cfg.data, cfg.model.vocab_size, run_dir(root, p["name"]), cfg.eval.batches,
                      log=log)


def run_sweep(plan: Plan, root: str | Path, ex: Executor | None = None, log=print) -> dict:
    """Run every unfinished point of ``plan`` under ``root``; returns ``{name: status}``."""
    root = Path(root)
    ex = ex or plan.sweep.executor
    check_executor(ex)
    record = write_plan(plan, root)
    statuses = {p["name"]: point_status(root, p) for p in record["points"]}
    jobs = [(job, names) for job, names in record["jobs"]
            if any(statuses[n] != "done" for n in names)]
    log(f"[sweep] {plan.sweep.name}: {sum(s == 'done' for s in statuses.values())} of "
        f"{len(statuses)} points done; {len(jobs)} jobs to run with the {ex.kind} executor")
    if jobs:
        _prepare_data(record, root, log)
    if ex.kind == "inline":
        for job, _ in jobs:
            log(f"[sweep] {job}: {run_job(root, job)}")
    elif ex.kind == "local":
        _run_local(root, jobs, ex, log)
    else:
        _run_submitit(root, jobs, ex, log)
    return {p["name"]: point_status(root, p) for p in record["points"]}


def _exit_with_parent() -> None:
    """A job process ends when the sweep process that started it is gone (killed or preempted),
    instead of training on unsupervised."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":  # a local executor's job process: python -m k3jax.sweep.runner DIR JOB
    _started = time.time()  # before JAX is imported: start-up is part of the point's wall time
    _exit_with_parent()
    run_job(sys.argv[1], sys.argv[2], _started)
