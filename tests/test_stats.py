"""The claims' statistics against scipy and against exact enumeration on small synthetic cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from resconv_jax.analysis import stats as st
from resconv_jax.experiments import claims


def test_tau_b_with_ties_equals_scipy():
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 3, (50, 12)).astype(float), rng.integers(0, 4, 12).astype(float)
    expected = [stats.kendalltau(row, y, variant="b").statistic for row in x]
    np.testing.assert_allclose(st.pooled_tau(x, y), expected, atol=1e-12)


@pytest.mark.parametrize("by_levels", [False, True])
def test_tau_b_with_an_infinite_value_is_scipys(monkeypatch, by_levels):
    """inf - inf on the diagonal of the sign matrices made τ-b NaN (x infinite) or gave it a
    wrong count of untied pairs (y infinite)."""
    if by_levels:
        monkeypatch.setattr(st, "LEVELS_MIN_RUNS", 0)
        monkeypatch.setattr(st, "LEVELS_MIN_PAIRS", 0)
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 4, 20).astype(float), rng.standard_normal(20)
    one, two = np.arange(20) == 3, np.isin(np.arange(20), (3, 11))  # two: tied infinities
    for xs, ys in ((np.where(one, np.inf, x), y), (np.where(two, np.inf, x), y),
                   (x, np.where(one, -np.inf, y)), (x, np.where(two, -np.inf, y))):  # fmt: skip
        expected = stats.kendalltau(xs, ys, variant="b").statistic
        np.testing.assert_allclose(st.tau_b(xs[None], ys), [expected], atol=1e-12)


def test_tau_b_by_levels_equals_the_pairwise_signs_to_the_bit(monkeypatch):
    """The one-hot product that large permutation tests take gives the same τ-b, bit for bit,
    as the pairwise signs: ties in x and in y, a constant row, a constant y, a NaN in y."""
    rng = np.random.default_rng(5)
    cases = []
    for n, levels in ((12, 3), (40, 5), (33, 1), (50, 16)):
        base = rng.choice(np.linspace(0.0, 1.0, levels), n)
        x = np.array([rng.permutation(base) for _ in range(300)])
        x[0] = 0.25  # a constant row
        for y in (rng.standard_normal(n), rng.integers(0, 4, n).astype(float), np.ones(n)):
            cases.append((x, y))
        y = rng.standard_normal(n)
        y[3] = np.nan
        cases.append((x, y))
    pairwise = [st.tau_b(x, y) for x, y in cases]  # small K·n²: the pairwise path
    monkeypatch.setattr(st, "LEVELS_MIN_RUNS", 0)
    monkeypatch.setattr(st, "LEVELS_MIN_PAIRS", 0)
    assert st._levels(cases[0][0]) is not None
    for (x, y), expected in zip(cases, pairwise, strict=True):
        np.testing.assert_array_equal(st.tau_b(x, y), expected)


def test_tau_b_from_the_pairs_above_the_diagonal_is_the_full_sign_sum_to_the_bit():
    """τ-b from the pairs i < j, one i at a time, equals Σ over the whole (K, n, n) array of
    signs (the formula before): ties, a constant row, a NaN in x."""
    rng = np.random.default_rng(6)
    x = rng.integers(0, 5, (500, 15)).astype(float)
    x[0], x[1, 2] = 1.0, np.nan
    y = rng.standard_normal(15)
    y[3] = y[4]
    dy = np.sign(y[:, None] - y[None, :])
    dx = np.sign(x[:, :, None] - x[:, None, :])
    untied = np.count_nonzero(dx, axis=(1, 2)) * float(np.count_nonzero(dy))
    with np.errstate(invalid="ignore", divide="ignore"):
        full = np.where(untied > 0, np.einsum("kij,ij->k", dx, dy) / np.sqrt(untied), np.nan)
    np.testing.assert_array_equal(st.tau_b(x, y), full)


def test_tau_b_of_a_constant_is_undefined_as_in_scipy_and_so_is_its_test():
    x, y = np.array([[0.0, 0.5, 1.0, 0.0, 0.5, 1.0]]), np.full(6, 300.0)
    assert math.isnan(stats.kendalltau(x[0], y).statistic)
    assert math.isnan(st.pooled_tau(x, y)[0]) and math.isnan(st.pooled_tau(y[None], x[0])[0])
    assert math.isnan(st.partial_tau(x[0], y, np.arange(6.0)))
    test = st.permutation_test(st.pooled_tau, x[0], y, np.repeat([0, 1], 3), alternative="less")
    assert math.isnan(test.observed) and math.isnan(test.p_value)  # not p = 0


def test_average_ranks_equal_scipys_with_ties():
    values = np.random.default_rng(6).integers(0, 4, (30, 9)).astype(float)
    np.testing.assert_array_equal(st.average_ranks(values), stats.rankdata(values, axis=-1))
    np.testing.assert_array_equal(st.average_ranks(values[0]), stats.rankdata(values[0]))


def _brute_force_p(x, y, strata, alternative):
    """p over every within-stratum permutation, by itertools, one τ at a time (scipy's)."""
    groups = [np.flatnonzero(strata == s) for s in np.unique(strata)]
    observed = stats.kendalltau(x, y).statistic
    values = []
    for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
        shuffled = x.copy()
        for g, order in zip(groups, orders, strict=True):
            shuffled[g] = x[list(order)]
        values.append(stats.kendalltau(shuffled, y).statistic)
    values = np.array(values)
    if alternative == "less":
        return np.mean(values <= observed + 1e-12)
    return np.mean(np.abs(values) >= abs(observed) - 1e-12)


@pytest.mark.parametrize("alternative", ["less", "two-sided"])
def test_the_exact_stratified_permutation_p_equals_enumeration(alternative):
    x = np.array([0.0, 0.5, 1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.5, 1.0, 1.0])  # ties in x
    strata = np.repeat([0, 1, 2], [3, 4, 4])
    y = np.array([9, 7, 8, 6, 6, 4, 2, 3, 3, 1, 0], float)  # ties in y
    result = st.permutation_test(st.pooled_tau, x, y, strata, alternative=alternative)
    assert result.exact and result.count == 6 * 24 * 24
    assert result.p_value == pytest.approx(_brute_force_p(x, y, strata, alternative), abs=1e-12)
    assert result.observed == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)


