"""Sweeps: a toy sweep planned, run, SIGKILLed and resumed to the same results, then reported;
WSD branches equal full WSD runs; bad specs are named errors before anything trains.

Runs are subprocesses of ``python -m k3jax.sweep`` with one CPU device, sharing one compilation
cache. Model: one MLA layer, d_model 32, vocab 256, 32-token sequences of the MQAR task.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from suite_env import subprocess_env

from k3jax.config.experiment import OptimConfig
from k3jax.parallel import compile_cache
from k3jax.sweep import Budget, Executor, Ladder, Sweep, SweepError, Variant, load_sweep, runner
from k3jax.sweep.__main__ import main
from k3jax.sweep.plan import branch_step, plan_sweep
from k3jax.sweep.report import collect, side_by_side
from k3jax.sweep.runner import (
    PLAN_FILE,
    TIMING_FILE,
    check_executor,
    run_dir,
    run_sweep,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[1]

SPEC = """
from k3jax.config import FFNConfig, MLAConfig, ModelConfig
from k3jax.config.experiment import (CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig,
                                     OptimConfig, TrainConfig)
from k3jax.config.experiment import OptimConfig
from k3jax.sweep import Budget, Executor, Ladder, Sweep, Variant


def base():
    return ExperimentConfig(
        model=ModelConfig(vocab_size=256, d_model=32, num_layers=1, mla_every=1, first_k_dense=1,
                          mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16),
                          dense_ffn=FFNConfig(intermediate_size=64), dtype="float32"),
        data=DataConfig(task="mqar", seq_len=32, batch_size=4),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, decay_fraction=0.5),
        train=TrainConfig(log_every=2),
        checkpoint=CheckpointConfig(every=2, keep=2), eval=EvalConfig(every=100, batches=1))


def get_sweep():
    return Sweep(name="toy", base=base(), ladder=Ladder(sizes=(32,)),
                 budget=Budget(tokens={tokens}, fractions={fractions}),
                 variants={variants},
                 seeds={seeds}, wsd_branching={branching}, executor=Executor(kind="inline"))
"""


VARIANTS = '(Variant("situ"), Variant("swiglu", ("model.dense_ffn.activation=swiglu",)))'


def _spec(path: Path, tokens=(1536,), fractions=(1.0,), seeds=(0, 1), branching=False,
          variants=VARIANTS) -> Path:
    path.write_text(SPEC.format(tokens=tokens, fractions=fractions, seeds=seeds,
                                branching=branching, variants=variants))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    return root, subprocess_env(JAX_COMPILATION_CACHE_DIR=str(root / "jaxc"),  # one CPU device
                                PYTHONPATH=str(ROOT))  # submitit's job processes import k3jax


def _cli(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "k3jax.sweep", *map(str, args)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kw)


def _finish(proc) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _losses(d: Path) -> dict:
    return {r["name"]: r["loss"] for r in collect(d)}


TOY_TOKENS = 768  # 6 steps a point, a checkpoint every 2: a point cut short resumes from one


@pytest.fixture(scope="module")
def toy(env):
    """A: straight through, in turn; B: two CPU processes at once, SIGKILLed (the whole process
    group) once a point has finished, then resumed through submitit's local executor."""
    root, e = env
    spec = _spec(root / "toy.py", tokens=(TOY_TOKENS,))
    _finish(_cli(["run", spec, "--dir", root / "A"], e))
    b = root / "B"
    proc = _cli(["run", spec, "--dir", b, "--executor", "local", "--devices", "cpu",
                 "--per-device", "2"], e, start_new_session=True)
    deadline = time.time() + 600
    while not list(b.glob("runs/*/summary.json")) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed = {r["name"]: r["status"] for r in collect(b)}
    resumed = _finish(_cli(["run", spec, "--dir", b, "--executor", "submitit-local"], e))
    return {"root": root, "spec": spec, "A": root / "A", "B": b, "killed": killed,
            "resumed": resumed, "env": e}


