"""Rank statistics of the claims: Spearman's ρ, Kendall's τ-b (with a permutation test that
keeps each seed's runs together), and a log-log slope. Inputs are 1-D sequences of equal length;
pairs with a non-finite entry are left out."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import numpy as np


def spearman(x, y) -> float:
    """Spearman's rank correlation over the pairs where both are finite (NaN with < 3)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return math.nan
    from scipy import stats  # here: scipy.stats takes a second to import, and most runs never ask

    return float(stats.spearmanr(x[keep], y[keep]).statistic)


def log_slope(x, y) -> float:
    """Least-squares slope of log y against log x over the positive finite pairs."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    if keep.sum() < 3:
        return math.nan
    return float(np.polyfit(np.log(x[keep]), np.log(y[keep]), 1)[0])


def kendall(x, y) -> tuple[float, float]:
    """(τ-b, two-sided p-value) over the pairs where both are finite; NaNs with < 3 pairs."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return math.nan, math.nan
    from scipy import stats

    result = stats.kendalltau(x[keep], y[keep])
    return float(result.statistic), float(result.pvalue)


# `tau_b` of x (K, n) with at most MAX_LEVELS distinct values (a permutation test's β levels),
# n ≥ LEVELS_MIN_RUNS and K·n² ≥ LEVELS_MIN_PAIRS takes `_levels_concordance`: the same integers
# as the pairwise signs (`_pairwise_concordance`), faster from about n = 64 (K = 20,000: the
# one-hot product 0.26 s, the pairs 0.48 s at n = 100; 0.12 s and 0.10 s at n = 50).
MAX_LEVELS, LEVELS_MIN_RUNS, LEVELS_MIN_PAIRS = 16, 64, 1 << 20


def _levels(x: np.ndarray) -> np.ndarray | None:
    """The sorted distinct values of x (K, n) when `tau_b` should take `_levels_concordance`."""
    rows, n = x.shape
    if n < LEVELS_MIN_RUNS or rows * n * n < LEVELS_MIN_PAIRS:
        return None
    levels = np.unique(x)
    return levels if levels.size <= MAX_LEVELS and np.isfinite(levels).all() else None


