"""Test setup: 8 virtual CPU devices so that sharded code paths are exercised."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight virtual devices share the cores: threaded BLAS in each per-device QR thrashes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests expect 8 CPU devices; import jax only after conftest"
