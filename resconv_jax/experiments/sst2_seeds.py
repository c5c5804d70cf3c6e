"""Row 5b″ of the claims table: claim 5b (SST-2) tested with seeds (docs/protocol.md, the second
reading). The classification report writes one row per run to RUNS_FILE; this row reads it.

The residual part pairs the runs of one (L, seed), β = 0 against β = 1; the depth part pairs, at
each β, the runs of one seed at the smallest and the largest L. Both are one-sided sign-flip
permutation tests (`stats.permutation_test` with the pairs as strata), with seed-bootstrap
intervals; the row also says how many seeds per cell the residual part would need.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np

from resconv_jax.analysis import stats
from resconv_jax.analysis.summary import lr_swept, series
from resconv_jax.experiments import claims
from resconv_jax.experiments.claims import Claim
from resconv_jax.runtime import workdir as wd

RUNS_FILE = "run_errors.csv"
FINAL_ERROR = "final_error"
_Z_SUM = NormalDist().inv_cdf(0.95) + NormalDist().inv_cdf(0.8)  # one-sided 5 %, power 0.8
FEWEST_SEEDS = 5  # with fewer, no sign pattern of one cell's pairs reaches p < 0.05


def run_rows(history: list[dict], runs: list[dict]) -> list[dict]:
    """One row per run of `runs` (their first metrics lines) with β_a = β_f: its depth, β, seed
    (and lr when the runs differ in it) and final training error."""
    rows = []
    swept = lr_swept(runs)
    for run in runs:
        errors = series(history, run["run"], "error")[1]
        if errors.size and run["beta_attn"] == run["beta_ffn"]:
            rows.append({"num_layers": run.get("num_layers"), "beta": float(run["beta_attn"]),
                         "seed": run["seed"], FINAL_ERROR: float(errors[-1])}
                        | ({"lr": run["lr"]} if swept else {}))  # fmt: skip
    return rows


def _mean_difference(xs: np.ndarray, y: np.ndarray, strata) -> np.ndarray:
    """(K,) mean over the pairs of y at x = 1 minus y at x = 0, for each row of xs (K, 2·pairs)."""
    pairs = xs.shape[1] // 2
    return (2 * xs @ y - y.sum()) / pairs


def sign_flip_test(differences, **draws) -> stats.PermutationTest:
    """The one-sided ("less") test that the mean of `differences` (one per pair) is below 0,
    by swapping the two members of each pair (exact over 2^pairs when feasible)."""
    d = np.asarray(differences, float)
    x = np.tile([0.0, 1.0], d.size)
    y = np.column_stack([np.zeros_like(d), d]).ravel()
    strata = np.repeat(np.arange(d.size), 2)
    return stats.permutation_test(_mean_difference, x, y, strata, alternative="less", **draws)


def _mean_difference_of(pairs: list[dict]) -> float:
    return float(np.mean([p["d"] for p in pairs]))


def _interval(pairs: list[dict]) -> tuple[float, float]:
    """The seed bootstrap's 95 % interval of the mean difference; none (NaN) from one seed."""
    return stats.cluster_bootstrap(_mean_difference_of, pairs, "seed")


def _power(pairs: list[dict]) -> float:
    def p_value(sample):
        d = [p["d"] for p in sample]
        return sign_flip_test(d, max_exact=0, draws=stats.POWER_DRAWS).p_value

    return stats.bootstrap_power(p_value, pairs, "seed")


def seeds_needed(pairs: list[dict], errors: tuple[float, float], sentences: int | None) -> float:
    """Seeds per cell for power 0.8 of a one-sided paired test at 5 % at the size |d̄| of the
    observed mean difference of `pairs` ({"num_layers", "seed", "d"}; normal approximation, at
    least FEWEST_SEEDS). The spread: of the differences over the seeds within each L, pooled, when
    there are two seeds or more; else the binomial spread over `sentences` of the two mean
    errors (`errors`: β = 0, β = 1). NaN when there is no difference or no spread to use."""
    by_depth: dict = {}
    for p in pairs:
        by_depth.setdefault(p["num_layers"], []).append(p["d"])
    if all(len(d) >= 2 for d in by_depth.values()):
        spread = math.sqrt(float(np.mean([np.var(d, ddof=1) for d in by_depth.values()])))
    elif sentences:
        spread = math.sqrt(sum(e * (1 - e) for e in errors) / sentences)
    else:
        return math.nan
    mean = _mean_difference_of(pairs)
    if mean == 0 or spread == 0:
        return math.nan
    return float(max(FEWEST_SEEDS, math.ceil((_Z_SUM * spread / abs(mean)) ** 2)))


def _pairs(rows: list[dict], key: str, low, high) -> list[dict]:
    """Differences error(key = high) − error(key = low) of the runs that agree on every other
    field (num_layers, beta, seed), each as {"seed", "d", and the other fields}."""
    others = [k for k in ("num_layers", "beta", "seed") if k != key]
    by_cell = {(tuple(r[k] for k in others), r[key]): r[FINAL_ERROR] for r in rows}
    pairs = []
    for (rest, value), error in sorted(by_cell.items(), key=str):
        if value == low and (rest, high) in by_cell:
            pairs.append(dict(zip(others, rest, strict=True)) | {"d": by_cell[rest, high] - error})
    return pairs


