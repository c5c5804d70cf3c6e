"""Test setup: 8 virtual CPU devices so that sharded code paths are exercised, and one JAX
compilation cache for the session (its subprocesses included): most tests compile the same few
small programs again and again, and their compile time dominates the suite's."""

import atexit
import os
import shutil
import tempfile

# LLVM's backend optimization off (-O0): the tests' programs are tiny and compiling them is most
# of the suite's time (fast tier 162 s against 209 s, 2 cores, back to back). Programs that a
# test compares are compiled alike (the tests' subprocesses too); users' runs, `reproduce` and
# the benchmarks keep XLA's default. RESCONV_TEST_XLA_OPTIMIZE=1 runs the suite at the default.
# -O0 can hide what optimization rounds differently: a test about such bits runs its programs in
# subprocesses with XLA_FLAGS cleared (test_train's trajectory-against-log_every test).
FLAGS = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
if not os.environ.get("RESCONV_TEST_XLA_OPTIMIZE"):
    FLAGS.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight virtual devices share the cores: threaded BLAS in each per-device QR thrashes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="resconv_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests expect 8 CPU devices; import jax only after conftest"


@pytest.fixture
def fewer_draws():
    """The claims' statistics at the smoke-test draw counts (`stats.SMOKE_TEST_COUNTS`)."""
    from resconv_jax.analysis import stats

    with stats.counts(**stats.SMOKE_TEST_COUNTS):
        yield


def pytest_collection_modifyitems(config, items):
    """The slow tests first (in their files' order): under pytest-xdist the long ones start
    early and the short ones fill the end, rather than one worker finishing a long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
