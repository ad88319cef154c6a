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

# The Pallas interpreter imports the fuser on its first kernel, and a setting the fuser registers
# is part of every jit's cache key: every program a worker compiled before that point would compile
# again when next called. Imported here, before any test traces anything.
import jax.experimental.pallas.fuser  # noqa: E402, F401
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """jax's persistent compilation cache as a run sets it up, in one directory for all of this
    run's test processes (the xdist workers share their run's temporary directory). Many tests
    compile a program that another test has compiled already: each training loop a test runs, for
    one, builds its step afresh, which jax's in-memory cache cannot know is the same. Those
    programs are then loaded, not compiled again (12% less CPU time for the training, layer and
    generation tests on a 2-core machine, run side by side with and without the cache).
    Subprocesses (the train.py and sweep runs) keep the cache their test gives them."""
    from jax.experimental.compilation_cache import compilation_cache

    from k3jax.parallel.compile_cache import use_compilation_cache

    base = tmp_path_factory.getbasetemp()
    use_compilation_cache((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
                          / "jax-cache")
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()  # jax decides at its first compile whether a cache is in use


@pytest.fixture()
def restore_cache_config():
    """The persistent cache's options restored after the test (which may point the cache
    elsewhere, as ``train.py``'s ``main`` does). jax decides once per process whether its cache is
    in use: that is reset on both sides too."""
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_enable_compilation_cache")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()

# `make test` runs `pytest -n 2 --dist loadfile`: whole files go to the two workers in the queue's
# order, each worker taking the next file as it runs out. Queued longest first (the largest
# files' test-seconds on a loaded 2-core machine, in this order: 110 down to 20 s), the two workers
# end within a short file of each other; in collection order one worker ran a minute longer than
# the other. The rest follow in collection order. (pytest-xdist would otherwise queue files by
# their number of tests.)
HEAVIEST_FILES_FIRST = (
    "test_train.py", "test_attnres.py", "test_pallas_kda.py", "test_sweep.py",
    "test_benchmarks_smoke.py", "test_distributed_train.py", "test_model.py",
    "test_pallas_kda_solve.py", "test_parallel.py", "test_pallas_kda_scores.py",
    "test_generate.py", "test_layers.py", "test_kda_ops.py", "test_convert_checkpoint.py",
    "test_ep_dispatch.py", "test_prefix_cache.py", "test_balancing.py", "test_moe.py",
    "test_readme.py", "test_accounting.py", "test_generate_cli.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return HEAVIEST_FILES_FIRST.index(name) if name in HEAVIEST_FILES_FIRST else len(
            HEAVIEST_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside each file and of the other files is kept
