"""Figures and the per-β table of a run directory, from its metrics lines (every task that trains:
theory, Jena, SST-2). Written by `experiments.run_report` at the end of a run.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from resconv_jax.analysis.summary import (  # noqa: E402
    FIT_FLOOR,
    LINEAR_FIT_R2,
    fit_rate,
    lr_swept,
    series,
)
from resconv_jax.runtime import workdir as wd  # noqa: E402
from resconv_jax.runtime.workdir import write_csv, write_png  # noqa: E402

Z_FRO = "layer0/z/sigma_min_over_fro"


# Figures are made at the dpi they are saved at: a layout measured at another dpi (tight_layout's)
# is measured again when saving (its text extents are cached per dpi), ~17 % of a report's time.
DPI = 110


def save_figure(fig, path) -> None:
    """Writes `fig` (made at `DPI`) as a PNG at `path` (local or object storage) atomically, in
    one write (never half a figure), then closes it."""
    write_png(fig, path, DPI)
    plt.close(fig)


def first_lines(history: list[dict]) -> list[dict]:
    first = {}
    for line in history:
        first.setdefault(line["run"], line)
    return [first[r] for r in sorted(first)]


def beta_label(line: dict, lr: bool = False) -> str:
    """'L=2, β=0.5' (L, d where swept; the lr too with `lr`, when the runs differ in it)."""
    depth = f"L={line['num_layers']}, " if "num_layers" in line else ""
    depth += f"d={line['dim']}, " if "dim" in line else ""
    depth += f"lr={line['lr']:.3g}, " if lr else ""
    if line["beta_attn"] == line["beta_ffn"]:
        return f"{depth}β={line['beta_attn']:g}"
    return f"{depth}β_a={line['beta_attn']:g}, β_f={line['beta_ffn']:g}"


def group_key(line: dict, by_lr: bool = False) -> tuple:
    """(L or 0, d or 0, lr (`by_lr`: an lr sweep, `lr_swept`) or 0, β_a, β_f): the runs (seeds)
    that share these are one row of the table."""
    layers, dim = line.get("num_layers", 0), line.get("dim", 0)
    return layers, dim, line["lr"] if by_lr else 0.0, line["beta_attn"], line["beta_ffn"]


def group_colors(keys) -> dict[tuple, np.ndarray]:
    """One colour per β group (`group_key`), along a sequential colormap in the keys' order."""
    keys = sorted(set(keys))
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(keys), 1)))
    return dict(zip(keys, colors, strict=False))


MAX_SEED_MARKERS = 5
SEED_MARKERS = "os^Dv"


