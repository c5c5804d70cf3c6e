"""Cost of the spectral probe: a training step with the probe against the same step without it.

    python -m benchmarks.probe_overhead                        # theory + large sizes (~3 min)
    python -m benchmarks.probe_overhead --sizes theory --repeats 21
    python -m benchmarks.probe_overhead --probes stacked       # only probe.per_sample=False
    python -m benchmarks.probe_overhead --kinds step,run1,chunk
    python -m benchmarks.probe_overhead --devices 8           # 8 virtual CPU devices, (1, 8) mesh
    python -m benchmarks.probe_overhead --openblas-threads 0  # OpenBLAS threads as the env says

The cases are `resconv_jax.step.make_step_functions` with `probe=None` and with
`probe=functools.partial(probe.probe_attention, mesh=mesh, per_sample=...)`, compiled as
resconv_jax.train does (`jax.jit(run_steps, donate_argnums=0, out_shardings=...)`, the state on the
runs' sharding and the data on the samples' sharding of the mesh that `sharding.make_mesh` picks).
Probes (`--probes`): "full" (stacked σ and per-sample σ_min, `probe.per_sample=True`, the default)
and "stacked" (stacked σ only, `probe.per_sample=False`). Timings (`--kinds`):

  step   one step + probe: one jitted function doing one vmapped step (`fns.step`) and, when
         probed, the probe of that step's intermediates: no loop, no buffers. A floor: since
         f7b2bfb training probes a forward pass of its own at the step's starting parameters.
  run1   `run_steps(state, hp, x, y, num_steps=1)`, so that the probe runs on every step, as
         trained with train.log_every = 1 (the probe's forward pass included).
  chunk  K-step chunk, as train.run calls it: K = train.log_every steps per call, the probe on
         the first; its overhead is the probe's cost in training (with probe.every = 0).
  period `--probe-every` / K chunks of one compiled chunk program, told to probe the first
         only: the probe's cost in training with probe.every = `--probe-every` (default 100).
  alone  the probe by itself, compiled on its own, on the intermediates of one real step, shown
         as a fraction of one step without it: the least that probing every step can cost on this
         machine unless the probe overlaps the step. It also prints the probe's FLOP floor (the
         Householder reductions of LAPACK's SVDs) against XLA's FLOP count of the step.

Sizes: "theory" is configs/theory.py (3 runs, β = 0, 0.5, 1; P=8 M=8 d=64 d_qk=16 d_h=64);
"large" is one run (β = 1) with P·M ≥ 1e5 rows in the stacked Z (default P=4096 M=25 d=16, d_qk=8,
d_h=32). Times are medians over `--repeats` round-robin repeats (order rotated each repeat) of
`--calls` calls each (K-step calls: calls/K), shown per step; the overhead is median(probed) /
median(no probe) − 1. Target: ≤ 10%. K is configs/theory.py's train.log_every for "theory" and 10
for "large" (`--log-every`).

OPENBLAS_NUM_THREADS is 1 unless `--openblas-threads` says otherwise: jaxlib's CPU LAPACK (the
probe's QR and SVD) runs on OpenBLAS, whose own threads fight XLA's for the cores. On a 2-core
machine the tall QR of the large size's 102,400×16 Z took ~6 ms with 1 OpenBLAS thread and
~180 ms with OpenBLAS's default, even on one device.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path


def _early_flags(argv: list[str]) -> None:
    """--devices and --openblas-threads must be applied before JAX (and its LAPACK) load."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--devices", type=int, default=0)
    parser.add_argument("--openblas-threads", type=int, default=1)
    known, _ = parser.parse_known_args(argv)
    if known.devices > 1:
        flag = f"--xla_force_host_platform_device_count={known.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    if known.openblas_threads > 0:
        os.environ["OPENBLAS_NUM_THREADS"] = str(known.openblas_threads)


_early_flags(sys.argv[1:])

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402

from benchmarks import common  # noqa: E402
from resconv_jax import sharding  # noqa: E402
from resconv_jax.analysis import probe  # noqa: E402
from resconv_jax.config_defaults import load_config_file  # noqa: E402
from resconv_jax.models import RunSettings, transformer  # noqa: E402
from resconv_jax.step import init_opt_state, make_step_functions  # noqa: E402

