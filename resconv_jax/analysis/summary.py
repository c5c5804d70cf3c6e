"""Per-run summaries of a finished run, computed from its metrics lines (so resumed runs agree)."""

from __future__ import annotations

import math

import numpy as np

from resconv_jax.analysis.linalg import eps_relative_to_float32
from resconv_jax.analysis.theory import fit_linear_rate

# In float32, below this fraction of the initial loss the rounding of the residuals (~eps·|F|)
# moves L_{t+1}/L_t by more than ~√eps, which bends the log-linear fit and the certificate checks.
FIT_FLOOR = 1e-7
# R² of the log-loss fit from which a run descends linearly (claim 1's threshold).
LINEAR_FIT_R2 = 0.99


def fit_floor(dtype: str) -> float:
    """FIT_FLOOR for a model trained in `dtype`, scaled by its epsilon (~1.9e-16 for float64)."""
    return FIT_FLOOR * eps_relative_to_float32(dtype)


def fit_rate(steps, losses, floor: float = FIT_FLOOR) -> tuple[float, float]:
    """(ρ, R²) of log L = a + t·log ρ over the logged steps with L > floor × L_0.

    steps, losses: (T,) in step order. NaN, NaN when there are none."""
    steps, losses = np.asarray(steps, float), np.asarray(losses, float)
    if not losses.size:
        return math.nan, math.nan
    keep = losses > floor * losses[0]
    return fit_linear_rate(steps[keep], losses[keep])


def series(history: list[dict], run: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values), each (T,): metric `key` of one run over the T metrics lines that have it."""
    lines = [line for line in history if line["run"] == run and key in line]
    values = np.array([float(line[key]) for line in lines])
    return np.array([line["step"] for line in lines]), values


def certificate_checks(lines: list[dict], floor: float) -> list[dict]:
    """The tangent-kernel checks of one run's metrics lines (in step order) that count: those
    whose loss is above `floor` × the initial loss (below it, L_{t+1}/L_t is rounding)."""
    losses = [line["loss"] for line in lines if "loss" in line]
    if not losses:
        return []
    return [line for line in lines if "ntk/holds" in line and line["loss"] > floor * losses[0]]


def lr_swept(lines: list[dict]) -> bool:
    """Whether `lines` (metrics lines, or one row per run) hold runs that differ only in lr: a
    sweep.lr axis, to be reported per lr. Per-run step sizes (optim.lr_rule="lambda_max") give
    each (L, d, seed, β_a, β_f) one lr, so they are not a sweep."""
    lrs: dict[tuple, set] = {}
    for line in lines:
        cell = tuple(line.get(k) for k in ("num_layers", "dim", "seed", "beta_attn", "beta_ffn"))
        lrs.setdefault(cell, set()).add(line.get("lr"))
    return any(len(values) > 1 for values in lrs.values())


def run_summaries(
    history: list[dict], settings: list[dict], floor: float = FIT_FLOOR
) -> list[dict]:
    """One dict per run: settings, initial/final loss, fitted linear rate, and where measured,
    σ_min²/σ_max² of Z (layer 0) at the first and last probed steps and the certificate's hold
    fraction (over the checks whose loss is above `floor` × the initial loss: `fit_floor`)."""
    summaries = []
    for run_settings in settings:
        run = run_settings["run"]
        lines = [line for line in history if line["run"] == run]
        steps, losses = series(lines, run, "loss")
        rate, r2 = fit_rate(steps, losses, floor)
        summary = {**run_settings, "initial_loss": losses[0], "final_loss": losses[-1]}
        summary |= {"final_step": lines[-1]["step"], "rate": rate, "rate_r2": r2}
        if "val_loss" in lines[-1]:
            summary["final_val_loss"] = float(lines[-1]["val_loss"])
        sigma_min, sigma_max = (
            series(lines, run, f"layer0/z/sigma_{k}")[1] for k in ("min", "max")
        )
        if sigma_min.size:
            ratio = (sigma_min / sigma_max) ** 2
            summary |= {"z_sigma_ratio_sq_start": ratio[0], "z_sigma_ratio_sq_end": ratio[-1]}
        holds = series(certificate_checks(lines, floor), run, "ntk/holds")[1]
        if holds.size:
            summary |= {
                "certificate_hold_fraction": float(holds.mean()),
                "certificate_checks": holds.size,
            }
        summaries.append(
            {k: v.item() if isinstance(v, np.generic) else v for k, v in summary.items()}
        )
    return summaries


def format_summary(summary: dict) -> str:
    """'run 0 (beta_attn=0, beta_ffn=0, seed=0, lr=0.01): final loss 1.2e-05 at step 2000, ...'"""
    s = summary
    settings = f"beta_attn={s['beta_attn']:g}, beta_ffn={s['beta_ffn']:g}, seed={s['seed']}"
    if "dim" in s:
        settings = f"d={s['dim']}, {settings}"
    if "num_layers" in s:
        settings = f"L={s['num_layers']}, {settings}"
    text = (
        f"run {s['run']} ({settings}, lr={s['lr']:.4g}): final loss {s['final_loss']:.3e} "
        f"at step {s['final_step']} (initial {s['initial_loss']:.3e}), "
        f"linear rate {s['rate']:.5f}/step (R² {s['rate_r2']:.4f})"
    )
    if "z_sigma_ratio_sq_start" in s:
        start, end = s["z_sigma_ratio_sq_start"], s["z_sigma_ratio_sq_end"]
        text += f", σ_min²/σ_max²(Z) {start:.3g} -> {end:.3g}"
    if "certificate_hold_fraction" in s:
        text += (
            f", certificate held {s['certificate_hold_fraction']:.0%} "
            f"of {s['certificate_checks']} checks"
        )
    return text
