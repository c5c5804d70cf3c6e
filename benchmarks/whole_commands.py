"""Part "commands" of benchmarks.sweep_vs_sequential: one sweep command against five single runs.

Wall time of one `python -m resconv_jax.main --config=configs/theory.py` command with
`--config.sweep.beta="(0.0,0.25,0.5,0.75,1.0)"` against five commands with one β each (each a
fresh process and workdir, the same number of steps), the order alternated between repeats. Each
command gets an empty compilation cache of its own (`--compilation_cache=DIR`): every command
compiles, as before main kept JAX's persistent cache by default; otherwise the first command of a
run would compile for the rest, and which one that is would decide the ratio.
Target: the sweep command >= 3x faster than the five.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

from benchmarks import common
from benchmarks.common import REPO, SWEEP_BETAS


def command(betas, workdir: str, steps: int | None, extra=()) -> list[str]:
    beta = "(" + ",".join(repr(float(b)) for b in betas) + ("," if len(betas) == 1 else "") + ")"
    cmd = [
        sys.executable,
        "-m",
        "resconv_jax.main",
        "--config=configs/theory.py",
        f"--workdir={workdir}",
        f"--config.sweep.beta={beta}",
    ]
    if steps is not None:
        cmd.append(f"--config.train.num_steps={steps}")
    return cmd + list(extra)


def run_command(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, the compile seconds the command printed) of one command."""
    wall, proc = common.run_in_repo(cmd)
    m = re.search(r"compiled in ([0-9.]+)s", proc.stdout)
    return wall, float(m.group(1)) if m else float("nan")


def bench_commands(repeats: int, steps: int | None, flags: list[str]) -> str:
    """Runs the comparison and returns its Markdown section."""
    root = tempfile.mkdtemp(prefix="resconv_bench_")
    walls = {"sweep": [], "singles": []}
    compiles = {"sweep": [], "singles": []}
    try:
        for r in range(repeats):
            for which in ["sweep", "singles"] if r % 2 == 0 else ["singles", "sweep"]:
                betas_list = [SWEEP_BETAS] if which == "sweep" else [(b,) for b in SWEEP_BETAS]
                wall = compile_s = 0.0
                for i, betas in enumerate(betas_list):
                    workdir = os.path.join(root, f"{which}{r}_{i}")
                    cold = f"--compilation_cache={os.path.join(root, f'cache_{which}{r}_{i}')}"
                    w, c = run_command(command(betas, workdir, steps, [cold, *flags]))
                    wall, compile_s = wall + w, compile_s + c
                walls[which].append(wall)
                compiles[which].append(compile_s)
            print(
                f"  repeat {r}: sweep {walls['sweep'][-1]:.1f} s, "
                f"5 singles {walls['singles'][-1]:.1f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sweep, singles = common.median(walls["sweep"]), common.median(walls["singles"])
    c_sweep, c_singles = common.median(compiles["sweep"]), common.median(compiles["singles"])
    steps = steps or common.load_config_file(str(REPO / "configs/theory.py")).train.num_steps
    rows = [
        ["1 sweep command (5 runs)", 1, f"{sweep:.1f} s", f"{c_sweep:.1f} s", "1.00x"],
        ["5 single-run commands", 5, f"{singles:.1f} s", f"{c_singles:.1f} s", ""],
        ["ratio (5 singles / sweep)", "", "", "", f"{singles / sweep:.2f}x"],
    ]
    met = "met" if singles / sweep >= 3 else "NOT met"
    text = (
        f"### Whole commands, configs/theory.py, {steps} steps per run, beta in {SWEEP_BETAS}"
        + (f", extra flags {' '.join(flags)}" if flags else "")
        + "\n\n"
        f"{repeats} repeat(s), order alternated; each command a fresh process, workdir and "
        "(empty) compilation cache; "
        f"load average {common.load_average()}. 'compile' is the sum of the 'compiled in' times "
        "the commands print (part of the wall time).\n\n"
        + common.table(["case", "commands", "wall (median)", "compile", "speedup"], rows)
        + f"\n\nTarget (sweep >= 3x faster than 5 single runs): {met}."
    )
    print(text + "\n", flush=True)
    return text
