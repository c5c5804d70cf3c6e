"""Entry point: python -m resconv_jax.main --config=configs/theory.py --workdir=DIR [--config.x=y].

Runs (or resumes) the config's sweep in DIR. Several processes (a pod, a cluster, or
`python -m launch.local`) run the same command, with --coordinator_address, --num_processes and
--process_id, or in a cluster JAX detects by itself (TPU, srun, mpirun): see multihost.py.
Every failure is one line on stderr; exit statuses:

  0  finished; or stopped by SIGTERM (a checkpoint saved, or nothing trained yet): rerun to go on
  1  a run diverged (the line names the last good checkpoint and a step size to try)
  2  bad input: flags, the config file, a config value, the data, a size that cannot fit, a
     workdir that holds another run; nothing was written
  3  the workdir is in use by another process (the line names its PID and host)
  4  a write into the workdir failed (disk full, vanished, read-only): the last checkpoint and
     every metrics line before it are intact; free space and rerun the same command
  5  multi-process: another process stopped responding or failed (the line names it); rerun the
     same command on every process to resume from the last checkpoint
  130  interrupted by Ctrl-C: while starting, nothing was written; later, the last checkpoint
     and the metrics lines before it are kept: rerun the same command to resume
  141  the output pipe closed (`| head`): as 130 (multi-process: the others exit 5)
--help prints the flags and exits 0.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback

from resconv_jax.runtime import signals

if __name__ == "__main__":  # until main() starts: Ctrl-C is one line, not a traceback
    signals.exit_on_interrupt()
# Seen from the first moment: a SIGTERM during the imports below stops the run before it starts.
# (In a multi-process run JAX's preemption notifier takes SIGTERM over once the processes join.)
# Second, so that a process that handles SIGTERM handles Ctrl-C too (the tests wait for that).
signals.install()
# Threaded OpenBLAS inside XLA's own CPU threads slows LAPACK (the probe's QR) ~30x; set first.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The imports make objects that live as long as the process: no garbage collection while they
# load, then frozen (`_frozen`), so that no later collection, the exit's included, walks them.
gc.disable()

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from resconv_jax import experiments  # noqa: E402
from resconv_jax.analysis.summary import format_summary  # noqa: E402
from resconv_jax.errors import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_DIVERGED,
    EXIT_LOST_PROCESS,
    EXIT_WRITE_FAILED,
    ConfigError,
    Preempted,
    TrainingDiverged,
    WorkdirBusy,
    WorkdirWriteError,
    exit_on_help,
    exit_with,
    one_line,
)
from resconv_jax.runtime import compile_cache, multihost  # noqa: E402
from resconv_jax.validation import check_sections, renamed_flag, wants_float64  # noqa: E402


def _frozen() -> None:
    """Moves every object alive now out of the garbage collector's reach (`gc.freeze`): the
    exit's collection of JAX's modules alone takes ~0.4 s."""
    gc.freeze()
    gc.enable()


_frozen()

EXIT_INTERRUPTED = signals.EXIT_INTERRUPTED  # Ctrl-C (SIGINT), as a shell reports it
EXIT_PIPE_CLOSED = signals.EXIT_PIPE_CLOSED  # stdout's reader went away (`| head`)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics); resumes.")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordinator (multi-process runs)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. N-1.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache",
    "",
    "Folder of JAX's persistent compilation cache (a rerun loads what was compiled before), "
    "or 'off'. Default: $RESCONV_JAX_COMPILATION_CACHE, else ~/.cache/resconv_jax/jax.",
)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout",
    100,
    "Seconds without a heartbeat after which a multi-process run counts a process as lost and "
    "every other process stops.",
)


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _check_config_file(path: str) -> None:
    """One line for a config file that cannot be a config: missing, unreadable, not Python."""
    where = f"--config={path}"
    if not os.path.exists(path) and ":" in path:  # FILE:ARG passes ARG to get_config
        path = path.rsplit(":", 1)[0]
    if not os.path.exists(path):
        exit_with(f"{where}: no such file", EXIT_BAD_INPUT)
    if os.path.isdir(path):
        exit_with(f"{where}: is a folder, not a config file", EXIT_BAD_INPUT)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as error:
        exit_with(f"{where}: cannot read it ({error.strerror})", EXIT_BAD_INPUT)
    try:
        compile(source, path, "exec")
    except (SyntaxError, ValueError) as error:
        line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
        reason = getattr(error, "msg", None) or str(error)
        exit_with(f"{where}: not a Python config file ({reason}{line})", EXIT_BAD_INPUT)
    if b"get_config" not in source:
        exit_with(f"{where}: defines no get_config()", EXIT_BAD_INPUT)


def _flag_error(error: BaseException) -> str:
    """absl's and ml_collections' messages, on one line and without their quoting."""
    return one_line(error).replace("'", "'").replace("'", "")


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors: an unknown config key, a value of the wrong type,
    a config file that is missing, is not Python, or fails in get_config()."""
    exit_on_help(argv)
    path = _config_path(argv)
    if path is not None:
        _check_config_file(path)
    if renamed := renamed_flag(argv):
        exit_with(renamed, EXIT_BAD_INPUT)
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        text = str(error).strip()
        if "Traceback (most recent call last)" in text:  # get_config() raised: its last line
            reason = text.splitlines()[-1].strip()
            exit_with(f"--config={path}: loading it failed ({_flag_error(reason)})", EXIT_BAD_INPUT)
        exit_with(f"bad flag: {_flag_error(error)}", EXIT_BAD_INPUT)
    except (AttributeError, KeyError, TypeError) as error:
        exit_with(f"bad flag: {_flag_error(error)}", EXIT_BAD_INPUT)
    except Exception as error:  # noqa: BLE001 - the config file's own code ran and failed
        cause = error.__cause__ or error
        exit_with(
            f"--config={path}: loading it failed ({type(cause).__name__}: {_flag_error(cause)})",
            EXIT_BAD_INPUT,
        )


