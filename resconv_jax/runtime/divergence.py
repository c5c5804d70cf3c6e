"""A run whose loss became non-finite: which runs, the last good checkpoint, a step size to try.

The last good checkpoint is the newest one whose logged loss is finite and no higher than at
step 0 for every diverging run (a checkpoint can hold a state whose own loss is already NaN: the
loss of a step is only computed by the next step). The suggested η is half the stable step size
2/λ_max(K) of the most restrictive diverging run: λ_max from the latest tangent-kernel
certificate, or, without one, measured at initialization by matrix-free power iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def diverging_runs(losses: np.ndarray) -> np.ndarray:
    """Indices of the runs with a non-finite loss in `losses` (steps, R)."""
    return np.flatnonzero((~np.isfinite(losses)).any(axis=0))


def last_good_checkpoint(history: list[dict], steps: list[int], runs: np.ndarray) -> int | None:
    """The newest of checkpoint `steps` whose logged loss is finite and at most the step-0 loss
    for every run in `runs` (None if there is none)."""
    loss = {(line["step"], line["run"]): line.get("loss") for line in history}

    def good(step: int, run: int) -> bool:
        value, start = loss.get((step, run)), loss.get((0, run))
        return (
            isinstance(value, float)
            and isinstance(start, float)
            and math.isfinite(value)
            and value <= start
        )

    for step in sorted(steps, reverse=True):
        if all(good(step, int(r)) for r in runs):
            return step
    return None


def diverged_message(
    losses: np.ndarray,
    step: int,
    runs: list,
    history: list[dict],
    checkpoint_steps: list[int],
    directory: str,
    stable_lrs: Callable[[], tuple[np.ndarray, str]],
    sweeps_lr: bool,
    lr_factor: float | None = None,
) -> str:
    """The one-line report of a divergence in the chunk that starts at `step`.

    losses: (steps, R) of the chunk. stable_lrs() -> ((R,) stable step sizes 2/λ_max(K) on the
    task's loss, where λ_max comes from). The advice names the option that sets the step size:
    optim.lr, the sweep.lr values (`sweeps_lr`), or optim.lr_factor under optim.lr_rule =
    lambda_max (`lr_factor`, each run's η = lr_factor / λ_max(K) at its initialization).
    """
    bad = diverging_runs(losses)
    offset, first = (int(v) for v in np.argwhere(~np.isfinite(losses))[0])
    run = runs[first]
    text = (
        f"{len(bad)} of {len(runs)} runs diverged (first: run {run.index}, beta_attn="
        f"{run.beta_attn:g}, beta_ffn={run.beta_ffn:g}, seed={run.seed}, lr={run.lr:g}: loss "
        f"{losses[offset, first]} at step {step + offset}); "
    )
    good = last_good_checkpoint(history, checkpoint_steps, bad)
    if good is not None:
        text += f"last good checkpoint: step {good} in {directory}; "
    elif checkpoint_steps:
        text += (
            f"no good checkpoint (at steps {', '.join(map(str, checkpoint_steps))} a diverging "
            "run's loss was already non-finite or above its step-0 loss); "
        )
    else:
        text += "no checkpoint yet; "
    stable, source = stable_lrs()
    stable = np.asarray(stable, float)[bad]
    if not np.isfinite(stable).all():  # λ_max(K) itself is not finite: no step size helps
        return text + (
            f"2/lambda_max(K) is not finite ({source}), so no smaller step size would help: "
            "check the data and the weights (a non-finite value in either)"
        )
    lrs = np.array([runs[r].lr for r in bad], float)
    # Half of each run's 2/λ_max(K), as the factor of its own η for the λ_max rule.
    needed = 0.5 * stable / lrs if lr_factor else 0.5 * stable
    worst = int(np.argmin(needed))
    text += (
        f"the most restrictive of them, run {runs[int(bad[worst])].index}, has 2/lambda_max(K) = "
        f"{stable[worst]:.3g} ({source}): rerun on a new --workdir with "
    )
    if lr_factor:
        return text + (
            f"--config.optim.lr_factor={lr_factor * needed[worst]:.3g} (optim.lr_rule=lambda_max "
            "sets each η from it)"
        )
    option = "--config.sweep.lr values at most " if sweeps_lr else "--config.optim.lr="
    return text + f"{option}{needed[worst]:.3g}"
