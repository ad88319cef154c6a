"""Training: a tiny run learns; SIGKILL + rerun is bit-exact; damaged checkpoints are skipped;
non-finite steps are skipped; packed documents do not see each other; optimiser rules.

The runs are subprocesses of ``train.py`` sharing one JAX compilation cache, so only the first one
compiles. Model: 2 layers (KDA then MLA), d_model 32, vocab 256, sequences of 32 tokens. The loop's
runs inside the test process check the loop itself, whatever the layers: they train one MLA layer
(KDA's chunked form takes most of the CPU compile).
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import host_variables, small_config
from suite_env import subprocess_env

from k3jax.config import ConfigError, FFNConfig, KDAConfig, MLAConfig, ModelConfig
from k3jax.config.experiment import OptimConfig
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from k3jax.train.checkpoint import MANIFEST, check_config
from k3jax.train.optim import build_optimizer, decay_mask, muon_labels, schedule, schedule_args

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 4

TINY_MODEL = ModelConfig(
    vocab_size=256, d_model=32, num_layers=2, mla_every=2, first_k_dense=2,
    kda=KDAConfig(num_heads=2, head_dim=16, gate_rank=8, chunk_size=16),
    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16),
    dense_ffn=FFNConfig(intermediate_size=64), dtype="float32")
# The model of the loop's runs in this process: TINY_MODEL's MLA layer alone.
LOOP_MODEL = TINY_MODEL.replace(num_layers=1, mla_every=1, first_k_dense=1)

PRESET = f"""
from k3jax.config import *
from k3jax.config.experiment import (CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig,
                                     OptimConfig, TrainConfig)

def get_config():
    return ExperimentConfig(
        model={TINY_MODEL!r},
        data=DataConfig(sources=({{source!r}},), seq_len=32, batch_size=8, heldout_fraction=0.2),
        optim=OptimConfig(lr=1e-2, warmup_steps=4),
        train=TrainConfig(steps={STEPS}, log_every=4, micro_batches=2),
        checkpoint=CheckpointConfig(every={EVERY}, keep=3),
        eval=EvalConfig(every=12, batches=2))
"""


def _text_source(root: Path) -> Path:
    """Repetitive English in many small documents: a tiny model learns it within 12 steps."""
    src = root / "text"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and the dog ran to the red ball while birds sang".split()
    for i in range(40):
        body = " ".join(rng.choice(words, size=120)) + ".\n"
        (src / f"doc{i:02d}.txt").write_text(body)
    return src


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run (A); a run killed by SIGKILL after step 10 (B), whose newest checkpoint is
    then damaged, and which is resumed by re-running the same command."""
    root = tmp_path_factory.mktemp("runs")
    preset = root / "preset.py"
    preset.write_text(PRESET.format(source=str(_text_source(root))))
    env = subprocess_env(JAX_COMPILATION_CACHE_DIR=str(root / "jaxc"),  # one CPU device
                         K3JAX_DATA_CACHE=str(root / "data"))

    def train(workdir, extra_env=None, *sets):
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(preset),
               "--workdir", str(root / workdir), *(a for s in sets for a in ("--set", s))]
        return subprocess.run(cmd, cwd=ROOT, env={**env, **(extra_env or {})},
                              capture_output=True, text=True, timeout=600)

    a = train("A")
    assert a.returncode == 0, a.stderr[-3000:]
    killed = train("B", {"K3JAX_FAULT_KILL_AFTER_STEP": "10"})
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL, not a clean exit
    # Only finalised checkpoints count (an async save cut by the kill is a tmp dir, ignored).
    done = sorted(int(p.name) for p in (root / "B" / "checkpoints").iterdir() if p.name.isdigit())
    assert done and max(done) <= 10
    damaged = root / "B" / "checkpoints" / str(max(done))
    for f in damaged.rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncate every file
    resumed = train("B")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"root": root, "A": a, "B": resumed, "damaged": damaged, "done": done, "train": train}


def _final_state(workdir: Path, step: int = STEPS):
    return ocp.PyTreeCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


def _assert_same_state(x, y):
    leaves_x, leaves_y = jax.tree.leaves(x), jax.tree.leaves(y)
    assert len(leaves_x) == len(leaves_y) > 0
    for a, b in zip(leaves_x, leaves_y):
        assert np.array_equal(np.asarray(a), np.asarray(b)), "states differ"