def _stopped_before_start() -> None:
    if signals.requested():
        print(
            "SIGTERM during start-up: nothing was trained yet; rerun the same command", flush=True
        )
        sys.exit(0)


def main(argv: list[str]) -> None:
    """Every process of a multi-process run tells the others how it ended (`PeerWatchdog`)."""
    signals.interrupts_raise()
    try:
        _main(argv)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
        # Multi-process: not JAX's exit-time shutdown, which waits for every process. A failed
        # write: Orbax's threads of a checkpoint that failed would block the interpreter's exit.
        if status == EXIT_WRITE_FAILED or (_watchdog is not None and status):
            _exit_now(status)
        _watchdog_finish(status)
        raise
    except KeyboardInterrupt:  # Ctrl-C: one line; at once, as for a failed write (Orbax's threads)
        with contextlib.suppress(OSError):
            print(
                "error: interrupted (Ctrl-C); the last checkpoint and the metrics lines before "
                "it are kept: rerun the same command to resume",
                file=sys.stderr,
                flush=True,
            )
        _exit_now(EXIT_INTERRUPTED)
    except Exception as error:
        if isinstance(error, BrokenPipeError):  # this process's own output: no peer to wait for
            _pipe_closed()
        if _watchdog is None:
            raise
        # Multi-process: a collective fails when another process dies; name it if so (exit 5).
        _watchdog.wait_for_loss()
        with contextlib.suppress(OSError):  # stderr itself may be what failed (a closed pipe)
            traceback.print_exc()
        _exit_now(1)  # JAX's exit-time shutdown would wait for the other processes forever
    _watchdog_finish(0)


def _pipe_closed() -> None:
    """A process whose stdout's reader went away (`| head`): one line on stderr, exit 141 (the
    other processes of a multi-process run are told, and exit 5)."""
    signals.discard_output(sys.stdout)
    with contextlib.suppress(OSError):
        print(
            "error: the output pipe closed (| head?): stopped; the last checkpoint and the "
            "metrics lines before it are kept: rerun the same command to resume",
            file=sys.stderr,
            flush=True,
        )
    _exit_now(EXIT_PIPE_CLOSED)


