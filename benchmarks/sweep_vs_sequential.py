"""A 5-run β sweep as one program against the same 5 runs one after another.

    python -m benchmarks.sweep_vs_sequential                 # both parts, small defaults
    python -m benchmarks.sweep_vs_sequential --part commands --cmd-repeats 3
    python -m benchmarks.sweep_vs_sequential --part steps --repeats 9 [--dump-hlo /tmp/hlo]
    python -m benchmarks.sweep_vs_sequential --part steps --sizes jena --runs-per-chunk auto,1

Part "commands" (benchmarks/whole_commands.py): wall time of one `resconv_jax.main` command on
configs/theory.py sweeping 5 β against five single-β commands. Target: >= 3x.

Part "steps", in one process: the jitted step of resconv_jax.step with the 5 runs in one state (R=5)
against the same functions built for R=1 and called 5 times, (a) as `run_steps` (K steps in an
on-device loop per call; "loop") and (b) one `step` per call ("call", dispatch-bound), at the
configs/theory.py size and a Jena-like size (P=512, M=24, d=6, d_qk=6, d_h=32, d_y=1; Gaussian
data of that shape). Variants (benchmarks/step_cases.py): library (defaults: fast_backward, all runs
vmapped); chunkB (runs_per_chunk=B, for each B of --runs-per-chunk; 'auto': as
train.runs_per_chunk=-1 picks it); plain (fast_backward=False, the formulation before the fast_ops
patch). Target: the R=5 step costs no more than the 5 single steps. Before timing, every case's
losses after 10 steps (5 at the Jena size) are checked against the library's five single runs.

`--malloc-no-mmap` makes glibc serve large allocations from the heap (no mmap/munmap and fresh page
faults per call for temporary buffers above its 32 MiB mmap threshold); process-wide, so compare
two runs of this script. Times are medians over `--repeats` round-robin repeats (the order rotated
each repeat); ratios are ratios of medians. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, step_cases  # noqa: E402
from benchmarks.common import SWEEP_BETAS  # noqa: E402
from benchmarks.whole_commands import bench_commands  # noqa: E402
from resconv_jax import runners  # noqa: E402

HEADERS = ["mode", "variant", "runs", "time / step", "IQR", "vs library 5xR=1", "vs own 5xR=1"]


def step_rows(cases, times, k: int) -> list[list[str]]:
    per_step = {key: common.median(ts) / cases[key].steps_per_call() for key, ts in times.items()}
    rows = []
    for mode in ("loop", "call"):
        base = per_step[("library", "5xR=1", mode)]
        for key in (key for key in cases if key[2] == mode):
            variant, label, _ = key
            own, own_ratio = step_cases.own_single_runs(variant), ""
            if label == "R=5":
                r = per_step[(own, "5xR=1", mode)] / per_step[key]
                own_ratio = f"{r:.2f}x ({own}) {'yes' if r >= 1.0 else 'no'}"
            rows.append(
                [
                    f"loop (K={k})" if mode == "loop" else "call (1 step)",
                    variant,
                    label,
                    common.fmt_time(per_step[key]),
                    common.spread(times[key]),
                    f"{base / per_step[key]:.2f}x",
                    own_ratio,
                ]
            )
    return rows


def diagnostics(size, cases, dump_hlo: str) -> list[str]:
    """Per loop case: YNNPACK fusions, dots outside them, temp buffer; optionally dump the HLO."""
    lines = ["Compiled loop functions (XLA:CPU):", ""]
    for (variant, label, mode), case in cases.items():
        if mode != "loop":
            continue
        hlo = case.compiled.as_text()
        dots = step_cases.unfused_dots(hlo)
        lines.append(
            f"- {variant} {label}: {step_cases.library_fusions(hlo)} YNNPACK fusions, {len(dots)} "
            f"dots outside them, temp buffer {case.temp_mb():.1f} MB"
        )
        lines += [f"    - `{d}`" for d in dots]
        if dump_hlo:
            path = Path(dump_hlo)
            path.mkdir(parents=True, exist_ok=True)
            name = f"{size.name}_{variant}_{label.replace('=', '')}_loop.hlo"
            (path / name).write_text(hlo)
    return lines


def bench_steps(args) -> str:
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(step_cases.VARIANTS))
    if unknown or "library" not in variants:
        raise SystemExit(f"--variants: need 'library', some of {step_cases.VARIANTS}; {unknown}")
    out = []
    for size in common.sizes_from_flag(args.sizes):
        k = args.loop_steps or (100 if size.name == "theory" else 5)
        t0 = time.perf_counter()
        chunks, notes = [], []
        for value in (v.strip() for v in args.runs_per_chunk.split(",") if v.strip()):
            if value == "auto":
                b, temp = step_cases.auto_runs_per_chunk(size, k, common.make_data(size))
                notes.append(
                    f"{b} by train.runs_per_chunk=-1 (probed R=5 run_steps temp "
                    f"{temp / 2**20:.1f} MiB vs {runners.CPU_CHUNK_BYTES / 2**20:.0f} MiB)"
                )
            else:
                b = int(value)
                notes.append(f"{b} (given)")
            chunks.append(b)
        cases = step_cases.build_cases(size, variants, k, chunks)
        compile_s = time.perf_counter() - t0
        checks = step_cases.check_losses(cases, min(args.check_steps, k), args.rtol)
        times = common.interleave(cases, args.repeats)
        table = common.table(HEADERS, step_rows(cases, times, k))
        out.append(
            f"### Per step, {size.name} size ({size.describe()}), 5 runs "
            f"(beta in {SWEEP_BETAS}), lr={size.lr:g}\n\n"
            f"runs_per_chunk of 'chunkB' cases: {'; '.join(notes) or '-'} (0: not timed). "
            f"{args.repeats} interleaved repeats; compiled {len(cases)} functions in "
            f"{compile_s:.0f} s; load average {common.load_average()}.\n"
            "Time per training step of all 5 runs (R=5: one step of the 5-run state; 5xR=1: five "
            "single-run steps). 'vs library 5xR=1' = library 5xR=1 time / this time; 'vs own "
            "5xR=1' = time of the five single steps this R=5 step replaces / this time, and "
            "whether it is >= 1 (the target).\n\n" + table
        )
        diag = diagnostics(size, cases, args.dump_hlo)
        out.append("\n".join([*diag, "", *[f"- check: {c}" for c in checks]]))
        print(out[-2] + "\n\n" + out[-1] + "\n", flush=True)
    return "\n\n".join(out)


def malloc_no_mmap() -> None:
    """glibc: serve every allocation from the heap and never trim it (no page faults per call)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    libc.mallopt(m_mmap_max, 0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "commands", "steps"), default="all")
    p.add_argument("--sizes", default="theory,jena", help="comma list of: theory, jena")
    p.add_argument("--variants", default=",".join(step_cases.VARIANTS), help="steps part")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (steps part)")
    p.add_argument("--loop-steps", type=int, default=0, help="K steps per loop call (0: 100 / 5)")
    p.add_argument(
        "--runs-per-chunk",
        default="auto",
        help="comma list of B for the 'chunked' variant, or 'auto' (as train.runs_per_chunk=-1)",
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="loss agreement required")
    p.add_argument("--check-steps", type=int, default=10, help="steps before the loss check")
    p.add_argument("--dump-hlo", default="", help="write the compiled loop HLO to this folder")
    p.add_argument("--malloc-no-mmap", action="store_true", help="see the module docstring")
    p.add_argument("--cmd-repeats", type=int, default=1)
    p.add_argument("--cmd-steps", type=int, default=None, help="train.num_steps (default: config)")
    p.add_argument(
        "--cmd-flag",
        action="append",
        default=[],
        help="extra flag for every command (repeatable), e.g. "
        "--cmd-flag=--config.certificate.every=0",
    )
    p.add_argument("--output", default="", help="also write the tables (Markdown) here")
    args = p.parse_args(argv)
    if args.malloc_no_mmap:
        malloc_no_mmap()
    header = f"Machine: {common.machine()}" + (
        "; glibc malloc: no mmap (--malloc-no-mmap)" if args.malloc_no_mmap else ""
    )
    print(header + "\n", flush=True)
    sections = [header]
    if args.part in ("all", "commands"):
        sections.append(bench_commands(args.cmd_repeats, args.cmd_steps, args.cmd_flag))
    if args.part in ("all", "steps"):
        sections.append(bench_steps(args))
    if args.output:
        Path(args.output).write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
