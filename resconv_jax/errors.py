"""Every error class of the package, in one module that imports nothing of ours, so that any
module can raise or catch them without importing the module that usually raises them.

Each message is one line saying what went wrong and what to do. The command line maps them to
exit statuses (`resconv_jax.main`): ValueError and its subclasses (bad input) 2, WorkdirBusy 3,
WorkdirWriteError 4, TrainingDiverged 1; Preempted is a clean stop (0). A process of a
multi-process run that another one's failure or loss stopped exits 5 (the launcher reads it).
"""

from __future__ import annotations

import sys

EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_WRITE_FAILED, EXIT_LOST_PROCESS = 1, 2, 3, 4, 5


class ConfigError(ValueError):
    """A config value that cannot be run."""


class JenaDataError(ValueError):
    """Bad Jena data or config; the message is one line naming the file and line if known."""


class SST2DataError(ValueError):
    """Bad SST-2 data or config; the message is one line naming the file and line if known."""


class WeightsError(ValueError):
    """Weights that cannot be found or do not fit the model; the message is one line."""


class WeightsNotFound(WeightsError):
    """A hub id that is neither a local folder, nor in the cache, nor reachable on the hub."""


class WorkdirBusy(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirWriteError(RuntimeError):
    """A write into the workdir failed (disk full, vanished, read-only); one line, no traceback."""


class TrainingDiverged(RuntimeError):
    """A run's loss became non-finite; the message is one line saying what to do."""


class Preempted(RuntimeError):
    """SIGTERM or a pod preemption: the run stopped at a safe point and can be resumed."""


class Interrupted(RuntimeError):
    """Ctrl-C: what was running stopped at a safe point and can be resumed."""


def one_line(error: BaseException) -> str:
    """`error`'s message on one line (newlines, escaped ones too, and runs of blanks as one
    space); its class name when the message is empty."""
    return " ".join(str(error).replace("\\n", " ").split()) or type(error).__name__


def in_file(error: type[ValueError], name: str, problem: str, line: int | None = None):
    """`error("NAME: line N: PROBLEM")` on one line: a data file's problem, where it is."""
    where = f"{name}: line {line}: " if line is not None else f"{name}: "
    return error((where + problem).replace("\n", " "))


def exit_with(message: str, status: int) -> None:
    """The command line's end for bad input: `error: MESSAGE` on stderr, exit `status`."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def exit_on_help(argv: list[str]) -> None:
    """absl answers --help with the usage and exit status 1, which a command here documents
    as a failure: print the usage for -h, --help, --helpshort or --helpfull and exit 0."""
    asked = [arg for arg in argv[1:] if arg in ("-h", "-?", "--help", "--helpshort", "--helpfull")]
    if asked:
        from absl import app  # only here: this module imports nothing else

        app.usage(shorthelp=asked[0] != "--helpfull", writeto_stdout=True, exitcode=0)
