"""Test configuration shared by the suite.

The environment of ``suite_env.py`` (eight simulated CPU devices, so the expert-parallel tests can
build real meshes, and the compile flags) is set before jax is imported; single-device tests simply
use device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One BLAS thread per test process (and the subprocesses they start): the suite runs a process
# per core, and OpenBLAS's threads spin against each other on the small scipy fits of the sweep
# report (a fit took minutes instead of seconds on a loaded 2-core machine). Before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from suite_env import SIMULATED_DEVICES, xla_flags  # noqa: E402

for _flag in xla_flags(SIMULATED_DEVICES).split():  # flags already given by the caller win
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402  (after the flags above)

jax.config.update("jax_default_matmul_precision", "highest")

# ``train.py``'s ``main`` switches on the persistent compilation cache. Called inside a test process
# it would leave the cache on for every later test of that worker, which would then hash and write
# each compiled program to a finished test's directory (~5% more compile time). Subprocesses (the
# train.py and sweep runs) are not affected: they use the cache as users do.
jax.config.update("jax_enable_compilation_cache", False)

# `make test` runs `pytest -n 2 --dist loadfile`: whole files go to the two workers in the queue's
# order. These files start training jobs or benchmark scripts in subprocesses (a minute or more
# each, in one to five tests): they are queued first, so they run while the other worker takes the
# many short files, not at the end on one worker with the other idle. (pytest-xdist would otherwise
# queue files by their number of tests, which puts exactly these last.)
SUBPROCESS_HEAVY_FILES = ("test_distributed_train.py", "test_train.py", "test_benchmarks_smoke.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return SUBPROCESS_HEAVY_FILES.index(name) if name in SUBPROCESS_HEAVY_FILES else len(
            SUBPROCESS_HEAVY_FILES)

    items.sort(key=rank)  # stable: the order inside each file and of the other files is kept
