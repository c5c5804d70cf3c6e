"""Rates, tangent-kernel eigenvalues and the PL certificate."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from resconv_jax.analysis import theory
from resconv_jax.analysis.summary import FIT_FLOOR, fit_floor, fit_rate


def contraction_factors(losses) -> np.ndarray:
    """(T,) losses -> (T − 1,) ratios L_{t+1}/L_t."""
    losses = np.asarray(losses, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return losses[1:] / losses[:-1]


def hold_fraction(measured, bound, *, rtol: float = 1e-6) -> float:
    """Fraction of steps with measured ratio ≤ bound, over entries where both are not NaN."""
    measured, bound = np.broadcast_arrays(np.asarray(measured), np.asarray(bound))
    checked = ~(np.isnan(measured) | np.isnan(bound))
    if not checked.any():
        return math.nan
    return float(np.mean(theory.bound_holds(measured[checked], bound[checked], rtol=rtol)))


def test_contraction_factors():
    np.testing.assert_allclose(contraction_factors([8.0, 4.0, 1.0]), [0.5, 0.25])


def test_fit_linear_rate_exact_and_noisy():
    t = np.arange(60)
    rate, r2 = theory.fit_linear_rate(t, 3.0 * 0.9**t)
    assert rate == pytest.approx(0.9, rel=1e-12) and r2 == pytest.approx(1.0, abs=1e-12)
    noisy = 3.0 * 0.9**t * np.exp(0.2 * np.random.default_rng(0).standard_normal(t.size))
    rate, r2 = theory.fit_linear_rate(t, noisy)
    assert rate == pytest.approx(0.9, rel=0.01) and 0.5 < r2 < 0.999


def test_fit_linear_rate_window_and_bad_values():
    t = np.arange(40)
    losses = np.where(t < 20, 0.5**t, 0.5**20 * 0.8 ** (t - 20))
    assert theory.fit_linear_rate(t, losses, window=15)[0] == pytest.approx(0.8, rel=1e-10)
    losses[[25, 30, 35]] = [0.0, np.nan, np.inf]
    rate, r2 = theory.fit_linear_rate(t, losses, window=15)
    assert rate == pytest.approx(0.8, rel=1e-10) and r2 == pytest.approx(1.0)
    assert all(math.isnan(v) for v in theory.fit_linear_rate([0, 1, 2], [1.0, np.nan, 0.5]))


def two_layer(x):
    def f(params):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    return f


def explicit_jacobian(f, params):
    theta, unravel = ravel_pytree(params)
    return np.asarray(jax.jit(jax.jacfwd(lambda t: jnp.ravel(f(unravel(t)))))(theta))


@pytest.mark.parametrize(
    "samples,width,hidden,out",
    [(4, 3, 5, 2), (20, 3, 2, 1)],  # n = 8 < p = 25; n = 20 > p = 8
)
def test_tangent_kernel_eigenvalues(samples, width, hidden, out):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((samples, width)))
        params = {
            "w1": jnp.asarray(rng.standard_normal((width, hidden))),
            "w2": jnp.asarray(rng.standard_normal((hidden, out))),
        }
        f = two_layer(x)
        n, p = theory.jacobian_shape(f, params)
        assert (n, p) == (samples * out, width * hidden + hidden * out)
        jac = explicit_jacobian(f, params)
        k_eig = np.linalg.eigvalsh(jac @ jac.T)
        g_eig = np.linalg.eigvalsh(jac.T @ jac)
        r = min(n, p)
        np.testing.assert_allclose(k_eig[-r:], g_eig[-r:], rtol=1e-10)
        lam_min, lam_max = jax.jit(theory.tangent_kernel_eigenvalues, static_argnums=0)(f, params)
        np.testing.assert_allclose(lam_max, k_eig[-1], rtol=1e-10)
        np.testing.assert_allclose(lam_min, k_eig[0], rtol=1e-10, atol=1e-10 * k_eig[-1])
        if n > p:
            assert lam_min == 0.0
        else:
            assert lam_min > 0.0
        assert theory.jacobian_size(*theory.jacobian_shape(f, params)) == n * p


def gradient_descent_ratios(a, y, lr, steps, loss_scale):
    """GD on loss_scale·½‖Aθ − y‖² from θ = 0; returns (steps,) ratios L_{t+1}/L_t."""
    theta = np.zeros(a.shape[1])
    losses = []
    for _ in range(steps + 1):
        r = a @ theta - y
        losses.append(0.5 * loss_scale * r @ r)
        theta -= lr * loss_scale * (a.T @ r)
    return contraction_factors(losses)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_certificate_exact_for_linear_least_squares(reduction):
    rng = np.random.default_rng(1)
    n, p = 6, 10
    a, y = rng.standard_normal((n, p)), rng.standard_normal(n)
    with jax.enable_x64(True):
        lam_min, lam_max = (
            float(v)
            for v in theory.tangent_kernel_eigenvalues(lambda th: jnp.asarray(a) @ th, jnp.zeros(p))
        )
    scale = 1.0 if reduction == "sum" else 1.0 / n
    lr = 1.0 / (lam_max * scale)  # η' = 1/λ_max
    ratios = gradient_descent_ratios(a, y, lr, 200, scale)
    bound = theory.certificate_bound(lr, lam_min, loss_scale=scale)
    assert hold_fraction(ratios, bound) == 1.0
    assert ratios[-1] == pytest.approx(bound, rel=1e-3)  # the slowest direction dominates: tight


def test_stable_lr_separates_convergence_from_divergence():
    rng = np.random.default_rng(2)
    a, y = rng.standard_normal((5, 8)), rng.standard_normal(5)
    lam_max = np.linalg.eigvalsh(a @ a.T)[-1]
    lr = theory.stable_lr(lam_max, loss_scale=1 / 5)
    assert np.all(gradient_descent_ratios(a, y, 0.99 * lr, 300, 1 / 5)[-50:] < 1.0)
    assert np.all(gradient_descent_ratios(a, y, 1.01 * lr, 300, 1 / 5)[-50:] > 1.0)


def test_bound_holds_and_hold_fraction():
    measured = np.array([0.5, 0.9, np.nan, 0.81])
    np.testing.assert_array_equal(theory.bound_holds(measured, 0.81), [True, False, False, True])
    assert hold_fraction(measured, 0.81) == pytest.approx(2 / 3)
    assert hold_fraction(measured, [0.81, 0.81, 0.81, np.nan]) == 0.5
    assert math.isnan(hold_fraction([np.nan], 1.0))


def test_rate_fit_floor_follows_the_training_dtype():
    """Losses at float32's floor (a plateau below 1e-7 · L_0) are cut from a float32 fit only."""
    steps = np.arange(0, 300, 10)
    losses = np.maximum(0.9**steps, 1e-9)  # 0.9 per step down to 1e-9, then flat
    rate32, r2_32 = fit_rate(steps, losses, fit_floor("float32"))
    assert fit_floor("float32") == FIT_FLOOR
    np.testing.assert_allclose(rate32, 0.9, rtol=1e-9)
    assert r2_32 > 0.999999
    rate64, _ = fit_rate(steps, losses, fit_floor("float64"))
    assert 1e-16 < fit_floor("float64") < 1e-15
    assert rate64 > 0.91  # the plateau, real in float64, bends the fit
