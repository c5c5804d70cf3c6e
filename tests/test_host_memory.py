"""glibc's malloc keeps XLA:CPU's freed step buffers (runtime/host_memory): no page faults per
step, in a fresh process; nothing changed in one that imported jax already."""

import os
import subprocess
import sys

import pytest

from resconv_jax.runtime import host_memory

# A (4096, 4096) float32 temporary (64 MiB, 16,384 pages) in every call of the jitted function.
SCRIPT = """
import resource
from resconv_jax.runtime import host_memory
kept = host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 256), jnp.float32)
f = jax.jit(lambda x: (x @ x.T) @ x)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""


def faults_of_a_step(**env) -> tuple[str, list[int]]:
    """(whether keep_freed_memory acted, the minor page faults of each of 8 calls)."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=os.environ | env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    kept, *faults = done.stdout.split()
    return kept, [int(f) for f in faults]


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's mallopt only")
def test_a_step_reuses_its_freed_temporaries_instead_of_faulting_them_in():
    kept, faults = faults_of_a_step()
    # After the first calls most are fault-free (0-1,300 faults: the output, small buffers); now
    # and then one maps its temporary afresh (seen: 2 of 7 calls in one of 6 runs).
    assert kept == "True" and sum(f < 2000 for f in faults[1:]) >= 3, faults
    kept, faults = faults_of_a_step(**{host_memory.ENV: "default"})
    assert kept == "False" and min(faults) > 8000, faults  # glibc's defaults: mapped every call


def test_nothing_changes_once_jax_is_imported():
    import jax  # noqa: F401 - conftest imported it already

    assert host_memory.keep_freed_memory() is False
    assert host_memory.free_heap_bytes() >= 0
