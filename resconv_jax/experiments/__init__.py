"""The experiments: each runs its task (`train.run`, or the rank-collapse spectra) and then writes
its own report. `main` calls `run`; the trainer imports nothing from here."""

from __future__ import annotations

import jax

from resconv_jax import train


def run(config, workdir: str) -> list[dict]:
    """Runs `config.task` in `workdir`; returns the per-run summaries ([] for rank collapse).

    Raises what `train.run` raises (see there), with nothing reported.
    """
    if config.task == "rank_collapse":
        from resconv_jax.experiments import rank_collapse

        rank_collapse.run(config, workdir)
        return []
    from resconv_jax.experiments.run_report import (
        write_run_report,  # its own CLI too: imported late
    )

    summaries = train.run(config, workdir)
    if jax.process_index() == 0:
        for table in write_run_report(workdir):
            print(table, flush=True)
    return summaries