def tau_b(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall's τ-b of each row of x (K, n) against y (n,) (scipy's statistic, vectorized;
    NaN, as scipy's, for a row or a y that is constant)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    dy = _signs(y[:, None], y[None, :])
    if (levels := _levels(x)) is not None:
        concordance, untied_x = _levels_concordance(x, dy, levels)
    else:
        concordance, untied_x = _pairwise_concordance(x, dy)
    untied = untied_x * float(np.count_nonzero(dy))  # every pair counted twice, as concordance
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(untied > 0, concordance / np.sqrt(untied), np.nan)


def _signs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sign(a − b), broadcast; 0 for two equal infinities (a tie, as scipy ranks them, where
    inf − inf is NaN); NaN where either is NaN."""
    with np.errstate(invalid="ignore"):
        return np.where(a == b, 0.0, np.sign(a - b))


def _pairwise_concordance(x: np.ndarray, dy: np.ndarray):
    """(K,) Σ_ij sign(x_ki − x_kj)·dy_ij and (K,) the count of untied (i, j) of each row of x
    (K, n), dy (n, n) antisymmetric: from the pairs i < j, one i at a time (integers, exact in
    float64; a (K, n, n) array of signs took 2-3.5x as long at n = 15-50)."""
    rows, n = x.shape
    concordance, untied = np.zeros(rows), np.zeros(rows, np.int64)
    signs = (lambda a, b: np.sign(a - b)) if np.isfinite(x).all() else _signs
    for i in range(n - 1):
        dx = signs(x[:, i, None], x[:, i + 1 :])
        concordance += dx @ dy[i, i + 1 :]
        untied += np.count_nonzero(dx, axis=1)
    return 2 * concordance, 2 * untied


def _levels_concordance(x: np.ndarray, dy: np.ndarray, levels: np.ndarray):
    """Σ_ij sign(x_ki − x_kj)·dy_ij and the count of untied (i, j) of each row of x (K, n),
    whose values are among `levels` (m,): with F = dy·onehot(x_k) (n, m), the sum is
    Σ_i (F·Aᵀ)[i, level of x_ki], A = sign(level_a − level_b); one matrix product for all rows,
    in integers (exact in float64), so it equals the pairwise sum."""
    rows, n = x.shape
    codes = np.searchsorted(levels, x).T  # (n, K)
    step = max(1, (1 << 22) // (n * levels.size))  # rows per product: ~32 MiB of one-hots
    concordance, untied = np.empty(rows), np.empty(rows, np.int64)
    sign = np.sign(levels[:, None] - levels[None, :])
    for start in range(0, rows, step):
        onehot = (codes[:, start : start + step, None] == np.arange(levels.size)).astype(float)
        f = (dy @ onehot.reshape(n, -1)).reshape(onehot.shape)  # (n, k, m)
        concordance[start : start + step] = np.einsum("ika,ika->k", onehot, f @ sign.T)
        counts = onehot.sum(axis=0).astype(np.int64)  # (k, m)
        untied[start : start + step] = n * n - np.sum(counts**2, axis=1)
    return concordance, untied


def stratified_p_value(betas, steps, seeds, *, permutations: int = 5000) -> float:
    """Two-sided p-value of the pooled Kendall τ under `permutations` random permutations of β
    within each seed (the runs of one seed share their initial weights, so only β is
    exchangeable there): `permutation_test` as rows 5a and 5a′ were defined."""
    test = permutation_test(pooled_tau, betas, steps, seeds, alternative="two-sided",
                            max_exact=0, draws=permutations, seed=0)  # fmt: skip
    return test.p_value


# --- Tests of the second reading of the claims (docs/protocol.md §5, rows marked ″) ---

# The protocol's counts (docs/protocol.md, the second reading), read when a function is called.
MAX_EXACT = 2_000_000  # enumerate every within-stratum permutation up to this many, else draw
DRAWS = 100_000  # random within-stratum permutations when there are more
BOOTSTRAP_DRAWS = 1000  # seed resamples of an interval
POWER_RESAMPLES = 200  # seed resamples of a power estimate
POWER_DRAWS = 1000  # permutations per resample of the power's test
# A tenth of the random draws (exact enumeration unchanged): for smoke tests (`reproduce
# --scale=tiny`, whose numbers mean nothing) and synthetic tests whose verdicts do not depend
# on them.
SMOKE_TEST_COUNTS = {"DRAWS": 10_000, "BOOTSTRAP_DRAWS": 200, "POWER_RESAMPLES": 50,
                     "POWER_DRAWS": 300}  # fmt: skip


def current_counts() -> dict[str, int]:
    """The module's draw counts as they are now (what a computed statistic depends on)."""
    names = ("MAX_EXACT", "DRAWS", "BOOTSTRAP_DRAWS", "POWER_RESAMPLES", "POWER_DRAWS")
    return {name: globals()[name] for name in names}


@contextlib.contextmanager
def counts(**values: int):
    """Within the block, the module's draw counts (DRAWS, BOOTSTRAP_DRAWS, POWER_RESAMPLES,
    POWER_DRAWS, MAX_EXACT) set to `values`."""
    saved = {name: globals()[name] for name in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(saved)


OPPOSITE = {"less": "greater", "greater": "less"}  # a one-sided alternative's other direction


@dataclasses.dataclass(frozen=True)
class PermutationTest:
    """A stratified permutation test: the observed statistic, its p-value for `alternative`
    ("less", "greater" or "two-sided"), and whether p counts every permutation (`exact`) or
    `count` random ones (p = (hits + 1) / (count + 1)). p_opposite: for a one-sided test, the
    p of the other direction over the same permutations (NaN for a two-sided one)."""

    observed: float
    p_value: float
    count: int
    exact: bool
    alternative: str
    p_opposite: float = math.nan

    def describe(self) -> str:
        how = f"exact over {self.count:,}" if self.exact else f"{self.count:,} draws"
        return f"{self.alternative} p = {self.p_value:.2g} ({how} within-stratum permutations)"


def permutation_count(strata) -> int:
    """∏ n_s! over the strata: how many within-stratum permutations there are."""
    _, sizes = np.unique(np.asarray(strata), return_counts=True)
    return math.prod(math.factorial(int(n)) for n in sizes)


def _within_strata(x: np.ndarray, strata: np.ndarray, *, max_exact: int, draws: int, seed: int):
    """Chunks (K, n) of x permuted within each stratum: every permutation (the identity
    included) when there are at most `max_exact`, else `draws` random ones."""
    groups = [np.flatnonzero(strata == s) for s in np.unique(strata)]
    if permutation_count(strata) <= max_exact:
        orders = [np.array(list(itertools.permutations(range(g.size)))) for g in groups]
        total = math.prod(len(o) for o in orders)
        for start in range(0, total, 20_000):  # the combinations in itertools.product's order
            picks = np.unravel_index(np.arange(start, min(start + 20_000, total)),
                                     [len(o) for o in orders])  # fmt: skip
            out = np.repeat(x[None], picks[0].size, axis=0)
            for g, o, pick in zip(groups, orders, picks, strict=True):
                out[:, g] = x[g][o[pick]]
            yield out
        return
    rng = np.random.default_rng(seed)
    for start in range(0, draws, 20_000):
        out = np.repeat(x[None], min(20_000, draws - start), axis=0)
        for g in groups:
            out[:, g] = rng.permuted(out[:, g], axis=1)
        yield out


def permutation_test(statistic, x, y, strata, *, alternative: str = "two-sided",
                     max_exact: int | None = None, draws: int | None = None, seed: int = 0,
                     ) -> PermutationTest:  # fmt: skip
    """Tests `statistic(xs (K, n), y (n,), strata (n,)) -> (K,)` by permuting x within each
    stratum (the runs of one stratum share what makes them dependent; only x is exchangeable
    there). Exact when there are at most `max_exact` (MAX_EXACT) permutations, else `draws`
    (DRAWS) random ones."""
    max_exact = MAX_EXACT if max_exact is None else max_exact
    draws = DRAWS if draws is None else draws
    x, y, strata = np.asarray(x, float), np.asarray(y, float), np.asarray(strata)
    observed = float(statistic(x[None], y, strata)[0])
    exact = permutation_count(strata) <= max_exact
    if not math.isfinite(observed):
        return PermutationTest(observed, math.nan, 0, exact, alternative)
    tolerance = 1e-12 * max(1.0, abs(observed))
    hits = {"less": 0, "greater": 0, "two-sided": 0}
    count = 0
    for xs in _within_strata(x, strata, max_exact=max_exact, draws=draws, seed=seed):
        values = statistic(xs, y, strata)
        hits["less"] += int(np.sum(values <= observed + tolerance))
        hits["greater"] += int(np.sum(values >= observed - tolerance))
        hits["two-sided"] += int(np.sum(np.abs(values) >= abs(observed) - tolerance))
        count += len(values)

    def p_of(direction: str) -> float:
        return float(hits[direction] / count if exact else (hits[direction] + 1) / (count + 1))

    opposite = OPPOSITE.get(alternative)
    p_opposite = p_of(opposite) if opposite else math.nan
    return PermutationTest(observed, p_of(alternative), count, exact, alternative, p_opposite)


def pooled_tau(xs: np.ndarray, y: np.ndarray, strata=None) -> np.ndarray:
    """Kendall's τ-b of each row of xs (K, n) against y (n,) over all n runs."""
    return tau_b(xs, y)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1 … n along the last axis of values (…, n), ties given their average rank
    (scipy's `rankdata`, which costs far more per call on the small arrays of the tests)."""
    values = np.asarray(values, float)
    n = values.shape[-1]
    rows = values.reshape(-1, n)
    order = np.argsort(rows, axis=-1, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=-1)
    starts = np.ones(ordered.shape, bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    groups = np.cumsum(starts, axis=-1) - 1 + n * np.arange(len(rows))[:, None]
    positions = np.broadcast_to(np.arange(1.0, n + 1), rows.shape).ravel()
    sums = np.bincount(groups.ravel(), weights=positions, minlength=rows.size)
    counts = np.bincount(groups.ravel(), minlength=rows.size)
    ranks = np.empty_like(rows)
    np.put_along_axis(ranks, order, (sums / np.maximum(counts, 1))[groups], axis=-1)
    return ranks.reshape(values.shape)


def stratified_spearman(xs: np.ndarray, y: np.ndarray, strata) -> np.ndarray:
    """(K,) Spearman's ρ between each row of xs (K, n) and y (n,) within each stratum, averaged
    over the strata weighted by their sizes (a stratum of < 3 runs, or one where x or y is
    constant, is left out)."""
    strata = np.asarray(strata)
    total, weight = np.zeros(xs.shape[0]), 0
    for s in np.unique(strata):
        g = np.flatnonzero(strata == s)
        rx, ry = average_ranks(xs[:, g]), average_ranks(y[g])
        rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean()
        norm = np.sqrt((rx**2).sum(axis=1) * (ry**2).sum())
        if g.size < 3 or not np.all(norm > 0):
            continue
        total += g.size * (rx * ry).sum(axis=1) / norm
        weight += g.size
    return total / weight if weight else np.full(xs.shape[0], np.nan)


def partial_tau(x, y, z) -> float:
    """Kendall's partial τ of x and y with z held fixed:
    (τ_xy − τ_xz τ_yz) / √((1 − τ_xz²)(1 − τ_yz²)) (τ-b throughout; NaN if z ranks x or y
    perfectly)."""
    x, y, z = (np.asarray(v, float) for v in (x, y, z))
    t_xy, t_xz, t_yz = (float(tau_b(a[None], b)[0]) for a, b in ((x, y), (x, z), (y, z)))
    denominator = math.sqrt(max((1 - t_xz**2) * (1 - t_yz**2), 0.0))
    return (t_xy - t_xz * t_yz) / denominator if denominator > 0 else math.nan


def _clusters(rows: list[dict], cluster: str) -> int:
    return len({row[cluster] for row in rows})


def cluster_resamples(rows: list[dict], cluster: str, draws: int, seed: int):
    """`draws` resamples of `rows`, each as many whole clusters (the rows sharing `cluster`,
    e.g. a seed) as there are, drawn with replacement; a cluster drawn twice enters twice, under
    a new label."""
    labels = sorted({row[cluster] for row in rows})
    by_label = {label: [row for row in rows if row[cluster] == label] for label in labels}
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        picks = rng.choice(len(labels), size=len(labels))
        yield [row | {cluster: k} for k, pick in enumerate(picks) for row in by_label[labels[pick]]]


def cluster_bootstrap(statistic, rows: list[dict], cluster: str, *, draws: int | None = None,
                      level: float = 0.95, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """Percentile interval of `statistic(rows)` over `cluster_resamples`; resamples whose
    statistic is NaN are left out; `draws` resamples (BOOTSTRAP_DRAWS). NaN from fewer than two
    clusters (every resample of one cluster is that cluster)."""
    if _clusters(rows, cluster) < 2:
        return math.nan, math.nan
    draws = BOOTSTRAP_DRAWS if draws is None else draws
    values = np.array([statistic(s) for s in cluster_resamples(rows, cluster, draws, seed)])
    values = values[np.isfinite(values)]
    if not values.size:
        return math.nan, math.nan
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_power(p_value, rows: list[dict], cluster: str, *, alpha: float = 0.05,
                    draws: int | None = None, seed: int = 1) -> float:  # fmt: skip
    """The power of a test at the observed effect, estimated as the fraction of
    `cluster_resamples` on which `p_value(rows)` < alpha: how often a rerun with as many
    clusters from the same population would reach significance; `draws` resamples
    (POWER_RESAMPLES). NaN from fewer than two clusters."""
    if _clusters(rows, cluster) < 2:
        return math.nan
    draws = POWER_RESAMPLES if draws is None else draws
    resamples = cluster_resamples(rows, cluster, draws, seed)
    return sum(p_value(sample) < alpha for sample in resamples) / draws
