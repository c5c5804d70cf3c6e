"""The host CPU as the reports name it: its model and the cores this process may use."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's 'model name' on Linux), else the platform's
    processor or machine type."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The CPU cores this process may run on (what taskset or a container allows, on Linux):
    the cores XLA:CPU sizes its thread pools for."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