def test_plan_lists_points_and_trains_nothing(env, capsys, tmp_path):
    spec = _spec(tmp_path / "toy.py")
    assert main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.startswith(("situ", "swiglu"))]
    assert names == ["situ.w32.lr0.01.s0.t12", "situ.w32.lr0.01.s1.t12",
                     "swiglu.w32.lr0.01.s0.t12", "swiglu.w32.lr0.01.s1.t12"]
    assert "4 points in 4 jobs" in out
    # Nothing written beside the spec (Python's bytecode cache of the spec module aside).
    assert [p for p in tmp_path.iterdir() if p.name != "__pycache__"] == [spec]


def test_killed_sweep_resumes_to_the_same_results(toy, capsys):
    assert "done" in toy["killed"].values()
    assert set(toy["killed"].values()) != {"done"}  # the kill came mid-sweep
    a, b = _losses(toy["A"]), _losses(toy["B"])
    assert len(a) == 4 and all(v is not None for v in a.values())
    assert a == b  # every point, bit for bit: resumed from checkpoints or trained afresh
    assert "4 done" in toy["resumed"]
    # Run once more, in this process (nothing is left to train, so no process is needed).
    assert main(["run", str(toy["spec"]), "--dir", str(toy["B"])]) == 0
    assert "4 of 4 points done; 0 jobs" in "".join(capsys.readouterr())


def test_report_writes_tables_plots_and_summary(toy):
    assert main(["report", str(toy["B"]), "--bootstrap", "20"]) == 0
    out = toy["B"] / "report"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["status"] for r in rows} == {"done"}
    # a synthetic task has no bytes, so its runs report no bits per byte
    assert all(r["loss"] > 0 and r["bpb"] is None and r["n"] > 0 and r["tokens"] == TOY_TOKENS
               for r in rows)
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("name,variant,seed,size,lr,n,n_total,tokens,compute")
    summary = (out / "summary.md").read_text()
    assert "no IsoFLOP fit" in summary and "| swiglu | 32 |" in summary
    assert (out / "loss_vs_compute.png").stat().st_size > 1000
    # B ran two points at a time: with points running less long than their times added up.
    busy, summed = side_by_side(toy["B"])
    # (a point killed between its end and its timing record has none: wall_s None)
    assert sum(r["wall_s"] or 0 for r in rows) == pytest.approx(summed)
    assert 0 < busy < summed
    assert f"Wall time {busy:.0f} s with points running" in summary


def test_side_by_side_merges_overlapping_launches(tmp_path):
    """The busy time is the union of the points' spans (gaps between launches left out)."""
    spans = {"a": [[0, 10], [100, 110]], "b": [[5, 20]], "c": [[120, 125]]}
    (tmp_path / PLAN_FILE).write_text(json.dumps({"points": [{"name": n} for n in spans]}))
    for name, s in spans.items():
        d = run_dir(tmp_path, name)
        d.mkdir(parents=True)
        (d / TIMING_FILE).write_text(json.dumps(s))
    assert side_by_side(tmp_path) == (20 + 10 + 5, 10 + 10 + 15 + 5)


def _done_point(root: Path, row: dict, spans: list, tokens_per_s: float) -> None:
    d = run_dir(root, row["name"])
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"steps": row["steps"], "heldout_last": {}}))
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "train", "tokens_per_s": tokens_per_s}))
    (d / TIMING_FILE).write_text(json.dumps(spans))


