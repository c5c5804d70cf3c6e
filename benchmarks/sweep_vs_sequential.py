"""A 5-run β sweep as one program against the same 5 runs one after another.

    python -m benchmarks.sweep_vs_sequential                # both parts, small defaults (~2.5 min)
    python -m benchmarks.sweep_vs_sequential --part commands --cmd-repeats 3
    python -m benchmarks.sweep_vs_sequential --part steps --repeats 9 \
        --candidates tn,sm,tn+sm+qkv,map,tn+sm+qkv+map --dump-hlo /tmp/hlo

Part "commands": wall time of one `python -m resconv_jax.main --config=configs/theory.py` command
with `--config.sweep.beta="(0.0,0.25,0.5,0.75,1.0)"` against five commands with one β each (fresh
workdir each, same number of steps). Target: the sweep command >= 3x faster than the five.

Part "steps", in one process: the jitted step of resconv_jax.step vmapped over 5 runs (R=5) against
the same functions with R=1 called 5 times, (a) as `run_steps` (K steps in an on-device loop per
call, so dispatch does not dominate) and (b) one step per call (dispatch-bound). At the
configs/theory.py size and a Jena-like size (P=512, M=24, d=6, d_qk=6, d_h=32, d_y=1; Gaussian data
of that shape). Target: the vmapped step costs no more than the 5 single steps. Before timing, every
case's losses after 10 steps are checked against the library's five single runs.

Candidates (`--candidates`, '+'-joined parts), timed next to the library in the same process:
  tn    every matmul has a custom VJP whose backward pass multiplies by a transposed copy made
        behind an optimization barrier (`tn_matmul`), so that every large dot of the backward
        pass reaches XLA:CPU's YNNPACK kernels in canonical (row-major, untransposed) form. Under
        vmap, XLA otherwise folds those transposes into batched dots with transposed contraction
        dimensions, which YNNPACK rejects and which then run as slow per-batch Eigen loops.
  sm    the attention softmax with the derivative y ⊙ (ẋ − Σ y ⊙ ẋ) (`softmax_rows`); by default
        `jax.nn.softmax` is differentiated through exp(x − max)/Σ, a longer chain of M×M passes.
  qkv   one x @ [W_Q W_K W_V] product instead of three.
  map   the runs stepped one after another inside the program (`jax.lax.map` over the run axis;
        mapB: B runs at a time, vmapped), so that the working set is one run's.
  plain the original formulation (plain matmuls, jax.nn.softmax), to compare against a library
        that already has the tn/sm/qkv patch; libchunkB: the library's own
        `make_step_functions(..., runs_per_chunk=B)`, where it exists (the patched step.py).
`--malloc-no-mmap` makes glibc serve large allocations from the heap (no mmap/munmap per call):
XLA's temporary buffer of the vmapped Jena-size step (~45 MB) exceeds glibc's largest mmap
threshold (32 MB), so every call otherwise faults in fresh pages. It is process-wide: compare two
runs of this script, with and without the flag.

Times are medians over `--repeats` round-robin repeats (the order rotated each repeat); ratios are
ratios of medians. See benchmarks/RESULTS.md for measured numbers and the recommended patch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import REPO, SWEEP_BETAS  # noqa: E402
from resconv_jax.models import transformer  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Candidate "tn": matmuls whose backward uses materialized transposes.


def _materialized_transpose(a: jax.Array) -> jax.Array:
    """`a` with its last two axes swapped, as a real copy: the optimization barrier keeps XLA
    from folding the transpose into the consuming dot as a transposed contraction dimension."""
    return jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))


def _transposed_times(a: jax.Array, g: jax.Array) -> jax.Array:
    """aᵀ g over the last two axes (a: (..., n, k), g: (..., n, m)) as a canonical dot.

    The narrower operand is transposed into a real copy; when that is g, (gᵀ a)ᵀ is computed and
    its (small) result transposed back."""
    if a.shape[-1] <= g.shape[-1]:
        return _materialized_transpose(a) @ g
    return _materialized_transpose(jax.lax.optimization_barrier(_materialized_transpose(g) @ a))


@jax.custom_vjp
def tn_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` (a: (..., n, k); b: (k, m) or (..., k, m)) with a layout-friendly backward."""
    return a @ b


