"""The README's figures in docs/ are the ones docs/figures.py recorded, and the numbers they state
are what the current code computes from the data recorded with them."""

import hashlib
import json
import math
import re
from pathlib import Path

import pytest

from resconv_jax.experiments import descent

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECORD = json.loads((DOCS / "figures.json").read_text())
README = (DOCS.parent / "README.md").read_text()


def test_every_figure_in_docs_is_recorded_and_unchanged():
    assert sorted(p.name for p in DOCS.glob("*.png")) == sorted(RECORD)
    for name, entry in RECORD.items():
        assert hashlib.sha256((DOCS / name).read_bytes()).hexdigest() == entry["sha256"], (
            f"docs/{name} is not the figure docs/figures.py wrote: rerun it"
        )
        assert f"](docs/{name})" in README, name


def _rows(rows: list[dict]) -> list[dict]:
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in rows]


@pytest.mark.parametrize("name", [n for n, e in RECORD.items() if "tau" in e["stated"]])
def test_the_descent_figures_numbers_are_the_codes(name):
    stated = RECORD[name]["stated"]
    order = descent.ordering(_rows(stated["descent_rows"]))
    assert order["tau"] == pytest.approx(stated["tau"], rel=1e-12)
    assert order["p_value"] == pytest.approx(stated["p_value"], rel=1e-12), (
        "the code now computes another p for this figure: rerun docs/figures.py"
    )


def test_the_readme_quotes_the_figures_numbers():
    stated = RECORD["jena_descent_by_beta.png"]["stated"]
    quoted = re.search(r"descent figure: Kendall τ = ([-+.\d]+), two-sided p = ([.\d]+)", README)
    assert quoted, "the README's Jena section quotes the descent figure's τ and p"
    assert float(quoted.group(1)) == pytest.approx(stated["tau"], abs=5e-3)
    assert float(quoted.group(2)) == pytest.approx(stated["p_value"], abs=5e-4)
