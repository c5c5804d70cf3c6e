"""SIGTERM as a request to stop at the next safe point (a log step, or before training starts);
and, for `reproduce`, a closed output pipe (`| head`) as the same request
(`stop_when_output_closes`).

`main.py` installs the handler before it imports JAX, so a SIGTERM at any point of start-up is
seen; `train.run` installs it too (for library callers) and polls `requested()`. On several
processes it serves only while they join (`multihost.initialize`): then JAX's preemption notifier
takes SIGTERM over, and a Python handler installed after it would hide SIGTERM from it, so that
only the signalled process would stop (`train.run` installs none there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_received = threading.Event()


def _on_sigterm(signum, frame) -> None:
    _received.set()


def install():
    """Routes SIGTERM to the flag; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def restore(previous) -> None:
    """Puts back a handler returned by `install`."""
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def requested() -> bool:
    """Whether a SIGTERM arrived and has not been acted on yet."""
    return _received.is_set()


def acknowledge() -> None:
    """Marks the pending SIGTERM as handled (the caller stops)."""
    _received.clear()


class _StopWhenClosed:
    """A text stream whose BrokenPipeError (its reader went away) is a stop request instead."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _output_closed(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _output_closed(self._stream)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def stop_when_output_closes() -> None:
    """From now on, stdout's reader going away (`| head`) is a stop request, as a SIGTERM is
    (`requested()`), and `output_closed()` says so; what is printed afterwards goes nowhere."""
    _closed.clear()
    if not isinstance(sys.stdout, _StopWhenClosed):
        sys.stdout = _StopWhenClosed(sys.stdout)


def _output_closed(stream) -> None:
    discard_output(stream)
    _closed.set()
    _received.set()


def discard_output(stream) -> None:
    """Points `stream`'s file descriptor at /dev/null after its reader went away: later writes,
    the interpreter's exit-time flush too, vanish instead of failing. Nothing for a stream
    without one."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


def output_closed() -> bool:
    """Whether stdout's reader went away since `stop_when_output_closes`."""
    return _closed.is_set()


_closed = threading.Event()

EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away
EXIT_INTERRUPTED = 130  # the exit status after Ctrl-C (SIGINT), as a shell reports it


def exit_on_interrupt() -> None:
    """Until `interrupts_raise`: Ctrl-C (SIGINT) writes one line on stderr, that nothing was
    written, and exits with EXIT_INTERRUPTED at once. For a command's start-up (the imports,
    the flags), where Python's KeyboardInterrupt would be a traceback through library code. An
    ignored SIGINT (a background job of a script, nohup) stays ignored."""

    def stop(signum, frame) -> None:
        os.write(2, b"error: interrupted (Ctrl-C) while starting; nothing was written\n")
        os._exit(EXIT_INTERRUPTED)

    if _on_main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        _interrupt_before.append(signal.signal(signal.SIGINT, stop))


def interrupts_raise() -> None:
    """Puts back the SIGINT handling that `exit_on_interrupt` replaced (Python's
    KeyboardInterrupt, unless SIGINT was ignored)."""
    if _on_main_thread() and _interrupt_before:
        signal.signal(signal.SIGINT, _interrupt_before.pop())


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupt_as_stop():
    """Within: the first Ctrl-C (SIGINT) sets `interrupted()` instead of raising, for a loop
    that stops at its next safe point; a second one raises KeyboardInterrupt. An ignored SIGINT
    stays ignored."""
    _interrupted.clear()

    def first_stops(signum, frame) -> None:
        if _interrupted.is_set():
            raise KeyboardInterrupt
        _interrupted.set()

    if not _on_main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, first_stops)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted() -> bool:
    """Whether a Ctrl-C arrived within `interrupt_as_stop`."""
    return _interrupted.is_set()


@contextlib.contextmanager
def ignored_by_children():
    """A process started within (fork and exec) ignores SIGINT and SIGTERM, as it inherits
    SIG_IGN, until it installs its own handling: a Ctrl-C or a stop during its imports would
    otherwise kill it with a traceback. In this process the two are blocked meanwhile, so that
    one arriving then is delivered afterwards, not lost; the child may inherit that mask too, and
    must unblock them once its handlers are in place."""
    if not _on_main_thread():
        yield
        return
    stops = {signal.SIGINT, signal.SIGTERM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    handlers = {number: signal.signal(number, signal.SIG_IGN) for number in stops}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


_interrupted = threading.Event()
_interrupt_before: list = []  # the SIGINT handler that exit_on_interrupt replaced
