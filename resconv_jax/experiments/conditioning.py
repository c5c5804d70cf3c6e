"""Rate against conditioning (claim 2), from a width sweep's metrics (configs/conditioning.py).

Per run: the fitted linear rate ρ and R² over the logged steps above the fit floor, the speed
1 − ρ, σ_min²/σ_max²(Z) (layer 0) at initialization and averaged over the probes of that window,
λ_min(K), λ_max(K) at initialization and η·λ_min(K) (η scaled by the loss reduction). Per width d:
Spearman's ρ of the speed against σ_min²/σ_max²(Z) at initialization, against its window mean and
against η·λ_min(K), and the log-log slope of the speed against σ_min²/σ_max²(Z).

Files: conditioning_runs.csv, conditioning_table.csv, rate_scatter.png and step_size.png (the stable
step 2/λ_max(K) against σ_max²(Z) at initialization: the paper's "the usable step size shrinks with
σ_max").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from resconv_jax.analysis import stats
from resconv_jax.analysis.stats import log_slope, spearman
from resconv_jax.analysis.summary import FIT_FLOOR, fit_rate, series
from resconv_jax.experiments import claims
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.figures import DPI, plt, save_figure
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import write_csv

Z_MIN, Z_MAX = "layer0/z/sigma_min", "layer0/z/sigma_max"
RUNS_FILE, TABLE_FILE = "conditioning_runs.csv", "conditioning_table.csv"
# Columns of TABLE_FILE that claim 2 reads: d / (P·M), Spearman's ρ of 1 − rate against
# σ_min²/σ_max²(Z) at initialization and against η·λ_min(K).
DIM_OVER_PM, RHO_Z_INIT, RHO_ETA_LAMBDA_MIN = (
    "dim_over_pm",
    "rho_z_ratio_sq_init",
    "rho_eta_lambda_min_init",
)


def _first(history: list[dict], run: int, key: str) -> float:
    values = series(history, run, key)[1]
    return float(values[0]) if values.size else math.nan


def run_rows(history: list[dict], loss_scale: float = 1.0, floor: float = FIT_FLOOR) -> list[dict]:
    """One row per run (see the module docstring); `loss_scale` is 1 for the sum loss."""
    rows = []
    for run in sorted({line["run"] for line in history}):
        lines = [line for line in history if line["run"] == run]
        steps, losses = series(lines, run, "loss")
        rate, r2 = fit_rate(steps, losses, floor)
        window = [line for line in lines if line["loss"] > floor * losses[0] and Z_MIN in line]
        ratio = np.array([(line[Z_MIN] / line[Z_MAX]) ** 2 for line in window])
        first = lines[0]
        z_min, z_max = _first(lines, run, Z_MIN), _first(lines, run, Z_MAX)
        lam_min, lam_max = (_first(lines, run, f"ntk/lambda_{k}") for k in ("min", "max"))
        rows.append(
            {
                "run": run,
                "dim": first.get("dim", 0),
                "num_layers": first.get("num_layers", 1),
                "seed": first["seed"],
                "beta_attn": first["beta_attn"],
                "beta_ffn": first["beta_ffn"],
                "lr": first["lr"],
                "rate": rate,
                "rate_r2": r2,
                "speed": 1.0 - rate,
                "z_ratio_sq_init": z_min**2 / z_max**2,
                "z_ratio_sq_window_mean": float(ratio.mean()) if ratio.size else math.nan,
                "z_sigma_max_sq_init": z_max**2,
                "lambda_min_init": lam_min,
                "lambda_max_init": lam_max,
                "lambda_ratio_init": lam_min / lam_max,
                "eta_lambda_min_init": first["lr"] * loss_scale * lam_min,
                "stable_lr_init": _first(lines, run, "ntk/stable_lr"),
            }
        )
    return rows


def width_table(rows: list[dict], num_tokens: int | None = None) -> list[dict]:
    """One row per width d: Spearman's ρ of the speed 1 − rate against each measure, the log-log
    slope against σ_min²/σ_max²(Z) at init, and d/(P·M) when `num_tokens` = P·M is given."""
    table = []
    for dim in sorted({row["dim"] for row in rows}):
        same = [row for row in rows if row["dim"] == dim]
        speed = [row["speed"] for row in same]
        entry = {"dim": dim, "runs": len(same)}
        entry["fitted_runs"] = int(np.isfinite(speed).sum())  # the rest are left out of ρ
        if num_tokens:
            entry[DIM_OVER_PM] = dim / num_tokens
        for name in ("z_ratio_sq_init", "z_ratio_sq_window_mean", "eta_lambda_min_init"):
            entry[f"rho_{name}"] = spearman(speed, [row[name] for row in same])
        entry["rho_beta"] = spearman(speed, [row["beta_attn"] for row in same])
        entry["slope_z_ratio_sq_init"] = log_slope([row["z_ratio_sq_init"] for row in same], speed)
        entry["min_rate_r2"] = float(np.nanmin([row["rate_r2"] for row in same]))
        table.append(entry)
    return table


def format_width_table(table: list[dict]) -> str:
    """The per-width table as printed at the end of a run."""
    lines = [
        "rate against conditioning (Spearman ρ of 1 − rate over β × seeds, per width d; fit: runs "
        "with a rate fit, the others are left out):",
        f"{'d':>5} {'runs':>4} {'fit':>4} {'ρ σ²min/σ²max(Z) init':>22} {'window':>7} "
        f"{'ρ ηλmin(K)':>11} {'ρ β':>6} {'slope':>6} {'min R²':>7}",
    ]
    for row in table:
        lines.append(
            f"{row['dim']:>5} {row['runs']:>4} {row['fitted_runs']:>4} "
            f"{row['rho_z_ratio_sq_init']:>22.3f} "
            f"{row['rho_z_ratio_sq_window_mean']:>7.3f} {row['rho_eta_lambda_min_init']:>11.3f} "
            f"{row['rho_beta']:>6.3f} {row['slope_z_ratio_sq_init']:>6.3f} "
            f"{row['min_rate_r2']:>7.4f}"
        )
    return "\n".join(lines)


def _by_width(rows: list[dict]):
    dims = sorted({row["dim"] for row in rows})
    colors = plt.cm.viridis(np.linspace(0, 0.85, max(len(dims), 1)))
    for color, dim in zip(colors, dims, strict=True):
        yield dim, color, [row for row in rows if row["dim"] == dim]


def plot_rate_scatter(rows: list[dict], table: list[dict], path) -> None:
    """1 − rate against σ_min²/σ_max²(Z) and against η·λ_min(K) at initialization, per width."""
    rho = {entry["dim"]: entry for entry in table}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), dpi=DPI)
    panels = (
        ("z_ratio_sq_init", "σ_min²/σ_max² of Z = Attn(X) + βX at initialization"),
        ("eta_lambda_min_init", "η·λ_min(K) at initialization (tangent kernel)"),
    )
    for ax, (key, xlabel) in zip(axes, panels, strict=True):
        for dim, color, same in _by_width(rows):
            label = f"d = {dim} (Spearman ρ {rho[dim][f'rho_{key}']:.2f})"
            x, y = [row[key] for row in same], [row["speed"] for row in same]
            ax.loglog(x, y, "o", color=color, alpha=0.75, label=label)
        ax.set(xlabel=xlabel, ylabel="convergence speed 1 − rate (per step)")
        ax.legend(fontsize=8)
    axes[0].set_title("Speed against conditioning of Z (one point per β, seed)")
    axes[1].set_title("Speed against the PL constant of the linearized step")
    fig.tight_layout()
    save_figure(fig, path)


def plot_step_size(rows: list[dict], path) -> None:
    """The stable step 2/λ_max(K) against σ_max²(Z), both at initialization, per width; the η
    used drawn as a line."""
    fig, ax = plt.subplots(figsize=(6, 4.4), dpi=DPI)
    for dim, color, same in _by_width(rows):
        x = [row["z_sigma_max_sq_init"] for row in same]
        ax.loglog(x, [row["stable_lr_init"] for row in same], "o", color=color, label=f"d = {dim}")
    for lr in sorted({row["lr"] for row in rows}):
        ax.axhline(lr, color="0.3", linestyle="--", linewidth=1, label=f"η used = {lr:g}")
    ax.set(
        xlabel="σ_max² of Z at initialization",
        ylabel="stable step size 2/λ_max(K) at initialization",
        title="The usable step size shrinks with σ_max(Z)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def write_conditioning_report(workdir, history: list[dict], config: dict, floor: float) -> str:
    """conditioning_runs.csv, conditioning_table.csv and the two figures; the printed table."""
    workdir = wd.path(workdir)
    data = config.get("data", {})
    reduction = config.get("optim", {}).get("reduction", "sum")
    num_tokens = data.get("num_samples", 0) * data.get("seq_len", 0)
    loss_scale = 1.0 if reduction == "sum" else 1.0 / (num_tokens * data.get("out_dim", 1))
    rows = run_rows(history, loss_scale, floor)
    table = width_table(rows, num_tokens or None)
    write_csv(workdir / RUNS_FILE, rows)
    write_csv(workdir / TABLE_FILE, table)
    plot_rate_scatter(rows, table, workdir / "rate_scatter.png")
    if not np.isnan(rows[0]["stable_lr_init"]):
        plot_step_size(rows, workdir / "step_size.png")
    return format_width_table(table)


def rate_vs_conditioning(workdir, threshold: float = 0.9, min_ratio: float = 2.0) -> Claim:
    """Claim 2: Spearman ρ(1 − rate, σ_min²/σ_max²(Z) at init) ≥ threshold for d ≥ 2·P·M."""
    claim = Claim(
        "2. rate governed by σ_min/σ_max of Z",
        "Spearman ρ(1 − rate, σ_min²/σ_max²(Z) at init) over β × seeds, per width",
        f"≥ {threshold:g} at d ≥ {min_ratio:g}·P·M (d = P·M reported)",
    )
    if missing := claims.missing(claim, workdir, TABLE_FILE):
        return missing
    table = claims.read_csv(wd.path(workdir) / TABLE_FILE)
    value = "; ".join(
        f"d={r['dim']} ({r[DIM_OVER_PM]:g}·P·M): ρ={r[RHO_Z_INIT]:.3f}" for r in table
    )
    held = [r for r in table if r[DIM_OVER_PM] >= min_ratio]
    if not held:
        return dataclasses.replace(claim, value=value, note=f"no width d ≥ {min_ratio:g}·P·M")
    rho_k = ", ".join(f"d={r['dim']}: {r[RHO_ETA_LAMBDA_MIN]:.3f}" for r in table)
    note = f"ρ against η·λ_min(K): {rho_k}"
    if all("rho_beta" in r for r in table):  # β orders the speeds too: row 2″ holds it fixed
        note += "; ρ against β alone: " + ", ".join(
            f"d={r['dim']}: {r['rho_beta']:.3f}" for r in table
        )
    if undefined := [r for r in held if not math.isfinite(r[RHO_Z_INIT])]:
        why = "; ".join(
            f"ρ is undefined at d={r['dim']} ({r.get('fitted_runs', '?')} of {r['runs']} runs "
            "have a rate fit)"
            for r in undefined
        )
        return dataclasses.replace(claim, value=value, note=f"{why}; {note}")
    ok = all(r[RHO_Z_INIT] >= threshold for r in held)
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


def within_beta(rows: list[dict], measure: str = "z_ratio_sq_init", power: bool = True) -> dict:
    """The second reading of claim 2 (row 2″) for the runs of one width: the stratified Spearman
    ρ (within each β, across seeds) between `measure` and the speed 1 − rate, its one-sided
    permutation test (greater), seed-bootstrap interval and power. Runs without a fitted rate
    are left out."""
    runs = [{"seed": r["seed"], "beta": r["beta_attn"], "x": r[measure], "speed": r["speed"]}
            for r in rows if np.isfinite(r["speed"]) and np.isfinite(r[measure])]  # fmt: skip

    def test(sample, **draws):
        x, speed, beta = (np.array([r[k] for r in sample], float) for k in ("x", "speed", "beta"))
        return stats.permutation_test(stats.stratified_spearman, x, speed, beta,
                                      alternative="greater", **draws)  # fmt: skip

    def rho(sample):
        x, speed, beta = (np.array([r[k] for r in sample], float) for k in ("x", "speed", "beta"))
        return float(stats.stratified_spearman(x[None], speed, beta)[0])

    return {
        "test": test(runs),
        "interval": stats.cluster_bootstrap(rho, runs, "seed"),
        "power": stats.bootstrap_power(
            lambda sample: test(sample, max_exact=0, draws=stats.POWER_DRAWS).p_value, runs, "seed"
        )
        if power
        else math.nan,
        "runs": len(runs),
    }


def rate_vs_conditioning_within_beta(workdir, alpha: float = 0.05, min_ratio: float = 2.0) -> Claim:
    """Row 2″: at a fixed β, a larger σ_min²/σ_max²(Z) at initialization goes with faster descent
    (docs/protocol.md, the second reading), at every width d ≥ min_ratio·P·M."""
    claim = Claim(
        "2″. at a fixed β, the rate follows σ_min²/σ_max²(Z) (second reading of 2)",
        "stratified Spearman ρ(σ_min²/σ_max²(Z) at init, 1 − rate) within β across seeds, "
        "one-sided p [95 % seed-bootstrap interval]; power; per width",
        f"ρ > 0 with p < {alpha:g} at d ≥ {min_ratio:g}·P·M; undecided if an interval spans 0 "
        "or power < 0.8",
    )
    if missing := claims.missing(claim, workdir, RUNS_FILE) or claims.missing(
        claim, workdir, TABLE_FILE
    ):
        return missing
    rows = claims.read_csv(wd.path(workdir) / RUNS_FILE)
    over_pm = {r["dim"]: r[DIM_OVER_PM] for r in claims.read_csv(wd.path(workdir) / TABLE_FILE)}
    values, notes, verdicts = [], [], []
    for dim in sorted({r["dim"] for r in rows}):
        same = [r for r in rows if r["dim"] == dim]
        z, k = within_beta(same), within_beta(same, "eta_lambda_min_init", power=False)
        t, kt = z["test"], k["test"]
        against = claims.against_text(t, z["interval"], 0.0, "above")
        values.append(f"d={dim}: ρ={t.observed:+.3f} {claims.interval_text(z['interval'])}, "
                      f"{t.describe()}{against}, power {z['power']:.2f}")  # fmt: skip
        notes.append(f"d={dim}: ρ={kt.observed:+.3f} {claims.interval_text(k['interval'])}, "
                     f"p = {kt.p_value:.2g}")  # fmt: skip
        if over_pm.get(dim, 0) >= min_ratio:
            ok = t.observed > 0 and t.p_value < alpha
            verdicts.append(claims.decided(ok, z["interval"], 0.0, z["power"], claimed="above",
                                           opposite_p=t.p_opposite, alpha=alpha))  # fmt: skip
    value = "; ".join(values)
    if not verdicts:
        return dataclasses.replace(claim, value=value, note=f"no width d ≥ {min_ratio:g}·P·M")
    verdict = claims.combined(verdicts)
    note = "the same for η·λ_min(K) at init: " + "; ".join(notes)
    return dataclasses.replace(claim, value=value, verdict=verdict, note=note)


EXPERIMENTS = (
    Experiment(
        "conditioning",
        "Rate against conditioning",
        "conditioning.py",
        scale_variants(),
        typical_seconds={"small": 19},
        claims=(
            ClaimCheck(2, rate_vs_conditioning),
            ClaimCheck(2.1, rate_vs_conditioning_within_beta),
        ),
        files=(RUNS_FILE, TABLE_FILE, "rate_scatter.png", "step_size.png"),
    ),
)