def training_figure(history: list[dict]):
    """The figure of `plot_training` (not saved)."""
    runs = first_lines(history)
    swept = lr_swept(runs)
    colors = group_colors(group_key(run, swept) for run in runs)
    seeds = sorted({run["seed"] for run in runs})
    marked = 1 < len(seeds) <= MAX_SEED_MARKERS  # a marker per seed; more seeds: thin lines
    thin = len(seeds) > MAX_SEED_MARKERS
    fig, (ax_loss, ax_sigma) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=DPI)
    for run in runs:
        style = {"color": colors[group_key(run, swept)], "lw": 0.8 if thin else 1.4}
        if thin:
            style["alpha"] = 0.7
        if marked:
            steps = series(history, run["run"], "loss")[0]
            every = max(len(steps) // 8, 1)
            offset = seeds.index(run["seed"]) * every // len(seeds)
            style |= {"marker": SEED_MARKERS[seeds.index(run["seed"])], "ms": 4}
            style["markevery"] = (offset, every)
        ax_loss.semilogy(*series(history, run["run"], "loss"), **style)
        if len(seeds) == 1:
            for key, line in (("layer0/z/sigma_min", "-"), ("layer0/attn/sigma_min", ":")):
                steps, values = series(history, run["run"], key)
                if values.size:
                    ax_sigma.semilogy(steps, values, linestyle=line, **style)
    if len(seeds) > 1:
        sigma_summary(ax_sigma, history, runs, colors)
    beta_handles = [
        Line2D([], [], color=color, lw=2, label=beta_label(run, swept))
        for key, color in colors.items()
        for run in [next(r for r in runs if group_key(r, swept) == key)]
    ]
    outside = len(beta_handles) > 4  # beside the panels, so that no legend covers a curve
    if outside:
        fig.legend(handles=beta_handles, fontsize=8, title="colour", loc="center right")
    else:
        ax_loss.add_artist(
            ax_loss.legend(handles=beta_handles, fontsize=8, title="colour", loc="upper right")
        )
    if marked:
        seed_handles = [
            Line2D([], [], color="0.3", lw=0, marker=m, label=f"seed {s}")
            for m, s in zip(SEED_MARKERS, seeds, strict=False)
        ]
        ax_loss.legend(handles=seed_handles, fontsize=8, title="marker", loc="lower left")
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
    summary = f": median of {len(seeds)} seeds, band min–max" if len(seeds) > 1 else ""
    ax_sigma.set(xlabel="step", ylabel="σ_min, layer 0 (log scale)")
    ax_sigma.set_title(f"σ_min of Z and of Attn(X), layer 0{summary}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.86, 1) if outside else (0, 0, 1, 1))
    return fig


def sigma_summary(ax, history: list[dict], runs: list[dict], colors: dict) -> None:
    """Per β group: the median over its runs (seeds) of σ_min(Z) (solid, with its min–max band)
    and of σ_min(Attn(X)) (dotted), against step: one line per group, not per run."""
    swept = lr_swept(runs)
    for key, color in colors.items():
        members = [r["run"] for r in runs if group_key(r, swept) == key]
        for name, line in (("layer0/z/sigma_min", "-"), ("layer0/attn/sigma_min", ":")):
            curves = [series(history, run, name) for run in members]
            if not curves or not curves[0][1].size:
                continue
            length = min(values.size for _, values in curves)
            steps, values = curves[0][0][:length], np.array([v[:length] for _, v in curves])
            ax.semilogy(steps, np.median(values, axis=0), linestyle=line, color=color, lw=1.4)
            if line == "-":
                ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.15)


def plot_training(history: list[dict], path: str) -> None:
    """Log-loss against step per run, and σ_min of Z and of Attn(X) (layer 0) against step:
    colour by β (and depth), marker by seed (thin lines for many seeds)."""
    save_figure(training_figure(history), path)


def steps_to_threshold(steps: np.ndarray, losses: np.ndarray, threshold: float) -> float:
    """First logged step whose loss is at or below `threshold` (NaN if never, and NaN for a run
    that starts at or below it: its count would say nothing about its descent)."""
    if losses.size and losses[0] <= threshold:
        return float("nan")
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
    runs = first_lines(history)
    finals = {r["run"]: series(history, r["run"], "loss")[1][-1] for r in runs}
    threshold = threshold or 1.5 * max(finals.values())
    swept = lr_swept(runs)
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        steps, losses = series(history, run["run"], "loss")
        val = series(history, run["run"], "val_loss")[1]
        fro = series(history, run["run"], Z_FRO)[1]
        rate, r2 = fit_rate(steps, losses, floor)
        groups.setdefault(group_key(run, swept), []).append(
            {
                "final_loss": losses[-1],
                "final_val_loss": val[-1] if val.size else np.nan,
                "steps_to_threshold": steps_to_threshold(steps, losses, threshold),
                "rate": rate,
                "rate_r2": r2,
                "z_sigma_min_over_fro_start": fro[0] if fro.size else np.nan,
                "z_sigma_min_over_fro_end": fro[-1] if fro.size else np.nan,
            }
        )
    rows = []
    for (layers, dim, lr, beta_attn, beta_ffn), members in sorted(groups.items()):
        row = {"num_layers": layers} if layers else {}
        row |= {"dim": dim} if dim else {}
        row |= {"lr": lr} if swept else {}
        row |= {"beta_attn": beta_attn, "beta_ffn": beta_ffn, "runs": len(members)}
        for key in members[0]:
            values = np.array([m[key] for m in members], float)
            row[key] = float(np.mean(values))
            row[f"{key}_min"] = float(np.min(values))
            row[f"{key}_max"] = float(np.max(values))
        fitted = [m["rate_r2"] for m in members if np.isfinite(m["rate_r2"])]
        row["rate_r2_min"] = min(fitted, default=np.nan)  # of the runs that could be fitted
        row["unfit_runs"] = len(members) - len(fitted)
        rows.append(row)
    return rows, threshold


def loss_by_beta_figure(history: list[dict], threshold: float):
    """The figure of `plot_loss_by_beta` (not saved)."""
    curves: dict[tuple, list[np.ndarray]] = {}
    labels, steps, reached = {}, None, []
    runs = first_lines(history)
    swept = lr_swept(runs)
    for run in runs:
        steps, losses = series(history, run["run"], "loss")
        key = group_key(run, swept)
        curves.setdefault(key, []).append(losses)
        labels.setdefault(key, beta_label(run, swept))
        if threshold:
            reached.append(steps_to_threshold(steps, losses, threshold))
    colors = group_colors(curves)
    # The early window: twice the last step at which a run first reaches the threshold, drawn
    # when that is at most 40 % of the run (else the full panel shows the crossings as well).
    reached = np.array(reached, float)
    early = 0.0
    if np.isfinite(reached).any():
        early = 2 * max(np.nanmax(reached), steps[min(1, steps.size - 1)])
    zoom = 0 < early <= 0.4 * steps[-1]
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(11.5 if zoom else 6.8, 4.6), dpi=DPI)
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
        shapes = [name for i, name in enumerate(("L", "d")) if any(key[i] for key in curves)]
        shapes += ["lr"] if swept else []
        note = f"one run per ({', '.join(shapes)}, β)" if shapes else "one run per β"
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
    save_figure(loss_by_beta_figure(history, threshold), path)