def test_overhead_counts_the_stable_stretch_each_branch_trained(tmp_path):
    """128 tokens a step at 64 tokens/s: 2 s a step. Branch ``a`` trained the stable phase to
    its step 6, then 4 steps of its own; ``b`` the stable phase from 6 to 14, then 6 of its own;
    ``c`` (no branch) its 10 steps. Each spent the rest of its wall time on anything else."""
    points = [{"name": "a", "steps": 10, "tokens": 1280, "branch_step": 6, "group": "g"},
              {"name": "b", "steps": 20, "tokens": 2560, "branch_step": 14, "group": "g"},
              {"name": "c", "steps": 10, "tokens": 1280, "branch_step": None, "group": None}]
    (tmp_path / PLAN_FILE).write_text(json.dumps({"points": points}))
    _done_point(tmp_path, points[0], [[0, 30, 6]], 64)
    _done_point(tmp_path, points[1], [[30, 45, 3], [50, 75, 5]], 64)  # resumed once
    _done_point(tmp_path, points[2], [[0, 25]], 64)
    rows = {r["name"]: r for r in collect(tmp_path)}
    assert {n: r["wall_s"] for n, r in rows.items()} == {"a": 30, "b": 40, "c": 25}
    # All 20 of b's steps at 2 s would fill its 40 s; 6 of them ran in a's launch.
    assert rows["a"]["overhead"] == pytest.approx(1 - 20 / 30)
    assert rows["b"]["overhead"] == pytest.approx(1 - 28 / 40)
    assert rows["c"]["overhead"] == pytest.approx(1 - 20 / 25)
    assert side_by_side(tmp_path) == (45 + 25, 30 + 40 + 25)


def test_a_branch_launch_records_the_stable_steps_it_trained(tmp_path, monkeypatch):
    """Training stood in for by checkpoint directories: the first branch's launch trains the
    stable phase to step 5, the second's from 5 to 8, and a resumed launch none."""
    def train(cfg, workdir):
        (workdir / "checkpoints" / str(cfg.train.steps)).mkdir(parents=True, exist_ok=True)
        (workdir / "summary.json").write_text(json.dumps({"steps": cfg.train.steps}))

    monkeypatch.setattr(runner, "_train", train)
    monkeypatch.setattr(compile_cache, "use_compilation_cache", lambda default: default)
    sweep = load_sweep(_spec(tmp_path / "toy.py", fractions=(0.5, 1.0), seeds=(0,),
                             branching=True, variants='(Variant("situ"),)'))
    plan = plan_sweep(sweep)
    write_plan(plan, tmp_path / "d")
    (group,) = plan.groups
    second = run_dir(tmp_path / "d", group.points[1])
    (second / "checkpoints" / "9").mkdir(parents=True)  # to be resumed from its own checkpoint
    assert set(runner.run_job(tmp_path / "d", group.name).values()) == {"done"}
    stable = [[span[2:] for span in json.loads((run_dir(tmp_path / "d", n) / TIMING_FILE)
                                               .read_text())] for n in group.points]
    assert stable == [[[5]], [[]]]
    shutil.rmtree(second)
    runner.run_job(tmp_path / "d", group.name)
    assert json.loads((second / TIMING_FILE).read_text())[0][2:] == [3]


def test_wsd_branches_equal_full_wsd_runs(env):
    root, e = env
    one = '(Variant("situ"),)'
    branched = _spec(root / "branched.py", fractions=(0.5, 1.0), seeds=(0,), branching=True,
                     variants=one)
    plan = plan_sweep(load_sweep(branched))
    assert len(plan.groups) == 1 and len(plan.groups[0].points) == 2
    assert [plan.point(n).branch_step for n in plan.groups[0].points] == [5, 8]
    _finish(_cli(["run", branched, "--dir", root / "branched"], e))
    straight = _spec(root / "straight.py", fractions=(0.5, 1.0), seeds=(0,), variants=one)
    _finish(_cli(["run", straight, "--dir", root / "straight"], e))
    assert _losses(root / "branched") == _losses(root / "straight")
    assert (root / "branched" / "stable").is_dir()


