"""The training loop: resume, step, log, evaluate, checkpoint, summarise.

:func:`run` is what ``train.py`` calls. Every piece it uses is a small tested function elsewhere:
data (:mod:`k3jax.data`), the jitted step (:mod:`.step`), the optimiser (:mod:`.optim`),
checkpoints (:mod:`.checkpoint`), metrics (:mod:`.metrics`), evaluation (:mod:`.evaluation`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from k3jax.config.base import ConfigError
from k3jax.data import make_data
from k3jax.files import write_atomically
from k3jax.train.checkpoint import Checkpointer, verify_newest_ahead
from k3jax.train.evaluation import evaluate_batches, task_batches
from k3jax.train.metrics import MetricsWriter, flatten, read_metrics
from k3jax.train.optim import build_optimizer, schedule_args, without_schedule_numbers
from k3jax.train.resume import check_schedule, history
from k3jax.train.step import BATCH_KEYS, init_state, make_eval_step, make_train_step
from k3jax.train.workdir import LOG_FILE, RunLog, check_workdir, lock_run

# Fault injection for the resume test: SIGKILL this process right after this step is dispatched.
KILL_ENV = "K3JAX_FAULT_KILL_AFTER_STEP"
EVAL_KEYS = ("loss", "bpb", "accuracy")  # what the metrics and the summary keep of an evaluation
MISS_NAMES = 6  # parts of a missed step key the log names


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row."""


@dataclass
class Progress:
    """Running numbers for the progress bar and the final summary."""

    start_step: int
    tokens_per_step: int
    first_eval: dict | None = None
    last_eval: dict | None = None
    last_loss: float = float("nan")
    t0: float = field(default_factory=time.time)
    window_t: float = field(default_factory=time.time)
    window_steps: int = 0


def run(cfg, workdir: str | Path, log=None) -> dict:
    """Train ``cfg`` (an ExperimentConfig) in ``workdir``; resumes from its checkpoints.

    Whatever can refuse the run (the workdir, the data, another run holding the workdir, a
    checkpoint made with another config or schedule) is checked before anything in the workdir
    changes and before anything compiles; such mistakes raise ConfigError.
    """
    from k3jax.parallel import initialize_distributed

    initialize_distributed()  # several processes (JAX_COORDINATOR_ADDRESS, SLURM, ...): join them
    workdir = check_workdir(workdir)
    log = RunLog(log or (lambda msg: tqdm.write(str(msg), file=sys.stderr)))
    data = make_data(cfg.data, cfg.model.vocab_size, workdir, cfg.eval.batches, log=log)
    mesh, place = _mesh_and_batch_placement(cfg)
    lock = lock_run(workdir)
    # Work held back until a point of the run (a background compile waits for the first step,
    # the compiled step's write for the first checkpoint): released here too, so that nothing
    # waits for a run that failed or ended before it got there.
    first_step, first_save = Future(), Future()
    try:
        log.open(workdir / (LOG_FILE if jax.process_index() == 0
                            else f"train.process{jax.process_index()}.log"))
        return _run_locked(cfg, workdir, data, mesh, place, log, first_step, first_save)
    except ConfigError as e:
        log.record(f"error: {e}")  # the caller prints it; the log file keeps it too
        raise
    finally:
        for milestone in (first_step, first_save):
            if not milestone.done():
                milestone.set_result(None)
        log.close()
        lock.release()


def _mesh_and_batch_placement(cfg):
    """The run's device mesh and :func:`~k3jax.parallel.batch_placement`'s function for it;
    ConfigError for experts or a batch the mesh cannot split."""
    from k3jax.parallel import batch_placement, check_experts_fit, make_mesh, start_devices

    mesh = make_mesh(cfg.mesh)
    if cfg.model.moe is not None:
        check_experts_fit(mesh, cfg.mesh.rules, cfg.model.moe.num_experts)
    place = batch_placement(mesh, cfg.mesh.rules, cfg.data.batch_size)
    start_devices(mesh)  # once the run is not refused: a refused run touches no device
    return mesh, place


