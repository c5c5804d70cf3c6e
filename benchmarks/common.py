"""Shared helpers of the benchmarks: problem sizes, library step functions, interleaved timing.

Timings on a shared machine are noisy, so every comparison runs its cases round-robin in one
process (the order rotated each repeat) and reports medians; ratios are ratios of medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/x.py` as well as `python -m benchmarks.x`
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from resconv_jax.config_defaults import base_config, load_config_file  # noqa: E402
from resconv_jax.data import synthetic  # noqa: E402
from resconv_jax.models import RunSettings, transformer  # noqa: E402
from resconv_jax.step import init_opt_state, make_optimizer, make_step_functions  # noqa: E402

SWEEP_BETAS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Size:
    """One problem size: P samples of M tokens of width d; model widths d_qk, d_h, d_y."""

    name: str
    P: int
    M: int
    d: int
    d_qk: int
    d_h: int
    d_y: int
    lr: float

    def describe(self) -> str:
        return f"P={self.P} M={self.M} d={self.d} d_qk={self.d_qk} d_h={self.d_h} d_y={self.d_y}"


def theory_size() -> Size:
    """The size of configs/theory.py (read from the config, so it follows the config)."""
    c = load_config_file(str(REPO / "configs" / "theory.py"))
    return Size(
        "theory",
        c.data.num_samples,
        c.data.seq_len,
        c.data.dim,
        c.model.transformer.d_qk,
        c.model.transformer.d_h,
        c.data.out_dim,
        c.optim.lr,
    )


def jena_size() -> Size:
    """A Jena-Climate-like size (Gaussian data of that shape: timing does not depend on values)."""
    return Size("jena", P=512, M=24, d=6, d_qk=6, d_h=32, d_y=1, lr=1e-5)


SIZES: dict[str, Callable[[], Size]] = {"theory": theory_size, "jena": jena_size}


def sizes_from_flag(value: str) -> list[Size]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; expected some of {sorted(SIZES)}")
    return [SIZES[n]() for n in names]


def make_data(size: Size, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian X (P, M, d) and Y (P, M, d_y), float32: resconv_jax.data.synthetic's data."""
    c = base_config().data
    with c.unlocked():
        c.num_samples, c.seq_len, c.dim, c.out_dim, c.seed = size.P, size.M, size.d, size.d_y, seed
    dataset = synthetic.load(c)
    return dataset.x_train, dataset.y_train


def model_config(size: Size) -> transformer.ModelConfig:
    c = base_config()
    with c.unlocked():
        c.model.transformer.d_qk = size.d_qk
        c.model.transformer.d_h = size.d_h
    return transformer.model_config(c.model, d=size.d, d_y=size.d_y)


def optimizer_for(size: Size):
    """Plain GD (`optim.name="sgd"`), the library's optimizer."""
    c = base_config()
    with c.unlocked():
        c.optim.lr = size.lr
    return make_optimizer(c.optim)


@dataclass
class Runs:
    """Library step functions and a train state for len(betas) runs of one size."""

    fns: object  # resconv_jax.step.StepFunctions
    state: dict
    hp: dict
    x: jax.Array
    y: jax.Array
    graphdef: object
    params0: dict  # the (unstacked) initial parameters, seed 0


def build_runs(
    size: Size,
    betas: Sequence[float],
    steps_per_call: int,
    seed: int = 0,
    data=None,
    step_kwargs: dict | None = None,
) -> Runs:
    """The library's (graphdef, optimizer, step functions) and a stacked state for `betas`.

    Every run starts from the same initialization (`seed`), as in a sweep over β.
    `step_kwargs` go to `make_step_functions`, but for `fast_backward` (the model's: False
    differentiates the plain model).
    """
    cfg = model_config(size)
    optimizer = optimizer_for(size)
    graphdef, params0 = transformer.init_params(cfg, seed)
    params = jax.tree.map(lambda a: jnp.stack([a] * len(betas)), params0)
    lrs = jnp.full((len(betas),), size.lr, jnp.float32)
    state = {"params": params, "opt_state": init_opt_state(optimizer, params, lrs)}
    b = jnp.asarray(betas, jnp.float32)
    hp = RunSettings(beta_attn=b, beta_ffn=b)
    x, y = make_data(size) if data is None else data
    kwargs = dict(step_kwargs or {})
    model = transformer.make_model(cfg, fast_backward=kwargs.pop("fast_backward", True))
    fns = make_step_functions(model, optimizer, "sum", steps_per_call, **kwargs)
    return Runs(fns, state, hp, jnp.asarray(x), jnp.asarray(y), graphdef, params0)


