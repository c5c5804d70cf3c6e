"""Linear convergence in the theory regime (claim 1) and the tangent-kernel certificate, from the
theory regime's runs (configs/theory.py: float64; with `softplus`, the certificate's premise).

Their figures and tables are every training run's (`figures`, via `run_report`); the claims read
summary.json (per run: the fitted rate and R², the certificate's hold fraction) and the step-0
metrics lines (the tangent kernel's stable step size).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from resconv_jax.analysis.summary import LINEAR_FIT_R2, certificate_checks, fit_floor, series
from resconv_jax.experiments import claims
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants
from resconv_jax.finished import SUMMARY_FILE
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.metrics import read_metrics
from resconv_jax.runtime.workdir import CONFIG_FILE


def linear_convergence(workdir, threshold: float = LINEAR_FIT_R2) -> Claim:
    """Claim 1: R² of the log-loss fit ≥ threshold for every run (theory regime, float64), each
    fitted ρ below 1 (a straight log-loss that rises or stays put is not convergence)."""
    claim = Claim(
        "1. linear convergence (theory regime, each β, float64)",
        "R² of the log-loss fit above the floor, per β",
        f"≥ {threshold:g} each, fitted ρ < 1",
    )
    if missing := claims.missing(claim, workdir, SUMMARY_FILE):
        return missing
    runs = claims.read_json(wd.path(workdir) / SUMMARY_FILE)
    value = ", ".join(f"β={r['beta_attn']:g}: {r['rate_r2']:.4f}" for r in runs)
    rising = [r for r in runs if not r["rate"] < 1]  # a straight log-loss that does not fall
    ok = all(r["rate_r2"] >= threshold for r in runs) and not rising
    note = claims.not_falling_note(
        [f"β={r['beta_attn']:g}" for r in rising], [r["rate"] for r in rising]
    )
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


def linear_convergence_bound(workdir) -> Claim:
    """Row 1″: linear convergence as a bound (docs/protocol.md, the second reading): with ρ_max
    the largest per-step certificate bound (1 − η·λ_min(K))² over a run's checks above the fit
    floor, log L_t ≤ log L_0 + t·log ρ_max at every logged step above the floor, every run."""
    claim = Claim(
        "1″. linear convergence as a bound (second reading of 1)",
        "log L_t ≤ log L_0 + t·log ρ_max at every logged step above the floor, ρ_max the "
        "largest certificate bound (1 − ηλ_min)² of the run; fitted rate and R² described",
        "every step of every run (no sampling: one float64 run per β)",
    )
    if missing := claims.missing(claim, workdir, SUMMARY_FILE):
        return missing
    runs = claims.read_json(wd.path(workdir) / SUMMARY_FILE)
    dtype = claims.read_json(wd.path(workdir) / CONFIG_FILE)["model"]["dtype"]
    history = read_metrics(workdir)
    values, held = [], []
    for run in runs:
        steps, losses = series(history, run["run"], "loss")
        floor = fit_floor(dtype) * losses[0]
        above = losses > floor
        checks = [line for line in history if line["run"] == run["run"] and "ntk/bound" in line]
        bounds = [line["ntk/bound"] for line in checks if line["loss"] > floor]
        if not bounds:
            return dataclasses.replace(claim, note=f"run {run['run']} has no certificate checks")
        rho_max = max(bounds)
        envelope = np.log(losses[0]) + steps[above] * np.log(rho_max)
        ok = bool(np.all(np.log(losses[above]) <= envelope + 1e-12)) and rho_max < 1
        held.append(ok)
        values.append(
            f"β={run['beta_attn']:g}: ρ_max = {rho_max:.5f}, bound "
            f"{'held' if ok else 'broken'} at {int(above.sum())} steps (fitted ρ = "
            f"{run['rate']:.5f}, R² {run['rate_r2']:.4f})"
        )
    return dataclasses.replace(claim, value="; ".join(values), verdict=claims.verdict(all(held)))


def certificate(workdir) -> Claim:
    """The certificate claim: with a smooth activation and η ≤ 1/λ_max(K) at init, every check
    above the fit floor has L_{t+1}/L_t ≤ bound."""
    claim = Claim(
        "certificate (smooth activation, η ≤ 1/λ_max)",
        "fraction of checks where L_{t+1}/L_t ≤ (1 − ηλ_min)² bound",
        "100 % each run",
    )
    if missing := claims.missing(claim, workdir, SUMMARY_FILE):
        return missing
    runs = claims.read_json(wd.path(workdir) / SUMMARY_FILE)
    config = claims.read_json(wd.path(workdir) / CONFIG_FILE)
    activation = config["model"]["transformer"]["activation"]
    if not all("certificate_hold_fraction" in r for r in runs):
        return dataclasses.replace(claim, note="a run has no certificate checks logged")
    value = ", ".join(
        f"β={r['beta_attn']:g}: {r['certificate_hold_fraction']:.0%} of {r['certificate_checks']}"
        for r in runs
    )
    lr_ok = _lr_below_one_over_lambda_max(workdir)
    ok = all(r["certificate_hold_fraction"] == 1.0 for r in runs)
    rule = config["optim"].get("lr_rule") == "lambda_max"
    how = f", by construction (η = {config['optim']['lr_factor']:g}/λ_max)" if rule else ""
    note = f"activation {activation}; η·λ_max(K) at init ≤ 1: {lr_ok}{how}"
    note += _margins(read_metrics(workdir), runs, config["model"].get("dtype", "float32"))
    if activation == "relu" or not lr_ok:
        return dataclasses.replace(claim, value=value, note=note + " (outside the claim's premise)")
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


def _margins(history: list[dict], runs: list[dict], dtype: str) -> str:
    """'; smallest margin ...: m; largest η·λ_max(K) ...: x' over every run's checks above the
    fit floor (the checks the hold fraction counts), or '' without any."""
    margins, products = [], []
    for run in runs:
        lines = [line for line in history if line["run"] == run.get("run", 0)]
        for line in certificate_checks(lines, fit_floor(dtype)):
            margins.append(1 - line["contraction"] / line["ntk/bound"])
            products.append(2 * line["lr"] / line["ntk/stable_lr"])
    if not margins:
        return ""
    return (
        f"; smallest margin 1 − (L_{{t+1}}/L_t)/bound over the checks: {min(margins):.2g}; "
        f"largest η·λ_max(K) over the checks: {max(products):.3g}"
    )


def _lr_below_one_over_lambda_max(workdir) -> bool:
    """η ≤ 1/(λ_max(K)·loss_scale) at step 0 for every run, i.e. η ≤ ntk/stable_lr / 2 (the loop's
    own loss scale); False when a run has no kernel at step 0."""
    first = [line for line in read_metrics(workdir) if line["step"] == 0]
    return bool(first) and all(
        "ntk/stable_lr" in line and line["lr"] <= line["ntk/stable_lr"] / 2 * (1 + 1e-9)
        for line in first
    )


_FILES = (SUMMARY_FILE, "beta_table.csv", "training.png", "loss_by_beta.png", "sigma_by_beta.png")
EXPERIMENTS = (
    Experiment(
        "theory",
        "Theory regime, ReLU, float64",
        "theory.py",
        scale_variants("float64,tiny", "float64", "float64"),
        typical_seconds={"small": 8},
        claims=(ClaimCheck(1, linear_convergence), ClaimCheck(1.1, linear_convergence_bound)),
        files=_FILES,
    ),
    Experiment(
        "theory_softplus",
        "Theory regime, softplus (smooth: Assumption 1), float64",
        "theory.py",
        scale_variants("float64,softplus,tiny", "float64,softplus", "float64,softplus"),
        typical_seconds={"small": 8},
        claims=(ClaimCheck(3.5, certificate),),
        files=_FILES,
    ),
)
