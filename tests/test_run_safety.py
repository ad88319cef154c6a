"""What can go wrong around a run, and what happens: a busy workdir, a damaged or half-written
checkpoint, a save that fails, a resume the checkpoint does not allow, plain user mistakes.

Everything here runs without compiling a model: ``train.main`` is called in-process and every
refusal it is tested for happens before the first compile. Checkpoints are small pytrees of numpy
arrays saved by the real :class:`~k3jax.train.checkpoint.Checkpointer`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax.config import ConfigError
from k3jax.config.experiment import ExperimentConfig, OptimConfig, TrainConfig
from k3jax.data import build_corpus, open_corpus
from k3jax.train import checkpoint
from k3jax.train.checkpoint import (
    MANIFEST,
    UNRESTORABLE,
    CheckpointDamaged,
    Checkpointer,
    CheckpointSaveError,
    abstract_like,
    verify_manifest,
    verify_newest_ahead,
    write_manifest,
)
from k3jax.train.resume import check_schedule, history
from k3jax.train.workdir import LOCK_FILE, WorkdirInUse, WorkdirLock

ROOT = Path(__file__).resolve().parents[1]
STATE = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)},
         "step": np.int32(0)}


@pytest.fixture
def train_main(restore_cache_config):
    """``train.py``'s ``main``, in this process (the suite's cache options restored after)."""
    spec = importlib.util.spec_from_file_location("k3jax_train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _state(step: int) -> dict:
    return {"params": {"w": STATE["params"]["w"] + step}, "step": np.int32(step)}


def _checkpoints(tmp_path, steps=(2, 4), log=None, **kw) -> Checkpointer:
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5, log=log or (lambda m: None), **kw)
    for s in steps:
        ckpt.save(s, _state(s), {"config": {}, "step": s})
    ckpt.wait()
    return ckpt


def _abstract():
    return abstract_like(jax.device_put(STATE))


def _data_file(step_dir: Path) -> Path:
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and "/d/" in str(f)]
    return max(files, key=lambda f: f.stat().st_size)


# -- checkpoints -------------------------------------------------------------------------------

def _flip(step_dir: Path) -> None:
    f = _data_file(step_dir)
    data = bytearray(f.read_bytes())
    n = min(4096, len(data) // 2)
    data[len(data) // 4:len(data) // 4 + n] = np.random.default_rng(0).bytes(n)
    f.write_bytes(bytes(data))  # same size, other bytes


def _truncate(step_dir: Path) -> None:
    f = _data_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _unfinished(step_dir: Path) -> None:
    (step_dir / MANIFEST).unlink()  # what a save killed before its manifest leaves


@pytest.mark.parametrize("ahead", [False, True], ids=["checked-in-turn", "checked-ahead"])
@pytest.mark.parametrize("damage, reason", [(_flip, "changed since it was saved"),
                                            (_truncate, "changed since it was saved"),
                                            (_unfinished, "the save did not finish")])
def test_damaged_checkpoint_is_named_moved_aside_and_the_older_one_used(tmp_path, damage, reason,
                                                                        ahead):
    lines = []
    ckpt = _checkpoints(tmp_path, log=lines.append)
    damage(tmp_path / "checkpoints" / "4")
    if ahead:  # as a run resumes: the newest one's files checked while the model is traced
        ckpt.close()
        ckpt = Checkpointer(tmp_path / "checkpoints", keep=5, log=lines.append,
                            verified=verify_newest_ahead(tmp_path / "checkpoints"))
    state, meta = ckpt.restore_latest(_abstract(), {})
    ckpt.close()
    assert meta["step"] == 2 and np.array_equal(state["params"]["w"], _state(2)["params"]["w"])
    assert len(lines) == 1 and f"cannot restore {tmp_path / 'checkpoints' / '4'}" in lines[0]
    assert reason in lines[0] and str(tmp_path / UNRESTORABLE / "4") in lines[0]
    assert (tmp_path / UNRESTORABLE / "4").is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_manifest_hashes_pieces_in_parallel_and_reads_whole_file_manifests(tmp_path,
                                                                           monkeypatch):
    """Each file's pieces are hashed (a change in any piece is caught, and a file of an exact
    number of pieces or none has them all); a manifest written before pieces, one SHA-256 a whole
    file, still verifies and still catches a change."""
    monkeypatch.setattr(checkpoint, "HASH_PIECE_BYTES", 1024)
    rng = np.random.default_rng(0)
    sizes = {"big": 5000, "exact": 2048, "empty": 0, "small": 10}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(rng.bytes(size))
    write_manifest(tmp_path)
    recorded = json.loads((tmp_path / MANIFEST).read_text())
    assert {n: len(e["sha256"]) for n, e in recorded["files"].items()} == {
        "big": 5, "exact": 2, "empty": 1, "small": 1}
    assert recorded["files"]["big"]["sha256"][2] == hashlib.sha256(
        (tmp_path / "big").read_bytes()[2048:3072]).hexdigest()
    verify_manifest(tmp_path)
    data = bytearray((tmp_path / "big").read_bytes())
    data[2500] ^= 1  # inside the third piece
    (tmp_path / "big").write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match="file big changed"):
        verify_manifest(tmp_path)
    whole = {n: {"size": size, "sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}
             for n, size in sizes.items()}
    (tmp_path / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": whole}))
    verify_manifest(tmp_path)
    (tmp_path / "small").write_bytes(rng.bytes(10))
    with pytest.raises(CheckpointDamaged, match="file small changed"):
        verify_manifest(tmp_path)


def test_the_check_made_ahead_is_the_one_taken(tmp_path, monkeypatch):
    assert verify_newest_ahead(tmp_path / "checkpoints") == {}  # no directory yet
    _checkpoints(tmp_path).close()
    verified = verify_newest_ahead(tmp_path / "checkpoints")
    assert list(verified) == [4]
    verified[4].result()
    hashed = []
    monkeypatch.setattr(checkpoint, "verify_manifest", lambda d: hashed.append(Path(d).name))
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5, log=lambda m: None, verified=verified)
    assert ckpt.newest_usable({}, _abstract())[0] == 4 and hashed == []
    ckpt.close()


def test_restore_formats_no_array(tmp_path, monkeypatch):
    """On the main thread, Python 3.12.0-3.12.1 took the repr of orbax's task (with every
    restored array) when asyncio put the SIGINT handler back."""
    ckpt = _checkpoints(tmp_path)
    shown = []
    monkeypatch.setattr(type(jax.device_put(np.zeros(()))), "__repr__",
                        lambda self: shown.append(1) or "array")
    state = ckpt.restore(4, _abstract())
    ckpt.close()
    assert np.array_equal(state["params"]["w"], _state(4)["params"]["w"]) and shown == []


def _failing_save(monkeypatch, where: str):
    """Orbax writes the state's files, then the disk is full: while the save is started
    (``where="start"``) or in its background commit (``"commit"``)."""
    handler = ocp.StandardCheckpointHandler
    original = handler.async_save

    async def write_then_fail(self, directory, *args, **kwargs):
        futures = list(await original(self, directory, *args, **kwargs) or [])
        full = OSError(errno.ENOSPC, "No space left on device", str(directory))
        if where == "start":
            for f in futures:
                f.result()
            raise full
        failed = concurrent.futures.Future()
        failed.set_exception(full)
        return [*futures, failed]

    monkeypatch.setattr(handler, "async_save", write_then_fail)


@pytest.mark.parametrize("policy, where", [("stop", "start"), ("stop", "commit"),
                                           ("continue", "commit")])
def test_failed_save_is_one_line_keeps_older_checkpoints_and_no_tmp(tmp_path, monkeypatch,
                                                                    policy, where):
    lines = []
    ckpt = _checkpoints(tmp_path, steps=(2,), log=lines.append, on_save_error=policy)
    _failing_save(monkeypatch, where)
    if policy == "stop":
        with pytest.raises(CheckpointSaveError) as e:
            ckpt.save(4, _state(4), {"config": {}, "step": 4})
            ckpt.wait()
        message = str(e.value)
    else:
        ckpt.save(4, _state(4), {"config": {}, "step": 4})
        ckpt.wait()
        assert len(lines) == 1
        message = lines[0]
    assert "\n" not in message and f"saving step 4 to {tmp_path / 'checkpoints' / '4'}" in message
    assert "No space left on device" in message
    assert f"checkpoint.on_save_error={policy}" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]  # no tmp dirs
    if policy == "continue":  # the disk has room again: the next save works
        monkeypatch.undo()
        ckpt.save(6, _state(6), {"config": {}, "step": 6})
        ckpt.wait()
        assert ckpt.last_good_step() == 6
    ckpt.close()


# -- the workdir lock --------------------------------------------------------------------------

def test_second_lock_names_the_holder_and_release_frees_it(tmp_path):
    first, second = WorkdirLock(tmp_path), WorkdirLock(tmp_path)
    first.acquire()
    with pytest.raises(WorkdirInUse, match=rf"in use by another run \(pid {os.getpid()} on "):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


HOLD = """
import sys, time
from k3jax.train.workdir import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _holder(workdir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_racing_run_stops_at_once_naming_the_holder_and_sigkill_leaves_no_stale_lock(
        tmp_path, capsys, train_main):
    workdir = tmp_path / "run"
    holder = _holder(workdir)
    try:
        t0 = time.time()
        rc = train_main(["--config", str(ROOT / "configs/k3_tiny.py"), "--workdir",
                            str(workdir), "--set", "data.task=mqar"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and f"in use by another run (pid {holder.pid}" in line
        assert time.time() - t0 < 60
        assert sorted(p.name for p in workdir.iterdir()) == [LOCK_FILE]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = WorkdirLock(workdir)  # the kernel released the killed holder's lock
    lock.acquire()
    lock.release()


# -- refused runs change nothing ---------------------------------------------------------------

def _tiny_cfg(**train) -> ExperimentConfig:
    from test_train import TINY_MODEL

    from k3jax.config.experiment import CheckpointConfig, DataConfig

    return ExperimentConfig(model=TINY_MODEL,
                            data=DataConfig(task="mqar", seq_len=32, batch_size=8),
                            optim=OptimConfig(lr=1e-2, warmup_steps=4),
                            train=TrainConfig(**{"steps": 24, "log_every": 4, **train}),
                            checkpoint=CheckpointConfig(every=4))


def _preset(tmp_path: Path, cfg: ExperimentConfig) -> Path:
    path = tmp_path / "preset.py"
    path.write_text("from k3jax.config import *\nfrom k3jax.config.experiment import *\n"
                    "from k3jax.config.mesh import MeshConfig\n\n"
                    f"def get_config():\n    return {cfg!r}\n")
    return path


def _finished_workdir(tmp_path: Path, cfg: ExperimentConfig, step: int) -> Path:
    """A workdir as a run of ``cfg`` leaves it at ``step``: config, metrics, a checkpoint whose
    state has the real shapes (zeros: nothing is trained or compiled)."""
    from k3jax.model import abstract_variables
    from k3jax.train.optim import build_optimizer
    from k3jax.train.step import init_state

    workdir = tmp_path / "run"
    variables = abstract_variables(cfg.model, (cfg.data.batch_size, cfg.data.seq_len))
    opt = build_optimizer(cfg.optim, cfg.train.steps, variables["params"])
    shapes = jax.eval_shape(lambda p, b: init_state(p, b, opt, 0), variables["params"],
                            variables.get("balance", {}))
    state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    ckpt = Checkpointer(workdir / "checkpoints", keep=3, log=lambda m: None)
    ckpt.save(step, state, {"config": cfg.to_dict(), "step": step})
    ckpt.close()
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict()))
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 0, "kind": "eval", "loss": 4.0,
                                                       "accuracy": 0.0}) + "\n")
    return workdir


