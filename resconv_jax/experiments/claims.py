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

from resconv_jax.runtime import workdir as wd

HOLDS, FAILS, NOT_RUN = "holds", "fails", "not run"


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


def verdict(ok: bool) -> str:
    """ "holds" or "fails"."""
    return HOLDS if ok else FAILS


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