def _run_locked(cfg, workdir: Path, data, mesh, place, log, first_step: Future,
                first_save: Future) -> dict:
    t_start = time.time()
    # The newest checkpoint's files are hashed on a thread meanwhile (until the restore below).
    verified = verify_newest_ahead(workdir / "checkpoints")
    from k3jax.model import K3Model
    from k3jax.parallel import (
        compile_in_background,
        init_sharded_state,
        sharded_state_shapes,
        shardings_of,
        under_mesh,
    )

    # Here, not at the top: `python -m k3jax.train.memory` runs that module as a script, which
    # importing the package must not have imported already.
    from k3jax.train.memory import check_state_fits

    first_process = jax.process_index() == 0
    config = _recorded_config(cfg, data)
    log(f"[data] {data.description}")
    micro = cfg.data.batch_size // cfg.train.micro_batches
    rules = cfg.mesh.rules
    # The shapes and the axis names for everything below.
    variables, variable_axes = variable_shapes(cfg.model, (micro, cfg.data.seq_len),
                                               _cache_directory())
    params, axes = variables["params"], variable_axes["params"]
    optimizer = build_optimizer(cfg.optim, cfg.train.steps, params, axes)

    def make_state(p, b):
        return init_state(p, b, optimizer, cfg.train.seed)

    state_shapes = jax.eval_shape(make_state, params, variables.get("balance", {}))
    # The per-device state against the device's memory, before any compile.
    state_bytes = check_state_fits(cfg, dict(mesh.shape), _device_bytes(),
                                   abstract=(params, axes, state_shapes["opt_state"]))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_save,
                        log=log, on_save_error=cfg.checkpoint.on_save_error, verified=verified)
    try:
        found = ckpt.newest_usable(config, state_shapes)
        if found is not None:
            note = check_schedule(found[1].get("config", {}), cfg, found[0],
                                  ckpt.step_path(found[0]))
            if note:
                log(note)
    except BaseException:
        ckpt.close()
        raise
    # The run can go on: from here on the workdir changes.
    if first_process:
        write_atomically(workdir / "config.json", json.dumps(config, indent=1))
    sharded_shapes = sharded_state_shapes(cfg.model, mesh, rules, make_state, variables,
                                           variable_axes)
    start = 0 if found is None else found[0]
    # XLA compiles the step on a worker thread while the state is created or restored below (a
    # finished run has no step left to compile).
    steps = _TrainSteps(cfg, mesh, sharded_shapes, axes, first_save, log)
    if start < cfg.train.steps:
        lr_args = steps.start(data.train(start))
    eval_jit = jax.jit(make_eval_step(K3Model(cfg.model)))
    eval_step = under_mesh(eval_jit, mesh, rules)
    # The evaluation at step 0 does not hold up the first step: its program compiles once that
    # step is done (beside the step's compile, the two shared the host and jaxlib's one lock for
    # Mosaic GPU kernels, and the step's took seconds longer), and it evaluates a copy of step
    # 0's variables (below).
    eval_compiled = (compile_in_background(eval_jit, mesh, rules, sharded_shapes["params"],
                                           sharded_shapes["balance"], _abstract(data.heldout[0]),
                                           after=first_step)
                     if start == 0 and data.heldout else None)
    log(f"[model] {_count(params):,} parameters; {cfg.model.num_layers} layers "
        f"{''.join(t[0].upper() for t in cfg.model.layer_types)}; optimiser {cfg.optim.name}")
    if found is None:
        # Jitted with out_shardings: parameters and optimiser moments are created already sharded.
        state = init_sharded_state(cfg.model, mesh, rules, jax.random.PRNGKey(cfg.train.seed),
                                   make_state, (micro, cfg.data.seq_len), variable_axes)
    else:
        # Restored straight into the step's shardings (nothing initialised only to be
        # overwritten): every process reads only its own shards.
        state = ckpt.restore(found[0], sharded_shapes)
        log(f"[checkpoint] resumed from {ckpt.step_path(int(state['step']))}")
        state = jax.device_put(state, shardings_of(sharded_shapes))  # the compiled step's layout
    writer = MetricsWriter(workdir, start, enabled=first_process)
    past = history(read_metrics(workdir), start) if start else {}
    prog = Progress(start, cfg.data.batch_size * cfg.data.seq_len, **past)
    held_out = _Evaluator(cfg, eval_step, data, writer, log)

    def evaluate(step: int, variables: tuple) -> None:
        # The steps dispatched before it are the throughput window's, the evaluation is not.
        jax.block_until_ready(state["step"])
        t0 = time.time()
        prog.last_eval = held_out(step, variables)
        prog.first_eval = prog.first_eval or prog.last_eval
        prog.window_t += time.time() - t0

    # Step 0's variables, kept (a copy: the steps donate the state) until their evaluation runs:
    # as soon as its program is compiled, at the latest before the first checkpoint or the next
    # evaluation, so that evaluations stay in step order.
    initial = None
    if start == 0:
        at_start = (state["params"], state["balance"])
        if eval_compiled is None:
            evaluate(0, at_start)
        else:
            # Into their own shardings: without a target, jax takes arrays over several
            # processes for one device's.
            initial = jax.device_put(at_start, shardings_of(at_start), may_alias=False)
    mfu = _mfu_fn(cfg)
    kill_at = int(os.environ.get(KILL_ENV, "-1"))
    bar = tqdm(total=cfg.train.steps, initial=start, unit="step", dynamic_ncols=True,
               file=sys.stderr, desc="train")
    pending = None
    try:
        for step in range(start, cfg.train.steps):
            host_batch = data.train(step)
            t_call = time.time()
            compiled, fresh = steps.for_batch(step, host_batch)
            state, metrics = compiled.run(state, place({k: host_batch[k] for k in BATCH_KEYS}),
                                          lr_args)
            if pending is not None:
                _check_finite(pending, cfg.train.max_bad_steps, ckpt)
            pending = (step + 1, metrics)
            done = step + 1
            if step == start:  # the first step waits for the compile: time from its end
                jax.block_until_ready(metrics["loss"])
                prog.window_t, prog.window_steps = time.time(), 0
                _record_first_step(writer, log, compiled, done, prog.window_t - t_call,
                                   prog.window_t - t_start, state_bytes)
                first_step.set_result(None)
            elif fresh:  # its compile is not throughput: the window starts after it
                jax.block_until_ready(metrics["loss"])
                prog.window_t, prog.window_steps = time.time(), 0
                log(f"[compile] step {done} done {prog.window_t - t_call:.1f} s after its batch")
            else:
                prog.window_steps += 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                nbytes = float(host_batch["nbytes"]) if data.has_bytes else 0.0
                _log_train(writer, bar, prog, done, metrics, nbytes, mfu)
            bar.update(1)
            saving = done % cfg.checkpoint.every == 0 or done == cfg.train.steps
            # Processes run the evaluation together: with several, only where all know it is due.
            if initial is not None and (saving or done % cfg.eval.every == 0 or (
                    jax.process_count() == 1 and eval_compiled.done())):
                eval_compiled.result()
                evaluate(0, initial)
                initial = None
            # Evaluated before it is saved: a run killed in between redoes the step and its
            # evaluation, where the other order would resume past an evaluation never made.
            if done % cfg.eval.every == 0 or done == cfg.train.steps:
                evaluate(done, (state["params"], state["balance"]))
            if saving:
                ckpt.save(done, state, _meta(config, done, cfg))
                if not first_save.done():  # outside the throughput window
                    prog.window_t += steps.store()
            else:
                ckpt.poll()
            if done == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        if pending is not None:
            _check_finite(pending, cfg.train.max_bad_steps, ckpt)
    finally:
        bar.close()
        writer.close()
        ckpt.close()
    summary = _summary(prog, state, cfg, workdir, ckpt)
    for line in summary["lines"]:
        log(line)
    if first_process:
        write_atomically(workdir / "summary.json", json.dumps(
            {k: v for k, v in summary.items() if k != "lines"}, indent=1))
    return summary


