"""Per-run summaries of a finished run, computed from its metrics lines (so resumed runs agree)."""

from __future__ import annotations

from resconv_jax.theory import fit_linear_rate

# Losses below this fraction of the initial loss sit at float32's floor and bend the log-linear fit.
FIT_FLOOR = 1e-7


def run_summaries(history: list[dict], settings: list[dict]) -> list[dict]:
    """One dict per run: its settings, initial and final loss, and the fitted linear rate.

    The rate ρ is the per-step factor of a least-squares fit of log L against step over the logged
    steps whose loss is above FIT_FLOOR × the initial loss; R² says how straight the line is.
    """
    summaries = []
    for run_settings in settings:
        lines = [line for line in history if line["run"] == run_settings["run"]]
        steps = [line["step"] for line in lines]
        losses = [float(line["loss"]) for line in lines]
        initial = losses[0] if losses else float("nan")
        kept = [(s, v) for s, v in zip(steps, losses, strict=True) if v > FIT_FLOOR * initial]
        rate, r2 = fit_linear_rate([s for s, _ in kept], [v for _, v in kept])
        summary = {**run_settings, "initial_loss": initial, "final_loss": losses[-1]}
        summary |= {"final_step": steps[-1], "rate": rate, "rate_r2": r2}
        if "val_loss" in lines[-1]:
            summary["final_val_loss"] = float(lines[-1]["val_loss"])
        summaries.append(summary)
    return summaries


def format_summary(summary: dict) -> str:
    """'run 0 (beta_attn=0, beta_ffn=0, seed=0, lr=0.01): final loss 1.2e-05 at step 2000, ...'"""
    s = summary
    settings = f"beta_attn={s['beta_attn']:g}, beta_ffn={s['beta_ffn']:g}, seed={s['seed']}"
    return (
        f"run {s['run']} ({settings}, lr={s['lr']:g}): final loss {s['final_loss']:.3e} "
        f"at step {s['final_step']} (initial {s['initial_loss']:.3e}), "
        f"linear rate {s['rate']:.5f}/step (R² {s['rate_r2']:.4f})"
    )
