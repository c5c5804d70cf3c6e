"""Test helper: wait until a child process handles a signal before sending it (a signal sent
during the interpreter's start-up, before the handler exists, kills the process instead)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def caught(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (Linux: /proc's SigCgt)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def wait_until_caught(
    process: subprocess.Popen, signum: int = signal.SIGTERM, timeout: float = 120.0
) -> None:
    """Returns once `process` handles `signum`; AssertionError if it exited or took `timeout` s.
    Without /proc (macOS): after a second, which a quiet machine's start-up needs."""
    if not os.path.exists(f"/proc/{process.pid}/status"):
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if caught(process.pid, signum):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {process.pid} never handled signal {signum}")