class _TrainSteps:
    """A run's compiled train steps: one per attention layout its batches take
    (:func:`step_documents`), each compiled on a worker thread from the first batch that needs it.
    They are written to the executable cache with the first checkpoint, what a resumed run
    needs (``first_save``): the write holds the interpreter lock for seconds, which would stall
    the steps beside it."""

    def __init__(self, cfg, mesh, sharded_shapes: dict, axes: dict, first_save: Future, log):
        self.cfg, self.mesh, self.sharded_shapes, self.axes = cfg, mesh, sharded_shapes, axes
        self.first_save, self.log = first_save, log
        self.compiling: dict[str, Future] = {}

    def start(self, host_batch: dict) -> dict:
        """Start compiling the step of this batch's layout; returns the schedule's placed numbers
        (the same for every layout)."""
        schedule, self.compiling[step_documents(self.cfg, host_batch)] = compile_step_async(
            self.cfg, self.mesh, self.sharded_shapes, self.axes, host_batch, self.first_save)
        return schedule

    def for_batch(self, step: int, host_batch: dict):
        """``(compiled step, compiled just now)`` for this batch's layout: a layout no batch took
        before compiles here, and the step waits for it."""
        documents = step_documents(self.cfg, host_batch)
        fresh = documents not in self.compiling
        if fresh:
            self.log(f"[compile] step {step + 1}: its batch takes MLA's {documents} attention; "
                     "compiling the train step for that")
            self.start(host_batch)
        return self.compiling[documents].result(), fresh

    def store(self) -> float:
        """Let the compiled steps be written and wait for that; returns the seconds it took."""
        t0 = time.time()
        self.first_save.set_result(None)
        for compiling in self.compiling.values():
            compiling.result().stored.result()
        return time.time() - t0


