"""The classification report (SST-2): errors against step, accuracy and per-layer conditioning.

Written, from the metrics lines, next to the per-β table whenever the runs log a training error:
`errors.png` (training loss and training / validation error against step, one curve per run),
`accuracy_table.csv` (one row per (L, β): final training error and validation accuracy, means over
seeds) and `layers_table.csv` (one row per run and layer: σ_min(Z)/‖Z‖_F and the rank-collapse
residual of Attn and Z at the first and the last probed step); `run_errors.csv` (one row per
run: L, β, seed, final training error; row 5b″ reads it, `sst2_seeds`).
"""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from resconv_jax.analysis.summary import lr_swept, series  # noqa: E402
from resconv_jax.experiments import claims  # noqa: E402
from resconv_jax.experiments.claims import Claim  # noqa: E402
from resconv_jax.experiments.figures import (  # noqa: E402
    DPI,
    beta_label,
    first_lines,
    group_key,
    save_figure,
)
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants  # noqa: E402
from resconv_jax.experiments.sst2_seeds import (  # noqa: E402
    FINAL_ERROR,  # the column of ACCURACY_FILE (and RUNS_FILE) that claims 5b and 5b″ read
    RUNS_FILE,
    run_rows,
    sst2_ordering_with_seeds,
)
from resconv_jax.runtime import workdir as wd  # noqa: E402
from resconv_jax.runtime.workdir import write_csv  # noqa: E402

ACCURACY_FILE, LAYERS_FILE = "accuracy_table.csv", "layers_table.csv"
LAYER_KEYS = ("z/sigma_min_over_fro", "z/collapse_residual", "attn/collapse_residual")


def plot_errors(history: list[dict], path: str) -> None:
    """Training loss (log scale) and training error (—) / validation error (⋯) against step."""
    fig, (ax_loss, ax_error) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=DPI)
    runs = first_lines(history)
    swept = lr_swept(runs)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(runs), 1)))
    for color, run in zip(colors, runs, strict=True):
        label = f"{beta_label(run, swept)}, seed {run['seed']}"
        ax_loss.semilogy(*series(history, run["run"], "loss"), color=color, label=label)
        ax_error.plot(*series(history, run["run"], "error"), color=color, label=label)
        steps, val = series(history, run["run"], "val_error")
        if val.size:
            ax_error.plot(steps, val, ":", color=color)
    ax_loss.set(xlabel="step", ylabel="training loss", title="Loss (log scale)")
    ax_error.set(xlabel="step", ylabel="error", title="Training error (—), validation error (⋯)")
    ax_loss.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def accuracy_rows(history: list[dict]) -> list[dict]:
    """One row per (L, lr, β_a, β_f) (lr when swept): final training error and validation
    accuracy, mean over seeds."""
    groups: dict[tuple, list[dict]] = {}
    runs = first_lines(history)
    swept = lr_swept(runs)
    for run in runs:
        error = series(history, run["run"], "error")[1]
        val = series(history, run["run"], "val_error")[1]
        groups.setdefault(group_key(run, swept), []).append(
            {
                FINAL_ERROR: error[-1] if error.size else np.nan,
                "final_val_accuracy": 1.0 - val[-1] if val.size else np.nan,
            }
        )
    rows = []
    for (layers, _, lr, beta_attn, beta_ffn), members in sorted(groups.items()):
        row = {"num_layers": layers} | ({"lr": lr} if swept else {})
        row |= {"beta_attn": beta_attn, "beta_ffn": beta_ffn}
        row["runs"] = len(members)
        for key in members[0]:
            row[key] = float(np.mean([m[key] for m in members]))
        rows.append(row)
    return rows


def layer_rows(history: list[dict]) -> list[dict]:
    """One row per run and layer: LAYER_KEYS at the first and the last probed step."""
    rows = []
    for run in first_lines(history):
        for layer in range(run.get("num_layers", 1) or 1):
            row = {"run": run["run"], "num_layers": run.get("num_layers", 0), "layer": layer}
            row |= {"beta_attn": run["beta_attn"], "seed": run["seed"]}
            for key in LAYER_KEYS:
                values = series(history, run["run"], f"layer{layer}/{key}")[1]
                row[f"{key}/start"] = values[0] if values.size else np.nan
                row[f"{key}/end"] = values[-1] if values.size else np.nan
            rows.append(row)
    return rows


