"""Early descent at single-step resolution, relative to each run's own start (claim 5a).

The same initial weights give each β a different initial function (and loss), so an absolute loss
threshold mixes where a run starts with how fast it descends. Here speed is the number of steps
until L_t ≤ f·L_0, read from the per-step losses that runs log over their first
`train.step_losses_until` steps ("step_losses" on each metrics line), per run and seed; the
ordering by β is Kendall's τ-b between β_a and those steps over all runs (negative τ: larger β
needs fewer steps), with the two-sided p-value of a permutation test that shuffles β within each
seed; a run that does not reach the level within the window ranks as the slowest. Runs that set
β_a ≠ β_f, or that differ in L, d or lr as well, get the table but no ordering, and claims 5a and
5a″ are not run on them (`not_comparable`).

Files: descent_table.csv (per run), descent_by_beta.png (L_t/L_0 over the early window; steps to
f·L_0 against β per seed).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from resconv_jax.analysis import stats
from resconv_jax.analysis.stats import kendall, stratified_p_value
from resconv_jax.analysis.summary import lr_swept
from resconv_jax.experiments import claims
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.figures import DPI, plt, save_figure
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import write_csv

FRACTIONS = (0.5, 0.2)  # f in "steps until L_t <= f·L_0"; HEADLINE is the one the claim uses
HEADLINE = 0.2
TABLE_FILE = "descent_table.csv"


def early_losses(history: list[dict], run: int) -> np.ndarray:
    """(T,) the training loss of `run` at steps 0 … T−1, from the lines that hold "step_losses"
    (contiguous from step 0; the window ends at the first gap)."""
    lines = sorted(
        (line for line in history if line["run"] == run and "step_losses" in line),
        key=lambda line: line["step"],
    )
    losses: list[float] = []
    for line in lines:
        if line["step"] != len(losses):
            break
        losses.extend(float(v) for v in line["step_losses"])
    return np.array(losses)


def steps_to_fraction(losses: np.ndarray, fraction: float) -> float:
    """First step t with L_t ≤ fraction·L_0 (NaN if the window never gets there)."""
    below = np.flatnonzero(losses <= fraction * losses[0]) if losses.size else np.array([])
    return float(below[0]) if below.size else math.nan


def descent_rows(history: list[dict]) -> list[dict]:
    """One row per run: settings, L_0, the window length and steps to f·L_0 for each f."""
    rows = []
    for run in sorted({line["run"] for line in history}):
        first = next(line for line in history if line["run"] == run)
        losses = early_losses(history, run)
        row = {k: first[k] for k in ("run", "seed", "beta_attn", "beta_ffn")}
        row |= {k: first[k] for k in ("num_layers", "dim", "lr") if k in first}
        row |= {"initial_loss": float(losses[0]) if losses.size else math.nan}
        row["window_steps"] = int(losses.size)
        for f in FRACTIONS:
            row[f"steps_to_{f:g}"] = steps_to_fraction(losses, f)
        rows.append(row)
    return rows


def not_comparable(rows: list[dict]) -> str | None:
    """Why the β ordering is not defined on `rows` (runs that set β_a ≠ β_f, or that differ in
    L, d or lr as well as in β and seed), or None: τ compares one β for both residuals within
    seeds, so such runs would be merged under their β_a."""
    if untied := sorted(
        {(r["beta_attn"], r["beta_ffn"]) for r in rows if r["beta_attn"] != r["beta_ffn"]}
    ):
        pairs = ", ".join(f"β_a={a:g} β_f={f:g}" for a, f in untied)
        return f"runs set β_a ≠ β_f ({pairs}); the ordering is over one β for both residuals"
    differ = [
        f"{name} ({', '.join(f'{v:g}' for v in values)})"
        for key, name in (("num_layers", "L"), ("dim", "d"), ("lr", "lr"))
        if len(values := sorted({r[key] for r in rows if r.get(key) is not None})) > 1
        and (key != "lr" or lr_swept(rows))
    ]
    if differ:
        return (
            f"the runs differ in {' and '.join(differ)} as well as in β and seed; the ordering "
            "compares β within one setting"
        )
    return None


def _censored_steps(row: dict, key: str, window: int) -> float:
    """Steps to the level, or `window` (the longest window of the sweep) for a run that did not
    get there within its window: it is slower than every run that did, so it ranks last, tied
    with the others that did not."""
    return row[key] if np.isfinite(row[key]) else float(window)


def _ranked_steps(rows: list[dict], key: str) -> tuple[list[dict], list[float], int]:
    """The rows with an early window, each one's steps to the level `key` (a run that did not
    get there counts as the sweep's longest window: `_censored_steps`), and that window."""
    rows = [r for r in rows if r["window_steps"] > 0]
    window = max((r["window_steps"] for r in rows), default=0)
    return rows, [_censored_steps(r, key, window) for r in rows], window


