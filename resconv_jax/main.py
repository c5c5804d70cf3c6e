"""Entry point: python -m resconv_jax.main --config=configs/theory.py --workdir=DIR [--config.x=y].

Runs (or resumes) the config's sweep in DIR. Every failure is one line on stderr; exit statuses:

  0  finished; or stopped by SIGTERM (a checkpoint saved, or nothing trained yet): rerun to go on
  1  a run diverged (the line names the last good checkpoint and a step size to try)
  2  bad input: flags, the config file, a config value, the data, a size that cannot fit, a
     workdir that holds another run; nothing was written
  3  the workdir is in use by another process (the line names its PID and host)
  4  a write into the workdir failed (disk full, vanished, read-only): the last checkpoint and
     every metrics line before it are intact; free space and rerun the same command
"""

from __future__ import annotations

import os
import sys

from resconv_jax import signals

# Seen from the first moment: a SIGTERM during the imports below stops the run before it starts.
signals.install()
# Threaded OpenBLAS inside XLA's own CPU threads slows LAPACK (the probe's QR) ~30x; set first.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from resconv_jax import experiments, train  # noqa: E402
from resconv_jax.analysis.summary import format_summary  # noqa: E402
from resconv_jax.validation import ConfigError, wants_float64  # noqa: E402
from resconv_jax.workdir import WorkdirBusy, WorkdirWriteError  # noqa: E402

EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_WRITE_FAILED = 1, 2, 3, 4

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics); resumes.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


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
        _fail(f"{where}: no such file", EXIT_BAD_INPUT)
    if os.path.isdir(path):
        _fail(f"{where}: is a folder, not a config file", EXIT_BAD_INPUT)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as error:
        _fail(f"{where}: cannot read it ({error.strerror})", EXIT_BAD_INPUT)
    try:
        compile(source, path, "exec")
    except (SyntaxError, ValueError) as error:
        line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
        reason = getattr(error, "msg", None) or str(error)
        _fail(f"{where}: not a Python config file ({reason}{line})", EXIT_BAD_INPUT)
    if b"get_config" not in source:
        _fail(f"{where}: defines no get_config()", EXIT_BAD_INPUT)


def _one_line(error: BaseException) -> str:
    message = str(error).replace("\\n", " ").replace("\\'", "'")
    return " ".join(message.split()).replace("'", "") or type(error).__name__


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors: an unknown config key, a value of the wrong type,
    a config file that is missing, is not Python, or fails in get_config()."""
    path = _config_path(argv)
    if path is not None:
        _check_config_file(path)
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError) as error:
        _fail(f"bad flag: {_one_line(error)}", EXIT_BAD_INPUT)
    except Exception as error:  # noqa: BLE001 - the config file's own code ran and failed
        cause = error.__cause__ or error
        _fail(
            f"--config={path}: loading it failed ({type(cause).__name__}: {_one_line(cause)})",
            EXIT_BAD_INPUT,
        )


def _stopped_before_start() -> None:
    if signals.requested():
        print(
            "SIGTERM during start-up: nothing was trained yet; rerun the same command", flush=True
        )
        sys.exit(0)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}", EXIT_BAD_INPUT)
    _stopped_before_start()
    if _is_multi_host_launch():
        jax.distributed.initialize()
    logging.set_verbosity(logging.WARNING)
    try:
        config = _CONFIG.value
        config.task  # noqa: B018 - config_flags loads the file on first access
    except Exception as error:  # noqa: BLE001 - config_flags defers the config file's errors
        cause = error.__cause__ or error
        _fail(f"--config: loading it failed ({_one_line(cause)})", EXIT_BAD_INPUT)
    if wants_float64(config):
        jax.config.update("jax_enable_x64", True)
        print("float64 in the config: jax_enable_x64 is on", flush=True)
    _stopped_before_start()
    try:
        summaries = experiments.run(config, _WORKDIR.value)
    except ConfigError as error:
        _fail(str(error), EXIT_BAD_INPUT)
    except ValueError as error:  # data errors: one line naming the file and the problem
        _fail(str(error), EXIT_BAD_INPUT)
    except WorkdirBusy as error:
        _fail(str(error), EXIT_BUSY)
    except WorkdirWriteError as error:
        _fail(str(error), EXIT_WRITE_FAILED)
    except train.TrainingDiverged as error:
        _fail(str(error), EXIT_DIVERGED)
    except train.Preempted as error:
        print(str(error), flush=True)
        return
    for summary in summaries:
        print(format_summary(summary), flush=True)


def _is_multi_host_launch() -> bool:
    """Whether this process is one of several: a TPU pod, a SLURM job, or a set coordinator."""
    env = os.environ
    return bool(
        env.get("JAX_COORDINATOR_ADDRESS")
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")
        or int(env.get("SLURM_NTASKS", "1") or 1) > 1
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