def _snapshot(workdir: Path) -> dict:
    return {str(p.relative_to(workdir)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                          p.stat().st_mtime_ns)
            for p in sorted(workdir.rglob("*")) if p.is_file()
            and p.name not in (LOCK_FILE, "train.log")}


@pytest.mark.parametrize("override, expect", [
    ("model.d_model=64", (r"was made with a different config: model\.d_model: checkpoint 32 "
                          r"vs config 64")),
    ("train.steps=48,train.schedule_change=refuse",
     r"train\.steps 24 -> 48 changes the learning rates.*train\.schedule_change=continue"),
    ("train.steps=12", r"train\.steps=12 is below step 24"),
    ("optim.b2=0.5,optim.weight_decay=0.9",
     r"optim\.b2: checkpoint 0\.95 vs config 0\.5; optim\.weight_decay: checkpoint"),
    ("optim.clip_norm=none", r"optim\.clip_norm: checkpoint 1\.0 vs config None"),
    ("data.heldout_fraction=0.1", r"data\.heldout_fraction: checkpoint 0\.02 vs config 0\.1"),
])
def test_refused_resume_is_one_error_line_and_leaves_the_workdir_untouched(
        tmp_path, capsys, train_main, override, expect):
    cfg = _tiny_cfg()
    workdir = _finished_workdir(tmp_path, cfg, 24)
    before = _snapshot(workdir)
    sets = [a for o in override.split(",") for a in ("--set", o)]
    rc = train_main(["--config", str(_preset(tmp_path, cfg)), "--workdir", str(workdir), *sets])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and re.search(expect, line), line
    assert _snapshot(workdir) == before
    assert line in (workdir / "train.log").read_text()  # and the run's log keeps it