def test_tiny_run_learns_and_logs(runs):
    a = runs["root"] / "A"
    summary = json.loads((a / "summary.json").read_text())
    first, last = summary["heldout_first"], summary["heldout_last"]
    assert first["step"] == 0 and last["step"] == STEPS
    # Random init predicts ~uniform over 256 bytes (8 bits/byte); 12 steps must cut that clearly.
    assert last["loss"] < first["loss"] - 1.0, (first, last)
    assert last["bpb"] < first["bpb"] - 1.0
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(4, STEPS + 1, 4))
    for key in ("loss", "bpb", "grad_norm", "lr", "tokens_per_s"):
        assert all(np.isfinite(r[key]) for r in train), key
    assert any((a / "tensorboard").iterdir())
    assert "[done]" in runs["A"].stderr and "bits/byte" in runs["A"].stderr
    # Per-device memory: the state as sized before the compile, XLA's temporaries after it.
    from k3jax.config.experiment import load_config
    from k3jax.train.memory import state_bytes_per_device

    (compiled,) = [r for r in records if r["kind"] == "compile"]
    cfg = load_config(runs["root"] / "preset.py")
    assert compiled["state_bytes"] == state_bytes_per_device(cfg, {}).total
    assert compiled["temp_bytes"] > 0
    assert "[memory] per device: training state" in runs["A"].stderr


def test_resume_after_sigkill_is_bit_exact_and_skips_damage(runs):
    err, damaged, done = runs["B"].stderr, runs["damaged"], runs["done"]
    assert f"cannot restore {damaged}" in err, err[-2000:]
    older = [s for s in done if s < int(damaged.name)]
    if older:
        assert f"resumed from {damaged.parent / str(max(older))}" in err
    _assert_same_state(_final_state(runs["root"] / "A"), _final_state(runs["root"] / "B"))
    steps = [json.loads(x)["step"] for x in (runs["root"] / "B" / "metrics.jsonl").read_text()
             .splitlines() if json.loads(x)["kind"] == "train"]
    assert steps == sorted(set(steps))  # records after the restored step were dropped
    # The damaged checkpoint is one console line, not orbax's tracebacks (they go to train.log).
    assert "Traceback" not in err and (runs["root"] / "B" / "train.log").is_file()
    # The resumed run's summary covers the whole run, the killed process's evaluations too.
    a, b = (json.loads((runs["root"] / w / "summary.json").read_text()) for w in "AB")
    assert b["heldout_first"]["step"] == 0 and b["heldout_first"] == a["heldout_first"]
    assert b["heldout_last"] == a["heldout_last"]
    assert b["final_train_loss"] == a["final_train_loss"]


def test_rerun_of_a_finished_run_keeps_its_summary(runs):
    before = json.loads((runs["root"] / "A" / "summary.json").read_text())
    again = runs["train"]("A")
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((runs["root"] / "A" / "summary.json").read_text())
    for key in ("steps", "final_train_loss", "heldout_first", "heldout_last"):
        assert after[key] == before[key], key


def test_a_run_killed_after_its_last_save_has_its_last_evaluation(runs):
    # The last save finished before the kill (not cut short, which would redo the last steps).
    # A shorter run than A's (the length is the step's data: the same compiled step), evaluated
    # only at step 0 and at its end.
    steps = 2 * EVERY
    sets = ("checkpoint.async_save=false", f"train.steps={steps}")
    killed = runs["train"]("C", {"K3JAX_FAULT_KILL_AFTER_STEP": str(steps)}, *sets)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (runs["root"] / "C" / "checkpoints" / str(steps) / MANIFEST).is_file()
    again = runs["train"]("C", None, *sets)  # finished: nothing left to train
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((runs["root"] / "C" / "summary.json").read_text())
    assert summary["steps"] == steps and summary["heldout_last"]["step"] == steps


