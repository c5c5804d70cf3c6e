"""Extreme eigenvalues of the empirical tangent kernel K = J Jᵀ by Lanczos, matrix-free.

`theory.tangent_kernel_eigenvalues` forms the (n, p) Jacobian J = ∂ vec f/∂θ, which stops fitting
in memory long before the models of interest do. Here K (or G = Jᵀ J) is only applied to vectors,
K v = J (Jᵀ v): one VJP and one JVP of f per product, so the memory is the (k, m) Lanczos basis plus
what one VJP and one JVP need. With full reorthogonalization the k = m case is the dense answer,
and with k < m the extreme Ritz values come with true residuals ‖K y − θ y‖ as their accuracy.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from resconv_jax.analysis import jacobian

_HI = jax.lax.Precision.HIGHEST


class KernelSpectrum(NamedTuple):
    """Extreme eigenvalue estimates of K = J Jᵀ (all fields () arrays, except `products`).

    lam_min: the smallest Ritz value, clipped at 0; exactly 0 when n > p (rank K ≤ p < n). With
      k < m Lanczos steps it is an upper bound on λ_min(K) (interlacing); with k = m it is λ_min(K).
      K has an eigenvalue within res_min of the (unclipped) Ritz value, so lam_min ≤ res_min means
      "λ_min(K) = 0 to the stated accuracy".
    lam_max: the largest Ritz value, clipped at 0; a lower bound on λ_max(K), exact when k = m.
    res_min, res_max: true residuals ‖A y − θ y‖ of the unit Ritz vectors y, A the operator
      (K if n ≤ p, else G = Jᵀ J, whose nonzero eigenvalues are K's); res_min is 0 when n > p.
    products: the number of operator products used, k + 2 if n ≤ p, else k + 1: a Python int
      from a traced call, an integer array once returned through `jax.jit` or `jax.lax.map`.
    """

    lam_min: jax.Array
    lam_max: jax.Array
    res_min: jax.Array
    res_max: jax.Array
    products: int


def tangent_kernel_lanczos(f: Callable, params, *, iterations: int) -> KernelSpectrum:
    """λ_min and λ_max of K = J Jᵀ (n, n) by k = min(iterations, m) Lanczos steps.

    Args:
      f: params pytree -> array of any shape (n entries once flattened); static under jit.
      params: pytree; θ is all leaves raveled (p entries), J = ∂ vec f/∂θ is (n, p), never formed.
      iterations: Lanczos steps (static). The operator is A = K (m = n) if n ≤ p, else A = G = Jᵀ J
        (m = p), and iterations ≥ m gives the eigenvalues of A exactly (to rounding).
    Returns:
      `KernelSpectrum`. Costs `products` = k + 2 (n ≤ p) or k + 1 (n > p) products with A, each one
      JVP and one VJP of f, plus one forward pass; the memory is the (k, m) basis buffer. Full
      reorthogonalization (classical Gram–Schmidt, twice) keeps the basis orthonormal; a
      breakdown (an invariant subspace, e.g. K of rank < k) restarts from the coordinate vector
      farthest from the basis, so the Ritz values stay exact and nothing divides by zero.
      Jit-able, and works under `jax.vmap` and `jax.lax.map` (fixed-size loops only).
    """
    return kernel_lanczos(jacobian.of_function(f, params), iterations=iterations)


def kernel_lanczos(ops: jacobian.JacobianOps, *, iterations: int) -> KernelSpectrum:
    """`tangent_kernel_lanczos` for J given as linear maps (`jacobian.JacobianOps`: of a
    function, or formed microbatch by microbatch)."""
    if iterations < 1:
        raise ValueError(f"iterations must be ≥ 1, got {iterations}")
    dtype = ops.theta.dtype
    n, p, jvp, vjp = ops.num_outputs, ops.theta.size, ops.jvp, ops.vjp
    if n <= p:
        m, apply = n, lambda v: jvp(vjp(v))
    else:
        m, apply = p, lambda u: vjp(jvp(u))
    k = min(iterations, m)
    basis, alphas, betas = _lanczos(apply, m, k, dtype)

    off = betas[: k - 1]
    tri = jnp.diag(alphas) + jnp.diag(off, 1) + jnp.diag(off, -1)
    ritz, vectors = jnp.linalg.eigh(tri)
    ends = jnp.stack([vectors[:, 0], vectors[:, -1]])  # (2, k): Ritz vectors of θ_min, θ_max
    ritz_ends = jnp.stack([ritz[0], ritz[-1]])
    if n > p:  # only θ_max's residual is needed
        ends, ritz_ends = ends[1:], ritz_ends[1:]
    ys = jnp.matmul(ends, basis, precision=_HI)  # (2 or 1, m)
    ys = ys / _floor(jnp.linalg.norm(ys, axis=1, keepdims=True))
    res = jnp.linalg.norm(jax.vmap(apply)(ys) - ritz_ends[:, None] * ys, axis=1)
    zero, products = jnp.zeros((), dtype), num_products(iterations, n, p)
    if n > p:
        return KernelSpectrum(zero, jnp.maximum(ritz[-1], 0), zero, res[0], products)
    return KernelSpectrum(
        jnp.maximum(ritz[0], 0), jnp.maximum(ritz[-1], 0), res[0], res[1], products
    )


def num_products(iterations: int, n: int, p: int) -> int:
    """Operator products one `tangent_kernel_lanczos` call uses for J of shape (n, p): the
    k = min(iterations, m) Lanczos steps and one residual product per reported extreme."""
    if n <= p:
        return min(iterations, n) + 2
    return min(iterations, p) + 1


def _floor(x):
    return jnp.maximum(x, jnp.finfo(x.dtype).tiny)


def _orthogonalize(basis, w):
    """w (m,) minus its projection on the rows of basis (k, m), twice; and the total coefficients.

    Rows not yet filled are zero, so they take no part.
    """
    h1 = jnp.matmul(basis, w, precision=_HI)
    w = w - jnp.matmul(h1, basis, precision=_HI)
    h2 = jnp.matmul(basis, w, precision=_HI)
    return w - jnp.matmul(h2, basis, precision=_HI), h1 + h2


def _lanczos(apply: Callable, m: int, k: int, dtype):
    """k Lanczos steps of the symmetric (m, m) operator `apply` with full reorthogonalization.

    Returns the orthonormal basis (k, m), the diagonal α (k,) of T, and β (k,): T's off-diagonal
    in β[:k − 1]. β_j ≤ √m·eps·max_i ‖A v_i‖ is a breakdown: β_j is set to 0 and the next vector
    is a restart. A larger β_j that is still at rounding level is kept; its vector, noise
    reorthogonalized twice, is an orthonormal restart as good as any.
    """
    start = jnp.cos(jnp.arange(m, dtype=dtype) * 0.7 + 0.3)
    basis = jnp.zeros((k, m), dtype).at[0].set(start / jnp.linalg.norm(start))
    eps = jnp.finfo(dtype).eps
    tol_factor = math.sqrt(m) * eps

    def restart(basis):
        # e_i with the smallest projection on the basis: ‖(I − VᵀV) e_i‖² ≥ 1 − rows/m > 0.
        i = jnp.argmin(jnp.sum(jnp.square(basis), axis=0))
        w, _ = _orthogonalize(basis, jax.nn.one_hot(i, m, dtype=dtype))
        return w / _floor(jnp.linalg.norm(w))

    def body(j, carry):
        basis, alphas, betas, scale = carry
        w = apply(basis[j])
        scale = jnp.maximum(scale, jnp.linalg.norm(w))  # ≤ ‖A‖, the size of rounding in w
        w, coefs = _orthogonalize(basis, w)
        beta = jnp.linalg.norm(w)
        broke = beta <= tol_factor * scale
        nxt = jax.lax.cond(broke, restart, lambda _: w / _floor(beta), basis)
        basis = basis.at[j + 1].set(nxt, mode="drop")  # dropped at j = k − 1
        alphas = alphas.at[j].set(coefs[j])
        betas = betas.at[j].set(jnp.where(broke, 0, beta))
        return basis, alphas, betas, scale

    zeros = jnp.zeros((k,), dtype)
    init = (basis, zeros, zeros, jnp.zeros((), dtype))
    basis, alphas, betas, _ = jax.lax.fori_loop(0, k, body, init)
    return basis, alphas, betas
