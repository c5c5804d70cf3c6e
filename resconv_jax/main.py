"""Entry point: python -m resconv_jax.main --config=configs/theory.py --workdir=DIR [--config.x=y].

Runs (or resumes) the config's sweep in DIR. Bad input exits with status 2 and one line on stderr;
a diverged run with status 1; a preempted run (SIGTERM) saves a checkpoint and exits with 0.
"""

from __future__ import annotations

import os
import sys

# Threaded OpenBLAS inside XLA's own CPU threads slows LAPACK (the probe's QR) ~30x; set first.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
from absl import app, flags, logging
from ml_collections import config_flags

from resconv_jax import train
from resconv_jax.summary import format_summary
from resconv_jax.validation import ConfigError, wants_float64

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics); resumes.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (an unknown config key, a value of the wrong type)."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as error:
        message = str(error).replace("\\n", " ").replace("\\'", "'")
        message = " ".join(message.split()).replace("'", "")
        _fail(f"bad flag: {message}", 2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}", 2)
    if _is_multi_host_launch():
        jax.distributed.initialize()
    logging.set_verbosity(logging.WARNING)
    try:
        config = _CONFIG.value
        task = config.task
    except OSError as error:  # the config file failed to load; config_flags defers the error
        _fail(" ".join(str(error).split()), 2)
    if wants_float64(config):
        jax.config.update("jax_enable_x64", True)
        print("float64 in the config: jax_enable_x64 is on", flush=True)
    try:
        if task == "rank_collapse":
            from resconv_jax import rank_collapse

            rank_collapse.run(config, _WORKDIR.value)
            return
        summaries = train.run(config, _WORKDIR.value)
    except ConfigError as error:
        _fail(str(error), 2)
    except ValueError as error:  # data errors: one line naming the file and the problem
        _fail(str(error), 2)
    except train.TrainingDiverged as error:
        _fail(str(error), 1)
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
