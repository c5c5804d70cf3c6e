"""A sweep: the runs of one program, each a setting of (seed, lr, β_a, β_f)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep."""

    index: int
    seed: int
    lr: float
    beta_attn: float
    beta_ffn: float

    def settings(self) -> dict:
        """The run's index and settings, as written on every metrics line."""
        settings = dataclasses.asdict(self)
        return {"run": settings.pop("index"), **settings}


def expand_runs(config) -> list[RunSpec]:
    """The product of the sweep lists (seed outermost, β innermost); empty lists use defaults."""
    seeds = config.sweep.seed or (config.seed,)
    lrs = config.sweep.lr or (config.optim.lr,)
    if config.sweep.beta:
        betas = [(b, b) for b in config.sweep.beta]
    else:
        betas = list(
            itertools.product(
                config.sweep.beta_attn or (config.model.beta_attn,),
                config.sweep.beta_ffn or (config.model.beta_ffn,),
            )
        )
    combos = itertools.product(seeds, lrs, betas)
    return [
        RunSpec(i, int(seed), float(lr), float(b_attn), float(b_ffn))
        for i, (seed, lr, (b_attn, b_ffn)) in enumerate(combos)
    ]


def run_hparams(runs: list[RunSpec]) -> dict[str, np.ndarray]:
    """Per-run residual coefficients as float32 arrays of shape (R,)."""
    return {
        "beta_attn": np.array([r.beta_attn for r in runs], np.float32),
        "beta_ffn": np.array([r.beta_ffn for r in runs], np.float32),
    }
