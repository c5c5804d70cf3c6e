"""Batched CPU linear algebra that cannot deadlock, and the precision of a dtype.

jaxlib's CPU LAPACK kernels (jaxlib 0.10) split a batch of matrices into tasks on XLA's intra-op
thread pool and block until the tasks finish. When every pool thread is itself blocked in such a
call (several devices, or concurrent kernels, on a 2-core machine) nothing runs the tasks and the
program hangs. A batch whose work is below the kernels' ~2e5 FLOP task threshold, or a single
matrix, runs inline on the calling thread, so `small_batches` feeds LAPACK such batches through
`lax.map`. Other backends get the whole batch in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

INLINE_FLOP = 10_000  # well below jaxlib's per-task minimum work (2e5 FLOP)


def small_batches(fn: Callable, x: jax.Array):
    """`fn` of one (m, n) matrix, applied to every matrix of x (..., m, n) in small batches.

    Returns fn's outputs with x's batch dimensions in front. Must not run under `jax.vmap`
    (which would batch the calls again).
    """
    *batch, m, n = x.shape
    flat = x.reshape(-1, m, n)
    if jax.default_backend() != "cpu":
        out = jax.vmap(fn)(flat)
    else:
        size = max(1, INLINE_FLOP // max(m * n * min(m, n), 1))
        out = jax.lax.map(fn, flat, batch_size=min(size, flat.shape[0]))
    return jax.tree.map(lambda o: o.reshape(*batch, *o.shape[1:]), out)


def eps_relative_to_float32(dtype) -> float:
    """Machine epsilon of `dtype` in units of float32's: 1 for float32, ~1.9e-9 for float64.

    Scales thresholds set for float32 rounding (fit and rank-collapse floors) to other dtypes."""
    return float(np.finfo(dtype).eps / np.finfo(np.float32).eps)
