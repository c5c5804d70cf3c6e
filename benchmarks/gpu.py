"""The accelerator check in one command: the trainer's own compiled steps timed on the default
device, with FLOP/s against a large matmul measured in the same run (and the device's nominal
peak where it is known).

    python -m benchmarks.gpu                 # on the GPU (or whatever jax.devices()[0] is)
    python -m benchmarks.gpu --quick         # small shapes: a check that it runs (tests, CPU)

Cases, each `train.build_program` of a config (what `resconv_jax.main` compiles), one run's
chunk timed after one warm-up call, the median of `--repeats` calls:

  matmul      one (N, N) @ (N, N) float32 product, N = 8192 (--quick: 512): the FLOP/s ceiling
  gpt2 L=2    random GPT-2-small-shaped classifier (768 wide, 12 heads), first L blocks, one GD
  gpt2 L=10   step on 32 SST-2 sentences of 64 tokens (configs/sst2.py), probe off (--quick:
              L = 2 and 3, 32 wide)
  jena        configs/jena.py's 15-run sweep, a chunk of 10 steps with the probe on its first
  jena/noprobe  the same chunk without the probe (the probe's cost as trained)
  jena full   configs/jena.py:full (P = 2041, microbatches of 64), a 10-step chunk, probe off

FLOP counts are XLA's of one step (`Program.flops`, `runtime.metrics.step_flops`). MFU is
FLOP/s over the matmul's measured FLOP/s, and over the nominal dense peak of the device kind
(NOMINAL_PEAK; float32 matmuls on NVIDIA GPUs run as TF32 under JAX's default precision, so
TF32's peak is the one quoted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import REPO, load_average, machine, table  # noqa: E402
from resconv_jax import train  # noqa: E402
from resconv_jax.config_defaults import load_config_file  # noqa: E402

# Dense TF32 tensor-core peaks (FLOP/s), from NVIDIA's data sheets.
NOMINAL_PEAK = {"H100": 494.7e12, "H200": 494.7e12, "A100": 156e12}


def nominal_peak(kind: str) -> float | None:
    return next((peak for name, peak in NOMINAL_PEAK.items() if name in kind), None)


def median_seconds(call, repeats: int) -> float:
    jax.block_until_ready(call())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_case(size: int, repeats: int) -> tuple[float, float]:
    """(seconds, FLOP) of one (size, size) @ (size, size) float32 product."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    product = jax.jit(lambda a: a @ a)
    return median_seconds(lambda: product(a), repeats), 2.0 * size**3


def gpt2_config(layers: int, quick: bool):
    overrides = {
        "model.gpt2.weights": "random",
        "model.num_layers": layers,
        "sweep.num_layers": (),
        "sweep.beta": (1.0,),
        "data.num_train": 8 if quick else 32,
        "data.max_tokens": 16 if quick else 64,
        "data.num_val": 8,
        "probe.enabled": False,
        "train.log_every": 1,
        "train.print_every": 1,
    }
    config = load_config_file(str(REPO / "configs" / "sst2.py"), **overrides)
    if quick:
        with config.unlocked():
            config.model.gpt2.shape.update(n_embd=32, n_head=2, n_layer=layers, n_positions=16)
    return config


def jena_config(variant: str | None, quick: bool, **overrides):
    if quick:
        overrides |= {"data.num_train": 32, "sweep.seed": (0,), "train.log_every": 2}
    return load_config_file(str(REPO / "configs" / "jena.py"), variant, **overrides)


def chunk_case(config, repeats: int) -> tuple[float, float, int]:
    """(seconds per step, FLOP per step, steps per chunk) of `config`'s first chunk."""
    program = train.build_program(config)
    steps = config.train.log_every
    state = [program.state]

    def call():
        state[0], buffers = program.runners.run(
            0, state[0], program.hp, program.x, program.y, steps
        )
        return buffers

    return median_seconds(call, repeats) / steps, program.flops, steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a check that it runs)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"machine: {machine()}; device {device.device_kind}; load average {load_average()}")
    mm_seconds, mm_flops = matmul_case(512 if args.quick else 8192, args.repeats)
    ceiling = mm_flops / mm_seconds
    peak = nominal_peak(device.device_kind)
    cases = {
        **{f"gpt2 L={L}": gpt2_config(L, args.quick) for L in ((2, 3) if args.quick else (2, 10))},
        "jena": jena_config(None, args.quick),
        "jena/noprobe": jena_config(None, args.quick, **{"probe.enabled": False}),
        "jena full": jena_config("full", args.quick, **{"probe.enabled": False}),
    }
    rows = [["matmul", f"{mm_seconds * 1e3:.2f} ms", f"{ceiling / 1e12:.2f}", "1.00", "-"]]
    seconds_of = {}
    for name, config in cases.items():
        seconds, flops, _ = chunk_case(config, args.repeats)
        seconds_of[name] = seconds
        rate = flops / seconds
        rows.append(
            [
                name,
                f"{seconds * 1e3:.2f} ms/step",
                f"{rate / 1e12:.2f}",
                f"{rate / ceiling:.2f}",
                "-" if peak is None else f"{rate / peak:.3f}",
            ]
        )
        print(f"  {name}: {seconds * 1e3:.2f} ms per step", flush=True)
    print()
    print(table(["case", "time", "TFLOP/s", "of the matmul", "MFU (nominal peak)"], rows))
    overhead = seconds_of["jena"] / seconds_of["jena/noprobe"] - 1
    print(f"\nprobe on the first step of each 10-step chunk (as trained): {100 * overhead:+.1f} %")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
