"""The README's figures, made by the commands the README names, never by hand.

    python docs/figures.py --workdir=workdirs/docs

runs (or reuses, when finished and intact: `finished.why_unfinished`) `configs/jena.py` and
`configs/theory.py` in WORKDIR/jena and WORKDIR/theory, copies their figures into docs/ and writes
docs/figures.json: for each figure, its command, the file it was copied from, its SHA-256, and
the numbers it states (the descent figure's Kendall τ and p, with the table they come from), so
that `tests/test_docs_figures.py` can check that every figure in docs/ is the one recorded and that
its numbers are what the current code computes from that table. Rerun it after a change to the
code behind the figures (about 1-2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
RECORD = DOCS / "figures.json"
# docs file: (config file, figure in its workdir)
FIGURES = {
    "jena_loss_by_beta.png": ("jena.py", "loss_by_beta.png"),
    "jena_descent_by_beta.png": ("jena.py", "descent_by_beta.png"),
    "theory_training.png": ("theory.py", "training.png"),
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stated_numbers(workdir: Path, figure: str) -> dict:
    """The numbers `figure` states in its text, with what they are computed from."""
    if figure != "descent_by_beta.png":
        return {}
    from resconv_jax.experiments import descent
    from resconv_jax.runtime.metrics import read_metrics

    rows = descent.descent_rows(read_metrics(workdir))
    order = descent.ordering(rows)
    return {"tau": order["tau"], "p_value": order["p_value"], "descent_rows": rows}


def _run(config_file: str, root: Path) -> None:
    """Runs, resumes or reuses configs/CONFIG_FILE in ROOT/<its stem>, as `reproduce` does."""
    from resconv_jax.experiments.record import Experiment, scale_variants
    from resconv_jax.reproducing import outcomes

    name = Path(config_file).stem
    defaults = scale_variants("", "", "")  # the file's own defaults
    experiment = Experiment(name, f"configs/{config_file}", config_file, defaults)
    outcome = outcomes.run_experiment(experiment, "paper", str(root), {})
    if outcome.status == "not run":
        raise SystemExit(f"error: {outcome.reason}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="folder of the runs behind the figures")
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    from resconv_jax.reproducing.report import code_version
    from resconv_jax.runtime.workdir import json_safe

    root = Path(args.workdir)
    record, code = {}, code_version()  # before the copies below change the tree
    for config_file in sorted({config for config, _ in FIGURES.values()}):
        _run(config_file, root)
    for name, (config_file, figure) in FIGURES.items():
        workdir = root / Path(config_file).stem
        shutil.copyfile(workdir / figure, DOCS / name)
        record[name] = {
            "command": f"python -m resconv_jax.main --config=configs/{config_file} --workdir=W",
            "copied_from": f"W/{figure}",
            "sha256": sha256(DOCS / name),
            "code": code,
            "stated": stated_numbers(workdir, figure),
        }
        print(f"wrote {DOCS / name}", flush=True)
    RECORD.write_text(json.dumps(json_safe(record), indent=1, allow_nan=False) + "\n")
    print(f"wrote {RECORD}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
