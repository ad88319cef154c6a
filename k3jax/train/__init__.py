"""Training: optimiser, the jitted step, checkpoints, metrics, evaluation and the loop."""

from k3jax.train.checkpoint import Checkpointer, CheckpointSaveError
from k3jax.train.loop import NonFiniteError, run
from k3jax.train.optim import build_optimizer, schedule, schedule_args
from k3jax.train.step import init_state, make_eval_step, make_train_step

__all__ = ["CheckpointSaveError", "Checkpointer", "NonFiniteError", "build_optimizer",
           "init_state", "make_eval_step", "make_train_step", "run", "schedule", "schedule_args"]