@pytest.mark.parametrize(("alternative", "opposite"), [("less", "greater"), ("greater", "less")])
def test_a_one_sided_test_also_gives_the_p_of_the_opposite_direction(alternative, opposite):
    x = np.array([0.0, 0.5, 1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.5, 1.0, 1.0])
    strata = np.repeat([0, 1, 2], [3, 4, 4])
    y = np.array([9, 7, 8, 6, 6, 4, 2, 3, 3, 1, 0], float)
    for draws in ({}, {"max_exact": 10, "draws": 3000}):
        one = st.permutation_test(st.pooled_tau, x, y, strata, alternative=alternative, **draws)
        other = st.permutation_test(st.pooled_tau, x, y, strata, alternative=opposite, **draws)
        assert one.p_opposite == other.p_value and other.p_opposite == one.p_value
    two = st.permutation_test(st.pooled_tau, x, y, strata, alternative="two-sided")
    assert math.isnan(two.p_opposite)


def test_drawn_permutations_approach_the_exact_p_and_say_so():
    x, strata = np.tile([0.0, 1, 2, 3], 3), np.repeat([0, 1, 2], 4)
    y = np.random.default_rng(0).normal(size=12) - 0.4 * x
    exact = st.permutation_test(st.pooled_tau, x, y, strata, alternative="less")
    drawn = st.permutation_test(
        st.pooled_tau, x, y, strata, alternative="less", max_exact=10, draws=40_000
    )
    assert not drawn.exact and drawn.count == 40_000 and "40,000 draws" in drawn.describe()
    assert abs(drawn.p_value - exact.p_value) < 0.01


def test_a_one_sided_p_is_small_only_in_the_direction_of_the_effect():
    x, strata = np.tile([0.0, 1, 2, 3], 3), np.repeat([0, 1, 2], 4)
    y = 10 - x + np.array([0.3, -0.2, 0.5, -0.6] * 3)
    less = st.permutation_test(st.pooled_tau, x, y, strata, alternative="less")
    greater = st.permutation_test(st.pooled_tau, x, y, strata, alternative="greater")
    assert less.p_value < 0.01 < 0.99 < greater.p_value


def test_stratified_spearman_is_the_size_weighted_mean_of_scipys_per_stratum_rho():
    rng = np.random.default_rng(1)
    strata = np.repeat([0, 1, 2], [4, 5, 6])
    x, y = rng.normal(size=15), rng.normal(size=15)
    expected = (
        sum(
            (strata == s).sum() * stats.spearmanr(x[strata == s], y[strata == s]).statistic
            for s in range(3)
        )
        / 15
    )
    assert st.stratified_spearman(x[None], y, strata)[0] == pytest.approx(expected, abs=1e-12)


def test_stratified_spearman_ignores_what_separates_the_strata():
    # Within each stratum x and y go together; across strata they go against each other.
    strata = np.repeat([0, 1, 2], 4)
    x = np.array([0, 1, 2, 3] * 3, float) + 10 * strata
    y = np.array([0, 1, 2, 3] * 3, float) - 10 * strata
    assert stats.spearmanr(x, y).statistic < 0
    assert st.stratified_spearman(x[None], y, strata)[0] == pytest.approx(1.0)