class _Evaluator:
    """The held-out loss (and bits per byte) of given variables and the accuracy of the config's
    synthetic tasks, written to the metrics and the log."""

    def __init__(self, cfg, eval_step, data, writer: MetricsWriter, log):
        self.eval_step, self.data, self.writer, self.log = eval_step, data, writer, log
        self.tasks = task_batches(cfg.eval.tasks, cfg.data.seq_len, cfg.data.batch_size,
                                  cfg.eval.batches, cfg.model.vocab_size)

    def __call__(self, step: int, variables: tuple) -> dict:
        """Evaluate ``variables`` (params, balance) as those of ``step``; -> the held-out
        result with its ``step``."""
        result = evaluate_batches(self.eval_step, *variables, self.data.heldout)
        if not self.data.has_bytes:
            result.pop("bpb")
        record = {**{k: result[k] for k in EVAL_KEYS if k in result},
                  **flatten(result["diag"], "diag/")}
        for name, batches in self.tasks.items():
            r = evaluate_batches(self.eval_step, *variables, batches)
            record[f"{name}/accuracy"], record[f"{name}/loss"] = r["accuracy"], r["loss"]
        self.writer.write(step, "eval", record)
        extra = "".join(f", {n} acc {record[f'{n}/accuracy']:.3f}" for n in self.tasks)
        self.log(f"[eval] step {step}: held-out {_eval_words(result)}{extra}")
        return {"step": step, **result}


def step_documents(cfg, host_batch: dict) -> str:
    """The MLA ``documents`` setting of the train step that runs ``host_batch``: the config's, or
    for ``"auto"`` the layout the batch's rows take, decided here on the host
    (:func:`~k3jax.ops.attention.batch_documents`), so the step has no ``lax.cond`` to check it."""
    from k3jax.ops.attention import batch_documents

    documents = cfg.model.mla.documents
    return batch_documents(host_batch["segment_ids"]) if documents == "auto" else documents


def with_documents(cfg, documents: str):
    """``cfg`` (an ExperimentConfig) with MLA's ``documents`` setting replaced."""
    mla = dataclasses.replace(cfg.model.mla, documents=documents)
    return dataclasses.replace(cfg, model=cfg.model.replace(mla=mla))


def compile_step_async(cfg, mesh, state_shapes: dict, axes: dict, host_batch: dict,
                       store_after: Future | None = None):
    """The train step of ``cfg`` over ``mesh`` for batches like ``host_batch`` (extra keys
    ignored; its MLA layers take the attention layout :func:`step_documents` picks for it), as the
    loop runs it, compiling on a worker thread
    (:meth:`~k3jax.parallel.step.MeshStep.compile_async`) for the sharded ``state_shapes``
    (:func:`~k3jax.parallel.step.sharded_state_shapes`); ``axes``: the parameters' logical axis
    names. A compilation cache in use gets the XLA autotuning results k3jax ships first
    (:func:`~k3jax.parallel.compile_cache.seed_cache_in_use`).

    Returns ``(schedule, compiling)``: the schedule's numbers, placed for the step (data, so a run
    with another learning rate or length loads this step from the compilation cache), and a future
    of :class:`~k3jax.parallel.step.CompiledStep`. With the executable cache on, the step is
    written there once ``store_after`` (when given) is done, and jax's persistent cache does
    not write it.
    """
    from k3jax.model import K3Model
    from k3jax.parallel import abstract_batch, sharded_step
    from k3jax.parallel.compile_cache import seed_cache_in_use

    seed_cache_in_use()
    rules = cfg.mesh.rules
    model_cfg = with_documents(cfg, step_documents(cfg, host_batch)).model
    step = sharded_step(make_train_step(K3Model(model_cfg), cfg.optim, cfg.train.micro_batches,
                                        cfg.model.moe, axes),
                        state_shapes, mesh, rules, donate=jax.default_backend() != "cpu")
    schedule = jax.device_put(schedule_args(cfg.optim, cfg.train.steps), step.replicated)
    batch = abstract_batch(mesh, rules, {k: host_batch[k] for k in BATCH_KEYS})
    # What make_train_step and sharded_step read of the config (the schedule's numbers are the
    # step's data, not its program): the rest of the key is the arguments, the mesh and the
    # environment (k3jax.parallel.executable_cache).
    description = (model_cfg, without_schedule_numbers(cfg.optim), cfg.train.micro_batches,
                   cfg.mesh)
    return schedule, step.compile_async(state_shapes, batch, schedule, _step_cache(),
                                        description, store_after)