# -- learning-rate schedule on resume ----------------------------------------------------------

def _cfg(steps: int, change: str = "continue") -> ExperimentConfig:
    return ExperimentConfig(optim=OptimConfig(lr=1.0, warmup_steps=10, decay_fraction=0.25),
                            train=TrainConfig(steps=steps, schedule_change=change))


def test_wsd_extended_in_its_stable_phase_continues_and_says_so():
    saved = _cfg(110).to_dict()  # warmup to 10, stable to 85, decay to 110
    assert check_schedule(saved, _cfg(110), 50, "ckpt") is None
    note = check_schedule(saved, _cfg(210), 50, "ckpt")
    assert "train.steps 110 -> 210" in note and "keep their learning rates" in note
    assert "stable to step 160, decay to step 210" in note


def test_wsd_extended_after_its_decay_began_warns_of_the_jump_or_is_refused():
    saved = _cfg(110).to_dict()
    note = check_schedule(saved, _cfg(210), 110, "ckpt")
    assert note.startswith("[schedule] warning:") and "continuing under the new plan" in note
    assert "from step 86 on" in note
    assert "step 111 trains at lr 1 where the old plan had 0.1" in note
    with pytest.raises(ConfigError, match=r"step 111 trains at lr 1 .*Refused \(train\."
                                          r"schedule_change=refuse\).*schedule_change=continue"):
        check_schedule(saved, _cfg(210, "refuse"), 110, "ckpt")


