"""Contraction rates, the tangent-kernel PL certificate, and the stable step size.

For GD on the squared loss L(θ) = ½‖f_θ − y‖² (the paper's sum over samples) with step η, the
linearized step multiplies the residual by (I − η K), K = J Jᵀ the empirical tangent kernel, so
L_{t+1} ≤ (1 − η λ_min(K))² L_t when η ≤ 1/λ_max(K), and GD is stable for η < 2/λ_max(K). With the
mean reduction L = ½/N ‖f_θ − y‖² the gradient is scaled by 1/N: pass ``loss_scale = 1/N``.

Host-side rate fits use NumPy; the kernel eigenvalues are JAX and jit-able.
"""

import math
from collections.abc import Callable

import jax
import numpy as np

from resconv_jax.analysis import jacobian


def fit_linear_rate(steps, losses, *, window: int | None = None) -> tuple[float, float]:
    """Least-squares fit of log L_t = a + t log ρ over the last ``window`` points (all if None).

    Args:
      steps, losses: (T,) step numbers and losses. Zero, negative and non-finite losses are dropped.
    Returns:
      (ρ, R²): the per-step factor (loss multiplies by ρ each step) and R² of the log-linear fit;
      (nan, nan) with fewer than 3 usable points.
    """
    steps = np.asarray(steps, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    if window is not None:
        steps, losses = steps[-window:], losses[-window:]
    keep = np.isfinite(losses) & (losses > 0) & np.isfinite(steps)
    t, y = steps[keep], np.log(losses[keep])
    if t.size < 3 or np.ptp(t) == 0:
        return math.nan, math.nan
    slope, intercept = np.polyfit(t, y, 1)
    ss_res = np.sum((y - (intercept + slope * t)) ** 2)
    ss_tot = np.sum((y - y.mean()) ** 2)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(np.exp(slope)), float(r2)


def jacobian_shape(f: Callable, params) -> tuple[int, int]:
    """(n, p): output entries of ``f(params)`` and parameter count, without running ``f``."""
    n = math.prod(jax.eval_shape(f, params).shape)
    p = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    return n, p


def jacobian_size(n: int, p: int) -> int:
    """Entries of the (n, p) Jacobian, the memory that ``tangent_kernel_eigenvalues`` needs."""
    return n * p


def tangent_kernel_eigenvalues(f: Callable, params) -> tuple[jax.Array, jax.Array]:
    """Extreme eigenvalues of the empirical tangent kernel K = J Jᵀ (n, n).

    Args:
      f: params pytree -> array of any shape (n entries once flattened).
      params: pytree; θ is all leaves raveled (p entries), J = ∂ vec f/∂θ is (n, p).
    Returns:
      (λ_min(K), λ_max(K)) scalars, clipped at 0. If n ≤ p, K is formed and diagonalized (J by
      reverse mode, n VJPs); if n > p, G = Jᵀ J (p, p) is used instead (J by forward mode, p JVPs),
      which shares K's nonzero eigenvalues, and λ_min(K) = 0 exactly since rank K ≤ p < n.
      Jit-able (``f`` static). `jacobian.dense_eigenvalues` for J given as linear maps.
    """
    return jacobian.dense_eigenvalues(jacobian.of_function(f, params))


def kernel_lambda_max(f: Callable, params, *, iterations: int = 30) -> jax.Array:
    """λ_max(K), K = J Jᵀ, by power iteration on Jᵀ J, matrix-free (J never formed).

    Each iteration is one JVP and one VJP of ``f`` (params pytree -> array). The estimate rises
    to λ_max from below; 30 iterations from a fixed start vector are within a few percent unless
    the top two eigenvalues nearly coincide. Jit-able (``f`` static).
    """
    return jacobian.power_lambda_max(jacobian.of_function(f, params), iterations=iterations)


def certificate_bound(lr, lam_min, *, loss_scale=1.0, lam_max=None):
    """Predicted contraction of the linearized GD step, η' = lr·loss_scale.

    (1 − η' λ_min(K))², valid when η' ≤ 1/λ_max(K). Given `lam_max`, the bound for any η',
    max((1 − η' λ_min)², (1 − η' λ_max)²), which equals the former for η' ≤ 2/(λ_min + λ_max).
    loss_scale is 1 for the sum loss ½Σ‖F − Y‖² and 1/N for the mean reduction ½/N Σ‖F − Y‖².
    """
    bound = (1.0 - lr * loss_scale * lam_min) ** 2
    if lam_max is not None:
        bound = np.maximum(bound, (1.0 - lr * loss_scale * lam_max) ** 2)
    return bound


def stable_lr(lam_max, *, loss_scale=1.0):
    """Largest stable GD step size 2/(λ_max(K)·loss_scale) on the squared loss."""
    return 2.0 / (lam_max * loss_scale)


def bound_holds(measured_ratio, bound, *, rtol: float = 1e-6) -> np.ndarray:
    """Elementwise measured L_{t+1}/L_t ≤ bound·(1 + rtol); NaN entries give False."""
    return np.asarray(measured_ratio) <= np.asarray(bound) * (1.0 + rtol)
