"""Linear convergence per depth (claim 4), from a depth sweep's metrics (configs/depth.py).

Per run: the fitted linear rate and R² over the logged steps above the fit floor, and the
σ_min²/σ_max² of each layer's Z at initialization; the "slowest layer" is the one with the smallest
ratio. Over all runs: Spearman's ρ between the speed 1 − rate and that smallest ratio (does the
worst-conditioned layer predict the rate?).

Files: depth_runs.csv, depth_sigma.png (σ_min(Z) of every layer against step, one panel per depth).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from matplotlib.lines import Line2D

from resconv_jax.analysis.stats import spearman
from resconv_jax.analysis.summary import FIT_FLOOR, fit_rate, lr_swept, series
from resconv_jax.experiments import claims
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.figures import DPI, plt, save_figure
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import write_csv

RUNS_FILE = "depth_runs.csv"


def _layer_ratio_sq(line: dict, layer: int) -> float:
    low, high = line.get(f"layer{layer}/z/sigma_min"), line.get(f"layer{layer}/z/sigma_max")
    return (low / high) ** 2 if low is not None and high else math.nan


def depth_rows(history: list[dict], floor: float = FIT_FLOOR, eps: float = 0.0) -> list[dict]:
    """One row per run: settings (lr when the runs differ in it), rate, R², speed and the
    slowest layer's ratio at init, 0 where it is at or below `eps`² (zero to the probe's
    precision `eps`)."""
    rows = []
    swept_lr = lr_swept(history)
    for run in sorted({line["run"] for line in history}):
        lines = [line for line in history if line["run"] == run]
        first = lines[0]
        layers = first.get("num_layers", 1)
        rate, r2 = fit_rate(*series(lines, run, "loss"), floor)
        ratios = [_layer_ratio_sq(first, i) for i in range(layers)]
        ratios = [0.0 if r <= eps**2 else r for r in ratios]  # NaN stays NaN
        slowest = int(np.nanargmin(ratios)) if np.isfinite(ratios).any() else -1
        rows.append(
            {
                "run": run,
                "num_layers": layers,
                "seed": first["seed"],
                "beta_attn": first["beta_attn"],
                "beta_ffn": first["beta_ffn"],
                **({"lr": first["lr"]} if swept_lr else {}),
                "rate": rate,
                "rate_r2": r2,
                "speed": 1.0 - rate,
                "final_loss": lines[-1]["loss"],
                "slowest_layer": slowest,
                "slowest_ratio_sq_init": ratios[slowest] if slowest >= 0 else math.nan,
            }
        )
    return rows


def _finite_min(values) -> float:
    return min((v for v in values if np.isfinite(v)), default=math.nan)


def _cell(row: dict) -> tuple:
    """(L, lr or 0, β_a, β_f): the runs (seeds) of one row of the depth table."""
    return row["num_layers"], row.get("lr", 0.0), row["beta_attn"], row["beta_ffn"]


def _split_betas(rows: list[dict]) -> bool:
    return any(r["beta_attn"] != r["beta_ffn"] for r in rows)


def _cell_text(cell: tuple, split: bool) -> str:
    """'2/0.5' or, with β_a and β_f swept apart, '2/β_a=0.5,β_f=1' (lr=… first when swept)."""
    layers, lr, beta_attn, beta_ffn = cell
    beta = f"β_a={beta_attn:g},β_f={beta_ffn:g}" if split else f"{beta_attn:g}"
    return f"{layers}/" + (f"lr={lr:g}," if lr else "") + beta


def format_depth_table(rows: list[dict], precision: str = "") -> str:
    """Per (L, lr, β_a, β_f) (lr, β_f shown when swept): the runs' rates and R²; then
    ρ(speed, slowest layer's ratio), and what a 0 ratio means when a run has one (`precision`:
    the probe's dtype)."""
    precision = precision if any(r["slowest_ratio_sq_init"] == 0 for r in rows) else ""
    split, lr = _split_betas(rows), "lr" in rows[0]
    columns = (f"{'lr':>9} " if lr else "") + (
        f"{'beta_a':>6} {'beta_f':>6}" if split else f"{'beta':>5}"
    )
    lines = [
        "linear convergence per depth (rate and R² of the log-loss fit above the floor):",
        f"{'L':>3} {columns} {'runs':>4} {'rate/step':>9} {'min R²':>7} {'final loss':>11} "
        f"{'slowest σ²min/σ²max(Z) init':>27}",
    ]
    for cell in sorted({_cell(r) for r in rows}):
        layers, cell_lr, beta_attn, beta_ffn = cell
        same = [r for r in rows if _cell(r) == cell]
        values = (f"{cell_lr:>9.3g} " if lr else "") + (
            f"{beta_attn:>6g} {beta_ffn:>6g}" if split else f"{beta_attn:>5g}"
        )
        lines.append(
            f"{layers:>3} {values} {len(same):>4} {np.mean([r['rate'] for r in same]):>9.5f} "
            f"{_finite_min([r['rate_r2'] for r in same]):>7.4f} "
            f"{np.mean([r['final_loss'] for r in same]):>11.4e} "
            f"{np.mean([r['slowest_ratio_sq_init'] for r in same]):>27.3g}"
        )
    rho = spearman([r["speed"] for r in rows], [r["slowest_ratio_sq_init"] for r in rows])
    lines.append(f"Spearman ρ(1 − rate, slowest layer's σ_min²/σ_max²(Z) at init) = {rho:.3f}")
    if precision:
        lines.append(f"0: at or below {precision}'s epsilon², zero to the probe's precision")
    return "\n".join(lines)


def plot_depth_sigma(history: list[dict], rows: list[dict], path, eps: float) -> None:
    """σ_min(Z) of each layer against step, one panel per depth (the first seed); colour: the
    layer (the same in every panel), line style: β (β_a, β_f when swept apart). A value at or
    below `eps`·σ_max(Z) of its layer is zero to the probe's precision: it is drawn at that
    floor, as × markers."""
    depths = sorted({r["num_layers"] for r in rows})
    betas = sorted({(r["beta_attn"], r["beta_ffn"]) for r in rows})
    styles = dict(zip(betas, ["-", "--", ":", "-."] * (len(betas) // 4 + 1), strict=False))
    colors = plt.cm.plasma(np.linspace(0, 0.85, max(depths)))
    size = (3.3 * len(depths) + 1.6, 3.6)
    fig, axes = plt.subplots(1, len(depths), figsize=size, squeeze=False, dpi=DPI)
    floored = False
    for ax, layers in zip(axes[0], depths, strict=True):
        for row in (r for r in rows if r["num_layers"] == layers and r["seed"] == rows[0]["seed"]):
            for layer in range(layers):
                steps, values = series(history, row["run"], f"layer{layer}/z/sigma_min")
                top = series(history, row["run"], f"layer{layer}/z/sigma_max")[1]
                floor = eps * top if top.size == values.size else np.zeros_like(values)
                low = values <= floor
                shown = np.where(low, floor, values)
                style = styles[row["beta_attn"], row["beta_ffn"]]
                ax.semilogy(steps, shown, style, color=colors[layer])
                if low.any():
                    floored = True
                    ax.semilogy(steps[low], shown[low], "x", color=colors[layer], ms=4)
        ax.set(xlabel="step", ylabel="σ_min(Z) of the layer", title=f"L = {layers}")
    floor_note = ""
    if floored:
        floor_note = (
            f"; ×: at or below {eps:.1g}·σ_max(Z) of the layer (0 to the probe's precision)"
        )
    handles = [Line2D([], [], color=colors[i], label=f"layer {i}") for i in range(max(depths))]
    split = _split_betas(rows)
    handles += [
        Line2D(
            [],
            [],
            color="0.3",
            ls=styles[a, f],
            label=f"β_a={a:g}, β_f={f:g}" if split else f"β={a:g}",
        )
        for a, f in betas
    ]
    fig.legend(handles=handles, fontsize=8, loc="center right")
    fig.suptitle(f"Per-layer σ_min(Z), seed {rows[0]['seed']}{floor_note}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / fig.get_figwidth(), 1))
    save_figure(fig, path)


def write_depth_report(
    workdir, history: list[dict], floor: float, probe_dtype: str = "float32"
) -> str:
    """depth_runs.csv and depth_sigma.png in `workdir`; the printed table. `probe_dtype`: the
    probe's, whose epsilon sets the figure's precision floor."""
    workdir = wd.path(workdir)
    eps = float(np.finfo(probe_dtype).eps)
    rows = depth_rows(history, floor, eps)
    write_csv(workdir / RUNS_FILE, rows)
    if any("layer0/z/sigma_min" in line for line in history):
        plot_depth_sigma(history, rows, workdir / "depth_sigma.png", eps)
    return format_depth_table(rows, probe_dtype)


def multilayer(workdir, threshold: float = 0.99, small_branches: bool = False) -> Claim:
    """Claim 4: R² of the log-loss fit ≥ threshold for every run of every depth; with
    `small_branches`, the row of configs/depth.py:branches (β = 1, float64)."""
    claim = Claim(
        "4. multi-layer linear convergence",
        "min R² per depth L (over β, seeds)",
        f"≥ {threshold:g} each, fitted ρ < 1",
    )
    if small_branches:
        claim = Claim(
            "4b. multi-layer, small residual branches (added after 4 failed)",
            "min R² per depth L (β = 1, seeds; W_V, W_1, W_2 at 0.3×, float64)",
            f"≥ {threshold:g} each, fitted ρ < 1",
        )
    if missing := claims.missing(claim, workdir, RUNS_FILE):
        return missing
    rows = claims.read_csv(wd.path(workdir) / RUNS_FILE)
    unfit = [r["run"] for r in rows if not math.isfinite(r["rate_r2"])]
    if unfit:
        note = f"runs {unfit} have no rate fit (fewer than 3 logged losses above the floor)"
        return dataclasses.replace(claim, verdict=claims.FAILS, note=note)
    depths = sorted({r["num_layers"] for r in rows})
    worst = {L: min(r["rate_r2"] for r in rows if r["num_layers"] == L) for L in depths}
    value = ", ".join(f"L={L}: {r2:.3f}" for L, r2 in worst.items())
    split = _split_betas(rows)
    per_cell = {
        cell: min(r["rate_r2"] for r in rows if _cell(r) == cell)
        for cell in sorted({_cell(r) for r in rows})
    }
    note = "min R² per (L, β): " + ", ".join(
        f"{_cell_text(cell, split)}: {v:.3f}" for cell, v in per_cell.items()
    )
    rising = [r for r in rows if not r["rate"] < 1]  # a straight log-loss that does not fall
    if rising:
        names = [_cell_text(_cell(r), split) for r in rising]
        note += "; " + claims.not_falling_note(names, [r["rate"] for r in rising])
    ok = all(r2 >= threshold for r2 in worst.values()) and not rising
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


def multilayer_small_branches(workdir) -> Claim:
    """Claim 4b: `multilayer` for the small-branches runs (configs/depth.py:branches)."""
    return multilayer(workdir, small_branches=True)


EXPERIMENTS = (
    Experiment(
        "depth",
        "Linear convergence per depth",
        "depth.py",
        scale_variants(),
        typical_seconds={"small": 59},
        claims=(ClaimCheck(4, multilayer),),
        files=(RUNS_FILE, "depth_sigma.png"),
    ),
    Experiment(
        "depth_branches",
        "Linear convergence per depth, small residual branches (β = 1, float64)",
        "depth.py",
        scale_variants("tiny,branches", "small,branches", "branches"),
        typical_seconds={"small": 57},
        claims=(ClaimCheck(4.5, multilayer_small_branches),),
        files=(RUNS_FILE, "depth_sigma.png"),
    ),
)