def _exit_now(status: int) -> None:
    """Tells the other processes (if any) how this one ended, flushes what can still be
    flushed, and exits at once, without the interpreter's exit-time handlers."""
    _watchdog_finish(status)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


_watchdog: multihost.PeerWatchdog | None = None


def _watchdog_finish(status: int) -> None:
    if _watchdog is not None:
        _watchdog.finish(status)


def _quiet_stdout(print_here: bool) -> None:
    """Multi-process: every process computes the same lines, so process 0 alone prints them; and
    no process's fd 1 gets the C++ collectives' chatter ("[Gloo] Rank 3 is connected to 7 peer
    ranks", per process and device). Errors stay on stderr everywhere."""
    sys.stdout.flush()
    kept = os.dup(1) if print_here else None
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    # The file objects live as long as the process.
    sys.stdout = open(kept, "w") if print_here else open(os.devnull, "w")  # noqa: SIM115


def _on_lost_process(message: str, last_words=None) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"error: {message}", file=sys.stderr, flush=True)
    if last_words is not None:
        last_words()
    os._exit(EXIT_LOST_PROCESS)


def _main(argv: list[str]) -> None:
    global _watchdog
    if len(argv) > 1:
        exit_with(f"unexpected arguments: {' '.join(argv[1:])}", EXIT_BAD_INPUT)
    _stopped_before_start()
    try:
        launch = multihost.resolve_launch(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _HEARTBEAT.value
        )
    except ConfigError as error:
        exit_with(str(error), EXIT_BAD_INPUT)
    logging.set_verbosity(logging.WARNING)  # before jax.distributed's INFO lines
    if launch.multi_process:
        # SIGTERM stays ours while the processes join, then is JAX's preemption notifier's.
        if not multihost.initialize(launch, stop=signals.requested):
            print("SIGTERM during start-up: nothing was trained yet; rerun the same command",
                  flush=True)  # fmt: skip
            _exit_now(0)  # the joining thread still waits for the others
        lost_after = max(2.0, launch.heartbeat_timeout_seconds / 2)
        _watchdog = multihost.PeerWatchdog(_on_lost_process, lost_after).start()
        _quiet_stdout(print_here=jax.process_index() == 0)
    compile_cache.enable(_COMPILATION_CACHE.value)
    try:
        config = _CONFIG.value
        config.task  # noqa: B018 - config_flags loads the file on first access
    except Exception as error:  # noqa: BLE001 - config_flags defers the config file's errors
        cause = error.__cause__ or error
        exit_with(f"--config: loading it failed ({_flag_error(cause)})", EXIT_BAD_INPUT)
    try:
        check_sections(config)
    except ConfigError as error:
        exit_with(str(error), EXIT_BAD_INPUT)
    if wants_float64(config):
        jax.config.update("jax_enable_x64", True)
        print("float64 in the config: jax_enable_x64 is on", flush=True)
    _stopped_before_start()
    try:
        workdir = os.path.expanduser(_WORKDIR.value)  # --workdir=~/x: the shell leaves the ~
        summaries = experiments.run_task(config, workdir, reuse_finished=True)
    except ConfigError as error:
        exit_with(str(error), EXIT_BAD_INPUT)
    except ValueError as error:  # data errors: one line naming the file and the problem
        exit_with(str(error), EXIT_BAD_INPUT)
    except WorkdirBusy as error:
        exit_with(str(error), EXIT_BUSY)
    except WorkdirWriteError as error:
        if _watchdog is not None:  # a checkpoint's collective fails when another process dies
            _watchdog.wait_for_loss()
        exit_with(str(error), EXIT_WRITE_FAILED)
    except TrainingDiverged as error:
        exit_with(str(error), EXIT_DIVERGED)
    except Preempted as error:
        print(str(error), flush=True)
        return
    for summary in summaries:
        print(format_summary(summary), flush=True)
    _frozen()  # what the run imported and built: not walked again at exit


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
