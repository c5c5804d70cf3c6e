"""Full-batch GD in microbatches: memory flat in P, step time linear in P (train.microbatch_size).

    python -m benchmarks.scaling                  # both models, P = 256 ... 16384, 2 rounds
    python -m benchmarks.scaling --models transformer --sizes 256,1024 --rounds 1
    python -m benchmarks.scaling --microbatch 256 --no-whole

Models: "gpt2", a random GPT-2 (width 64, 4 heads, L = 4 blocks, T = 16 tokens) on the first P
bundled GLUE SST-2 train sentences; "transformer", the paper's model (d = 32, M = 16, d_qk = 16,
d_h = 64, L = 2) on P Gaussian samples. One run (β = 1) each, plain GD, the library's compiled
chunk (`train.build_program`, probe off) on one device, called as `main` calls it: a chunk of
`--steps-per-call` steps on device (default 10, the library's train.log_every) per call, so that
the cost every call pays whatever its steps (XLA:CPU allocates and first touches the program's
temporaries at every call: a few ms for this GPT-2, RESULTS.md §6) is spread over a chunk's
steps as in a run. The default run takes ~16 min on a 2-core CPU.

Each case runs in a fresh process, so that its peak RSS (`ru_maxrss`) is its own, `--rounds`
times, round-robin over the cases (a change of the machine's load then reaches every case, not
the last few). Reported per case: XLA's temporaries of the compiled step
(`memory_analysis().temp_size_in_bytes`), the process's peak RSS, the step time (a call's time
over its steps: the median over at least `--repeats` calls and 2 s after a warm-up call, in the
fastest round) and the time per sample. The microbatched cases (a fixed `--microbatch` n) are
compared with the smallest P (memory: ratio largest/smallest, the target ≤ 1.25) and with each
other (time/P: spread around the mean, the target ±15 %), and with the whole batch at once
("whole", where it fits) at the same P in the same run. The least-squares line
step time = a + b·P separates the fixed cost of a step (a) from the cost per sample (b);
`--steps-per-call 1` shows what a call costs on top (~9 ms for this GPT-2 at one step per call,
most of it the first touches of the 50,257 × 64 token embedding's gradient buffer; RESULTS.md §6).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import REPO, load_average, machine, table

SIZES = (256, 1024, 4096, 16384)
MIN_SECONDS, MAX_REPEATS = 2.0, 200  # short calls are repeated for at least 2 s
STEPS_PER_CALL = 10  # the library's train.log_every (config_defaults.base_config)


def case_config(
    model: str, num_samples: int, microbatch: int, steps_per_call: int = STEPS_PER_CALL
):
    """The config of one case: `model`, P samples, train.microbatch_size, chunks of
    `steps_per_call` steps (train.log_every)."""
    from resconv_jax.config_defaults import base_config, load_config_file

    overrides = {
        "train.num_steps": 1000 * steps_per_call,
        "train.log_every": steps_per_call,
        "train.print_every": steps_per_call,
        "train.checkpoint_every": 1000 * steps_per_call,
        "train.microbatch_size": microbatch,
        "train.runs_per_chunk": 0,
        "probe.enabled": False,
        "sweep.beta": (),
        "sweep.seed": (),  # one run: configs/sst2.py:full sweeps seeds 0-4
    }
    if model == "gpt2":
        config = load_config_file(
            str(REPO / "configs" / "sst2.py"),
            "full",
            **overrides,
            **{
                "model.gpt2.weights": "random",
                "sweep.num_layers": (),
                "model.num_layers": 4,
                "data.num_train": num_samples,
                "data.max_tokens": 16,
            },
        )
        with config.unlocked():
            config.model.gpt2.shape.update(n_embd=64, n_head=4, n_layer=4, n_positions=16)
        return config
    config = base_config()
    config.update_from_flattened_dict(
        overrides
        | {
            "data.num_samples": num_samples,
            "data.seq_len": 16,
            "data.dim": 32,
            "model.num_layers": 2,
            "model.transformer.d_qk": 16,
            "model.transformer.d_h": 64,
            "optim.lr": 1e-5,
        }
    )
    return config


def run_case(
    model: str,
    num_samples: int,
    microbatch: int,
    repeats: int,
    steps_per_call: int = STEPS_PER_CALL,
) -> dict:
    """Builds and times one case in this process; the JSON-able record. After a warm-up call of
    one step, at least `repeats` calls of `steps_per_call` steps (and at least MIN_SECONDS)."""
    import jax

    from resconv_jax import train

    program = train.build_program(case_config(model, num_samples, microbatch, steps_per_call))

    def call(state, num_steps: int):
        state, buffers = program.runners.run(0, state, program.hp, program.x, program.y, num_steps)
        jax.block_until_ready(buffers)
        return state, buffers

    state, _ = call(program.state, 1)
    times = []
    while len(times) < repeats or (sum(times) < MIN_SECONDS and len(times) < MAX_REPEATS):
        start = time.perf_counter()
        state, buffers = call(state, steps_per_call)
        times.append(time.perf_counter() - start)
    analysis = program.runners.compiled.memory_analysis()
    return {
        "model": model,
        "P": num_samples,
        "microbatch": microbatch,
        "steps_per_call": steps_per_call,
        "temp_bytes": analysis.temp_size_in_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds": statistics.median(times) / steps_per_call,
        "loss": float(buffers["loss"][steps_per_call - 1, 0]),  # (steps, runs)
    }


def in_subprocess(
    model: str, num_samples: int, microbatch: int, repeats: int, steps_per_call: int
) -> dict | None:
    """`run_case` in a fresh Python; None (with its last line printed) when it fails."""
    args = [sys.executable, "-m", "benchmarks.scaling", "--case"]
    args += [f"{model},{num_samples},{microbatch}", "--repeats", str(repeats)]
    args += ["--steps-per-call", str(steps_per_call)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {model} P={num_samples} microbatch={microbatch}: failed: {last}", flush=True)
        return None
    return json.loads(lines[-1])


def best_of(measured: list[dict]) -> dict:
    """One case over its rounds: the fastest round's median step time (another process's load
    only adds time), the largest memory figures."""
    best = dict(min(measured, key=lambda r: r["step_seconds"]))
    best["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in measured)
    best["temp_bytes"] = max(r["temp_bytes"] for r in measured)
    best["rounds"] = [r["step_seconds"] for r in measured]
    return best


def affine_fit(num_samples: list[int], seconds: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line step time = a + b·P: a fixed per-step cost (whatever P)
    and a cost per sample."""
    slope, intercept = np.polyfit(np.asarray(num_samples, float), np.asarray(seconds), 1)
    return float(intercept), float(slope)