def _abstract(host_batch: dict) -> dict:
    """The step inputs of a host batch as ``jax.ShapeDtypeStruct`` (numpy arrays, as
    :func:`~k3jax.train.evaluation.evaluate_batches` passes them: no sharding)."""
    return {k: jax.ShapeDtypeStruct(host_batch[k].shape, host_batch[k].dtype) for k in BATCH_KEYS}


def _cache_directory() -> Path | None:
    """jax's persistent compilation cache's directory when that cache is on, else None: the
    library keeps what it caches itself beside it."""
    directory = jax.config.jax_compilation_cache_dir
    return Path(directory) if jax.config.jax_enable_compilation_cache and directory else None


def variable_shapes(model_cfg, batch_shape: tuple[int, int],
                    cache_dir: Path | None) -> tuple[dict, dict]:
    """:func:`~k3jax.model.abstract_variables_and_axes`, kept in ``cache_dir`` (when given) under
    a key of the model config, ``batch_shape`` and the environment
    (:func:`~k3jax.parallel.executable_cache.value_key`): a resumed run, or another run of the
    same model, skips the initialiser's trace (``k3_small``: 1.2 s on a 2-core CPU)."""
    from k3jax.model import abstract_variables_and_axes
    from k3jax.parallel.executable_cache import load_or_make, value_key

    def make():
        return abstract_variables_and_axes(model_cfg, batch_shape)

    if cache_dir is None:
        return make()
    key = value_key(("abstract_variables_and_axes", model_cfg, batch_shape))
    return load_or_make(cache_dir / "k3jax-shapes", key, make)


def _step_cache():
    """An :class:`~k3jax.parallel.executable_cache.ExecutableCache` of train steps next to jax's
    persistent compilation cache, when that is on and one process runs
    (:func:`~k3jax.parallel.executable_cache.usable`); else None."""
    from k3jax.parallel.executable_cache import ExecutableCache, usable

    directory = _cache_directory()
    return ExecutableCache(directory / "k3jax-steps") if directory and usable() else None


def _record_first_step(writer: MetricsWriter, log, compiled, step: int, waited: float,
                       since_start: float, state_bytes) -> None:
    """``metrics.jsonl``'s compile record and the log's lines on it: the time from the start to
    the first step done, what the step ``waited`` for its compile, the memory per device."""
    from k3jax.train.memory import memory_line, memory_record  # as in _run_locked

    temp = compiled.temp_bytes()
    writer.write(step, "compile", {"first_step_s": waited, "start_to_first_step_s": since_start,
                                   **compiled.seconds, **memory_record(state_bytes, temp)})
    log(f"[compile] first train step done {since_start:.1f} s after the start; "
        f"{_compile_words(compiled.seconds)} while the state was set up, then the step waited "
        f"{waited:.1f} s")
    if compiled.differs:
        log(miss_line(compiled.differs))
    log(memory_line(state_bytes, temp))


def miss_line(differs: tuple[str, ...]) -> str:
    """The log's line on a step compiled although steps were stored: the first
    :data:`MISS_NAMES` parts of the key that differ (``CompiledStep.differs``)."""
    more = len(differs) - MISS_NAMES
    return (f"[compile] no stored step matched: the most recently used one was made with other "
            f"{', '.join(differs[:MISS_NAMES])}{f' and {more} more' if more > 0 else ''} "
            "(docs/runs.md)")


def _compile_words(seconds: dict) -> str:
    if "load_s" in seconds:
        return f"the compiled step was loaded from the cache in {seconds['load_s']:.1f} s"
    return f"XLA compiled it in {seconds['compile_s']:.1f} s"


def _recorded_config(cfg, data) -> dict:
    """The config as ``config.json`` and the checkpoints record it: with a built corpus, the
    tokenizer is the one that made it (``data.tokenizer`` names what a build would use)."""
    config = cfg.to_dict()
    if data.tokenizer is not None:
        config["data"]["tokenizer"] = data.tokenizer["kind"]
        config["data"]["corpus"] = data.tokenizer
    return config


