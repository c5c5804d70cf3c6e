"""Figures and the per-β table of a run directory, from its metrics lines (every task that trains:
theory, Jena, SST-2). Written by `experiments.report` at the end of a run.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

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
    depth += f"d={line['dim']}, " if "dim" in line else ""
    if line["beta_attn"] == line["beta_ffn"]:
        return f"{depth}β={line['beta_attn']:g}"
    return f"{depth}β_a={line['beta_attn']:g}, β_f={line['beta_ffn']:g}"


def _group_key(line: dict) -> tuple:
    """(L or 0, d or 0, β_a, β_f): the runs (seeds) that share these are one row of the table."""
    return line.get("num_layers", 0), line.get("dim", 0), line["beta_attn"], line["beta_ffn"]


def _group_colors(keys) -> dict[tuple, np.ndarray]:
    """One colour per β group (`_group_key`), along a sequential colormap in the keys' order."""
    keys = sorted(set(keys))
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(keys), 1)))
    return dict(zip(keys, colors, strict=False))


MAX_SEED_MARKERS = 5
SEED_MARKERS = "os^Dv"


def _training_figure(history: list[dict]):
    """The figure of `plot_training` (not saved)."""
    runs = _runs(history)
    colors = _group_colors(_group_key(run) for run in runs)
    seeds = sorted({run["seed"] for run in runs})
    marked = 1 < len(seeds) <= MAX_SEED_MARKERS  # a marker per seed; more seeds: thin lines
    thin = len(seeds) > MAX_SEED_MARKERS
    fig, (ax_loss, ax_sigma) = plt.subplots(1, 2, figsize=(12, 4.6))
    for run in runs:
        style = {"color": colors[_group_key(run)], "lw": 0.8 if thin else 1.4}
        if thin:
            style["alpha"] = 0.7
        if marked:
            steps = series(history, run["run"], "loss")[0]
            every = max(len(steps) // 8, 1)
            offset = seeds.index(run["seed"]) * every // len(seeds)
            style |= {"marker": SEED_MARKERS[seeds.index(run["seed"])], "ms": 4}
            style["markevery"] = (offset, every)
        ax_loss.semilogy(*series(history, run["run"], "loss"), **style)
        for key, line in (("layer0/z/sigma_min", "-"), ("layer0/attn/sigma_min", ":")):
            steps, values = series(history, run["run"], key)
            if values.size:
                ax_sigma.semilogy(steps, values, linestyle=line, **style)
    beta_handles = [
        Line2D([], [], color=color, lw=2, label=_beta_label(run))
        for key, color in colors.items()
        for run in [next(r for r in runs if _group_key(r) == key)]
    ]
    legend = ax_loss.legend(handles=beta_handles, fontsize=8, title="colour", loc="upper right")
    if marked:
        seed_handles = [
            Line2D([], [], color="0.3", lw=0, marker=m, label=f"seed {s}")
            for m, s in zip(SEED_MARKERS, seeds, strict=False)
        ]
        ax_loss.add_artist(legend)
        ax_loss.legend(handles=seed_handles, fontsize=8, title="marker", loc="center right")
    title = "Training loss per run"
    if len(seeds) > 1:
        title += f" ({len(seeds)} seeds: " + ("thin lines)" if thin else "markers)")
    ax_loss.set(xlabel="step", ylabel="training loss (log scale)", title=title)
    if ax_sigma.lines:
        style_handles = [
            Line2D([], [], color="0.3", ls="-", label="σ_min(Z), Z = Attn(X) + β_a·X"),
            Line2D([], [], color="0.3", ls=":", label="σ_min(Attn(X)) (= σ_min(Z) at β_a = 0)"),
        ]
        ax_sigma.legend(handles=style_handles, fontsize=8, loc="best")
    ax_sigma.set(
        xlabel="step",
        ylabel="σ_min, layer 0 (log scale)",
        title="Smallest singular value of Z and of Attn(X), layer 0",
    )
    fig.tight_layout()
    return fig


def plot_training(history: list[dict], path: str) -> None:
    """Log-loss against step per run, and σ_min of Z and of Attn(X) (layer 0) against step:
    colour by β (and depth), marker by seed (thin lines for many seeds)."""
    save_figure(_training_figure(history), path)


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
    for (layers, dim, beta_attn, beta_ffn), members in sorted(groups.items()):
        row = {"num_layers": layers} if layers else {}
        row |= {"dim": dim} if dim else {}
        row |= {"beta_attn": beta_attn, "beta_ffn": beta_ffn, "runs": len(members)}
        for key in members[0]:
            values = np.array([m[key] for m in members], float)
            row[key] = float(np.mean(values))
            row[f"{key}_min"] = float(np.min(values))
            row[f"{key}_max"] = float(np.max(values))
        rows.append(row)
    return rows, threshold


def _loss_by_beta_figure(history: list[dict], threshold: float):
    """The figure of `plot_loss_by_beta` (not saved)."""
    curves: dict[tuple, list[np.ndarray]] = {}
    labels, steps, reached = {}, None, []
    for run in _runs(history):
        steps, losses = series(history, run["run"], "loss")
        curves.setdefault(_group_key(run), []).append(losses)
        labels.setdefault(_group_key(run), _beta_label(run))
        if threshold:
            reached.append(steps_to_threshold(steps, losses, threshold))
    colors = _group_colors(curves)
    # The early window: twice the last step at which a run first reaches the threshold, drawn
    # when that is at most 40 % of the run (else the full panel shows the crossings as well).
    reached = np.array(reached, float)
    early = 0.0
    if np.isfinite(reached).any():
        early = 2 * max(np.nanmax(reached), steps[min(1, steps.size - 1)])
    zoom = 0 < early <= 0.4 * steps[-1]
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(11.5 if zoom else 6.8, 4.6))
    axes = np.atleast_1d(axes)
    counts = {len(c) for c in curves.values()}
    for ax, window in zip(axes, (steps[-1], early), strict=False):
        keep = steps <= window
        for key, members in sorted(curves.items()):
            members = np.array(members)[:, keep]
            color, count = colors[key], len(members)
            label = labels[key] + (f" ({count} seeds)" if len(counts) > 1 else "")
            ax.semilogy(steps[keep], members.mean(0), color=color, label=label)
            if count > 1:
                ax.fill_between(
                    steps[keep], members.min(0), members.max(0), color=color, alpha=0.2, lw=0
                )
        if threshold:
            ax.axhline(
                threshold,
                color="0.3",
                ls="--",
                lw=1,
                label=f"threshold {threshold:.4g} (steps<thr in beta_table.csv)",
            )
        ax.set(xlabel="step", ylabel="training loss (log scale)")
    seeds = max(counts)
    if seeds > 1:
        note = (f"{seeds} seeds" if len(counts) == 1 else "seeds") + ": line mean, band min–max"
    else:
        note = "one run per β"
    axes[0].set_title(f"Full-batch GD by β ({note})")
    axes[0].legend(fontsize=8)
    if zoom:
        axes[1].set_title(f"First {early:g} steps (the same curves)")
    fig.tight_layout()
    return fig


