"""A finished run, rerun: `resconv_jax.main` on a workdir that holds the config's finished run.

    python -m benchmarks.finished_rerun [--config=configs/jena.py] [--repeats=5] [--workdir=DIR]

Trains the config once (or reuses DIR's finished run), then times, round-robin in fresh
processes, three commands:

  rerun          the same `resconv_jax.main` command again: the finished check, the tables from
                 results_cache.json (what users hit after every run)
  rerun, redraw  the same with results_cache.json removed first: the report drawn again
  import jax     `python -c "import jax"`: the floor any JAX command pays

and prints the medians and their ratios. Target (issue 20): the rerun ≤ 3 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from benchmarks.common import REPO
from resconv_jax.experiments.results_cache import CACHE_FILE


def timed_command(command: list[str], before=None) -> float:
    """Wall seconds of `command` in a fresh process (after calling `before`, untimed)."""
    if before is not None:
        before()
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}: {result.stderr[-800:]}")
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/jena.py")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default=None, help="a folder to train in (or reuse)")
    args = parser.parse_args(argv)
    workdir = args.workdir or os.path.join(tempfile.mkdtemp(prefix="finished_rerun_"), "run")
    rerun = [sys.executable, "-m", "resconv_jax.main", f"--config={args.config}",
             f"--workdir={workdir}"]  # fmt: skip
    print(f"training (or reusing) {args.config} in {workdir} ...", flush=True)
    timed_command(rerun)
    out = subprocess.run(rerun, cwd=REPO, capture_output=True, text=True).stdout
    if "finished and intact" not in out.splitlines()[0]:
        raise SystemExit(f"the rerun was not recognised as finished: {out.splitlines()[0]}")

    def drop_cache():
        cache = os.path.join(workdir, CACHE_FILE)
        if os.path.exists(cache):
            os.remove(cache)

    cases = {
        "rerun": (rerun, None),
        "rerun, redraw": (rerun, drop_cache),
        "import jax": ([sys.executable, "-c", "import jax"], None),
    }
    load_before = common.load_average()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            command, before = cases[name]
            times[name].append(timed_command(command, before))  # a redraw writes it again
    base = common.median(times["rerun"])
    rows = [
        [name, common.fmt_time(common.median(t)), common.spread(t),
         f"{common.median(t) / base:.2f}"]
        for name, t in times.items()
    ]  # fmt: skip
    print(f"machine: {common.machine()}; load average before {load_before}, after "
          f"{common.load_average()}; {args.repeats} repeats, round-robin")  # fmt: skip
    print(f"config {args.config}, workdir {workdir}")
    print(common.table(["command", "median", "IQR", "× rerun"], rows))


if __name__ == "__main__":
    main()
