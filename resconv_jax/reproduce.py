"""python -m resconv_jax.reproduce --workdir=DIR [--scale=small|paper|tiny]: every claim of the
paper checked by one command, DIR/REPORT.md (see `experiments.reproduce`).

Exit status: 0 every experiment ran or was reused; 1 one could not run (REPORT.md says which
and why); 2 bad flags or a workdir that cannot be written; 3 a workdir in use by another process.
"""

from __future__ import annotations

import os
import sys

from resconv_jax import signals

signals.install()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in main: threaded OpenBLAS slows LAPACK

from absl import app, flags, logging  # noqa: E402

from resconv_jax.errors import Preempted, WorkdirBusy, WorkdirWriteError  # noqa: E402
from resconv_jax.experiments import reproduce as experiment  # noqa: E402
from resconv_jax.validation import check_workdir  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder of the experiments and REPORT.md.")
_SCALE = flags.DEFINE_enum("scale", "small", experiment.SCALES, "Sizes: tiny, small or paper.")
_README = flags.DEFINE_string(
    "readme", None, "Also write the claims table into this file's marked block (README.md)."
)
flags.mark_flags_as_required(["workdir"])


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad or missing flag as one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        _fail(f"bad flag: {error}", 2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}", 2)
    logging.set_verbosity(logging.WARNING)
    try:
        check_workdir(_WORKDIR.value)
        status = experiment.reproduce(_WORKDIR.value, _SCALE.value, _README.value)
        if status:  # an experiment's failed checkpoint save leaves Orbax threads that block exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        sys.exit(status)
    except Preempted as stop:
        print(f"{stop}; rerun the same reproduce command to go on", flush=True)
        sys.exit(0)
    except WorkdirBusy as error:
        _fail(str(error), 3)
    except (WorkdirWriteError, ValueError) as error:
        _fail(str(error), 2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