def sigma_axis(rows: list[dict]) -> tuple[str, str, str] | None:
    """(x key, x label, key of the lines) of `plot_sigma_by_beta`: β when the rows hold several,
    else the swept depth or width; None when there is only one point to draw."""
    shapes = [k for k in ("num_layers", "dim") if len({row.get(k) for row in rows}) > 1]
    if len({row["beta_attn"] for row in rows}) > 1:
        return "beta_attn", "β (attention residual)", "shape"
    if shapes:
        return shapes[0], {"num_layers": "depth L", "dim": "width d"}[shapes[0]], "beta"
    return None


def plot_sigma_by_beta(rows: list[dict], path: str) -> bool:
    """σ_min(Z)/‖Z‖_F (layer 0) at the first and the last logged step against β, one line per
    depth L or width d; with a single β, against the swept L or d instead. Nothing is drawn
    (False) when that leaves a single point."""
    axis = sigma_axis(rows)
    if axis is None:
        return False
    x_key, x_label, line_key = axis
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=DPI)

    def line_of(row):
        if line_key == "beta":
            return row.get("lr", 0.0), row["beta_attn"], row["beta_ffn"]
        return row.get("num_layers", 0), row.get("dim", 0), row.get("lr", 0.0)

    for line in sorted({line_of(row) for row in rows}):
        same = sorted((r for r in rows if line_of(r) == line), key=lambda r: r[x_key])
        if line_key == "beta":
            betas = {k: v for k, v in same[0].items() if k not in ("num_layers", "dim")}
            name = beta_label(betas, "lr" in same[0])
        else:
            name = ", ".join(f"{n}={v:g}" for n, v in zip(("L", "d", "lr"), line, strict=True) if v)
        for when, marker in (("start", "o"), ("end", "s")):
            key = f"z_sigma_min_over_fro_{when}"
            mean = np.array([row[key] for row in same])
            low = mean - [row[f"{key}_min"] for row in same]
            high = np.array([row[f"{key}_max"] for row in same]) - mean
            label = f"{name + ', ' if name else ''}{when} of training"
            xs = [row[x_key] for row in same]
            ax.errorbar(xs, mean, yerr=[low, high], marker=marker, capsize=3, label=label)
    if x_key != "beta_attn":
        ticks = sorted({row[x_key] for row in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(v) for v in ticks])
    several = any(row["runs"] > 1 for row in rows)
    title = "Conditioning of Z, layer 0" + (" (mean over seeds, bars min–max)" if several else "")
    ax.set(xlabel=x_label, ylabel="σ_min(Z) / ‖Z‖_F", title=title)
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    save_figure(fig, path)
    return True


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
            if not plot_sigma_by_beta(rows, workdir / "sigma_by_beta.png"):
                (workdir / "sigma_by_beta.png").unlink(missing_ok=True)
    write_csv(workdir / "beta_table.csv", rows)
    return [row | {"threshold": threshold} for row in rows]


