"""Figures and the per-β table of a run directory, from its metrics lines (every task that trains:
theory, Jena, SST-2). Written by `experiments.report` at the end of a run.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from resconv_jax import workdir as wd  # noqa: E402
from resconv_jax.analysis.summary import FIT_FLOOR, fit_rate, series  # noqa: E402
from resconv_jax.workdir import write_csv, write_png  # noqa: E402

Z_FRO = "layer0/z/sigma_min_over_fro"


def save_figure(fig, path, dpi: int = 110) -> None:
    """Writes `fig` as a PNG at `path` (local or object storage) atomically, in one write (never
    half a figure), then closes it."""
    write_png(fig, path, dpi)
    plt.close(fig)


def _runs(history: list[dict]) -> list[dict]:
    first = {}
    for line in history:
        first.setdefault(line["run"], line)
    return [first[r] for r in sorted(first)]


def _beta_label(line: dict) -> str:
    depth = f"L={line['num_layers']}, " if "num_layers" in line else ""
    if line["beta_attn"] == line["beta_ffn"]:
        return f"{depth}β={line['beta_attn']:g}"
    return f"{depth}β_a={line['beta_attn']:g}, β_f={line['beta_ffn']:g}"


def _group_key(line: dict) -> tuple:
    """(L or 0, β_a, β_f): the runs (seeds) that share these are one row of the table."""
    return line.get("num_layers", 0), line["beta_attn"], line["beta_ffn"]


def plot_training(history: list[dict], path: str) -> None:
    """Log-loss against step per run, and σ_min of Z and of Attn(X) (layer 0) against step."""
    fig, (ax_loss, ax_sigma) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(_runs(history)), 1)))
    for color, run in zip(colors, _runs(history), strict=False):
        label = f"{_beta_label(run)}, seed {run['seed']}"
        ax_loss.semilogy(*series(history, run["run"], "loss"), color=color, label=label)
        for key, style in (("layer0/z/sigma_min", "-"), ("layer0/attn/sigma_min", ":")):
            steps, values = series(history, run["run"], key)
            if values.size:
                ax_sigma.semilogy(steps, values, style, color=color)
    ax_loss.set(xlabel="step", ylabel="training loss", title="Loss (log scale)")
    ax_loss.legend(fontsize=7)
    ax_sigma.set(xlabel="step", ylabel="σ_min", title="σ_min of Z = Attn(X)+βX (—), Attn(X) (⋯)")
    fig.tight_layout()
    save_figure(fig, path)


def steps_to_threshold(steps: np.ndarray, losses: np.ndarray, threshold: float) -> float:
    """First logged step whose loss is at or below `threshold` (NaN if never)."""
    below = np.flatnonzero(losses <= threshold)
    return float(steps[below[0]]) if below.size else float("nan")


def beta_table(
    history: list[dict], threshold: float = 0.0, floor: float = FIT_FLOOR
) -> tuple[list[dict], float]:
    """One row per (β_a, β_f): means (and ranges) over the runs (seeds) that share it.

    `threshold` for steps-to-threshold; 0 picks 1.5 × the largest final training loss, a level
    every run reaches. `floor`: the rate fit's, as in `summary.fit_rate`. Returns (rows, the
    threshold used).
    """
    runs = _runs(history)
    finals = {r["run"]: series(history, r["run"], "loss")[1][-1] for r in runs}
    threshold = threshold or 1.5 * max(finals.values())
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        steps, losses = series(history, run["run"], "loss")
        val = series(history, run["run"], "val_loss")[1]
        fro = series(history, run["run"], Z_FRO)[1]
        rate, _ = fit_rate(steps, losses, floor)
        groups.setdefault(_group_key(run), []).append(
            {
                "final_loss": losses[-1],
                "final_val_loss": val[-1] if val.size else np.nan,
                "steps_to_threshold": steps_to_threshold(steps, losses, threshold),
                "rate": rate,
                "z_sigma_min_over_fro_start": fro[0] if fro.size else np.nan,
                "z_sigma_min_over_fro_end": fro[-1] if fro.size else np.nan,
            }
        )
    rows = []
    for (layers, beta_attn, beta_ffn), members in sorted(groups.items()):
        row = {"num_layers": layers} if layers else {}
        row |= {"beta_attn": beta_attn, "beta_ffn": beta_ffn, "runs": len(members)}
        for key in members[0]:
            values = np.array([m[key] for m in members], float)
            row[key] = float(np.mean(values))
            row[f"{key}_min"] = float(np.min(values))
            row[f"{key}_max"] = float(np.max(values))
        rows.append(row)
    return rows, threshold


def plot_loss_by_beta(history: list[dict], path: str) -> None:
    """Training loss against step per β: mean over seeds with the min–max range shaded."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    by_beta: dict[tuple, list[np.ndarray]] = {}
    steps = None
    for run in _runs(history):
        steps, losses = series(history, run["run"], "loss")
        by_beta.setdefault((*_group_key(run), _beta_label(run)), []).append(losses)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(by_beta), 1)))
    for color, ((*_, label), curves) in zip(colors, sorted(by_beta.items()), strict=False):
        curves = np.array(curves)
        ax.semilogy(steps, curves.mean(0), color=color, label=f"{label} ({len(curves)} seeds)")
        ax.fill_between(steps, curves.min(0), curves.max(0), color=color, alpha=0.2)
    ax.set(xlabel="step", ylabel="training loss (log scale)", title="Full-batch GD by β")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_sigma_by_beta(rows: list[dict], path: str) -> None:
    """σ_min(Z)/‖Z‖_F (layer 0) against β, at the first and the last logged step (per depth L
    when the sweep has several)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for layers in sorted({row.get("num_layers", 0) for row in rows}):
        same = [row for row in rows if row.get("num_layers", 0) == layers]
        betas = [row["beta_attn"] for row in same]
        depth = f"L={layers}, " if layers else ""
        for when, marker in (("start", "o"), ("end", "s")):
            key = f"z_sigma_min_over_fro_{when}"
            mean = np.array([row[key] for row in same])
            low = mean - [row[f"{key}_min"] for row in same]
            high = np.array([row[f"{key}_max"] for row in same]) - mean
            label = f"{depth}{when} of training"
            ax.errorbar(betas, mean, yerr=[low, high], marker=marker, capsize=3, label=label)
    ax.set(xlabel="β (attention residual)", ylabel="σ_min(Z) / ‖Z‖_F", title="Conditioning of Z")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def write_reports(
    workdir, history: list[dict], threshold: float = 0.0, floor: float = FIT_FLOOR
) -> list[dict]:
    """training.png, loss_by_beta.png, sigma_by_beta.png and beta_table.csv in `workdir`."""
    workdir = wd.path(workdir)
    plot_training(history, workdir / "training.png")
    rows, threshold = beta_table(history, threshold, floor)
    if len(rows) > 1:
        plot_loss_by_beta(history, workdir / "loss_by_beta.png")
        if not np.isnan(rows[0]["z_sigma_min_over_fro_start"]):
            plot_sigma_by_beta(rows, workdir / "sigma_by_beta.png")
    write_csv(workdir / "beta_table.csv", rows)
    return [row | {"threshold": threshold} for row in rows]


def format_beta_table(rows: list[dict]) -> str:
    """The per-β table as printed at the end of a run."""
    depth = "num_layers" in rows[0]
    header = ("   L " if depth else "") + (
        f"{'beta_a':>6} {'beta_f':>6} {'runs':>4} {'final loss':>11} {'final val':>11} "
        f"{'steps<thr':>9} {'rate/step':>9} {'σmin/‖Z‖F start':>16} {'end':>9}"
    )
    lines = [f"per-β table (threshold {rows[0]['threshold']:.4g}; means over runs):", header]
    for row in rows:
        lines.append(
            (f"{row['num_layers']:>4d} " if depth else "")
            + f"{row['beta_attn']:>6g} {row['beta_ffn']:>6g} {row['runs']:>4d} "
            f"{row['final_loss']:>11.4e} {row['final_val_loss']:>11.4e} "
            f"{row['steps_to_threshold']:>9.0f} {row['rate']:>9.5f} "
            f"{row['z_sigma_min_over_fro_start']:>16.4g} {row['z_sigma_min_over_fro_end']:>9.4g}"
        )
    return "\n".join(lines)