def _tn_matmul_fwd(a, b):
    return a @ b, (a, b)


def _tn_matmul_bwd(res, g):
    a, b = res
    da = g @ jnp.swapaxes(b, -1, -2)
    if b.ndim == 2:  # a weight: contract over every leading axis of a as one matrix product
        db = _transposed_times(a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1]))
    else:
        db = _transposed_times(a, g)
    return da, db


tn_matmul.defvjp(_tn_matmul_fwd, _tn_matmul_bwd)


@jax.custom_vjp
def tn_matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ bᵀ` over the last two axes (the attention logits Q Kᵀ), layout-friendly backward."""
    return a @ jnp.swapaxes(b, -1, -2)


def _tn_matmul_nt_fwd(a, b):
    return a @ jnp.swapaxes(b, -1, -2), (a, b)


def _tn_matmul_nt_bwd(res, g):
    a, b = res
    return g @ b, _transposed_times(g, a)


tn_matmul_nt.defvjp(_tn_matmul_nt_fwd, _tn_matmul_nt_bwd)


@jax.custom_jvp
def softmax_rows(logits: jax.Array) -> jax.Array:
    """Softmax over the last axis, differentiated as y ⊙ (ẋ − Σ y ⊙ ẋ) (candidate "sm").

    `jax.nn.softmax` by default (jax_softmax_custom_jvp=False) is differentiated through
    exp(x − max) / Σ, which XLA turns into a longer chain of (M × M)-sized passes.
    """
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    return unnormalized / unnormalized.sum(-1, keepdims=True)


@softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = softmax_rows(x)
    return y, y * (x_dot - jnp.sum(y * x_dot, axis=-1, keepdims=True))


def _plain_matmul_nt(a, b):
    return a @ jnp.swapaxes(b, -1, -2)


class Variant(NamedTuple):
    """A candidate: which model changes (tn, sm, qkv) and how the runs are stepped."""

    tn: bool = False  # tn_matmul / tn_matmul_nt for every matmul
    sm: bool = False  # softmax_rows for the attention softmax
    qkv: bool = False  # one x @ [W_Q W_K W_V] product instead of three
    plain: bool = False  # the original formulation (for a library that has the patch applied)
    chunk: int = 0  # 0: vmap over all runs; B: jax.lax.map over the runs, B at a time
    lib_chunk: int = 0  # B: the library's own make_step_functions(runs_per_chunk=B), if it has it

    @property
    def model(self) -> bool:
        return self.tn or self.sm or self.qkv or self.plain


def parse_variant(name: str) -> Variant:
    """'library', or '+'-joined parts 'tn', 'sm', 'qkv', 'plain', 'map' / 'mapB', 'libchunkB'
    (e.g. 'tn+sm+qkv+map')."""
    v = Variant()
    for part in name.split("+"):
        if part in ("tn", "sm", "qkv", "plain"):
            v = v._replace(**{part: True})
        elif part.startswith("map") and (part[3:] == "" or part[3:].isdigit()):
            v = v._replace(chunk=int(part[3:] or 1))
        elif part.startswith("libchunk") and part[8:].isdigit():
            v = v._replace(lib_chunk=int(part[8:]))
        elif part != "library":
            raise SystemExit(
                f"unknown candidate {name!r} (parts: tn, sm, qkv, plain, map, mapB, libchunkB)"
            )
    return v


def candidate_block_methods(v: Variant):
    """`Block.attention` and `Block.__call__` of the candidate model (the proposed patch)."""
    mm = tn_matmul if v.tn else jnp.matmul
    mm_nt = tn_matmul_nt if v.tn else _plain_matmul_nt

    def softmax(logits):
        return softmax_rows(logits) if v.sm else jax.nn.softmax(logits, axis=-1)

    def attention(self, x, **_):  # ** takes the library's own options, if any
        w_q, w_k, w_v = self.w_q[...], self.w_k[...], self.w_v[...]
        if v.qkv:
            d_qk = w_q.shape[1]
            qkv = mm(x, jnp.concatenate([w_q, w_k, w_v], axis=1))
            q, k, val = qkv[..., :d_qk], qkv[..., d_qk : 2 * d_qk], qkv[..., 2 * d_qk :]
        else:
            q, k, val = mm(x, w_q), mm(x, w_k), mm(x, w_v)
        logits = mm_nt(q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        return mm(softmax(logits), val)

    def call(self, x, beta_attn, beta_ffn, **_):
        attn = self.attention(x)
        z = attn + beta_attn * x
        h = mm(jax.nn.relu(mm(z, self.w_1[...])), self.w_2[...]) + beta_ffn * z
        return h, attn, z

    return attention, call


def candidate_model(v: Variant):
    """A context-manager factory: while tracing, `transformer.Block` is the candidate model."""

    @contextlib.contextmanager
    def patched():
        saved = transformer.Block.attention, transformer.Block.__call__
        transformer.Block.attention, transformer.Block.__call__ = candidate_block_methods(v)
        try:
            yield
        finally:
            transformer.Block.attention, transformer.Block.__call__ = saved

    return patched


# ---------------------------------------------------------------------------------------------
# Candidate "map": the runs one after another inside the program.


def map_step(fns, batch_size: int = 1):
    """`(state, hp, x, y) -> (state, metrics)` stepping the runs `batch_size` at a time (vmapped
    within a chunk), chunk after chunk: `jax.lax.map` over the run axis."""
    step = common.step_fn(fns)

    def step_all(state, hp, x, y):
        def one(run):
            s, h = jax.tree.map(lambda a: a[None], run)
            return jax.tree.map(lambda a: a[0], step(s, h, x, y))

        return jax.lax.map(one, (state, hp), batch_size=batch_size)

    return step_all


def map_run_steps(fns, steps_per_call: int, batch_size: int = 1):
    """`run_steps` (as in resconv_jax.step) around `map_step`."""
    step = map_step(fns, batch_size)

    def run_steps(state, hp, x, y, num_steps):
        num_runs = hp["beta_attn"].shape[0]
        buffers = {
            k: jnp.full((steps_per_call, num_runs), jnp.nan, jnp.float32)
            for k in ("loss", "grad_norm")
        }

        def body(i, carry):
            state, buffers = carry
            state, metrics = step(state, hp, x, y)
            return state, {k: buffers[k].at[i].set(metrics[k]) for k in buffers}

        return jax.lax.fori_loop(0, num_steps, body, (state, buffers))

    return run_steps


# ---------------------------------------------------------------------------------------------
# Compiled cases.


def unfused_dots(hlo: str) -> list[str]:
    """Dots that XLA:CPU runs outside a library (YNNPACK/XNNPACK) fusion: Eigen or loop code."""
    dots, comp = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            comp = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            continue
        if " dot(" in line and comp and not comp.lstrip("%").startswith(("fused_", "wrapped")):
            text = re.sub(r", metadata=.*", "", line.strip())
            m = re.match(r"%(\S+) = (\S+) dot\(.*?\), (.*)$", text)
            dots.append(f"{m.group(2)} {m.group(3)}" if m else text)
    return dots


def library_fusions(hlo: str) -> int:
    return len(re.findall(r"= \S+ fusion\(.*kind=kCustom", hlo))


def build_cases(size, candidates, loop_steps):
    """{(variant, 'R=5'|'5xR=1', 'loop'|'call'): Case} for the library and the candidates."""
    r5 = common.build_runs(size, SWEEP_BETAS, loop_steps)
    data = (np.asarray(r5.x), np.asarray(r5.y))
    r1s = [common.build_runs(size, (b,), loop_steps, data=data) for b in SWEEP_BETAS]
    cases = {}
    for variant in ("library", *candidates):
        v = parse_variant(variant)
        batch = v.chunk
        ctx = candidate_model(v) if v.model else None
        r5v = r5
        if v.lib_chunk:
            if not common.library_accepts("runs_per_chunk"):
                print(f"skipping {variant}: make_step_functions has no runs_per_chunk", flush=True)
                continue
            kwargs = {"runs_per_chunk": v.lib_chunk}
            r5v = common.build_runs(size, SWEEP_BETAS, loop_steps, data=data, step_kwargs=kwargs)
        for mode, k in (("loop", loop_steps), ("call", None)):
            for label, runs_list in (("R=5", [r5v]), ("5xR=1", r1s)):
                if (batch or v.lib_chunk) and label == "5xR=1":
                    continue  # chunking only changes how several runs are stepped
                fns = runs_list[0].fns
                if batch:
                    fn = map_run_steps(fns, k, batch) if k else map_step(fns, batch)
                else:
                    fn = common.run_steps_fn(fns) if k else common.step_fn(fns)
                cases[(variant, label, mode)] = common.Case(fn, runs_list, k, ctx)
    return cases


def single_runs_of(variant: str) -> str:
    """The variant whose 5xR=1 steps an R=5 variant replaces: the same model, no chunking."""
    parts = [p for p in variant.split("+") if not p.startswith(("map", "libchunk"))]
    return "+".join(parts) or "library"


def check_candidates(cases, steps: int, rtol: float) -> list[str]:
    """After `steps` steps from the same start, every loop case's losses equal those of the
    library's five single runs (to `rtol`); returns report lines."""
    lines = []
    ref = cases[("library", "5xR=1", "loop")]
    ref(steps)
    want = ref.final_losses()
    for (variant, label, mode), case in cases.items():
        if mode != "loop" or (variant, label) == ("library", "5xR=1"):
            continue
        case(steps)
        got = case.final_losses()
        err = float(np.max(np.abs(got - want) / np.abs(want)))
        lines.append(
            f"{variant} {label}: losses after {steps} steps agree with the library's 5xR=1 to "
            f"{err:.1e} (max relative difference)"
        )
        if not err <= rtol:
            raise SystemExit(f"{variant} {label} disagrees with the library: {got} vs {want}")
    return lines


def bench_steps(args) -> str:
    candidates = [c for c in args.candidates.split(",") if c]
    for c in candidates:
        parse_variant(c)
    out = []
    for size in common.sizes_from_flag(args.sizes):
        k = args.loop_steps or (100 if size.name == "theory" else 5)
        t0 = time.perf_counter()
        cases = build_cases(size, candidates, k)
        compile_s = time.perf_counter() - t0
        checks = check_candidates(cases, min(args.check_steps, k), args.rtol)
        times = common.interleave(cases, args.repeats)
        per_step = {
            key: common.median(ts) / cases[key].steps_per_call() for key, ts in times.items()
        }
        rows = []
        for mode in ("loop", "call"):
            base = per_step[("library", "5xR=1", mode)]
            for key in cases:
                if key[2] != mode:
                    continue
                variant, label, _ = key
                ratio = base / per_step[key]
                own, own_ratio, target = single_runs_of(variant), "", ""
                if label == "R=5" and (own, "5xR=1", mode) in per_step:
                    r = per_step[(own, "5xR=1", mode)] / per_step[key]
                    own_ratio, target = f"{r:.2f}x ({own})", "yes" if r >= 1.0 else "no"
                rows.append(
                    [
                        f"{mode} (K={k})" if mode == "loop" else "call (1 step)",
                        variant,
                        label,
                        common.fmt_time(per_step[key]),
                        common.spread(times[key]),
                        f"{ratio:.2f}x",
                        own_ratio,
                        target,
                    ]
                )
        out.append(
            f"### Per step, {size.name} size ({size.describe()}), 5 runs "
            f"(beta in {SWEEP_BETAS}), lr={size.lr:g}\n\n"
            f"{args.repeats} interleaved repeats; compiled {len(cases)} functions in "
            f"{compile_s:.0f} s; load average {common.load_average()}.\n"
            "Time is per training step of all 5 runs (R=5: one vmapped step; 5xR=1: five single "
            "steps). 'vs library 5xR=1' = library 5xR=1 time / this time; 'vs own 5xR=1' = "
            "time of the five single steps this R=5 step replaces (same model code) / this time; "
            "target: the latter >= 1.\n\n"
            + common.table(
                [
                    "mode",
                    "variant",
                    "runs",
                    "time / step",
                    "IQR",
                    "vs library 5xR=1",
                    "vs own 5xR=1",
                    "target",
                ],
                rows,
            )
        )
        diag = ["", "Compiled loop bodies (XLA:CPU):", ""]
        for key, case in cases.items():
            if key[2] != "loop":
                continue
            hlo = case.compiled.as_text()
            dots = unfused_dots(hlo)
            diag.append(
                f"- {key[0]} {key[1]}: {library_fusions(hlo)} YNNPACK fusions, {len(dots)} dots "
                f"outside them, temp buffer {case.temp_mb():.1f} MB"
            )
            diag.extend(f"    - `{d}`" for d in dots)
            if args.dump_hlo:
                path = Path(args.dump_hlo)
                path.mkdir(parents=True, exist_ok=True)
                name = f"{size.name}_{key[0]}_{key[1].replace('=', '')}_loop.hlo"
                (path / name).write_text(hlo)
        diag += ["", *[f"- check: {c}" for c in checks]]
        out.append("\n".join(diag))
        print(out[-2] + "\n" + out[-1] + "\n", flush=True)
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------
# Whole commands.


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
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    m = re.search(r"compiled in ([0-9.]+)s", proc.stdout)
    return wall, float(m.group(1)) if m else float("nan")


def bench_commands(args) -> str:
    root = tempfile.mkdtemp(prefix="resconv_bench_")
    walls = {"sweep": [], "singles": []}
    compiles = {"sweep": [], "singles": []}
    try:
        for r in range(args.cmd_repeats):
            order = ["sweep", "singles"] if r % 2 == 0 else ["singles", "sweep"]
            for which in order:
                betas_list = [SWEEP_BETAS] if which == "sweep" else [(b,) for b in SWEEP_BETAS]
                wall = compile_s = 0.0
                for i, betas in enumerate(betas_list):
                    wd = os.path.join(root, f"{which}{r}_{i}")
                    w, c = run_command(command(betas, wd, args.cmd_steps, args.cmd_flag))
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
    steps = (
        args.cmd_steps or common.load_config_file(str(REPO / "configs/theory.py")).train.num_steps
    )
    rows = [
        ["1 sweep command (5 runs)", 1, f"{sweep:.1f} s", f"{c_sweep:.1f} s", "1.00x"],
        ["5 single-run commands", 5, f"{singles:.1f} s", f"{c_singles:.1f} s", ""],
        ["ratio (5 singles / sweep)", "", "", "", f"{singles / sweep:.2f}x"],
    ]
    met = "met" if singles / sweep >= 3 else "NOT met"
    text = (
        f"### Whole commands, configs/theory.py, {steps} steps per run, beta in {SWEEP_BETAS}"
        + (f", extra flags {' '.join(args.cmd_flag)}" if args.cmd_flag else "")
        + "\n\n"
        f"{args.cmd_repeats} repeat(s), order alternated; each command a fresh process and "
        f"workdir; load average {common.load_average()}. 'compile' is the sum of the "
        "'compiled in' times the commands print (part of the wall time).\n\n"
        + common.table(["case", "commands", "wall (median)", "compile", "speedup"], rows)
        + f"\n\nTarget (sweep >= 3x faster than 5 single runs): {met}."
    )
    print(text + "\n", flush=True)
    return text


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
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (steps part)")
    p.add_argument(
        "--loop-steps", type=int, default=0, help="K steps per run_steps call (0: 100 / 5)"
    )
    p.add_argument(
        "--candidates",
        default="tn+sm+qkv,tn+sm+qkv+map",
        help="comma list of '+'-joined parts (module docstring); '' for none",
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="loss agreement required")
    p.add_argument("--check-steps", type=int, default=10, help="steps before the loss check")
    p.add_argument("--dump-hlo", default="", help="write the compiled loop HLO to this folder")
    p.add_argument("--malloc-no-mmap", action="store_true", help="see the module docstring")
    p.add_argument("--cmd-repeats", type=int, default=1)
    p.add_argument(
        "--cmd-steps", type=int, default=None, help="train.num_steps (default: the config's)"
    )
    p.add_argument(
        "--cmd-flag",
        action="append",
        default=[],
        help="extra flag for every command, e.g. --cmd-flag=--config.theory.every=0 (repeatable)",
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
        sections.append(bench_commands(args))
    if args.part in ("all", "steps"):
        sections.append(bench_steps(args))
    if args.output:
        Path(args.output).write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