def ordering(rows: list[dict], fraction: float = HEADLINE) -> dict:
    """Kendall's τ-b between β_a and steps to `fraction`·L_0 over the runs with an early window,
    and per seed; a run that does not reach the level counts as the slowest (`_censored_steps`).
    p_value: the stratified permutation test (`stratified_p_value`); the pooled τ's normal
    p-value would treat runs that share their initial weights as independent."""
    key = f"steps_to_{fraction:g}"
    rows, steps, window = _ranked_steps(rows, key)
    betas, seeds = [r["beta_attn"] for r in rows], [r["seed"] for r in rows]
    tau, _ = kendall(betas, steps)
    p = stratified_p_value(betas, steps, seeds) if np.isfinite(tau) else math.nan
    per_seed = {}
    for seed in sorted(set(seeds)):
        same = [(b, s) for b, s, sd in zip(betas, steps, seeds, strict=True) if sd == seed]
        per_seed[seed] = kendall(*zip(*same, strict=True))[0]
    reached = sum(np.isfinite(r[key]) for r in rows)
    return {"fraction": fraction, "tau": tau, "p_value": p, "per_seed_tau": per_seed,
            "runs": len(rows), "reached": int(reached), "window": window}  # fmt: skip


def format_ordering(rows: list[dict]) -> str:
    """The printed summary: τ and p per fraction, the per-seed τ, and steps per β and seed."""
    lines = []
    for f in FRACTIONS:
        o = ordering(rows, f)
        seeds = ", ".join(f"seed {s}: {t:+.2f}" for s, t in o["per_seed_tau"].items())
        lines.append(
            f"steps until L_t <= {f:g}·L_0: Kendall τ(β, steps) = {o['tau']:+.3f} "
            f"(two-sided p = {o['p_value']:.2g}; {o['reached']} of {o['runs']} runs reached it "
            f"in the window, the others count as slowest); {seeds}"
        )
    key = f"steps_to_{HEADLINE:g}"
    for seed in sorted({r["seed"] for r in rows}):
        same = sorted((r for r in rows if r["seed"] == seed), key=lambda r: r["beta_attn"])
        steps = " ".join(f"β={r['beta_attn']:g}:{r[key]:.0f}" for r in same)
        lines.append(f"  seed {seed}, steps to {HEADLINE:g}·L_0: {steps}")
    return "\n".join(lines)