def test_evaluate_and_plot(runs, capsys):
    from k3jax.evaluate import main as evaluate_main
    from k3jax.plot import plot_runs

    # The sources edited since: the evaluation reads the corpus the run trained on, not one built
    # again from them (whose held-out split would hold other text).
    sources = {f: f.read_text() for f in (runs["root"] / "text").iterdir()}
    for f, text in sources.items():
        f.write_text(text.upper())
    try:
        assert evaluate_main(["--workdir", str(runs["root"] / "A"), "--tasks", "parity"]) == 0
    finally:
        for f, text in sources.items():
            f.write_text(text)
    table = capsys.readouterr().out
    assert "heldout" in table and "parity" in table
    result = json.loads((runs["root"] / "A" / "eval.json").read_text())
    summary = json.loads((runs["root"] / "A" / "summary.json").read_text())
    assert result["step"] == STEPS
    assert result["results"]["heldout"]["bpb"] == pytest.approx(summary["heldout_last"]["bpb"],
                                                                rel=1e-5)
    paths = plot_runs([str(runs["root"] / "A"), str(runs["root"] / "B")], runs["root"] / "plots")
    assert {p.name for p in paths} >= {"loss.png", "bpb.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


# -- in-process pieces -------------------------------------------------------------------------

def test_packed_batch_equals_documents_one_by_one():
    """Per-document losses of three documents packed in one row (segment ids) equal those of each
    document run alone: no attention and no KDA/conv state crosses a boundary. One compiled
    forward over five rows: the packed row; each document alone at the start of a row, filler
    after it (causal: later tokens never reach it, tests/test_model.py); the packed tokens
    without segment ids."""
    from k3jax.model import K3Model
    from k3jax.ops.cross_entropy import token_nats

    lengths, width = (11, 16, 5), 32
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, size=n + 1).astype(np.int32) for n in lengths]
    variables = host_variables(TINY_MODEL, 3)
    filler = rng.integers(0, 256, size=width + 1).astype(np.int32)
    alone_rows = [np.concatenate([d, filler[len(d):]]) for d in docs]
    packed_row = np.concatenate([d[:-1] for d in docs] + [docs[-1][-1:]])
    rows = np.stack([packed_row, *alone_rows, packed_row])               # [5, width + 1]
    seg = np.ones((5, width), np.int32)
    seg[0] = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    targets = np.concatenate([np.concatenate([d[1:] for d in docs])[None], rows[1:4, 1:],
                              np.concatenate([d[1:] for d in docs])[None]])
    logits = jax.jit(lambda t, s: K3Model(TINY_MODEL).apply(variables, t, segment_ids=s,
                                                            deterministic=True))(rows[:, :-1], seg)
    nats = np.asarray(token_nats(logits, targets))
    bounds = np.cumsum((0,) + lengths)
    alone = [nats[1 + i, :n] for i, n in enumerate(lengths)]
    for i, ref in enumerate(alone):
        got = nats[0, bounds[i]:bounds[i + 1]]
        assert rel_rms(ref, got) <= FP32_TOL, (i, rel_rms(ref, got))
    # And without segment ids the later documents do see the earlier ones (the test can fail).
    assert rel_rms(alone[1], nats[4, bounds[1]:bounds[2]]) > 10 * FP32_TOL


def _loop_config(tmp_path, steps: int, eval_batches: int):
    """:data:`LOOP_MODEL` on the text source, for runs of the loop in this process: evaluated at
    step 0 and at the end."""
    from k3jax.config.experiment import DataConfig, EvalConfig, ExperimentConfig, TrainConfig

    return ExperimentConfig(
        model=LOOP_MODEL,
        data=DataConfig(sources=(str(_text_source(tmp_path)),), seq_len=32, batch_size=8,
                        cache_dir=str(tmp_path / "data")),
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
        train=TrainConfig(steps=steps, log_every=steps),
        eval=EvalConfig(every=100, batches=eval_batches))


def test_each_batch_runs_the_step_of_its_attention_layout(tmp_path, monkeypatch):
    """With MLA's ``documents="auto"`` the loop picks each batch's attention layout on the host
    and compiles a step per layout when a batch first needs it. Here the layout is "packed" for
    batches of one document a row (on the CPU both steps are the same computation): the run
    compiles the second step when it first needs it and ends where a run with one step does."""
    import k3jax.ops.attention as attention
    from k3jax.train.loop import run

    cfg = _loop_config(tmp_path, steps=6, eval_batches=1)
    chosen, lines = [], []

    def by_documents(ids):
        chosen.append("packed" if (np.diff(ids, axis=1) == 0).all() else "masked")
        return chosen[-1]

    monkeypatch.setattr(attention, "batch_documents", by_documents)
    run(cfg, tmp_path / "two", log=lines.append)
    assert set(chosen) == {"packed", "masked"}, chosen  # else this run tests nothing
    later = next(c for c in chosen if c != chosen[0])
    compiles = [m for m in map(str, lines) if m.startswith("[compile] step")]
    assert len(compiles) == 2 and f"takes MLA's {later} attention" in compiles[0], compiles
    assert "after its batch" in compiles[1]  # the compiled step timed on its own
    monkeypatch.undo()
    run(cfg, tmp_path / "one", log=lambda m: None)  # "masked" throughout (no cuDNN here)
    _assert_same_state(_final_state(tmp_path / "two", 6), _final_state(tmp_path / "one", 6))