def write_classification_report(workdir, history: list[dict]) -> list[dict]:
    """errors.png, accuracy_table.csv, layers_table.csv and run_errors.csv (one row per run,
    for row 5b″) in `workdir`; the accuracy rows."""
    workdir = wd.path(workdir)
    plot_errors(history, workdir / "errors.png")
    rows = accuracy_rows(history)
    write_csv(workdir / ACCURACY_FILE, rows)
    write_csv(workdir / LAYERS_FILE, layer_rows(history))
    if per_run := run_rows(history, first_lines(history)):
        write_csv(workdir / RUNS_FILE, per_run)
    return rows


def format_accuracy_table(rows: list[dict]) -> str:
    """The per-(L, β) accuracy table as printed at the end of a run."""
    lr = "lr" in rows[0]
    lines = [
        f"per-(L, {'lr, ' if lr else ''}β) accuracy (means over runs):",
        f"{'L':>3} "
        + (f"{'lr':>9} " if lr else "")
        + f"{'beta_a':>6} {'beta_f':>6} {'runs':>4} {'train error':>11} {'val acc':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['num_layers'] or '-':>3} "
            + (f"{row['lr']:>9.3g} " if lr else "")
            + f"{row['beta_attn']:>6g} {row['beta_ffn']:>6g} "
            f"{row['runs']:>4d} {row['final_error']:>11.4f} {row['final_val_accuracy']:>8.4f}"
        )
    return "\n".join(lines)


def sst2_ordering(workdir) -> Claim:
    """Claim 5b: at every L the residual run's (β = 1) final training error is below the plain
    one's (β = 0), and only with the residual does the error improve with depth (error at the
    largest L below that at the smallest)."""
    claim = Claim(
        "5b. SST-2: residual lowers training error, depth helps only with it",
        "final training error per (L, β)",
        "β=1 < β=0 at each L; error(L_max) < error(L_min) at β=1 only",
    )
    if missing := claims.missing(claim, workdir, ACCURACY_FILE):
        return missing
    rows = claims.read_csv(wd.path(workdir) / ACCURACY_FILE)
    if mixed := claims.several_lrs(claim, rows):
        return mixed
    error = {
        (r["num_layers"], float(r["beta_attn"])): r[FINAL_ERROR]
        for r in rows
        if r["beta_attn"] == r["beta_ffn"]
    }
    depths = sorted({L for L, _ in error})
    if len(depths) < 2 or any((L, b) not in error for L in depths for b in (0.0, 1.0)):
        return dataclasses.replace(claim, note="needs β = 0 and β = 1 at two depths or more")
    value = "; ".join(f"L={L}: {error[L, 0.0]:.3f} vs {error[L, 1.0]:.3f}" for L in depths)
    lower = all(error[L, 1.0] < error[L, 0.0] for L in depths)
    helps = {b: error[depths[-1], b] < error[depths[0], b] for b in (0.0, 1.0)}
    ok = lower and helps[1.0] and not helps[0.0]
    note = (
        f"β=1 lower at every L: {lower}; deeper is better at β=1: {helps[1.0]}, "
        f"at β=0: {helps[0.0]}"
    )
    value += " (β=0 vs β=1)"
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


_FILES = (ACCURACY_FILE, LAYERS_FILE, RUNS_FILE, "errors.png", "beta_table.csv")
_CLAIMS = (ClaimCheck(5.2, sst2_ordering), ClaimCheck(5.21, sst2_ordering_with_seeds))
EXPERIMENTS = (
    Experiment(
        "sst2",
        "SST-2, pretrained GPT-2",
        "sst2.py",
        scale_variants(paper="full"),
        claims=_CLAIMS,
        files=_FILES,
        label="pretrained GPT-2",
        fallback=Experiment(
            "sst2_random",
            "SST-2, random-init GPT-2 (not the pretrained model)",
            "sst2.py",
            scale_variants("random_small,tiny", "random_small,small", "random_small"),
            typical_seconds={"small": 81},
            claims=_CLAIMS,
            files=_FILES,
            label="random-init GPT-2, not the pretrained model",
            substitute=" (random-init substitute, not the claim's model)",
        ),
    ),
)