THEORY_BETAS = (0.0, 0.5, 1.0)
PROBES = {
    "full": {"per_sample": True, "label": "probe (stacked+per-sample)"},
    "stacked": {"per_sample": False, "label": "probe (stacked only)"},
}


def large_size(spec: str) -> common.Size:
    """'P,M,d' -> a one-run size with d_qk = d/2, d_h = 2d, d_y = 1."""
    p, m, d = (int(v) for v in spec.split(","))
    return common.Size("large", P=p, M=m, d=d, d_qk=max(d // 2, 1), d_h=2 * d, d_y=1, lr=1e-6)


class Problem:
    """A train state, data and hparams for `betas` runs of `size`, placed as train.run does."""

    def __init__(self, size: common.Size, betas, mesh_data: int):
        self.size = size
        self.betas = tuple(betas)
        mesh_cfg = ml_collections.ConfigDict({"sweep": 0, "data": mesh_data})
        self.mesh = sharding.make_mesh(len(betas), size.P, mesh_cfg)
        on_runs = sharding.run_sharding(self.mesh)
        put_data = functools.partial(sharding.put, sharding=sharding.data_sharding(self.mesh))
        x, y = common.make_data(size)
        self.x, self.y = put_data(x), put_data(y)
        self.model = transformer.make_model(common.model_config(size))
        _, params0 = transformer.init_params(common.model_config(size), 0)
        self.optimizer = common.optimizer_for(size)
        params = jax.tree.map(lambda a: jnp.stack([a] * len(betas)), params0)
        lrs = jnp.full((len(betas),), size.lr, jnp.float32)
        state = {"params": params, "opt_state": init_opt_state(self.optimizer, params, lrs)}
        self.state = sharding.put_tree(state, on_runs)
        b = jnp.asarray(betas, jnp.float32)
        self.hp = sharding.put_tree(RunSettings(beta_attn=b, beta_ffn=b), on_runs)
        self.state_sharding = jax.tree.map(lambda _: on_runs, self.state)

    def probe_fn(self, kind: str | None):
        """None, or the probe as train.run builds it: "full" (per_sample) or "stacked"."""
        if kind is None:
            return None
        return functools.partial(
            probe.probe_attention, mesh=self.mesh, per_sample=PROBES[kind]["per_sample"]
        )

    def fns(self, probe_kind: str | None, steps_per_call: int = 1):
        return make_step_functions(
            self.model, self.optimizer, "sum", steps_per_call, probe=self.probe_fn(probe_kind)
        )

    def fresh_state(self):
        return jax.tree.map(lambda a: jnp.array(a, copy=True), self.state)


class Case:
    """A compiled (state, hp, x, y[, n, probe_now]) -> (state, out) that donates and replaces its
    state (n and probe_now = True for `run_steps`, as train.run passes them).

    One call of the case is `calls` calls of the compiled function, `steps` GD steps each."""

    def __init__(self, problem: Problem, fn, num_steps: int | None, calls: int):
        self.calls, self.steps = calls, num_steps or 1
        self.state = problem.fresh_state()
        self.args = (problem.hp, problem.x, problem.y)
        if num_steps is not None:
            self.args += (jnp.int32(num_steps), jnp.bool_(True))
        jitted = jax.jit(fn, donate_argnums=0, out_shardings=(problem.state_sharding, None))
        self.compiled = jitted.lower(self.state, *self.args).compile()

    def __call__(self):
        out = None
        for _ in range(self.calls):
            self.state, out = self.compiled(self.state, *self.args)
        return self.state, out


def run_steps_case(problem: Problem, probe_kind: str | None, calls: int, steps: int) -> Case:
    """`run_steps` doing `steps` steps per call (compiled for steps_per_call = steps)."""
    return Case(problem, problem.fns(probe_kind, steps).run_steps, steps, calls)


def step_case(problem: Problem, probe_kind: str | None, calls: int) -> Case:
    """One vmapped step, plus the probe of its intermediates when probed: nothing else."""
    fns = problem.fns(None)
    probe_fn = problem.probe_fn(probe_kind)

    def one_step(state, hp, x, y):
        state, metrics, inter = fns.step(state, hp, x, y)
        if probe_fn is not None:
            metrics = metrics | probe_fn(inter["attn"], inter["z"])
        return state, metrics

    return Case(problem, one_step, None, calls)


class PeriodCase:
    """`period // log_every` chunks of `log_every` steps, the probe on the first chunk only: the
    cost of training with probe.every = period (train.run's compiled chunk, probe_now False after
    the first)."""

    def __init__(self, problem: Problem, probe_kind: str | None, period: int, log_every: int):
        self.calls, self.steps = period // log_every, log_every
        self.chunk = run_steps_case(problem, probe_kind, 1, log_every)
        self.unprobed = (*self.chunk.args[:-1], jnp.bool_(False))

    def __call__(self):
        state, out = self.chunk.compiled(self.chunk.state, *self.chunk.args)
        for _ in range(self.calls - 1):
            state, _ = self.chunk.compiled(state, *self.unprobed)
        self.chunk.state = state
        return state, out


def _bidiagonalization_flop(m: int, n: int) -> float:
    """Householder reduction of an m×n matrix to bidiagonal form, the bulk of a Householder-based
    SVD (LAPACK's gesdd and gesvd; Jacobi SVDs, which do not reduce, cost more)."""
    m, n = max(m, n), min(m, n)
    return 4 * m * n * n - 4 * n**3 / 3


def probe_flop_floor(shape: tuple[int, ...], per_sample: bool) -> float:
    """Least FLOP count of a Householder-based probe of (R, L, P, M, d) intermediates Attn(X) and
    Z: each stacked (P·M, d) matrix reduced directly or after a QR (whichever is cheaper), and
    one reduction per sample."""
    runs, layers, n_samples, m, d = shape
    rows = n_samples * m
    stacked = _bidiagonalization_flop(rows, d)
    if rows > d:
        qr_first = 2 * rows * d * d - 2 * d**3 / 3 + _bidiagonalization_flop(d, d)
        stacked = min(stacked, qr_first)
    sample = n_samples * _bidiagonalization_flop(m, d) if per_sample else 0.0
    return 2 * runs * layers * (stacked + sample)


def _flop(compiled) -> float:
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


class ProbeAloneCase:
    """The probe alone, compiled on its own, on the (R, L, P, M, d) intermediates of one step."""

    def __init__(self, problem: Problem, probe_kind: str, calls: int):
        self.calls, self.steps = calls, 1
        step = jax.jit(problem.fns(None).step)
        args = (problem.fresh_state(), problem.hp, problem.x, problem.y)
        self.step_flop = _flop(step.lower(*args).compile())
        _, _, inter = step(*args)
        self.args = (inter["attn"], inter["z"])
        # XLA counts the FLOPs of one device's partition of the step: the floor's share of them.
        floor = probe_flop_floor(inter["z"].shape, PROBES[probe_kind]["per_sample"])
        self.floor_flop = floor / problem.mesh.devices.size
        self.compiled = jax.jit(problem.probe_fn(probe_kind)).lower(*self.args).compile()

    def __call__(self):
        out = None
        for _ in range(self.calls):
            out = self.compiled(*self.args)
        return None, out


def measure(problem: Problem, args, calls: int, log_every: int) -> list[list[object]]:
    """Rows of the table for one size: per-step times without and with each probe."""
    kinds = {
        "step": ("one step + probe of its intermediates", lambda pk: step_case(problem, pk, calls)),
        "run1": ("run_steps, 1 step/call", lambda pk: run_steps_case(problem, pk, calls, 1)),
        "chunk": (
            f"{log_every}-step chunk, probe on its first step (as trained)",
            lambda pk: run_steps_case(problem, pk, max(1, calls // log_every), log_every),
        ),
        "period": (
            f"probe.every={args.probe_every}: {args.probe_every // log_every} chunks of "
            f"{log_every} steps, the probe on the first",
            lambda pk: PeriodCase(problem, pk, args.probe_every, log_every),
        ),
        "alone": (
            "probe alone (no step), against one step",
            lambda pk: (
                step_case(problem, None, calls)
                if pk is None
                else ProbeAloneCase(problem, pk, calls)
            ),
        ),
    }
    probes = [p for p in args.probes.split(",") if p]
    rows = []
    for kind in [k for k in args.kinds.split(",") if k]:
        label, build = kinds[kind]
        cases = {"none": build(None)} | {pk: build(pk) for pk in probes}
        for pk in probes:  # the probe is really in the compiled step, with its parts
            # Finished before the next case starts: two programs with collectives in flight at
            # once deadlock XLA:CPU's devices (8 devices: an all-gather's rendezvous hung).
            out = jax.block_until_ready(cases[pk]()[1])
            assert "z/sigma_min" in out, sorted(out)
            assert ("z/sample_sigma_min" in out) == PROBES[pk]["per_sample"], sorted(out)
        times = common.interleave(
            cases, args.repeats or (15 if problem.size.name == "theory" else 5)
        )
        per_step = {k: common.median(times[k]) / (cases[k].calls * cases[k].steps) for k in cases}
        row = [
            problem.size.name,
            len(problem.betas),
            f"{problem.size.P * problem.size.M:,}×{problem.size.d}",
            label,
            common.fmt_time(per_step["none"]),
        ]
        for pk in PROBES:
            if pk in per_step:
                ratio = per_step[pk] / per_step["none"]
                cost = (
                    f"{100 * ratio:.1f}% of a step"
                    if kind == "alone"
                    else f"{100 * (ratio - 1):+.1f}%"
                )
                row += [common.fmt_time(per_step[pk]), cost]
            else:
                row += ["", ""]
        row.append(" / ".join(common.spread(times[k]) for k in cases))
        if kind == "alone":
            for pk in probes:
                case = cases[pk]
                print(
                    f"  FLOP floor, {PROBES[pk]['label']}: >= {case.floor_flop / 1e6:.2f} MFLOP "
                    f"against a step of {case.step_flop / 1e6:.2f} MFLOP (XLA's count, per "
                    f"device): {100 * case.floor_flop / case.step_flop:.1f}% at equal speed"
                )
        rows.append(row)
        print("  " + " | ".join(str(c) for c in row), flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="theory,large", help="comma list of: theory, large")
    p.add_argument("--large", default="4096,25,16", help="P,M,d of the large size (one run)")
    p.add_argument("--repeats", type=int, default=0, help="interleaved repeats (0: 15 / 5)")
    p.add_argument("--probes", default="full,stacked", help="comma list of: full, stacked")
    p.add_argument(
        "--kinds", default="step,chunk", help="comma list of: step, run1, chunk, period, alone"
    )
    p.add_argument(
        "--probe-every", type=int, default=100, help="probe period of 'period' (x log_every)"
    )
    p.add_argument("--calls", type=int, default=0, help="calls per timing (0: 20 / 1)")
    p.add_argument("--devices", type=int, default=0, help="virtual CPU devices (set before JAX)")
    p.add_argument(
        "--openblas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for jaxlib's LAPACK (0: leave the environment's)",
    )
    p.add_argument("--mesh-data", type=int, default=0, help="'data' mesh axis (0: largest)")
    p.add_argument(
        "--log-every", type=int, default=0, help="steps per call as in training (0: config's)"
    )
    args = p.parse_args(argv)

    print(common.machine())
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    print(f"load average before: {common.load_average()}")
    rows = []
    for name in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        if name == "theory":
            size, betas, calls = common.theory_size(), THEORY_BETAS, 20
            log_every = load_config_file(str(common.REPO / "configs" / "theory.py")).train.log_every
        elif name == "large":
            size, betas, calls = large_size(args.large), (1.0,), 1
            log_every = 10
        else:
            raise SystemExit(f"unknown size {name!r}; expected theory or large")
        problem = Problem(size, betas, args.mesh_data)
        print(f"{name}: {size.describe()}, {len(betas)} run(s), mesh {dict(problem.mesh.shape)}")
        rows += measure(problem, args, args.calls or calls, args.log_every or log_every)
    print(f"load average after: {common.load_average()}")
    print()
    headers = ["size", "runs", "stacked Z", "timed", "no probe"]
    for spec in PROBES.values():
        headers += [spec["label"], "overhead"]
    headers.append("IQR (cases in order)")
    print(common.table(headers, rows))


if __name__ == "__main__":
    main()
