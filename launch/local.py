"""N processes of resconv_jax.main on this machine, as on a pod: how tests simulate several hosts.

    python -m launch.local --processes=2 --devices_per_process=4 -- \\
        --config=configs/jena.py --workdir=workdirs/jena_2x4

Each process gets its own CPU device count, the coordinator runs in process 0 on 127.0.0.1 (a free
port, bound to loopback only), and every line a process prints is prefixed with its index
("[1] ..."). SIGTERM and SIGINT are forwarded to every process (a SIGTERM is a pod preemption:
all of them save at the same step and exit 0). When a process fails, the others are stopped and
the launcher exits with the first failure's status (128 + N for a process killed by signal N),
or with the cause's when the first to fail was only stopped by another (main's status 5) and
another process reported its own failure.
When the launcher's own output pipe closes (`| head`), every process is stopped as on a
preemption, and the launcher says so in one line and exits 141.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from resconv_jax.errors import EXIT_LOST_PROCESS
from resconv_jax.runtime.signals import EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, discard_output

GRACE_SECONDS = 10.0  # after the first failure, how long the others get before SIGKILL


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(devices: int, base: dict | None = None) -> dict:
    """The environment of one process: `devices` CPU devices and this launcher's XLA flags
    without any device count of its own. (main turns on gloo for the cross-process collectives;
    a single process keeps XLA's in-process ones.)"""
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def commands(num: int, port: int, main_args: list[str], heartbeat: int) -> list[list[str]]:
    """The command line of every process: main's flags plus the multi-process ones; a
    --heartbeat_timeout among main's flags is kept (absl would keep the last one given)."""
    address = f"127.0.0.1:{port}"
    given = any(a.startswith("--heartbeat_timeout") for a in main_args)
    return [
        [
            sys.executable,
            "-m",
            "resconv_jax.main",
            *main_args,
            f"--coordinator_address={address}",
            f"--num_processes={num}",
            f"--process_id={index}",
            *([] if given else [f"--heartbeat_timeout={heartbeat}"]),
        ]
        for index in range(num)
    ]


def _pump(stream, out, prefix: str, on_closed) -> None:
    """Copies a child's lines to `out` with `prefix`; once `out`'s reader has gone away
    (`| head`), calls `on_closed()` and reads on without writing, so that no child blocks on a
    full pipe."""
    writing = True
    for line in iter(stream.readline, ""):
        if writing:
            try:
                out.write(prefix + line)
                out.flush()
            except (BrokenPipeError, ValueError):  # ValueError: `out` was closed meanwhile
                writing = False
                on_closed()
    stream.close()


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def run(num: int, devices: int, main_args: list[str], heartbeat: int = 10) -> int:
    """Starts the processes, waits for all of them; returns the launcher's exit status."""
    port = free_port()
    env = process_env(devices)
    children, pumps = [], []
    pipe_closed, closing = threading.Event(), threading.Lock()

    def forward(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    def on_closed():  # a closed output pipe is a preemption: every process saves at one step
        with closing:  # stdout's and stderr's threads may both find it closed: one SIGTERM
            if not pipe_closed.is_set():
                pipe_closed.set()
                forward(signal.SIGTERM, None)

    for index, command in enumerate(commands(num, port, main_args, heartbeat)):
        child = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        children.append(child)
        for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            pump = threading.Thread(
                target=_pump, args=(stream, out, f"[{index}] ", on_closed), daemon=True
            )
            pump.start()
            pumps.append(pump)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure = _wait(children)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:
            pump.join(timeout=5)
    if pipe_closed.is_set():
        return _said_pipe_closed(first_failure)
    return first_failure


def _said_pipe_closed(failure: int) -> int:
    """After the output pipe closed: one line on stderr (if it is still open), stdout pointed at
    /dev/null (the interpreter's last flush would fail), exit status 141 unless a process
    failed."""
    discard_output(sys.stdout)
    with contextlib.suppress(OSError, ValueError):
        print(
            "error: the output pipe closed (| head?): every process stopped as on a preemption "
            "(a checkpoint saved at one step); rerun the same command to resume",
            file=sys.stderr,
            flush=True,
        )
    return failure or EXIT_PIPE_CLOSED


def _wait(children: list[subprocess.Popen]) -> int:
    """Waits for every child; after the first failure, stops the rest (SIGTERM, then SIGKILL)."""
    failure, deadline = 0, None
    while any([child.poll() is None for child in children]):  # a list: poll every child
        for index, child in enumerate(children):
            if child.returncode not in (None, 0) and not failure:
                failure = exit_status(child.returncode)
                for other in children:
                    if other.poll() is None:
                        other.terminate()
                deadline = time.monotonic() + GRACE_SECONDS
                with contextlib.suppress(OSError, ValueError):  # stderr may be a closed pipe
                    print(
                        f"launch.local: process {index} exited with status {failure}; "
                        "stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
        if deadline is not None and time.monotonic() > deadline:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.05)
    statuses = [exit_status(c.returncode) for c in children]
    if failure in (0, EXIT_LOST_PROCESS):  # the cause, if another process said one
        failure = next((s for s in statuses if _said_by_itself(s)), failure)
    return failure or next((s for s in statuses if s), 0)


def _said_by_itself(status: int) -> bool:
    """A failure a process reported itself (an exit status it chose, Ctrl-C's, a closed
    pipe's), not main's 5 for "stopped by another" nor a signal that the stopping sent
    (SIGTERM, SIGKILL, JAX's abort once the coordinator is gone)."""
    chosen = 0 < status < 128 and status != EXIT_LOST_PROCESS
    return chosen or status in (EXIT_INTERRUPTED, EXIT_PIPE_CLOSED)


class _OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line and exit status 2, as for main, not the usage and the error."""

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrors(
        prog="python -m launch.local",
        description="Run resconv_jax.main as N local processes (a simulated pod).",
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    parser.add_argument(
        "--heartbeat_timeout",
        type=int,
        default=10,
        help="seconds after which a lost process stops the others (main's --heartbeat_timeout)",
    )
    parser.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then main's flags")
    args = parser.parse_args(argv)
    main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices_per_process must be >= 1")
    if not main_args:
        parser.error("give main's flags after --, e.g. -- --config=configs/jena.py --workdir=DIR")
    return run(args.processes, args.devices_per_process, main_args, args.heartbeat_timeout)


if __name__ == "__main__":
    sys.exit(main())