def _eval_words(result: dict) -> str:
    words = f"loss {result['loss']:.4f}"
    if "bpb" in result:
        words += f", {result['bpb']:.4f} bits/byte"
    return words + ("" if "bpb" in result else f", accuracy {result['accuracy']:.3f}")


def _log_train(writer, bar, prog: Progress, step: int, metrics, nbytes, mfu) -> None:
    m = jax.device_get(metrics)
    elapsed = max(time.time() - prog.window_t, 1e-9)
    tps = prog.window_steps * prog.tokens_per_step / elapsed if prog.window_steps else 0.0
    record = {"loss": m["loss"], "aux_loss": m["aux_loss"], "grad_norm": m["grad_norm"],
              "lr": m["lr"], "tokens_per_s": tps, "finite": float(m["finite"]),
              **flatten(m["maxvio"], "maxvio/"), **flatten(m["diag"], "diag/")}
    if nbytes:
        record["bpb"] = float(m["sum_nats"]) / (np.log(2.0) * nbytes)
    if mfu is not None and tps:
        record["mfu"] = mfu(tps)
    writer.write(step, "train", record)
    prog.last_loss = float(m["loss"])
    extra = f" | MFU {record['mfu']:.1%}" if "mfu" in record else ""
    bar.set_postfix_str(f"loss {prog.last_loss:.4f} | {tps:,.0f} tok/s{extra}")


def _check_finite(pending, max_bad: int, ckpt: Checkpointer) -> None:
    step, metrics = pending
    if bool(metrics["finite"]):
        return
    bad = int(metrics["bad_steps"])
    if bad >= max_bad:
        ckpt.wait()
        good = ckpt.last_good_step()
        where = ckpt.step_path(good) if good is not None else "none saved yet"
        raise NonFiniteError(f"stopping at step {step}: {bad} non-finite steps in a row "
                             f"(loss or gradient NaN/Inf; updates skipped). Last good checkpoint: "
                             f"{where}")


def _meta(config: dict, step: int, cfg) -> dict:
    return {"config": config, "step": step,
            "data_position": {"batches_consumed": step,
                              "sequences_consumed": step * cfg.data.batch_size,
                              "seed": cfg.data.seed}}


def _summary(prog: Progress, state, cfg, workdir: Path, ckpt: Checkpointer) -> dict:
    steps = int(state["step"]) - prog.start_step
    secs = time.time() - prog.t0
    lines = [f"[done] {int(state['step'])} steps ({steps} this run) in {secs / 60:.1f} min; "
             f"{steps * prog.tokens_per_step:,} tokens; final train loss {prog.last_loss:.4f}"]
    out = {"steps": int(state["step"]), "seconds": secs, "skipped_steps": int(state["skipped"]),
           "final_train_loss": prog.last_loss}
    if prog.first_eval and prog.last_eval:
        a, b = prog.first_eval, prog.last_eval
        if "bpb" in a and "bpb" in b:
            lines.append(f"[done] held-out: {a['bpb']:.3f} -> {b['bpb']:.3f} bits/byte "
                         f"({a['loss']:.3f} -> {b['loss']:.3f} nats/token), steps {a['step']} "
                         f"-> {b['step']}")
        else:
            lines.append(f"[done] held-out: loss {a['loss']:.3f} -> {b['loss']:.3f} nats/token, "
                         f"accuracy {a['accuracy']:.3f} -> {b['accuracy']:.3f}, steps "
                         f"{a['step']} -> {b['step']}")
        out.update(heldout_first=_pick(a), heldout_last=_pick(b))
    good = ckpt.last_good_step()
    lines.append(f"[done] non-finite steps skipped: {int(state['skipped'])}; checkpoint "
                 f"{ckpt.step_path(good) if good is not None else '-'}; metrics "
                 f"{workdir / 'metrics.jsonl'}")
    out["lines"] = lines
    return out


def _pick(e: dict) -> dict:
    return {k: e[k] for k in ("step", *EVAL_KEYS) if k in e}


def _count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _device_bytes() -> float | None:
    """A local device's memory as its allocator reports it (None where it says nothing: CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def _mfu_fn(cfg):
    """tokens/s -> model FLOP utilisation, or None where the peak is unknown (CPU)."""
    from k3jax.accounting import mfu_fn

    return mfu_fn(cfg.model, cfg.data.seq_len, jax.devices()[0].device_kind, jax.device_count())