def test_shared_stable_phase_counts_once_in_trained_compute(tmp_path):
    sweep = load_sweep(_spec(tmp_path / "toy.py", fractions=(0.5, 1.0), seeds=(0,),
                             branching=True, variants='(Variant("situ"),)'))
    plan = plan_sweep(sweep)
    short, full = (plan.point(n) for n in plan.groups[0].points)
    assert (short.steps, short.branch_step, full.steps, full.branch_step) == (6, 5, 12, 8)
    # The stable phase to step 8 once, then decays of 6 - 5 and 12 - 8 steps, 128 tokens each.
    assert plan.trained_compute() == pytest.approx(full.flops_per_token * 128 * (8 + 1 + 4))


def test_branch_step_is_where_the_decay_starts():

    # 100 steps, 10 warmup, decay over 20% of the 90 after it: flat through step 82.
    assert branch_step(OptimConfig(warmup_steps=10, decay_fraction=0.2), 100) == 83


# -- bad specs ------------------------------------------------------------------------------------

def _toy_sweep(tmp_path, **changes):

    sweep = load_sweep(_spec(tmp_path / "toy.py"))
    return dataclasses.replace(sweep, **changes)


def test_unknown_axis_is_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(_spec(tmp_path / "toy.py").read_text().replace("sizes=", "size="))
    with pytest.raises(SweepError, match="unknown axis 'size' of Ladder; did you mean sizes"):
        load_sweep(bad)


def test_unknown_override_is_named(tmp_path):
    with pytest.raises(SweepError, match="variant 'x'.*unknown key 'mla_evry'.*model.mla_every"):
        _toy_sweep(tmp_path, variants=(Variant("x", ("model.mla_evry=2",)),))


def test_rung_the_model_cannot_build_is_named(tmp_path):
    with pytest.raises(SweepError, match="rung d_model=40: mla.num_heads .* whole number"):
        plan_sweep(_toy_sweep(tmp_path, ladder=Ladder(sizes=(32, 40))))
    with pytest.raises(SweepError, match="rung depth=0|sizes=.*positive"):
        Ladder(sizes=(0,), knob="depth")
    # Three dense layers before any MoE: a two-layer rung cannot hold them.
    deep = _toy_sweep(tmp_path, ladder=Ladder(sizes=(3, 2), knob="depth"),
                      variants=(Variant("dense3", ("model.num_layers=3",
                                                   "model.first_k_dense=3")),))
    with pytest.raises(SweepError, match="rung depth=2: the model cannot be built.*first_k_dense"):
        plan_sweep(deep)


def test_budget_below_one_step_is_named(tmp_path):
    with pytest.raises(SweepError, match="below one step of 128 tokens"):
        plan_sweep(_toy_sweep(tmp_path, budget=Budget(tokens=(50,))))
    with pytest.raises(SweepError, match="exactly one of tokens, tokens_per_param, compute"):
        Budget(tokens=(100,), compute=(1e12,))