def mib(num: float) -> str:
    return f"{num / 2**20:.1f}"


def report(records: list[dict], model: str, microbatch: int) -> list[str]:
    """The model's table and its verdict lines."""
    parts = sorted((r for r in records if r["microbatch"] == microbatch), key=lambda r: r["P"])
    whole = {r["P"]: r for r in records if r["microbatch"] == 0}
    if not parts:
        return [f"{model}: no microbatched case ran"]
    per_sample = [r["step_seconds"] / r["P"] for r in parts]
    mean = statistics.mean(per_sample)
    rows = []
    for r, t in zip(parts, per_sample, strict=True):
        w = whole.get(r["P"])
        rows.append(
            [
                r["P"],
                mib(r["temp_bytes"]),
                mib(r["peak_rss_bytes"]),
                f"{r['step_seconds'] * 1e3:.1f}",
                f"{t * 1e6:.1f} ({100 * (t / mean - 1):+.0f} %)",
                "-" if w is None else mib(w["temp_bytes"]),
                "-" if w is None else mib(w["peak_rss_bytes"]),
                "-" if w is None else f"{r['step_seconds'] / w['step_seconds']:.2f}",
            ]
        )
    headers = [
        "P",
        "temp MiB",
        "peak RSS MiB",
        "step ms",
        "µs per sample (vs mean)",
        "whole: temp MiB",
        "whole: RSS MiB",
        "time / whole",
    ]
    temp = [r["temp_bytes"] for r in parts]
    rss = [r["peak_rss_bytes"] for r in parts]
    spread = max(abs(t / mean - 1) for t in per_sample)
    verdicts = [
        f"temp memory largest/smallest {max(temp) / min(temp):.2f} (target ≤ 1.25): "
        f"{'met' if max(temp) <= 1.25 * min(temp) else 'NOT met'}",
        f"peak RSS largest/smallest {max(rss) / min(rss):.2f} (target ≤ 1.25): "
        f"{'met' if max(rss) <= 1.25 * min(rss) else 'NOT met'}",
        f"time per sample within {100 * spread:.0f} % of the mean (target ±15 %): "
        f"{'met' if spread <= 0.15 else 'NOT met'}",
    ]
    if len(parts) > 1:
        fixed, per_sample_fit = affine_fit(
            [r["P"] for r in parts], [r["step_seconds"] for r in parts]
        )
        verdicts.append(
            f"least-squares step time = {fixed * 1e3:.1f} ms + {per_sample_fit * 1e6:.1f} µs·P "
            f"(the fixed part is {100 * fixed / parts[0]['step_seconds']:.0f} % of the "
            f"P = {parts[0]['P']} step)"
        )
    runs = [len(r["rounds"]) for r in parts]
    steps = parts[0].get("steps_per_call", 1)
    verdicts.append(
        f"step times: {steps} step{'s' if steps > 1 else ''} per call, the fastest of "
        f"{min(runs)} rounds (fresh processes, round-robin) per case"
    )
    title = f"### {model}, microbatches of {microbatch}"
    return [title, "", table(headers, rows), "", *[f"- {v}" for v in verdicts], ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,transformer")
    parser.add_argument("--sizes", default=",".join(str(p) for p in SIZES))
    parser.add_argument("--microbatch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per case")
    parser.add_argument(
        "--steps-per-call", type=int, default=STEPS_PER_CALL, help="steps per chunk call"
    )
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-batch baseline")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # MODEL,P,MICROBATCH: one case
    args = parser.parse_args()
    if args.steps_per_call < 1:
        parser.error(f"--steps-per-call must be at least 1, not {args.steps_per_call}")
    if args.case:
        model, num_samples, microbatch = args.case.split(",")
        record = run_case(
            model, int(num_samples), int(microbatch), args.repeats, args.steps_per_call
        )
        print(json.dumps(record))
        return
    sizes = [int(p) for p in args.sizes.split(",")]
    print(f"machine: {machine()}; load average {load_average()}", flush=True)
    cases = [
        (model, num_samples, microbatch)
        for model in args.models.split(",")
        for num_samples in sizes
        for microbatch in (args.microbatch, *(() if args.no_whole else (0,)))
    ]
    rounds: dict[tuple, list[dict]] = {case: [] for case in cases}
    for round_index in range(args.rounds):  # round-robin: a load change hits every case alike
        for model, num_samples, microbatch in cases:
            record = in_subprocess(
                model, num_samples, microbatch, args.repeats, args.steps_per_call
            )
            if record is not None:
                rounds[model, num_samples, microbatch].append(record)
                print(
                    f"  round {round_index + 1}: {model} P={num_samples} microbatch={microbatch}: "
                    f"{record['step_seconds'] * 1e3:.1f} ms/step, temp "
                    f"{mib(record['temp_bytes'])} MiB, RSS {mib(record['peak_rss_bytes'])} MiB",
                    flush=True,
                )
    records = [best_of(measured) for measured in rounds.values() if measured]
    print()
    for model in args.models.split(","):
        ran = [r for r in records if r["model"] == model]
        print("\n".join(report(ran, model, args.microbatch)))
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