def test_compiled_step_is_written_with_the_first_checkpoint(tmp_path, monkeypatch,
                                                            restore_cache_config):
    """With the executable cache on, the loop writes the compiled step when it saves its first
    checkpoint (serialising it holds the interpreter lock for seconds, which would stall the steps
    beside it) and waits for it there; jax's persistent cache does not write the step's programs
    (the same bytes once more, just before the first step), but still writes others."""
    import dataclasses

    import k3jax.parallel.executable_cache as executable_cache
    import k3jax.train.loop as loop
    from k3jax.config.experiment import CheckpointConfig

    events = []
    stored = executable_cache.ExecutableCache.store
    logged = loop._log_train

    def store(self, key, programs):
        events.append("store")
        return stored(self, key, programs)

    def log_train(writer, bar, prog, step, *args):
        events.append(step)
        return logged(writer, bar, prog, step, *args)

    monkeypatch.setattr(executable_cache, "usable", lambda: True)  # else only on GPUs
    monkeypatch.setattr(executable_cache.ExecutableCache, "store", store)
    monkeypatch.setattr(loop, "_log_train", log_train)
    cfg = _loop_config(tmp_path, steps=5, eval_batches=1)
    cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(every=3, keep=2),
                              train=dataclasses.replace(cfg.train, log_every=1))
    cache = tmp_path / "jax_cache"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    # Every program written, however quickly it compiles: the step's alone must not be.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    loop.run(cfg, tmp_path / "run", log=lambda m: None)
    assert events == [1, 2, 3, "store", 4, 5], events
    assert len(list((cache / "k3jax-steps").glob("*.executable"))) == 1
    assert len(list((cache / "k3jax-steps").glob("*.json"))) == 1  # the key's parts beside it
    assert len(list((cache / "k3jax-shapes").glob("*.pickle"))) == 1  # the variables' shapes
    written = [p.name for p in cache.glob("jit_*")]
    assert written and not [n for n in written if n.startswith(("jit_gradients", "jit_update"))]


def test_step_zero_evaluation_is_compiled_once_in_the_background(tmp_path, caplog):
    """The evaluation program compiles on a worker thread once the first step is done, and the
    evaluations at step 0 and at the end run that executable: jit lowers it only once (a call
    that missed jit's cache would lower it again), over the suite's 8 simulated devices."""
    from k3jax.train.loop import run

    cfg = _loop_config(tmp_path, steps=1, eval_batches=2)
    lines, logging_before = [], jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)  # globally: the context form is per thread
    try:
        with caplog.at_level("WARNING"):
            run(cfg, tmp_path / "run", log=lines.append)
    finally:
        jax.config.update("jax_log_compiles", logging_before)
    evals = [m.split(":")[0] for m in map(str, lines) if m.startswith("[eval] step")]
    assert evals == ["[eval] step 0", "[eval] step 1"]
    records = [(r.threadName, r.getMessage()) for r in caplog.records]
    lowered = [t for t, m in records if m.startswith("Compiling jit(eval_step)")]
    compiled = [t for t, m in records if m.startswith("Finished XLA compilation of jit(eval_step)")]
    assert len(lowered) == 1 and compiled == ["compile"], (lowered, compiled)