def plot_loss_by_beta(history: list[dict], path: str, threshold: float = 0.0) -> None:
    """Training loss against step per β: mean over seeds with the min–max range shaded, and
    `threshold` (if not 0), the level of the table's steps to threshold, dashed. When the runs
    all reach it within the first 20 % of the steps, a second panel shows the first steps (twice
    the step at which the last of them does)."""
    save_figure(_loss_by_beta_figure(history, threshold), path)


def plot_sigma_by_beta(rows: list[dict], path: str) -> None:
    """σ_min(Z)/‖Z‖_F (layer 0) against β, at the first and the last logged step (per depth L
    when the sweep has several)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))

    def shape(row):
        return row.get("num_layers", 0), row.get("dim", 0)

    for layers, dim in sorted({shape(row) for row in rows}):
        same = [row for row in rows if shape(row) == (layers, dim)]
        betas = [row["beta_attn"] for row in same]
        depth = (f"L={layers}, " if layers else "") + (f"d={dim}, " if dim else "")
        for when, marker in (("start", "o"), ("end", "s")):
            key = f"z_sigma_min_over_fro_{when}"
            mean = np.array([row[key] for row in same])
            low = mean - [row[f"{key}_min"] for row in same]
            high = np.array([row[f"{key}_max"] for row in same]) - mean
            label = f"{depth}{when} of training"
            ax.errorbar(betas, mean, yerr=[low, high], marker=marker, capsize=3, label=label)
    several = any(row["runs"] > 1 for row in rows)
    title = "Conditioning of Z" + (" (mean over seeds, bars min–max)" if several else "")
    ax.set(xlabel="β (attention residual)", ylabel="σ_min(Z) / ‖Z‖_F", title=title)
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
        plot_loss_by_beta(history, workdir / "loss_by_beta.png", threshold)
        if not np.isnan(rows[0]["z_sigma_min_over_fro_start"]):
            plot_sigma_by_beta(rows, workdir / "sigma_by_beta.png")
    write_csv(workdir / "beta_table.csv", rows)
    return [row | {"threshold": threshold} for row in rows]


def format_beta_table(rows: list[dict]) -> str:
    """The per-β table as printed at the end of a run."""
    depth, width = "num_layers" in rows[0], "dim" in rows[0]
    header = (
        ("   L " if depth else "")
        + ("    d " if width else "")
        + (
            f"{'beta_a':>6} {'beta_f':>6} {'runs':>4} {'final loss':>11} {'final val':>11} "
            f"{'steps<thr':>9} {'rate/step':>9} {'σmin/‖Z‖F start':>16} {'end':>9}"
        )
    )
    lines = [f"per-β table (threshold {rows[0]['threshold']:.4g}; means over runs):", header]
    for row in rows:
        lines.append(
            (f"{row['num_layers']:>4d} " if depth else "")
            + (f"{row['dim']:>5d} " if width else "")
            + f"{row['beta_attn']:>6g} {row['beta_ffn']:>6g} {row['runs']:>4d} "
            f"{row['final_loss']:>11.4e} {row['final_val_loss']:>11.4e} "
            f"{row['steps_to_threshold']:>9.0f} {row['rate']:>9.5f} "
            f"{row['z_sigma_min_over_fro_start']:>16.4g} {row['z_sigma_min_over_fro_end']:>9.4g}"
        )
    return "\n".join(lines)
