"""The records `reproduce` walks: an experiment (a config file and its variant per scale, in a
folder of its own) and the claims it backs, each a function of that folder.

Every experiment module `experiments/NAME.py` lists its records in `EXPERIMENTS`; its claim
functions sit beside the report writers whose files (and column constants) they read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import ml_collections

from resconv_jax.config_defaults import load_config_file
from resconv_jax.experiments.claims import Claim

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCALES = ("tiny", "small", "paper")


@dataclasses.dataclass(frozen=True)
class ClaimCheck:
    """A claim of the table: `check(folder) -> Claim` reads the experiment's folder (None when
    the experiment did not run, which gives "not run" with the reason). `rank` orders the table."""

    rank: float
    check: Callable[[str | None], Claim]


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment of the report, run in DIR/`name`.

    config: a file of configs/; variants: per scale, the `get_config` argument (the file's own
    variants, "" for none). files: what its report writes besides metrics (for the reader).
    label: prefixed to the notes of its claims. fallback: the experiment run instead when this
    one's weights are not found, whose claims then carry `substitute` in their verdicts.
    typical_seconds: per scale, about how long it takes from scratch, one experiment at a time on
    this project's 2-core CPU machine (benchmarks/RESULTS.md §9); a hint that only `reproduce
    --jobs` reads, to start the longest first in a folder that has no recorded times.
    """

    name: str
    title: str
    config: str
    variants: dict[str, str]
    claims: tuple[ClaimCheck, ...] = ()
    files: tuple[str, ...] = ()
    label: str = ""
    fallback: Experiment | None = None
    substitute: str = ""
    typical_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def config_arg(self, scale: str) -> str:
        """`file.py:variants` as a config path is written on the command line."""
        arg = self.variants[scale]
        return f"{self.config}:{arg}" if arg else self.config

    def load(self, scale: str) -> ml_collections.ConfigDict:
        """The experiment's config at `scale` (one of SCALES)."""
        return load_config_file(str(CONFIGS / self.config), self.variants[scale] or None)

    @property
    def rank(self) -> float:
        """Where it runs in the report: at its first claim's place in the table."""
        return min((claim.rank for claim in self.claims), default=float("inf"))


def scale_variants(tiny: str = "tiny", small: str = "small", paper: str = "") -> dict[str, str]:
    """{scale: variant} with the usual names: the file's `tiny` and `small` variants, and its
    default for `paper`."""
    return {"tiny": tiny, "small": small, "paper": paper}
