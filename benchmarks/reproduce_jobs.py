"""`reproduce` one experiment at a time against `--jobs=N`, in the same run.

    python -m benchmarks.reproduce_jobs [--scale small] [--only NAME,...] [--jobs 2] [--repeats 1]
        [--warm]

Each repeat runs `python -m resconv_jax.reproduce --scale=S [--only=...]` twice, with --jobs=1
and with --jobs=N (the order alternated between repeats), each in a fresh workdir with an empty
compilation cache of its own, and prints the wall times and their ratio. Before any time is
reported, every metrics.jsonl, summary.json and CSV table of the two workdirs must be the same
bytes: the workers run the programs one process runs. `--scale=small` with every experiment
takes 13-16 min per repeat on a 2-core CPU (7-9 min one at a time, 6-7 with 2 jobs).

`--warm` adds a third command per repeat: --jobs=N into another fresh workdir with the
compilation cache the --jobs=N command filled (what a second `reproduce` on a machine meets), its
files held to the same bytes; the difference to the cold --jobs=N time is what compiling costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks import common
from resconv_jax.reproduce import TIMES_FILE


def outputs(folder: Path) -> dict[str, bytes]:
    """Every metrics, summary and CSV file under `folder`, by relative path."""
    files = [*folder.rglob("metrics.jsonl"), *folder.rglob("summary.json"), *folder.rglob("*.csv")]
    return {str(path.relative_to(folder)): path.read_bytes() for path in files}


def cache_of(workdir: Path) -> Path:
    """The compilation cache folder of the command that wrote `workdir`."""
    return workdir.parent / (workdir.name + "_cache")


def run_reproduce(
    workdir: Path, scale: str, only: str, jobs: int, cache: Path | None = None
) -> float:
    """Wall seconds of one reproduce command, from a fresh process and the compilation cache
    `cache` (default: an empty one of its own, `cache_of(workdir)`)."""
    cmd = [sys.executable, "-m", "resconv_jax.reproduce", f"--workdir={workdir}",
           f"--scale={scale}", f"--jobs={jobs}",
           f"--compilation_cache={cache or cache_of(workdir)}"]  # fmt: skip
    if only:
        cmd.append(f"--only={only}")
    wall, _ = common.run_in_repo(cmd)
    return wall


def experiment_seconds(workdir: Path) -> str:
    """`name seconds, ...` of each experiment that ran, from the workdir's reproduce.json."""
    times = json.loads((workdir / TIMES_FILE).read_text())
    ranked = sorted(times.items(), key=lambda item: -item[1]["seconds"])
    return ", ".join(f"{name} {entry['seconds']:.0f}" for name, entry in ranked)


def differing(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """The files that are not the same bytes in `a` and `b` (or in only one of them)."""
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))


def bench(scale: str, only: str, jobs: int, repeats: int, warm: bool = False) -> str:
    """Runs the comparison; its Markdown section."""
    root = Path(tempfile.mkdtemp(prefix="resconv_reproduce_jobs_"))
    walls: dict[int | str, list[float]] = {1: [], jobs: [], "warm": []}
    try:
        for r in range(repeats):
            folders = {}
            for n in (1, jobs) if r % 2 == 0 else (jobs, 1):
                folders[n] = root / f"jobs{n}_{r}"
                walls[n].append(run_reproduce(folders[n], scale, only, n))
                print(f"  --jobs={n}: {walls[n][-1]:.1f} s; experiments (s): "
                      f"{experiment_seconds(folders[n])}", flush=True)  # fmt: skip
            alone, together = outputs(folders[1]), outputs(folders[jobs])
            if not alone or (changed := differing(alone, together)):
                raise SystemExit(f"--jobs={jobs} wrote other bytes than one at a time: "
                                 f"{(changed if alone else ['no files'])[:5]}")  # fmt: skip
            seconds = f"one at a time {walls[1][-1]:.1f} s, --jobs={jobs} {walls[jobs][-1]:.1f} s"
            if warm:
                folder = root / f"warm_{r}"
                walls["warm"].append(
                    run_reproduce(folder, scale, only, jobs, cache=cache_of(folders[jobs]))
                )
                if changed := differing(together, outputs(folder)):
                    raise SystemExit(f"a filled compilation cache gave other bytes: {changed[:5]}")
                seconds += f", --jobs={jobs} with its cache filled {walls['warm'][-1]:.1f} s"
            print(f"  repeat {r}: {seconds}; {len(alone)} files, the same bytes", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, many = common.median(walls[1]), common.median(walls[jobs])
    rows = [
        ["one at a time (--jobs=1)", f"{one:.1f} s", " ".join(f"{w:.1f}" for w in walls[1]),
         "1.00x"],
        [f"--jobs={jobs}", f"{many:.1f} s", " ".join(f"{w:.1f}" for w in walls[jobs]),
         f"{one / many:.2f}x"],
    ]  # fmt: skip
    if warm:
        filled = common.median(walls["warm"])
        repeats_text = " ".join(f"{w:.1f}" for w in walls["warm"])
        name = f"--jobs={jobs}, compilation cache filled"
        rows.append([name, f"{filled:.1f} s", repeats_text, f"{one / filled:.2f}x"])
    text = (
        f"### reproduce --scale={scale}" + (f" --only={only}" if only else "") + "\n\n"
        f"{common.machine()}\n\n{repeats} repeat(s), order alternated; each command a fresh "
        "process, workdir and empty compilation cache"
        + (" (the last row's: the cache the --jobs command filled; it runs third)" if warm else "")
        + f"; load average {common.load_average()}; every metrics, summary and CSV file the same "
        "bytes in all.\n\n" + common.table(["case", "wall (median)", "repeats", "speedup"], rows)
    )
    print(text + "\n", flush=True)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="small", choices=("tiny", "small", "paper"))
    parser.add_argument("--only", default="", help="reproduce's --only (default: every one)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warm", action="store_true", help="also time a filled compile cache")
    args = parser.parse_args(argv)
    if args.jobs < 2:
        parser.error("--jobs: compare 2 or more against one at a time")
    bench(args.scale, args.only, args.jobs, args.repeats, args.warm)


if __name__ == "__main__":
    main()