def step_fn(fns) -> Callable:
    """`(state, hp, x, y) -> (state, metrics)`: the library's vmapped `step`, without extras."""
    return lambda state, hp, x, y: fns.step(state, hp, x, y)[:2]


def copy_tree(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


class Case:
    """One compiled function (a loop of K steps, or one step) and the states it advances.

    `fn` is `(state, hp, x, y[, num_steps]) -> (state, out)`; calling the case advances each
    state once (one call for a vmapped R=5 state, five calls for five R=1 states), donating and
    replacing the state as resconv_jax.train does.
    """

    def __init__(self, fn, runs_list: Sequence[Runs], loop_steps: int | None):
        self.runs_list = list(runs_list)
        self.states = [copy_tree(r.state) for r in self.runs_list]
        self.loop_steps = loop_steps
        n = (jnp.int32(loop_steps),) if loop_steps else ()
        self.args = [(r.hp, r.x, r.y, *n) for r in self.runs_list]

        lowered = jax.jit(fn, donate_argnums=0).lower(self.states[0], *self.args[0])
        self.compiled = lowered.compile()

    def __call__(self, num_steps: int | None = None):
        outs = []
        for i, args in enumerate(self.args):
            if num_steps is not None:  # a loop case: fewer steps than K this call
                args = (*args[:-1], jnp.int32(num_steps))
            self.states[i], out = self.compiled(self.states[i], *args)
            outs.append(out)
        return outs

    def steps_per_call(self) -> int:
        return self.loop_steps or 1

    def final_losses(self) -> np.ndarray:
        """Training loss (library `evaluate`) of each run's current parameters, in run order."""
        out = []
        for state, runs in zip(self.states, self.runs_list, strict=True):
            ev = jax.jit(runs.fns.evaluate)(state["params"], runs.hp, runs.x, runs.y)
            out.extend(np.asarray(ev).tolist())
        return np.asarray(out)

    def temp_mb(self) -> float:
        """XLA's temporary buffer for one call (allocated per call), in MB."""
        try:
            return self.compiled.memory_analysis().temp_size_in_bytes / 1e6
        except Exception:  # noqa: BLE001 - diagnostics only
            return float("nan")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleave(
    cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each case, measured round-robin (order rotated every repeat)."""
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            timed(cases[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed(cases[name]))
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """Interquartile range as a percentage of the median (a noise indicator)."""
    if len(xs) < 4:
        return "-"
    q = statistics.quantiles(xs, n=4)
    return f"{100 * (q[2] - q[0]) / statistics.median(xs):.0f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (readable as plain text too)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def fmt(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), rule, *[fmt(r) for r in cells[1:]]])


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def machine() -> str:
    """One line naming the machine and the software versions."""
    import jaxlib

    from resconv_jax.runtime import host

    cores = host.usable_cores()
    flags = os.environ.get("XLA_FLAGS", "")
    parts = [
        f"resconv_jax {git_commit()}",
        f"{host.cpu_model()}, {cores} cores",
        f"Linux {platform.release()}" if sys.platform.startswith("linux") else sys.platform,
        f"Python {platform.python_version()}",
        f"jax {jax.__version__} / jaxlib {jaxlib.__version__} ({jax.default_backend()}, "
        f"{jax.device_count()} device{'s' if jax.device_count() > 1 else ''})",
    ]
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    if flags:
        parts.append(f"XLA_FLAGS={flags!r}")
    return "; ".join(parts)


def git_commit() -> str:
    """Short hash of HEAD, '+dirty' with local changes under resconv_jax/ or configs/."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip() or "?"
        return head + (
            "+dirty" if git("status", "--porcelain", "--", "resconv_jax", "configs") else ""
        )
    except OSError:
        return "?"


def run_in_repo(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """(wall seconds, the finished process) of `cmd` run from the repository root with it on
    PYTHONPATH; SystemExit naming the command and its stderr when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    return wall, proc


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"