def test_partial_tau_follows_its_formula_and_removes_a_common_cause():
    rng = np.random.default_rng(2)
    z = rng.normal(size=40)
    x, y = z + 0.3 * rng.normal(size=40), z + 0.3 * rng.normal(size=40)
    t = {k: stats.kendalltau(a, b).statistic for k, (a, b) in
         {"xy": (x, y), "xz": (x, z), "yz": (y, z)}.items()}  # fmt: skip
    expected = (t["xy"] - t["xz"] * t["yz"]) / math.sqrt((1 - t["xz"] ** 2) * (1 - t["yz"] ** 2))
    assert st.partial_tau(x, y, z) == pytest.approx(expected, abs=1e-12)
    assert t["xy"] > 0.5 and abs(st.partial_tau(x, y, z)) < t["xy"] / 2


def test_the_cluster_bootstrap_interval_covers_a_known_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(4)

    def mean_of(rows):
        return float(np.mean([r["v"] for r in rows]))

    covered = 0
    for trial in range(120):
        rows = [{"seed": s, "v": v} for s, v in enumerate(rng.normal(1.0, 2.0, size=30))]
        low, high = st.cluster_bootstrap(mean_of, rows, "seed", draws=400, seed=trial)
        covered += low <= 1.0 <= high
    assert 0.85 <= covered / 120 <= 1.0  # binomial sd at 95 %: 2 %


def test_one_cluster_gives_no_interval_and_no_power():
    """Every resample of one cluster is that cluster: a zero-width interval and a power of 0 or
    1 are artefacts, not evidence."""
    rows = [{"seed": 3, "x": b, "y": -b} for b in range(5)]

    def p_value(sample):
        x, y, strata = (np.array([r[k] for r in sample]) for k in ("x", "y", "seed"))
        return st.permutation_test(st.pooled_tau, x, y, strata, alternative="less").p_value

    low, high = st.cluster_bootstrap(lambda s: float(np.mean([r["y"] for r in s])), rows, "seed")
    assert math.isnan(low) and math.isnan(high)
    assert math.isnan(st.bootstrap_power(p_value, rows, "seed", draws=5))


def test_a_cluster_resample_keeps_each_cluster_whole_and_relabels_repeats():
    rows = [{"seed": s, "run": r} for s in (7, 8, 9) for r in range(4)]
    for sample in st.cluster_resamples(rows, "seed", draws=20, seed=0):
        assert len(sample) == 12 and sorted({r["seed"] for r in sample}) == [0, 1, 2]
        for k in range(3):
            assert [r["run"] for r in sample if r["seed"] == k] == [0, 1, 2, 3]


def test_bootstrap_power_is_high_for_a_strong_effect_and_low_for_none():
    rng = np.random.default_rng(5)

    def rows_of(effect):
        return [{"seed": s, "x": b, "y": -effect * b + rng.normal()}
                for s in range(8) for b in range(5)]  # fmt: skip

    def p_value(rows):
        x, y, strata = (np.array([r[k] for r in rows]) for k in ("x", "y", "seed"))
        return st.permutation_test(st.pooled_tau, x, y, strata, alternative="less",
                                   max_exact=0, draws=300).p_value  # fmt: skip

    assert st.bootstrap_power(p_value, rows_of(2.0), "seed", draws=30) >= 0.9
    assert st.bootstrap_power(p_value, rows_of(0.0), "seed", draws=30) <= 0.5


@pytest.mark.parametrize(
    ("ok", "interval", "power", "expected"),
    [
        (True, (-0.6, -0.1), 0.9, "holds"),
        (False, (0.1, 0.4), 0.0, "fails"),  # wholly on the other side: power is moot
        (True, (-0.6, 0.1), 0.9, "undecided"),  # the interval spans the threshold 0
        (True, (-0.6, -0.1), 0.5, "undecided"),  # too little power at the observed effect
        (False, (-0.6, -0.1), 0.9, "undecided"),  # the claimed side, but not significant
        (True, (math.nan, -0.1), None, "undecided"),
    ],
)
def test_three_way_verdicts(ok, interval, power, expected):
    assert claims.decided(ok, interval, 0.0, power, claimed="below") == expected


@pytest.mark.parametrize(("opposite_p", "expected"), [(0.01, "fails"), (0.2, "undecided")])
def test_fails_needs_the_test_against_the_claim_to_be_significant(opposite_p, expected):
    """With 3 seeds a seed bootstrap has 10 distinct resamples: with no association at all its
    interval lay wholly against the claim in 16 % of simulated sweeps, so the interval alone
    said "fails" far more often than a 95 % interval promises."""
    interval = (0.1, 0.4)  # wholly above 0, the claim being "below"
    verdict = claims.decided(False, interval, 0.0, 0.0, claimed="below", opposite_p=opposite_p)
    assert verdict == expected