def test_unavailable_executor_is_named_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no nvidia-smi
    with pytest.raises(SweepError, match="executor 'slurm' is not available: sbatch"):
        check_executor(Executor(kind="slurm"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sweep = _toy_sweep(tmp_path, executor=Executor(kind="local", devices="gpu"))
    with pytest.raises(SweepError, match="no GPU is visible"):
        run_sweep(plan_sweep(sweep), tmp_path / "out")
    assert not (tmp_path / "out" / PLAN_FILE).exists()
    with pytest.raises(SweepError, match="Executor.kind='cluster'"):
        Executor(kind="cluster")


def test_another_plan_in_the_directory_is_an_error(tmp_path, env):
    sweep = _toy_sweep(tmp_path)

    write_plan(plan_sweep(sweep), tmp_path / "d")
    other = plan_sweep(_toy_sweep(tmp_path, seeds=(5,)))
    with pytest.raises(SweepError, match="holds a different plan"):
        write_plan(other, tmp_path / "d")


def test_sweep_checks(tmp_path):

    with pytest.raises(SweepError, match="baseline='nope'"):
        _toy_sweep(tmp_path, baseline="nope")
    base = _toy_sweep(tmp_path).base
    cosine = dataclasses.replace(base, optim=dataclasses.replace(base.optim, schedule="cosine"))
    with pytest.raises(SweepError, match="wsd_branching=True is invalid.*'cosine'"):
        _toy_sweep(tmp_path, base=cosine, wsd_branching=True)
    assert isinstance(_toy_sweep(tmp_path), Sweep)


def test_learning_rates_must_differ_in_their_names(tmp_path):
    # (a repeated rate, or two that round to one name, planned one point and said nothing)
    for grid in ((1e-3, 1.0001e-3), (1e-3, 2e-3, 1e-3)):
        with pytest.raises(SweepError, match=r"Sweep.lr_grid=.*differ in their first 3 "
                                             r"significant digits.*their labels: \[.*'0\.001'"):
            _toy_sweep(tmp_path, lr_grid=grid)
    sweep = _toy_sweep(tmp_path, lr_grid=(1e-3, 1.01e-3), seeds=(0,))
    assert [p.name for p in plan_sweep(sweep).points if p.variant == "situ"] == [
        "situ.w32.lr0.001.s0.t12", "situ.w32.lr0.00101.s0.t12"]
    twice = dataclasses.replace(sweep, lr_grid=(), budget=Budget(tokens=(1536, 1540)))
    assert len(plan_sweep(twice).points) == 2  # one point a variant: both budgets are 12 steps


@pytest.mark.slow
def test_report_fits_isoflop_profiles_and_the_multiplier(tmp_path):
    """A planned IsoFLOP sweep whose runs are given losses from a known law (no training): the
    variant is worth 1.3x the baseline's compute; the report's fits, plots and summary say so."""
    import numpy as np

    sweep = dataclasses.replace(_toy_sweep(tmp_path), ladder=Ladder(sizes=(32, 48, 64, 96)),
                                budget=Budget(compute=(1e9, 3e9, 1e10)), seeds=(0,),
                                baseline="situ")
    plan = plan_sweep(sweep)
    write_plan(plan, tmp_path / "d")
    rng = np.random.default_rng(0)
    mid = plan.point(next(p.name for p in plan.points if p.size == 48)).n
    for p in plan.points:
        c = p.budget * (1.3 if p.variant == "swiglu" else 1.0)
        n_opt = mid * (c / 3e9) ** 0.5
        loss = (40 * c ** -0.08 + 0.03 * np.log(p.n / n_opt) ** 2) * np.exp(rng.normal(0, 1e-3))
        d = tmp_path / "d" / "runs" / p.name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({
            "steps": p.steps, "seconds": 1.0,
            "heldout_last": {"step": p.steps, "loss": loss, "bpb": loss / 2, "accuracy": 0.0}}))
    assert main(["report", str(tmp_path / "d"), "--bootstrap", "10", "--out",
                 str(tmp_path / "r")]) == 0
    fits = json.loads((tmp_path / "r" / "fits.json").read_text())
    m = fits["multipliers"]["swiglu"]
    assert abs(m["value"] - 1.3) < 0.05 and 1.0 < m["low"] < m["high"], m
    iso = fits["variants"]["situ"]["isoflop"]
    assert len(iso["profiles"]) == 3 and abs(iso["loss_law"]["b"]["value"] - 0.08) < 0.005
    assert "chinchilla" in fits["variants"]["situ"]
    for png in ("loss_vs_compute", "isoflop", "n_opt", "multipliers"):
        assert (tmp_path / "r" / f"{png}.png").stat().st_size > 1000
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "## Compute multipliers against `situ`" in summary and "excludes 1" in summary


@pytest.mark.parametrize("spec", sorted(p.name for p in (ROOT / "configs" / "sweeps").glob("*.py")
                                        if p.name != "__init__.py"))
def test_every_shipped_sweep_file_plans(spec, capsys):
    """The sweep files in configs/sweeps build and plan (shapes only; nothing trains)."""
    assert main(["plan", str(ROOT / "configs" / "sweeps" / spec)]) == 0
    assert " points in " in capsys.readouterr().out