def sst2_ordering_with_seeds(workdir, alpha: float = 0.05) -> Claim:
    """Row 5b″: the residual lowers the final training error at every L, and depth lowers it
    only with the residual, each tested over seeds (docs/protocol.md)."""
    claim = Claim(
        "5b″. SST-2 with seeds: residual lowers training error, depth helps only with it "
        "(second reading of 5b)",
        "mean paired difference d̄ = e(β=1) − e(β=0) over (L, seed) [95 % seed-bootstrap "
        "interval], one-sided sign-flip p, power; at β=1 and β=0 e(L_max) − e(L_min) likewise",
        f"d̄ < 0 with p < {alpha:g}, every L's interval below 0, power ≥ 0.8; at β=1 depth < 0 "
        "with p < 0.05, at β=0 not wholly below 0; undecided if an interval spans 0",
    )
    if missing := claims.missing(claim, workdir, RUNS_FILE):
        return missing
    rows = claims.read_csv(wd.path(workdir) / RUNS_FILE)
    if mixed := claims.several_lrs(claim, rows):
        return mixed
    residual = _pairs(rows, "beta", 0.0, 1.0)
    depths = sorted({r["num_layers"] for r in rows})
    if not residual or len(depths) < 2:
        return dataclasses.replace(claim, note="needs β = 0 and β = 1 at two depths or more")
    test = sign_flip_test([p["d"] for p in residual])
    interval, power = _interval(residual), _power(residual)
    at_depth = {L: [p for p in residual if p["num_layers"] == L] for L in depths}
    per_depth = {L: _interval(pairs) for L, pairs in at_depth.items()}
    residual_ok = (
        test.observed < 0
        and test.p_value < alpha
        and all(high < 0 for _, high in per_depth.values())
    )
    verdicts = [claims.decided(residual_ok, interval, 0.0, power, claimed="below",
                               opposite_p=test.p_opposite, alpha=alpha)]  # fmt: skip
    deeper = {
        beta: _pairs([r for r in rows if r["beta"] == beta], "num_layers", depths[0], depths[-1])
        for beta in (1.0, 0.0)
    }  # each d: e(L_max) − e(L_min) of one seed
    depth_test = sign_flip_test([p["d"] for p in deeper[1.0]]) if deeper[1.0] else None
    depth_interval = {beta: _interval(pairs) for beta, pairs in deeper.items()}
    if depth_test is None or not claims.has_interval(depth_interval[0.0]):
        verdicts.append(claims.UNDECIDED)  # "depth helps only with the residual" needs β = 0
    else:
        depth_ok = (
            depth_test.observed < 0 and depth_test.p_value < alpha and depth_interval[0.0][1] >= 0
        )
        verdicts.append(claims.decided(depth_ok, depth_interval[1.0], 0.0, claimed="below",
                                       opposite_p=depth_test.p_opposite, alpha=alpha))  # fmt: skip
    seeds = len({r["seed"] for r in rows})
    sentences = _training_sentences(workdir)
    mean_error = tuple(
        float(np.mean([r[FINAL_ERROR] for r in rows if r["beta"] == b])) for b in (0.0, 1.0)
    )
    needed = seeds_needed(residual, mean_error, sentences)

    per_l = ", ".join(
        f"L={L} {_mean_difference_of(at_depth[L]):+.3f}{_bounds(per_depth[L])}" for L in depths
    )
    depth_at_1 = (
        f"{depth_test.observed:+.3f}{_bounds(depth_interval[1.0])}, {depth_test.describe()}"
        f"{claims.against_text(depth_test, depth_interval[1.0], 0.0, 'below')}"
        if depth_test
        else "-"
    )
    depth_at_0 = (
        f", at β=0: {_mean_difference_of(deeper[0.0]):+.3f}{_bounds(depth_interval[0.0])}"
        if deeper[0.0]
        else ""
    )
    value = (
        f"d̄ = {test.observed:+.3f}{_bounds(interval)}, {test.describe()}"
        f"{claims.against_text(test, interval, 0.0, 'below')}, power {power:.2f}; "
        f"per L: {per_l}; e(L_max) − e(L_min) at β=1: {depth_at_1}{depth_at_0}"
    )
    note = f"{seeds} seed(s) per cell; seeds per cell needed for power 0.8: {needed:.0f}"
    if seeds < 2:
        note += f" (binomial spread over P = {sentences} sentences)"
    if test.observed > 0:  # the rule's n is for |d̄|: a one-sided test has no power at d̄ > 0
        note += " if the effect were |d̄| in the claim's direction (the observed d̄ > 0 is not)"
    if seeds < 2:
        note += "; one run per cell: no interval, so undecided"
    return dataclasses.replace(claim, value=value, verdict=claims.combined(verdicts), note=note)


def _bounds(interval: tuple[float, float]) -> str:
    """' [low, high]', or '' when there is no interval (one seed)."""
    low, high = interval
    return f" [{low:+.3f}, {high:+.3f}]" if claims.has_interval(interval) else ""


def _training_sentences(workdir) -> int | None:
    """P, the training sentences of the run (config.json's data.num_train), if it says."""
    saved = wd.read_saved_config(workdir) or {}
    count = saved.get("data", {}).get("num_train")
    return count if isinstance(count, int) and count > 0 else None