def plot_descent(history: list[dict], rows: list[dict], path) -> None:
    """L_t/L_0 per run over the early window (colour: β; line style: seed), and steps to
    HEADLINE·L_0 against β per seed, with Kendall's τ."""
    betas = sorted({r["beta_attn"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    colors = dict(zip(betas, plt.cm.viridis(np.linspace(0, 0.9, len(betas))), strict=True))
    styles = dict(zip(seeds, ["-", "--", ":", "-."] * (len(seeds) // 4 + 1), strict=False))
    fig, (ax_curve, ax_steps) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=DPI)
    for row in rows:
        losses = early_losses(history, row["run"])
        label = f"β={row['beta_attn']:g}" if row["seed"] == seeds[0] else None
        ax_curve.semilogy(
            losses / losses[0], styles[row["seed"]], color=colors[row["beta_attn"]], label=label
        )
    for f in FRACTIONS:
        ax_curve.axhline(f, color="0.4", linewidth=0.8, linestyle=(0, (2, 2)))
        # In the right margin, beside the line: inside the axes the curves cross the label.
        ax_curve.annotate(f"{f:g}·L_0", (1.01, f), xycoords=("axes fraction", "data"),
                          fontsize=7, va="center", annotation_clip=False)  # fmt: skip
    style_note = ", ".join(f"{styles[s]} seed {s}" for s in seeds)
    if len(seeds) > 4:  # the styles repeat: name the cycle, not every seed (the title must fit)
        style_note = f"-, --, :, -. cycling over {len(seeds)} seeds {seeds[0]}–{seeds[-1]}"
    ax_curve.set(
        xlabel="step",
        ylabel="L_t / L_0 (each run relative to its own start)",
        title=f"Early descent per run (line style: {style_note})",
    )
    ax_curve.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(betas))
    key = f"steps_to_{HEADLINE:g}"
    markers = dict(zip(seeds, "osd^v<>" * (len(seeds) // 7 + 1), strict=False))
    for seed in seeds:
        same = sorted((r for r in rows if r["seed"] == seed), key=lambda r: r["beta_attn"])
        x = [r["beta_attn"] for r in same]
        y = [_censored_steps(r, key, max(r["window_steps"] for r in rows)) for r in same]
        (line,) = ax_steps.plot(x, y, marker=markers[seed], label=f"seed {seed}")
        never = [(b, s) for b, s, r in zip(x, y, same, strict=True) if not np.isfinite(r[key])]
        if never:
            hollow = {"markerfacecolor": "white", "markersize": 10, "color": line.get_color()}
            ax_steps.plot(*zip(*never, strict=True), marker=markers[seed], ls="none", **hollow)
    window = max(r["window_steps"] for r in rows)
    ax_steps.axhline(window, color="0.6", linewidth=0.8, linestyle=":")
    ax_steps.set_ylim(top=window * 1.12)  # room for the label, above the open markers
    ax_steps.annotate(f"not reached in {window} steps (open markers)", (0.01, window),
                      xycoords=("axes fraction", "data"), xytext=(0, 6), textcoords="offset points",
                      fontsize=7, va="bottom")  # fmt: skip
    o = ordering(rows)
    ax_steps.set(
        xlabel="β (both residuals)",
        ylabel=f"steps until L_t ≤ {HEADLINE:g}·L_0",
        title=f"Kendall τ(β, steps) = {o['tau']:+.2f} (two-sided p = {o['p_value']:.2g})",
    )
    ax_steps.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # up to 10 seeds
    fig.tight_layout()
    save_figure(fig, path)


def write_descent_report(workdir, history: list[dict]) -> str:
    """descent_table.csv and descent_by_beta.png in `workdir`; the printed summary."""
    workdir = wd.path(workdir)
    rows = descent_rows(history)
    write_csv(workdir / TABLE_FILE, rows)
    if reason := not_comparable(rows):
        return f"early descent: per run in {TABLE_FILE}; no ordering by β: {reason}"
    if len({r["beta_attn"] for r in rows}) > 1:
        plot_descent(history, rows, workdir / "descent_by_beta.png")
    return format_ordering(rows)


def _as_replication(claim: Claim, title: str) -> Claim:
    """`claim` as a row of the replication runs (5a′, docs/protocol.md): `title`, and the
    replication's data and seeds named in its measure."""
    measure = claim.measure + " (P = 2041 windows of 2009–2016, seeds 3–12)"
    return dataclasses.replace(claim, claim=title, measure=measure)


def jena_descent(workdir, alpha: float = 0.05, replication: bool = False) -> Claim:
    """Claim 5a: Kendall τ(β, steps until L_t ≤ 0.2·L_0) < 0 with two-sided p < alpha; with
    `replication`, row 5a′ (docs/protocol.md: the same on every window of 2009-2016, seeds
    3-12)."""
    claim = Claim(
        "5a. Jena: larger β descends faster",
        f"Kendall τ(β, steps until L_t ≤ {HEADLINE:g}·L_0), all runs",
        f"< 0 with two-sided p < {alpha:g}",
    )
    if replication:
        claim = _as_replication(
            claim, "5a′. Jena replication (rule fixed before it ran): every window, fresh seeds"
        )
    if missing := claims.missing(claim, workdir, TABLE_FILE):
        return missing
    rows = claims.read_csv(wd.path(workdir) / TABLE_FILE)
    if reason := not_comparable(rows):
        return dataclasses.replace(claim, note=reason)
    o = ordering(rows)
    value = f"τ = {o['tau']:+.3f}, two-sided p = {o['p_value']:.2g} ({o['runs']} runs)"
    seeds = ", ".join(f"seed {s}: {t:+.2f}" for s, t in o["per_seed_tau"].items())
    ok = o["tau"] < 0 and o["p_value"] < alpha
    if math.isnan(o["tau"]):
        return dataclasses.replace(claim, value=value, note="too few runs reached the level")
    others = "; ".join(
        f"at {f:g}·L_0: τ = {other['tau']:+.3f}, two-sided p = {other['p_value']:.2g}"
        for f in FRACTIONS
        if f != HEADLINE
        for other in [ordering(rows, f)]
    )
    note = (
        f"per seed {seeds}; {o['runs'] - o['reached']} of {o['runs']} runs did not reach the "
        f"level within {rows[0]['window_steps']} steps (ranked slowest); {others}"
    )
    return dataclasses.replace(claim, value=value, verdict=claims.verdict(ok), note=note)


def jena_descent_replication(workdir) -> Claim:
    """Row 5a′: `jena_descent` of the replication runs."""
    return jena_descent(workdir, replication=True)


def fixed_start_ordering(rows: list[dict], fraction: float = HEADLINE, power: bool = True) -> dict:
    """The second reading of 5a (docs/protocol.md, row 5a″): τ-b(β, steps to `fraction`·L_0)
    with its one-sided stratified permutation test (exact when feasible), Kendall's partial
    τ(β, steps | L_0) with its seed-bootstrap interval, and the power of the test."""
    rows, steps, _ = _ranked_steps(rows, f"steps_to_{fraction:g}")
    runs = [{"seed": r["seed"], "beta": r["beta_attn"], "l0": r["initial_loss"], "steps": n}
            for r, n in zip(rows, steps, strict=True)]  # fmt: skip

    def columns(sample):
        return (np.array([r[k] for r in sample], float) for k in ("beta", "steps", "l0", "seed"))

    def test(sample, **draws):
        beta, steps, _, seeds = columns(sample)
        return stats.permutation_test(stats.pooled_tau, beta, steps, seeds, alternative="less",
                                      **draws)  # fmt: skip

    def partial(sample):
        beta, steps, l0, _ = columns(sample)
        return stats.partial_tau(beta, steps, l0)

    def tau(sample):
        beta, steps, _, _ = columns(sample)
        return kendall(beta, steps)[0]

    result = test(runs)
    return {
        "fraction": fraction,
        "test": result,
        "tau_interval": stats.cluster_bootstrap(tau, runs, "seed"),
        "partial_tau": partial(runs),
        "partial_interval": stats.cluster_bootstrap(partial, runs, "seed"),
        "l0_tau": kendall([r["l0"] for r in runs], [r["steps"] for r in runs])[0],
        "power": stats.bootstrap_power(
            lambda sample: test(sample, max_exact=0, draws=stats.POWER_DRAWS).p_value, runs, "seed"
        )
        if power
        else math.nan,
        "runs": len(runs),
    }


def jena_descent_fixed_start(workdir, alpha: float = 0.05, replication: bool = False) -> Claim:
    """Row 5a″ (5a′″ with `replication`): larger β descends faster with L_0 held fixed
    (docs/protocol.md, the second reading)."""
    claim = Claim(
        "5a″. Jena: larger β descends faster, L_0 held fixed (second reading of 5a)",
        f"τ-b(β, steps until L_t ≤ {HEADLINE:g}·L_0), one-sided stratified p; partial τ | L_0 "
        "[95 % seed-bootstrap interval]; power",
        f"τ < 0 with p < {alpha:g} and partial τ < 0; undecided if its interval spans 0 or "
        "power < 0.8",
    )
    if replication:
        claim = _as_replication(
            claim, "5a′″. Jena replication, L_0 held fixed (second reading of 5a′)"
        )
    if missing := claims.missing(claim, workdir, TABLE_FILE):
        return missing
    rows = claims.read_csv(wd.path(workdir) / TABLE_FILE)
    if reason := not_comparable(rows):
        return dataclasses.replace(claim, note=reason)
    o = fixed_start_ordering(rows)
    if not np.isfinite(o["test"].observed):
        return dataclasses.replace(claim, note="too few runs reached the level")
    tau_interval, partial_interval = map(
        claims.interval_text, (o["tau_interval"], o["partial_interval"])
    )
    value = (
        f"τ = {o['test'].observed:+.3f} {tau_interval}, {o['test'].describe()}; "
        f"partial τ | L_0 = {o['partial_tau']:+.3f} {partial_interval}"
        f"{claims.against_text(o['test'], o['partial_interval'], 0.0, 'below')}; "
        f"power {o['power']:.2f} ({o['runs']} runs)"
    )
    ok = o["test"].observed < 0 and o["test"].p_value < alpha and o["partial_tau"] < 0
    alternative = fixed_start_ordering(rows, 0.5, power=False)
    note = (
        f"τ(L_0, steps) = {o['l0_tau']:+.3f}; the alternative at 0.5·L_0: τ = "
        f"{alternative['test'].observed:+.3f}, {alternative['test'].describe()}, partial τ | L_0 "
        f"= {alternative['partial_tau']:+.3f} "
        f"{claims.interval_text(alternative['partial_interval'])}"
    )
    verdict = claims.decided(ok, o["partial_interval"], 0.0, o["power"], claimed="below",
                             opposite_p=o["test"].p_opposite, alpha=alpha)  # fmt: skip
    return dataclasses.replace(claim, value=value, verdict=verdict, note=note)


def jena_descent_fixed_start_replication(workdir) -> Claim:
    """Row 5a′″: `jena_descent_fixed_start` of the replication runs."""
    return jena_descent_fixed_start(workdir, replication=True)


EXPERIMENTS = (
    Experiment(
        "jena",
        "Jena Climate β sweep",
        "jena.py",
        scale_variants(paper="full"),
        typical_seconds={"small": 13},
        claims=(ClaimCheck(5.1, jena_descent), ClaimCheck(5.11, jena_descent_fixed_start)),
        files=(TABLE_FILE, "descent_by_beta.png", "beta_table.csv", "loss_by_beta.png"),
    ),
    Experiment(
        "jena_replication",
        "Jena Climate β sweep, replication of 5a (every window of 2009–2016, seeds 3–12)",
        "jena.py",
        scale_variants("full,replication,tiny", "full,replication", "full,replication"),
        typical_seconds={"small": 155},
        claims=(
            ClaimCheck(5.15, jena_descent_replication),
            ClaimCheck(5.16, jena_descent_fixed_start_replication),
        ),
        files=(TABLE_FILE, "descent_by_beta.png", "beta_table.csv", "loss_by_beta.png"),
    ),
)