def test_history_spans_the_whole_run():
    records = [{"step": 0, "kind": "eval", "loss": 5.0}, {"step": 4, "kind": "train", "loss": 3.0},
               {"step": 8, "kind": "eval", "loss": 2.0}, {"step": 8, "kind": "train", "loss": 2.5},
               {"step": 12, "kind": "train", "loss": 9.0}]
    h = history(records, 8)
    assert h["first_eval"]["step"] == 0 and h["last_eval"]["step"] == 8 and h["last_loss"] == 2.5


# -- user mistakes: one `error:` line, exit status 2, before anything compiles ------------------

def _corpus(tmp_path: Path, **kw) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i in range(16):
        (src / f"d{i}.txt").write_text(f"document {i} " + "some words of text. " * 40)
    build_corpus([str(src)], tmp_path / "corpus", heldout_fraction=0.1, log=lambda m: None, **kw)
    return tmp_path / "corpus"


def _one_error_line(stderr: str) -> str:
    """The last line of ``stderr``, checked to be its only ``error:`` line (no traceback)."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert not any("Traceback" in line for line in lines), lines
    return errors[0]


def _mistakes(tmp_path: Path) -> list[tuple[list[str], str]]:
    tiny = str(ROOT / "configs/k3_tiny.py")
    (tmp_path / "a_file").write_text("x")
    corpus = _corpus(tmp_path)
    return [
        (["--config", str(ROOT / "README.md")], "not a Python preset file"),
        (["--config", tiny, "--workdir", str(tmp_path / "a_file")], "is a file; expected a dir"),
        (["--config", tiny, "--workdir", str(tmp_path / "a_file" / "run")], "which is a file"),
        (["--config", tiny, "--set", f"data.data_dir={tmp_path / 'nope'}"],
         "no such directory; build a corpus there with `python -m k3jax.data build"),
        (["--config", tiny, "--set", f"data.sources={tmp_path / 'nope.txt'}"],
         "no such file or directory"),
        (["--config", tiny, "--set", f"data.data_dir={corpus}", "--set", "model.vocab_size=128"],
         "vocabulary of 256 tokens but model.vocab_size=128"),
        (["--config", tiny, "--set", f"data.data_dir={corpus}", "--set",
          f"data.seq_len={len(open_corpus(corpus).val.tokens)}"], "the held-out split has"),
        (["--config", tiny, "--set", "data.task=mqar", "--set", "model.vocab_size=16"],
         "synthetic tasks need model.vocab_size >= 32"),
        (["--config", tiny, "--set", "data.batch_size=9"],  # over the suite's 8 CPU devices
         "data.batch_size=9 must be divisible by the 8 batch shards"),
    ]


def test_user_mistakes_are_one_error_line_with_status_2(tmp_path, capsys, train_main):
    main = train_main
    for args, expect in _mistakes(tmp_path):
        if "--workdir" not in args:
            args = [*args, "--workdir", str(tmp_path / "w")]
        rc = main(args)
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and expect in line, (args, line)
    assert not (tmp_path / "w").exists()  # a mistake found before the workdir is touched


def test_damaged_corpus_ids_are_caught_once_per_corpus(tmp_path):
    from k3jax.config.experiment import DataConfig
    from k3jax.data import make_data

    corpus = _corpus(tmp_path)
    tokens = np.load(corpus / "train.tokens.npy")
    tokens[3] = 300  # an id a byte tokenizer never makes
    np.save(corpus / "train.tokens.npy", tokens)
    with pytest.raises(ConfigError, match=r"train split .* holds token id 300, outside "
                                          r"model\.vocab_size=256"):
        make_data(DataConfig(data_dir=str(corpus), seq_len=16, batch_size=2), 256, tmp_path, 1)


def test_model_rejects_out_of_range_token_ids():
    from test_train import TINY_MODEL

    from k3jax.model import K3Model

    for bad in (np.array([[1, 256]], np.int32), np.array([[-1, 3]], np.int32)):
        with pytest.raises(ValueError, match=r"tokens: ids must lie in \[0, model\.vocab_size="
                                             r"256\)"):
            K3Model(TINY_MODEL).apply({"params": {}}, bad)


_REWRITER = """
import json, sys
from k3jax.files import write_atomically
text = json.dumps(list(range(2_000_000)))
while True:
    write_atomically(sys.argv[1], text)
"""


def test_a_file_rewritten_while_killed_is_whole(tmp_path):
    """A process SIGKILLed while it rewrites a 15 MB file over and over leaves a file that parses
    (the sweep's and the loop's JSON files are read back by the next run)."""
    path = tmp_path / "record.json"
    for delay in (0.05, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, "-c", _REWRITER, str(path)],
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        deadline = time.time() + 60
        while not path.is_file():
            assert time.time() < deadline and proc.poll() is None, "the writer never wrote"
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(json.loads(path.read_text())) == 2_000_000