def test_step_zero_evaluation_runs_the_initial_variables_whenever_it_is_compiled(tmp_path,
                                                                                  monkeypatch):
    """The first steps do not wait for the step-0 evaluation's compile: it runs when its program
    is ready (here after step 1 or step 3 exactly), on a copy of the initial variables (the steps
    donate the state), and the evaluations stay in step order."""
    import k3jax.parallel as parallel
    from k3jax.train.loop import run

    background = parallel.compile_in_background

    def held_back(steps):
        def compile_in_background(*args, **kwargs):
            future, asked = background(*args, **kwargs), []

            class Held:  # done() says no at the first ``steps`` step ends, then yes
                def done(self):
                    asked.append(True)
                    return len(asked) > steps and future.result() is not None

                def result(self):
                    return future.result()
            return Held()
        return compile_in_background

    cfg = _loop_config(tmp_path, steps=4, eval_batches=1)
    zero, first = {}, {}
    for steps in (0, 2):
        monkeypatch.setattr(parallel, "compile_in_background", held_back(steps))
        lines = []
        run(cfg, tmp_path / f"held{steps}", log=lines.append)
        first[steps] = next(m for m in map(str, lines)
                            if m.startswith(("[eval] step 0", "[compile] first train step")))
        records = [json.loads(x) for x in (tmp_path / f"held{steps}" / "metrics.jsonl")
                   .read_text().splitlines()]
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["step"] for r in evals] == [0, 4]
        zero[steps] = evals[0]["loss"]
    assert first[2].startswith("[compile]"), first  # the first step did not wait for it
    # Evaluated after one step or after three, the step-0 loss is the initial variables' loss.
    assert zero[0] == zero[2], zero


def test_nonfinite_step_is_skipped_and_counted():
    """The skip is the train step's, whatever the layers: a one-layer MLA model (quick to
    compile)."""
    from k3jax.model import K3Model
    from k3jax.train.optim import schedule
    from k3jax.train.step import init_state, make_train_step

    model_cfg = small_config(num_layers=1, mla_every=1, first_k_dense=1)
    cfg = OptimConfig(warmup_steps=0, schedule="cosine")  # another rate at each count
    variables = host_variables(model_cfg, 0)
    opt = build_optimizer(cfg, 10, variables["params"])
    state = init_state(variables["params"], {}, opt, 0)
    step = functools.partial(jax.jit(make_train_step(K3Model(model_cfg), cfg, 1)),
                             schedule=schedule_args(cfg, 10))
    good = {"tokens": np.ones((2, 16), np.int32), "targets": np.full((2, 16), 7, np.int32),
            "segment_ids": np.ones((2, 16), np.int32), "weights": np.ones((2, 16), np.float32)}
    bad = {**good, "weights": np.full((2, 16), np.nan, np.float32)}
    s1, m1 = step(state, bad)
    assert not bool(m1["finite"]) and int(s1["bad_steps"]) == 1 and int(s1["skipped"]) == 1
    assert int(s1["step"]) == 1
    _assert_same_state(s1["params"], state["params"])
    _assert_same_state(s1["opt_state"], state["opt_state"])
    s2, m2 = step(s1, good)
    assert bool(m2["finite"]) and int(s2["bad_steps"]) == 0 and int(s2["skipped"]) == 1
    assert not np.array_equal(np.asarray(s2["params"]["head"]), np.asarray(s1["params"]["head"]))
    # The skipped step's update was undone with the optimiser's count: the rate logged is the one
    # the next update takes, the schedule's first again.
    assert float(m1["lr"]) == float(m2["lr"]) == float(schedule(cfg, 10)(0))


def test_runs_differing_in_schedule_numbers_share_one_step_program():
    """Learning rate, warmup, decay and length are step data: two runs' train steps lower to the
    same program (so the second loads the first's from the compilation cache)."""
    from k3jax.model import K3Model
    from k3jax.train.optim import without_schedule_numbers
    from k3jax.train.step import init_state, make_train_step

    model_cfg = small_config(num_layers=1, mla_every=1, first_k_dense=1)
    variables = host_variables(model_cfg, 0)
    batch = {"tokens": np.ones((2, 16), np.int32), "targets": np.ones((2, 16), np.int32),
             "segment_ids": np.ones((2, 16), np.int32), "weights": np.ones((2, 16), np.float32)}

    def program(cfg, steps):
        state = init_state(variables["params"], {}, build_optimizer(cfg, steps,
                                                                    variables["params"]), 0)
        step = jax.jit(make_train_step(K3Model(model_cfg), cfg, 1))
        return step.trace(state, batch, schedule_args(cfg, steps)).lower().as_text()

    a_cfg = OptimConfig(lr=1e-2, warmup_steps=4, decay_fraction=0.2)
    b_cfg = OptimConfig(lr=3e-4, warmup_steps=0, decay_fraction=0.5, min_lr_ratio=0.3)
    cosine = OptimConfig(lr=1e-2, warmup_steps=4, schedule="cosine")
    a = program(a_cfg, 100)
    assert a == program(b_cfg, 7)
    assert a != program(cosine, 100)
    # ... and the executable cache describes them alike (a learning-rate sweep loads one step).
    assert without_schedule_numbers(a_cfg) == without_schedule_numbers(b_cfg)
    assert without_schedule_numbers(a_cfg) != without_schedule_numbers(cosine)