def format_beta_table(rows: list[dict], summed: bool = False) -> str:
    """The per-β table as printed at the end of a run; `summed`: the losses are sums over their
    samples (optim.reduction=sum), said under the table when it has a validation loss."""
    depth, width, lr = "num_layers" in rows[0], "dim" in rows[0], "lr" in rows[0]
    header = (
        ("   L " if depth else "")
        + ("    d " if width else "")
        + (f"{'lr':>9} " if lr else "")
        + (
            f"{'beta_a':>6} {'beta_f':>6} {'runs':>4} {'final loss':>11} {'final val':>11} "
            f"{'steps<thr':>9} {'rate/step':>9} {'min R²':>7} {'σmin/‖Z‖F start':>16} {'end':>9}"
        )
    )
    lines = [f"per-β table (threshold {rows[0]['threshold']:.4g}; means over runs):", header]
    undefined = False
    for row in rows:
        steps = row["steps_to_threshold"]
        undefined |= not np.isfinite(steps)
        steps = f"{steps:>9.0f}" if np.isfinite(steps) else f"{'-':>9}"
        lines.append(
            (f"{row['num_layers']:>4d} " if depth else "")
            + (f"{row['dim']:>5d} " if width else "")
            + (f"{row['lr']:>9.3g} " if lr else "")
            + f"{row['beta_attn']:>6g} {row['beta_ffn']:>6g} {row['runs']:>4d} "
            f"{row['final_loss']:>11.4e} {row['final_val_loss']:>11.4e} "
            f"{steps} {row['rate']:>9.5f} {row['rate_r2_min']:>7.4f} "
            f"{row['z_sigma_min_over_fro_start']:>16.4g} {row['z_sigma_min_over_fro_end']:>9.4g}"
        )
    if undefined:
        lines.append(
            "steps<thr '-': a run of the row starts at or below the threshold, or never reaches it"
        )
    if any(row["rate_r2_min"] < LINEAR_FIT_R2 for row in rows):
        lines.append(
            f"rate/step: the slope of a line fitted to log loss; min R² below {LINEAR_FIT_R2:g} "
            "(the row's worst run): its loss is no line, and the slope is not a linear rate"
        )
    if unfit := sum(row["unfit_runs"] for row in rows):
        lines.append(
            f"{unfit} run(s) have no rate fit (fewer than 3 logged losses above the fit floor): "
            "their rows' rate/step is nan, their min R² that of the other runs"
        )
    if depth and any(row["num_layers"] > 1 for row in rows):
        lines.append("σmin/‖Z‖F: layer 0's; the depth table and depth_sigma.png give every layer")
    if summed and any(np.isfinite(row["final_val_loss"]) for row in rows):
        lines.append(
            "final loss and final val are sums over the training and the validation samples "
            "(optim.reduction=sum), sets of different sizes: compare them per sample"
        )
    return "\n".join(lines)
