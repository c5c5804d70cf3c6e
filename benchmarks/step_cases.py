"""The compiled step cases of the "steps" comparison: variants of the library's step, R=5 and 5xR=1.

Variants (all `resconv_jax.step.make_step_functions`, plain GD, sum loss):
  library  the defaults: `fast_backward=True` (models/fast_ops.py), the runs vmapped together.
  chunked  `runs_per_chunk=B`: the runs stepped B at a time (`jax.lax.map`), B as
           resconv_jax.train's `train.runs_per_chunk=-1` picks it (`auto_runs_per_chunk`) or given;
           one case "chunkB" per B.
  plain    `fast_backward=False`: the model differentiated by JAX as written, the formulation from
           before the fast_ops patch (but with the fused x @ [W_Q W_K W_V]), as a reference.

A case is one compiled function, a loop of K steps (`run_steps`) or one step per call (`step`),
and the states it advances: one R=5 state, or five R=1 states called one after another.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from benchmarks import common
from benchmarks.common import SWEEP_BETAS
from resconv_jax import runners, sharding
from resconv_jax.analysis import probe
from resconv_jax.config_defaults import base_config

VARIANTS = ("library", "chunked", "plain")
STEP_KWARGS = {"library": {}, "plain": {"fast_backward": False}}


def own_single_runs(variant: str) -> str:
    """The variant whose five R=1 steps an R=5 step of `variant` replaces (same model code)."""
    return "plain" if variant == "plain" else "library"  # chunkB: the library model


def train_mesh(num_runs: int, num_samples: int) -> jax.sharding.Mesh:
    """The mesh resconv_jax.train picks by default (mesh.sweep = mesh.data = 0)."""
    return sharding.make_mesh(
        num_runs, num_samples, ml_collections.ConfigDict({"sweep": 0, "data": 0})
    )


def train_probe(mesh: jax.sharding.Mesh):
    """The probe as resconv_jax.train builds it by default, on `mesh`."""
    defaults = base_config().probe
    return functools.partial(
        probe.probe_attention,
        mesh=mesh,
        dtype=jnp.dtype(defaults.dtype),
        per_sample=defaults.per_sample,
    )


def auto_runs_per_chunk(size: common.Size, steps_per_call: int, data) -> tuple[int, int]:
    """(runs per chunk, temp bytes) as `train.runs_per_chunk=-1` picks them for the 5-run sweep:
    `runners.automatic_runs_per_chunk` of the probed `run_steps` with all runs vmapped."""
    num_runs = len(SWEEP_BETAS)
    mesh = train_mesh(num_runs, size.P)
    runs = common.build_runs(
        size, SWEEP_BETAS, steps_per_call, data=data, step_kwargs={"probe": train_probe(mesh)}
    )
    compiled = (
        jax.jit(runs.fns.run_steps, donate_argnums=0)
        .lower(runs.state, runs.hp, runs.x, runs.y, jnp.int32(steps_per_call), jnp.bool_(True))
        .compile()
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    return runners.automatic_runs_per_chunk(num_runs, mesh, compiled), temp


def build_cases(
    size: common.Size, variants, loop_steps: int, chunks=()
) -> dict[tuple[str, str, str], common.Case]:
    """{(variant, 'R=5' | '5xR=1', 'loop' | 'call'): Case}. 'chunked' gives the R=5 cases
    'chunkB' for each B in `chunks` (B = 0 or B >= 5 would be 'library' and is left out)."""
    data = common.make_data(size)
    expanded = []
    for variant in variants:
        if variant == "chunked":
            expanded += [f"chunk{b}" for b in dict.fromkeys(chunks) if 0 < b < len(SWEEP_BETAS)]
        else:
            expanded.append(variant)
    cases = {}
    for variant in expanded:
        if variant.startswith("chunk"):
            kwargs, labels = {"runs_per_chunk": int(variant[5:])}, ("R=5",)
        else:
            kwargs, labels = STEP_KWARGS[variant], ("R=5", "5xR=1")
        runs = {
            "R=5": [common.build_runs(size, SWEEP_BETAS, loop_steps, data=data, step_kwargs=kwargs)]
        }
        if "5xR=1" in labels:
            runs["5xR=1"] = [
                common.build_runs(size, (b,), loop_steps, data=data, step_kwargs=kwargs)
                for b in SWEEP_BETAS
            ]
        for mode, k in (("loop", loop_steps), ("call", None)):
            for label in labels:
                fns = runs[label][0].fns
                fn = fns.run_steps if k else common.step_fn(fns)
                cases[(variant, label, mode)] = common.Case(fn, runs[label], k)
    return cases


def check_losses(cases, steps: int, rtol: float) -> list[str]:
    """After `steps` steps from the same start, every loop case's losses equal those of the
    library's five single runs (to `rtol`); raises SystemExit if not; returns report lines."""
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
            f"{variant} {label}: losses after {steps} steps agree with library 5xR=1 to {err:.1e}"
        )
        if not err <= rtol:
            raise SystemExit(f"{variant} {label} disagrees with the library: {got} vs {want}")
    return lines


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
    """Number of custom (YNNPACK) fusions in compiled HLO text."""
    return len(re.findall(r"= \S+ fusion\(.*kind=kCustom", hlo))
