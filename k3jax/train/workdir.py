"""A run's working directory: one run at a time, and a log file that keeps library chatter.

:class:`WorkdirLock` is an OS file lock (``flock`` on ``WORKDIR/.lock``): the kernel releases it
when the holding process ends, however it ends, so a killed run never leaves a stale lock. The
holder writes who it is into the file; a second run reads that and stops naming it. A
multi-process run takes the lock once, in process 0 (:func:`lock_run`).

:class:`RunLog` prints the run's own lines and appends them to ``WORKDIR/train.log``; orbax's and
absl's log records go to that file only, so the console shows what a user needs to read.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import sys
import time
from pathlib import Path

from k3jax.config.base import ConfigError

LOCK_FILE = ".lock"
LOG_FILE = "train.log"
LIBRARY_LOGGERS = ("absl", "orbax", "tensorstore")


class WorkdirInUse(ConfigError):
    """Another run holds the workdir."""


def check_workdir(workdir: str | Path) -> Path:
    """The workdir as a path that is, or can become, a directory (else ConfigError)."""
    path = Path(workdir)
    for p in (path, *path.absolute().parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == path else f"lies under {p}, which is a file"
            raise ConfigError(f"--workdir {str(workdir)!r} {what}; expected a directory")
    return path


class WorkdirLock:
    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise WorkdirInUse naming its holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise WorkdirInUse(f"--workdir {str(self.path.parent)!r} is in use by another run "
                               f"({holder}); wait for it to end, or pass another --workdir"
                               ) from None
        os.ftruncate(fd, 0)
        os.write(fd, (f"pid {os.getpid()} on {socket.gethostname()}, started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}").encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_run(workdir: str | Path) -> WorkdirLock:
    """Process 0 takes the workdir's lock; every process learns whether it got it, so all of a
    multi-process run stop together when another run holds it."""
    import jax
    import numpy as np

    lock, error = WorkdirLock(workdir), None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except WorkdirInUse as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if not int(multihost_utils.broadcast_one_to_all(np.int32(error is None))):
            error = error or WorkdirInUse(f"--workdir {str(workdir)!r} is in use by another run "
                                          "(process 0's message names it)")
    if error is not None:
        raise error
    return lock


class RunLog:
    """``log(msg)``: print to stderr and append to the run's log file (once :meth:`open` ran)."""

    def __init__(self, echo=None):
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr))
        self._file, self._handler, self._saved = None, None, []
        self._early: list[str] = []  # lines logged before the file opened (the data's)

    def __call__(self, msg) -> None:
        self._echo(str(msg))
        self.record(msg)

    def record(self, msg) -> None:
        """Append ``msg`` to the log file only."""
        if self._file is None:
            self._early.append(str(msg))
            return
        self._file.write(f"{msg}\n")
        self._file.flush()

    def open(self, path: Path) -> None:
        """Append to ``path`` from now on and send the libraries' log records there only."""
        self._file = path.open("a")
        for msg in self._early:
            self.record(msg)
        self._early = []
        self._handler = logging.StreamHandler(self._file)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s "
                                                     "%(message)s"))
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate))
            logger.addHandler(self._handler)
            logger.propagate = False

    def close(self) -> None:
        for logger, propagate in self._saved:
            logger.removeHandler(self._handler)
            logger.propagate = propagate
        self._saved = []
        if self._file is not None:
            self._file.close()
            self._file = None
