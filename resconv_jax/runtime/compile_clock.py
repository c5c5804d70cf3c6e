"""Seconds this process spends making programs: tracing a function to a jaxpr, lowering it to
StableHLO, and compiling it with XLA or loading it from the persistent compilation cache, read from
JAX's monitoring events (`jax.monitoring`). A program run again from JAX's in-memory cache adds
nothing.
"""

from __future__ import annotations

import threading

import jax

EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)

_lock = threading.Lock()
_seconds = 0.0
_listening = False


def _add(event: str, duration: float, **_) -> None:
    global _seconds
    if event in EVENTS:
        with _lock:
            _seconds += duration


def seconds() -> float:
    """The seconds spent making programs since the first call of this function in the process
    (the first call starts the count, and returns 0.0)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_add)
            _listening = True
        return _seconds
