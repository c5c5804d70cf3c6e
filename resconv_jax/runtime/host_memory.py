"""glibc's malloc set for XLA:CPU, whose every execution allocates its temporaries and frees them.

With glibc's defaults a large allocation (above its mmap threshold, at most 32 MiB) or one made in
a thread's own arena is mapped fresh and unmapped when freed, so each step faults its temporaries
back in page by page: the GPT-2-small-shaped step of `benchmarks/vs_hf_gpt2.py` at L = 2 (562 MiB
of temporaries) takes 144,000 minor page faults and 0.69-1.07 s per step, against 0 faults and
0.58-0.60 s in 4 of 4 steps with `keep_freed_memory` (2 cores, AMD EPYC, 2026-12-03; now and then
a step still maps a temporary afresh: tests/test_host_memory.py). It sets, by `mallopt`, one
arena, no mmap, and a 2 GiB trim threshold: freed memory stays in the heap for the next step.

It acts only before jax is imported (XLA's threads, once started, keep arenas of their own), so
`resconv_jax.main` and `resconv_jax.reproduce` call it first thing; a process that imported jax
already (a test, a notebook) is left as it is. What it costs: the heap keeps its peak size until
the process exits, which MemAvailable does not count as free; `free_heap_bytes` does.
Off with RESCONV_JAX_HOST_MALLOC=default; on a C library other than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "RESCONV_JAX_HOST_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> bool:
    """One malloc arena, no mmap, a 2 GiB trim threshold; True when set. Nothing is changed (False)
    after jax was imported, with RESCONV_JAX_HOST_MALLOC=default, or without glibc."""
    if "jax" in sys.modules or os.environ.get(ENV, "") == "default":
        return False
    libc = _glibc()
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def free_heap_bytes() -> int:
    """Bytes that malloc holds free for this process (glibc ≥ 2.33's mallinfo2 `fordblks`), which
    its next allocations reuse; 0 where unknown."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)