def test_nonfinite_run_stops_naming_step_and_checkpoint(tmp_path):
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.loop import NonFiniteError, _check_finite

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, log=lambda m: None)
    ckpt.save(8, {"x": np.zeros(3)}, {"config": {}, "step": 8})
    metrics = {"finite": np.bool_(False), "bad_steps": np.int32(5)}
    with pytest.raises(NonFiniteError,
                       match=r"step 12: 5 non-finite steps in a row.*checkpoints/8"):
        _check_finite((12, metrics), 5, ckpt)
    _check_finite((12, {**metrics, "bad_steps": np.int32(4)}), 5, ckpt)  # not yet
    ckpt.close()


def test_checkpoint_config_check_names_fields(tmp_path):
    saved = {"model": {"d_model": 32, "kda": {"num_heads": 2}}, "optim": {"name": "adamw"}}
    current = {"model": {"d_model": 32, "kda": {"num_heads": 4}}, "optim": {"name": "muon"}}
    with pytest.raises(ConfigError, match=r"model\.kda\.num_heads.*optim\.name"):
        check_config(saved, current, tmp_path)
    check_config(saved, saved, tmp_path)
    # How MLA's attention takes packed documents is not part of the run: a checkpoint without the
    # field, or with another value, resumes.
    old = {**saved, "model": {**saved["model"], "mla": {"num_heads": 2}}}
    for documents in ("auto", "masked"):
        mla = {"num_heads": 2, "documents": documents}
        check_config(old, {**old, "model": {**old["model"], "mla": mla}}, tmp_path)


def test_optimizer_groups_and_schedules():
    params = {"embedding": jnp.ones((16, 8)), "head": jnp.ones((8, 16)),
              "layer": {"w_q": jnp.ones((8, 6)), "A_log": jnp.ones((2,)), "dt_bias": jnp.ones((6,)),
                        "norm": {"scale": jnp.ones((3, 8))}, "conv_q": jnp.ones((4, 6)),
                        "attnres_query": jnp.ones((3, 8)), "w_kvb": jnp.ones((3, 8, 2, 4))}}
    decay = decay_mask(params)
    assert decay["embedding"] and decay["layer"]["w_q"] and decay["layer"]["w_kvb"]
    assert not any(decay["layer"][k] for k in ("A_log", "dt_bias", "attnres_query"))
    assert not decay["layer"]["norm"]["scale"]
    labels = muon_labels(params)
    assert labels["layer"]["w_q"] == "muon" and labels["layer"]["w_kvb"] == "muon"
    assert all(labels[k] == "adam" for k in ("embedding", "head"))
    assert all(labels["layer"][k] == "adam" for k in ("A_log", "conv_q", "attnres_query"))
    # No-decay parameters do not shrink under a zero gradient; decayed ones do.
    for name in ("adamw", "muon"):
        opt = build_optimizer(OptimConfig(name=name, warmup_steps=0, weight_decay=0.5), 10, params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, _ = jax.jit(opt.update)(zeros, opt.init(params), params)  # faster than op by op
        assert float(jnp.abs(updates["layer"]["A_log"]).max()) == 0.0
        assert float(jnp.abs(updates["layer"]["norm"]["scale"]).max()) == 0.0
        assert float(updates["layer"]["w_q"].max()) < 0.0
    wsd = schedule(OptimConfig(lr=1.0, warmup_steps=10, decay_fraction=0.5, min_lr_ratio=0.1),
                   110)
    assert float(wsd(0)) == 0.0 and float(wsd(10)) == pytest.approx(1.0)
    assert float(wsd(55)) == pytest.approx(1.0) and float(wsd(110)) == pytest.approx(0.1)
    cos = schedule(OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1), 110)
    assert float(cos(60)) == pytest.approx(0.55, abs=1e-3) and float(cos(110)) == pytest.approx(0.1)
