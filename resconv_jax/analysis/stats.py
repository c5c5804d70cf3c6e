"""Rank statistics of the claims: Spearman's ρ, Kendall's τ-b (with a permutation test that
keeps each seed's runs together), and a log-log slope. Inputs are 1-D sequences of equal length;
pairs with a non-finite entry are left out."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def spearman(x, y) -> float:
    """Spearman's rank correlation over the pairs where both are finite (NaN with < 3)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return math.nan
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
    result = stats.kendalltau(x[keep], y[keep])
    return float(result.statistic), float(result.pvalue)


def tau_b(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall's τ-b of each row of x (K, n) against y (n,) (scipy's statistic, vectorized)."""
    dx = np.sign(x[:, :, None] - x[:, None, :])
    dy = np.sign(y[:, None] - y[None, :])
    upper = np.triu(np.ones(dy.shape, bool), 1)
    concordance = (dx * dy)[:, upper].sum(axis=1)
    pairs_x = (dx[:, upper] != 0).sum(axis=1)
    pairs_y = (dy[upper] != 0).sum()
    return concordance / np.sqrt(np.maximum(pairs_x * pairs_y, 1))


def stratified_p_value(betas, steps, seeds, *, permutations: int = 5000) -> float:
    """Two-sided p-value of the pooled Kendall τ under permutations of β within each seed (the
    runs of one seed share their initial weights, so only β is exchangeable there)."""
    betas, steps, seeds = (np.asarray(v, float) for v in (betas, steps, seeds))
    observed = abs(tau_b(betas[None], steps)[0])
    rng = np.random.default_rng(0)
    shuffled = np.repeat(betas[None], permutations, axis=0)
    for seed in np.unique(seeds):
        group = np.flatnonzero(seeds == seed)
        shuffled[:, group] = rng.permuted(shuffled[:, group], axis=1)
    hits = np.sum(np.abs(tau_b(shuffled, steps)) >= observed - 1e-12)
    return float((hits + 1) / (permutations + 1))
