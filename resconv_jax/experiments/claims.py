"""The claims table of REPORT.md: one row per claim of docs/protocol.md, read from the files that
each experiment wrote into its run directory, held to the protocol's threshold.

Every function takes the experiment's run directory (or None when it was not run) and returns a
`Claim`; a missing directory or file gives the verdict "not run" with the reason, never a guess.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math

from resconv_jax.experiments import descent
from resconv_jax.runtime import workdir as wd

HOLDS, FAILS, NOT_RUN = "holds", "fails", "not run"


@dataclasses.dataclass
class Claim:
    """One row of the claims table."""

    claim: str
    measure: str
    threshold: str
    value: str = "-"
    verdict: str = NOT_RUN
    note: str = ""


def _read_csv(path) -> list[dict]:
    with wd.path(path).open() as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _read_json(path):
    return json.loads(wd.path(path).read_text())


def _missing(claim: Claim, workdir, name: str) -> Claim | None:
    """`claim` marked not run when `workdir` or its file `name` is absent, else None."""
    if workdir is None:
        return dataclasses.replace(claim, note="experiment not run")
    if not (wd.path(workdir) / name).exists():
        return dataclasses.replace(claim, note=f"{name} missing in {workdir}")
    return None


def _verdict(ok: bool) -> str:
    return HOLDS if ok else FAILS


def linear_convergence(workdir, threshold: float = 0.99) -> Claim:
    """Claim 1: R² of the log-loss fit ≥ threshold for every run (theory regime, float64)."""
    claim = Claim(
        "1. linear convergence (theory regime, each β, float64)",
        "R² of the log-loss fit above the floor, per β",
        f"≥ {threshold:g} each",
    )
    if missing := _missing(claim, workdir, "summary.json"):
        return missing
    runs = _read_json(wd.path(workdir) / "summary.json")
    value = ", ".join(f"β={r['beta_attn']:g}: {r['rate_r2']:.4f}" for r in runs)
    ok = all(r["rate_r2"] >= threshold for r in runs)
    return dataclasses.replace(claim, value=value, verdict=_verdict(ok))


def rate_vs_conditioning(workdir, threshold: float = 0.9, min_ratio: float = 2.0) -> Claim:
    """Claim 2: Spearman ρ(1 − rate, σ_min²/σ_max²(Z) at init) ≥ threshold for d ≥ 2·P·M."""
    claim = Claim(
        "2. rate governed by σ_min/σ_max of Z",
        "Spearman ρ(1 − rate, σ_min²/σ_max²(Z) at init) over β × seeds, per width",
        f"≥ {threshold:g} at d ≥ {min_ratio:g}·P·M (d = P·M reported)",
    )
    if missing := _missing(claim, workdir, "conditioning_table.csv"):
        return missing
    table = _read_csv(wd.path(workdir) / "conditioning_table.csv")
    value = "; ".join(
        f"d={r['dim']} ({r['dim_over_pm']:g}·P·M): ρ={r['rho_z_ratio_sq_init']:.3f}" for r in table
    )
    held = [r for r in table if r["dim_over_pm"] >= min_ratio]
    if not held:
        return dataclasses.replace(claim, value=value, note=f"no width d ≥ {min_ratio:g}·P·M")
    ok = all(r["rho_z_ratio_sq_init"] >= threshold for r in held)
    rho_k = ", ".join(f"d={r['dim']}: {r['rho_eta_lambda_min_init']:.3f}" for r in table)
    note = f"ρ against η·λ_min(K): {rho_k}"
    return dataclasses.replace(claim, value=value, verdict=_verdict(ok), note=note)


def residual_conditioning(workdir, d_qk: int = 4096, attn_max=1e-4, z_min=0.1) -> Claim:
    """Claim 3: at d_QK = 4096 (variance 1/d_QK) σ_min/σ_max of Attn(X) stays < attn_max and
    that of Attn(X) + X > z_min for every seed (per-sample ratios, mean over samples)."""
    claim = Claim(
        "3. residual fixes conditioning at init",
        f"σ_min/σ_max of Attn(X) vs Attn(X) + X at d_QK = {d_qk} (every seed)",
        f"< {attn_max:g} vs > {z_min:g}",
    )
    if missing := _missing(claim, workdir, "rank_collapse.csv"):
        return missing
    rows = [
        r
        for r in _read_csv(wd.path(workdir) / "rank_collapse.csv")
        if r["qk_init"] == "1/d_qk" and r["d_qk"] == d_qk
    ]
    if not rows:
        return dataclasses.replace(claim, note=f"no d_QK = {d_qk} row with qk_init 1/d_qk")
    attn_worst, z_worst = rows[0]["attn_ratio_p_mean/max"], rows[0]["z_ratio_p_mean/min"]
    value = f"Attn(X) ≤ {attn_worst:.3g}, Attn(X) + X ≥ {z_worst:.3g}"
    return dataclasses.replace(
        claim, value=value, verdict=_verdict(attn_worst < attn_max and z_worst > z_min)
    )


def certificate(workdir) -> Claim:
    """The certificate claim: with a smooth activation and η ≤ 1/λ_max(K) at init, every check
    above the fit floor has L_{t+1}/L_t ≤ bound."""
    claim = Claim(
        "certificate (smooth activation, η ≤ 1/λ_max)",
        "fraction of checks where L_{t+1}/L_t ≤ (1 − ηλ_min)² bound",
        "100 % each run",
    )
    if missing := _missing(claim, workdir, "summary.json"):
        return missing
    runs = _read_json(wd.path(workdir) / "summary.json")
    config = _read_json(wd.path(workdir) / "config.json")
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
    if activation == "relu" or not lr_ok:
        return dataclasses.replace(claim, value=value, note=note + " (outside the claim's premise)")
    return dataclasses.replace(claim, value=value, verdict=_verdict(ok), note=note)


def _lr_below_one_over_lambda_max(workdir) -> bool:
    """η ≤ 1/(λ_max(K)·loss_scale) at step 0 for every run, i.e. η ≤ ntk/stable_lr / 2 (the loop's
    own loss scale); False when a run has no kernel at step 0."""
    from resconv_jax.runtime.metrics import read_metrics

    first = [line for line in read_metrics(workdir) if line["step"] == 0]
    return bool(first) and all(
        "ntk/stable_lr" in line and line["lr"] <= line["ntk/stable_lr"] / 2 * (1 + 1e-9)
        for line in first
    )


def multilayer(workdir, threshold: float = 0.99, small_branches: bool = False) -> Claim:
    """Claim 4: R² of the log-loss fit ≥ threshold for every run of every depth; with
    `small_branches`, the row of configs/depth.py:branches (β = 1, float64)."""
    claim = Claim(
        "4. multi-layer linear convergence",
        "min R² per depth L (over β, seeds)",
        f"≥ {threshold:g} each",
    )
    if small_branches:
        claim = Claim(
            "4b. multi-layer, small residual branches (added after 4 failed)",
            "min R² per depth L (β = 1, seeds; W_V, W_1, W_2 at 0.3×, float64)",
            f"≥ {threshold:g} each",
        )
    if missing := _missing(claim, workdir, "depth_runs.csv"):
        return missing
    rows = _read_csv(wd.path(workdir) / "depth_runs.csv")
    unfit = [r["run"] for r in rows if not math.isfinite(r["rate_r2"])]
    if unfit:
        note = f"runs {unfit} have no rate fit (fewer than 3 logged losses above the floor)"
        return dataclasses.replace(claim, verdict=FAILS, note=note)
    depths = sorted({r["num_layers"] for r in rows})
    worst = {L: min(r["rate_r2"] for r in rows if r["num_layers"] == L) for L in depths}
    value = ", ".join(f"L={L}: {r2:.3f}" for L, r2 in worst.items())
    per_beta = {
        (L, b): min(r["rate_r2"] for r in rows if (r["num_layers"], r["beta_attn"]) == (L, b))
        for L in depths
        for b in sorted({r["beta_attn"] for r in rows})
    }
    note = "min R² per (L, β): " + ", ".join(
        f"{L}/{b:g}: {v:.3f}" for (L, b), v in per_beta.items()
    )
    ok = all(r2 >= threshold for r2 in worst.values())
    return dataclasses.replace(claim, value=value, verdict=_verdict(ok), note=note)


def jena_descent(workdir, alpha: float = 0.05) -> Claim:
    """Claim 5a: Kendall τ(β, steps until L_t ≤ 0.2·L_0) < 0 with two-sided p < alpha."""
    claim = Claim(
        "5a. Jena: larger β descends faster",
        f"Kendall τ(β, steps until L_t ≤ {descent.HEADLINE:g}·L_0), all runs",
        f"< 0 with p < {alpha:g}",
    )
    if missing := _missing(claim, workdir, "descent_table.csv"):
        return missing
    rows = _read_csv(wd.path(workdir) / "descent_table.csv")
    o = descent.ordering(rows)
    value = f"τ = {o['tau']:+.3f}, p = {o['p_value']:.2g} ({o['runs']} runs)"
    seeds = ", ".join(f"seed {s}: {t:+.2f}" for s, t in o["per_seed_tau"].items())
    ok = o["tau"] < 0 and o["p_value"] < alpha
    if math.isnan(o["tau"]):
        return dataclasses.replace(claim, value=value, note="too few runs reached the level")
    others = "; ".join(
        f"at {f:g}·L_0: τ = {other['tau']:+.3f}, p = {other['p_value']:.2g}"
        for f in descent.FRACTIONS
        if f != descent.HEADLINE
        for other in [descent.ordering(rows, f)]
    )
    note = (
        f"per seed {seeds}; {o['runs'] - o['reached']} of {o['runs']} runs did not reach the "
        f"level within {rows[0]['window_steps']} steps (ranked slowest); {others}"
    )
    return dataclasses.replace(claim, value=value, verdict=_verdict(ok), note=note)


def sst2_ordering(workdir, label: str = "") -> Claim:
    """Claim 5b: at every L the residual run's (β = 1) final training error is below the plain
    one's (β = 0), and only with the residual does the error improve with depth (error at the
    largest L below that at the smallest). A random-init substitute says so in its verdict."""
    claim = Claim(
        "5b. SST-2: residual lowers training error, depth helps only with it",
        "final training error per (L, β)",
        "β=1 < β=0 at each L; error(L_max) < error(L_min) at β=1 only",
    )
    if missing := _missing(claim, workdir, "accuracy_table.csv"):
        return missing
    rows = _read_csv(wd.path(workdir) / "accuracy_table.csv")
    error = {
        (r["num_layers"], float(r["beta_attn"])): r["final_error"]
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
        f"{label}; β=1 lower at every L: {lower}; deeper is better at β=1: {helps[1.0]}, "
        f"at β=0: {helps[0.0]}"
    ).lstrip("; ")
    verdict = _verdict(ok)
    if label.startswith("random-init"):
        verdict += " (random-init substitute, not the claim's model)"
    return dataclasses.replace(claim, value=value + " (β=0 vs β=1)", verdict=verdict, note=note)


def format_claims_table(claims: list[Claim]) -> str:
    """The claims as a Markdown table."""
    lines = [
        "| claim | measure | threshold | measured | verdict | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in claims:
        cells = (c.claim, c.measure, c.threshold, c.value, f"**{c.verdict}**", c.note)
        cells = (cell.replace("|", "\\|").replace("\n", " ") for cell in cells)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
