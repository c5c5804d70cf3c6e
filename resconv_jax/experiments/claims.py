"""The claims table of REPORT.md: one row per claim of docs/protocol.md, and what the claim
functions share. Each claim function lives with the experiment that measures it
(`experiments/NAME.py`, listed in its records' `claims`): it takes the experiment's run directory
(or None when it was not run) and returns a `Claim`, reading the files (and the columns, by the
constants their writer uses) held to the protocol's threshold; a missing directory or file gives
the verdict "not run" with the reason, never a guess.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math

from resconv_jax.analysis import stats
from resconv_jax.runtime import workdir as wd

HOLDS, FAILS, UNDECIDED, NOT_RUN = "holds", "fails", "undecided", "not run"


@dataclasses.dataclass(frozen=True)
class Claim:
    """One row of the claims table."""

    claim: str
    measure: str
    threshold: str
    value: str = "-"
    verdict: str = NOT_RUN
    note: str = ""


def read_csv(path) -> list[dict]:
    """The rows of a CSV file, each value an int, a float or (else) the text."""
    with wd.path(path).open() as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def read_json(path):
    """The JSON content of a file (local or object storage)."""
    return json.loads(wd.path(path).read_text())


def missing(claim: Claim, workdir, name: str) -> Claim | None:
    """`claim` marked not run (the reason in its note) when `workdir` or its file `name` is
    absent, else None."""
    if workdir is None:
        return dataclasses.replace(claim, note="experiment not run")
    if not (wd.path(workdir) / name).exists():
        return dataclasses.replace(claim, note=f"{name} missing in {workdir}")
    return None


def several_lrs(claim: Claim, rows: list[dict]) -> Claim | None:
    """`claim` not run, saying why, when `rows` (a table that has an "lr" column only when its
    runs differ in lr) mix learning rates: its comparisons are between runs of one lr."""
    if rows and "lr" in rows[0]:
        lrs = ", ".join(f"{lr:g}" for lr in sorted({row["lr"] for row in rows}))
        return dataclasses.replace(
            claim, note=f"the runs differ in lr ({lrs}); the claim compares runs of one lr"
        )
    return None


def verdict(ok: bool) -> str:
    """ "holds" or "fails"."""
    return HOLDS if ok else FAILS


def has_interval(interval: tuple[float, float]) -> bool:
    """Whether `interval` (low, high) was computed: both ends finite (NaN: too few clusters)."""
    return all(map(math.isfinite, interval))


def not_falling_note(names: list[str], rates: list[float]) -> str:
    """'NAME: fitted ρ = 1.00500 ≥ 1 (the loss does not fall), …' for the runs (or cells) whose
    fitted per-step factor is not below 1; '' when there are none."""
    return ", ".join(
        f"{name}: fitted ρ = {rate:.5f} ≥ 1 (the loss does not fall)"
        for name, rate in zip(names, rates, strict=True)
    )


def interval_text(interval: tuple[float, float]) -> str:
    """'[low, high]', signed, to two decimals; '[no interval]' when it was not computed."""
    low, high = interval
    return f"[{low:+.2f}, {high:+.2f}]" if has_interval(interval) else "[no interval]"


def against_claim(interval: tuple[float, float], threshold: float, claimed: str) -> bool:
    """Whether `interval` lies wholly on the other side of `threshold` than the `claimed` one."""
    low, high = interval
    return has_interval(interval) and (high < threshold if claimed == "above" else low > threshold)


def against_text(test, interval: tuple[float, float], threshold: float, claimed: str) -> str:
    """', against the claim: greater p = 0.039' (the one-sided `test`'s p in the opposite
    direction, which decides "fails") when `interval` lies against the claim, else ''."""
    if not against_claim(interval, threshold, claimed):
        return ""
    return f", against the claim: {stats.OPPOSITE[test.alternative]} p = {test.p_opposite:.2g}"


def decided(ok: bool, interval: tuple[float, float], threshold: float,
            power: float | None = None, *, claimed: str, opposite_p: float | None = None,
            alpha: float = 0.05) -> str:  # fmt: skip
    """The second reading's verdict (docs/protocol.md): "undecided" when `interval` spans
    `threshold` (or is NaN); when it lies wholly on the other side than the `claimed` one
    ("below" or "above"), "fails" if the row's one-sided test in the opposite direction has
    `opposite_p` < `alpha` (rows without a test: None), else "undecided"; on the claimed side,
    "holds" when `ok` (the row's test) and the power at the observed effect is at least 0.8,
    else "undecided"."""
    low, high = interval
    if not has_interval(interval) or low <= threshold <= high:
        return UNDECIDED
    if against_claim(interval, threshold, claimed):
        return FAILS if opposite_p is None or opposite_p < alpha else UNDECIDED
    return HOLDS if ok and (power is None or power >= 0.8) else UNDECIDED


def combined(verdicts) -> str:
    """One verdict for several parts of a claim: "fails" if one part fails, else "undecided" if
    one is, else "holds"."""
    verdicts = set(verdicts)
    return next((v for v in (FAILS, UNDECIDED) if v in verdicts), HOLDS)


def format_claims_table(claims: list[Claim]) -> str:
    """The claims as a Markdown table."""
    lines = [
        "| claim | measure | threshold | measured | verdict | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in claims:
        cells = (c.claim, c.measure, c.threshold, c.value, f"**{c.verdict}**", c.note)
        cells = (cell.replace("|", "\\|").replace("\n", " ") for cell in cells)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
