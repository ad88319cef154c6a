"""Resuming a run: what a changed learning-rate schedule does, and the run's history so far.

A resumed run whose ``train.steps`` (or learning-rate settings) changed goes on under the new plan:
a WSD run keeps its warmup, its stable phase is extended and its decay planned at the new end.
When the steps already trained had the same learning rates under that plan (a WSD run extended in
its stable phase), the run continues seamlessly and the log says so. When they did not (more steps
after the decay began: the learning rate would rise from its decayed value back to the peak), the
log line is a warning naming the jump, or, with ``train.schedule_change="refuse"``, the resume is
refused naming that choice.
"""

from __future__ import annotations

import numpy as np

from k3jax.config.base import ConfigError
from k3jax.config.experiment import SCHEDULE_FIELDS, OptimConfig, from_dict
from k3jax.train.optim import phases, schedule


def plan(optim, steps: int) -> str:
    """The schedule's phases in words, e.g. ``warmup to step 20, stable to step 284, decay to
    step 400``."""
    warmup, rest, decay = phases(optim, steps)
    if optim.schedule == "wsd":
        return (f"warmup to step {warmup}, stable to step {warmup + rest - decay}, "
                f"decay to step {steps}")
    if optim.schedule == "cosine":
        return f"warmup to step {warmup}, cosine decay to step {steps}"
    return f"warmup to step {warmup}, then constant to step {steps}"


def check_schedule(saved_config: dict, cfg, step: int, path) -> str | None:
    """Compare the checkpoint's schedule (``saved_config``, at ``step``) with ``cfg``'s.

    -> None when nothing changed, else the line to log; ConfigError for a refused change.
    """
    new_optim, new_steps = cfg.optim, cfg.train.steps
    if step > new_steps:
        raise ConfigError(f"train.steps={new_steps} is below step {step} of the checkpoint at "
                          f"{path}; pass train.steps >= {step}, or another --workdir")
    old_optim = from_dict(OptimConfig, saved_config.get("optim", {}),
                          where=f"the checkpoint at {path}", prefix="optim.")
    old_steps = int(saved_config.get("train", {}).get("steps", new_steps))
    if _schedule_key(old_optim, old_steps) == _schedule_key(new_optim, new_steps):
        return None
    # The optimiser counts of the steps already taken (a skipped non-finite step took none, so
    # after k of them the counts end at step - k: the comparison's last k rates are unused ones).
    trained = np.arange(step)
    old_lr = np.asarray(schedule(old_optim, old_steps)(trained))
    new_lr = np.asarray(schedule(new_optim, new_steps)(trained))
    change = (f"train.steps {old_steps} -> {new_steps}" if old_steps != new_steps
              else "the learning-rate settings changed")
    if np.array_equal(old_lr, new_lr):
        return (f"[schedule] {change}: the {step} steps trained so far keep their learning "
                f"rates, so the run continues under the new plan ({plan(new_optim, new_steps)})")
    first = int(np.argmax(old_lr != new_lr))
    at_old = float(schedule(old_optim, old_steps)(step))
    at_new = float(schedule(new_optim, new_steps)(step))
    what = (f"{change} changes the learning rates of steps already trained (from step {first} "
            f"on; the checkpoint at {path} is at step {step} of a run planned as "
            f"{plan(old_optim, old_steps)}): step {step + 1} trains at lr {at_new:.3g} where the "
            f"old plan had {at_old:.3g}")
    if cfg.train.schedule_change == "refuse":
        raise ConfigError(f"{what}. Refused (train.schedule_change=refuse): keep "
                          f"train.steps={old_steps} and the checkpoint's optim settings, use "
                          "another --workdir, or pass --set train.schedule_change=continue")
    return (f"[schedule] warning: {what}; continuing under the new plan "
            f"({plan(new_optim, new_steps)}); --set train.schedule_change=refuse stops instead")


def _schedule_key(optim, steps: int) -> tuple:
    return tuple(getattr(optim, f) for f in SCHEDULE_FIELDS), steps


def history(records: list[dict], upto: int) -> dict:
    """The run's first and last held-out evaluations and last train loss up to step ``upto``,
    from its metrics records (so the summary of a resumed or finished run covers all of it)."""
    kept = [r for r in records if r.get("step", 0) <= upto]
    evals = [r for r in kept if r.get("kind") == "eval"]
    trains = [r for r in kept if r.get("kind") == "train" and r.get("loss") is not None]
    return {"first_eval": evals[0] if evals else None, "last_eval": evals[-1] if evals else None,
            "last_loss": float(trains[-1]["loss"]) if trains else float("nan")}
