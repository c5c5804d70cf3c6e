"""One process with 8 CPU devices against 2 processes x 4 (launch.local, gloo), same mesh.

    python -m benchmarks.multiprocess                       # theory and Jena, ~4 min on 2 cores
    python -m benchmarks.multiprocess --sizes theory --repeats 3 --steps 1000

Two parts:
1. Step rate: the main command of configs/theory.py and configs/jena.py (shortened to --steps)
   run as 1 x 8 and as 2 x 4, round-robin, --repeats times each. The rate is the median of the
   progress lines' steps/s (after the first, which includes warm-up), so start-up and compile
   time are not in it. Ratio: 2x4 rate / 1x8 rate.
2. Bytes moved: the collectives of the compiled chunk (the first chunk, with the probe), read
   from its HLO. The program is the same SPMD program for 1 x 8 and 2 x 4 (same mesh shape), so
   the bytes are too; across processes they go through gloo instead of shared memory. Collectives
   inside the step loop run every step; those at the top level once per chunk (the probe). The
   design expects, per step, one all-reduce of the gradients (R x the parameters) over 'data'
   when data > 1, and, per probed chunk, all-gathers of the probe's R factors (from each of the
   `data` devices one min(rows per device, d) x d factor per run, layer and probed matrix, Attn
   and Z) and the probed first step's own gradient all-reduce.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from launch import local  # noqa: E402
from resconv_jax import train  # noqa: E402
from resconv_jax.config_defaults import load_config_file  # noqa: E402
from resconv_jax.data import load_dataset  # noqa: E402
from resconv_jax.models import build_model  # noqa: E402
from resconv_jax.sweep import expand_runs, group_runs  # noqa: E402

CONFIGS = {"theory": "configs/theory.py", "jena": "configs/jena.py"}
COLLECTIVE = re.compile(
    r"= (?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[\d,]*\})?) "
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
)
ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
BYTES = {"f32": 4, "f64": 8, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}


def overrides(steps: int) -> list[str]:
    print_every = max(steps // 5, 10)
    return [f"--config.train.num_steps={steps}", f"--config.train.print_every={print_every}"]


def rate_of(output: str) -> float:
    """Median steps/s of a run's progress lines after the first."""
    rates = [float(m) for m in re.findall(r"([\d.]+) steps/s", output)]
    if len(rates) < 2:
        raise RuntimeError(f"too few progress lines:\n{output[-2000:]}")
    return statistics.median(rates[1:])


def run_once(name: str, layout: str, steps: int, workdir: str) -> float:
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, never a resume
    args = [f"--config={CONFIGS[name]}", f"--workdir={workdir}", *overrides(steps)]
    if layout == "1x8":
        command = [sys.executable, "-m", "resconv_jax.main", *args]
        env = local.process_env(8)
    else:
        command = [sys.executable, "-m", "launch.local", "--processes=2"]
        command += ["--devices_per_process=4", "--", *args]
        env = None
    result = subprocess.run(
        command, cwd=common.REPO, env=env, capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise RuntimeError(f"{layout} {name} failed:\n{result.stderr[-3000:]}")
    return rate_of(result.stdout)


def step_rates(names: list[str], steps: int, repeats: int, scratch: str) -> list[list[object]]:
    rows = []
    for name in names:
        rates: dict[str, list[float]] = {"1x8": [], "2x4": []}
        for repeat in range(repeats):
            order = ["1x8", "2x4"] if repeat % 2 == 0 else ["2x4", "1x8"]
            for layout in order:
                workdir = os.path.join(scratch, f"{name}_{layout}_{repeat}")
                rates[layout].append(run_once(name, layout, steps, workdir))
        one, two = common.median(rates["1x8"]), common.median(rates["2x4"])
        rows.append(
            [
                name,
                f"{one:.1f}",
                common.spread(rates["1x8"]),
                f"{two:.1f}",
                common.spread(rates["2x4"]),
                f"{two / one:.2f}",
            ]
        )
    return rows


def _bytes(shape: str) -> int:
    return sum(
        BYTES[m["dtype"]] * int(np.prod([int(d) for d in m["dims"].split(",") if d]))
        for m in ARRAY.finditer(shape)
    )


def collectives(hlo: str) -> dict[tuple[str, str], int]:
    """{(where, kind): bytes} of the collectives in an HLO module's text; where is 'per chunk'
    for the entry computation and 'per step' for the computations of the step loop."""
    found: dict[tuple[str, str], int] = {}
    where = "per step"
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            where = "per chunk" if line.startswith("ENTRY") else "per step"
        if match := COLLECTIVE.search(line):
            key = (where, match["kind"])
            found[key] = found.get(key, 0) + _bytes(match["shape"])
    return found


def hlo_bytes(name: str) -> list[list[object]]:
    """Collective bytes of the 1 x 8 program against the design's expectation."""
    config = load_config_file(str(common.REPO / CONFIGS[name]))
    dataset = load_dataset(config)
    model = build_model(config.model, dataset)
    runs = group_runs(expand_runs(config))[0][1]
    program = train.build_program(config, dataset, runs)
    mesh = program.y.sharding.mesh
    params = model.init(runs[0].seed)
    found = collectives(program.runners.compiled.as_text())
    leaves = jax.tree.leaves(params)
    grads = len(runs) * sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    d, data = dataset.x_train.shape[-1], mesh.shape["data"]
    rows = dataset.num_train * dataset.x_train.shape[-2] // data  # stacked P·M rows per device
    layers = config.model.num_layers
    # Each device's R factor (min(rows, d) x d) of Attn and of Z, gathered from all `data` devices.
    factor = data * min(rows, d) * d * np.dtype(config.probe.dtype).itemsize
    factors = 2 * len(runs) * layers * factor
    expected = {
        ("per step", "all-reduce"): grads if mesh.shape["data"] > 1 else 0,
        ("per chunk", "all-gather"): factors if mesh.shape["data"] > 1 else 0,
        # The chunk's first step is probed, so it runs outside the loop, with its gradients.
        ("per chunk", "all-reduce"): grads if mesh.shape["data"] > 1 else 0,
    }
    rows = []
    for key in sorted(found.keys() | expected.keys()):
        got, want = found.get(key, 0), expected.get(key)
        ratio = f"{got / want:.3f}" if want else "-"
        rows.append([name, dict(mesh.shape), *key, got, want if want is not None else "-", ratio])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="theory,jena")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scratch", default="/tmp/resconv_bench_multiprocess")
    args = parser.parse_args()
    names = args.sizes.split(",")
    print(common.machine())
    print(f"load average before: {common.load_average()}")
    print("\nStep rate (steps/s, all runs of the sweep; median of progress lines, then repeats)\n")
    rows = step_rates(names, args.steps, args.repeats, args.scratch)
    headers = ["config", "1x8 steps/s", "IQR", "2x4 steps/s", "IQR", "2x4 / 1x8"]
    print(common.table(headers, rows))
    print("\nCollective bytes of the compiled chunk (same program for 1x8 and 2x4)\n")
    rows = [row for name in names for row in hlo_bytes(name)]
    headers = ["config", "mesh", "where", "collective", "bytes", "expected", "ratio"]
    print(common.table(headers, rows))
    print(f"\nload average after: {common.load_average()}")


if __name__ == "__main__":
    main()
