"""One run's Jacobian J = ∂ vec f/∂θ as a pair of linear maps, and the tangent kernel's extreme
eigenvalues from them.

The tangent-kernel code (dense, power iteration, Lanczos) sees J only through `JacobianOps`, so
the same code serves J of a whole batch (`of_function`) and J formed microbatch by microbatch
(`microbatched`: J u one microbatch's rows at a time, Jᵀ v summed over microbatches), whose
memory is one microbatch's activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

_HI = jax.lax.Precision.HIGHEST


class JacobianOps(NamedTuple):
    """J (n, p) at θ: theta (p,) the raveled parameters, jvp: u (p,) -> J u (n,), vjp: v (n,) ->
    Jᵀ v (p,), both in θ's dtype; num_outputs: n."""

    theta: jax.Array
    jvp: Callable
    vjp: Callable
    num_outputs: int


def of_function(f: Callable, params) -> JacobianOps:
    """J of `f` (params pytree -> array, n entries once flattened) at `params`."""
    theta, unravel = ravel_pytree(params)
    dtype = theta.dtype

    def flat_f(t):
        return jnp.ravel(f(unravel(t)))

    out = jax.eval_shape(flat_f, theta)
    _, pullback = jax.vjp(flat_f, theta)

    def jvp(u):
        return jax.jvp(flat_f, (theta,), (u.astype(dtype),))[1].astype(dtype)

    def vjp(v):
        return pullback(v.astype(out.dtype))[0].astype(dtype)

    return JacobianOps(theta, jvp, vjp, out.size)


def microbatched(f: Callable, params, x, batches) -> JacobianOps:
    """J of `f(params, x)` (outputs (P, ...)) over all P samples of `x`, taken in `batches`
    (`microbatch.Microbatches`): f is only ever called on one microbatch (S·n, ...)."""
    theta, unravel = ravel_pytree(params)
    dtype = theta.dtype

    def part(t, k):
        return f(unravel(t), batches.take(x, k))

    one = jax.eval_shape(part, theta, 0)
    shape = (batches.num_samples, *one.shape[1:])

    def jvp(u):
        def body(k, out):
            tangent = jax.jvp(lambda t: part(t, k), (theta,), (u.astype(dtype),))[1]
            return batches.put(out, k, tangent.astype(dtype))

        return jnp.ravel(jax.lax.fori_loop(0, batches.count, body, jnp.zeros(shape, dtype)))

    def vjp(v):
        v = v.reshape(shape)

        def one_part(k):
            weights = batches.weights(k, dtype).reshape(-1, *[1] * (len(shape) - 1))
            _, pullback = jax.vjp(lambda t: part(t, k), theta)
            cotangent = (batches.take(v, k) * weights).astype(one.dtype)
            return pullback(cotangent)[0].astype(dtype)

        return batches.sum(one_part, jnp.zeros_like(theta))

    n = 1
    for size in shape:
        n *= size
    return JacobianOps(theta, jvp, vjp, n)


def dense_eigenvalues(ops: JacobianOps) -> tuple[jax.Array, jax.Array]:
    """(λ_min(K), λ_max(K)) of K = J Jᵀ (n, n), clipped at 0, from J formed whole.

    n ≤ p: J by n VJPs and K diagonalized; n > p: J by p JVPs and G = Jᵀ J (p, p), which shares
    K's nonzero eigenvalues, diagonalized (λ_min(K) = 0 exactly, rank K ≤ p < n).
    """
    n, p, dtype = ops.num_outputs, ops.theta.size, ops.theta.dtype
    if n <= p:
        jac = jax.vmap(ops.vjp)(jnp.eye(n, dtype=dtype))  # (n, p)
        eig = jnp.linalg.eigvalsh(jnp.matmul(jac, jac.T, precision=_HI))
        lam_min = eig[0]
    else:
        jac = jax.vmap(ops.jvp)(jnp.eye(p, dtype=dtype))  # (p, n): Jᵀ
        eig = jnp.linalg.eigvalsh(jnp.matmul(jac, jac.T, precision=_HI))
        lam_min = jnp.zeros_like(eig[0])
    return jnp.maximum(lam_min, 0), eig[-1]


def power_lambda_max(ops: JacobianOps, *, iterations: int = 30) -> jax.Array:
    """λ_max(K) by power iteration on Jᵀ J, matrix-free (one JVP and one VJP per iteration).

    The estimate rises to λ_max from below; 30 iterations from a fixed start vector are within a
    few percent unless the top two eigenvalues nearly coincide.
    """
    theta = ops.theta

    def body(_, carry):
        u, _ = carry
        w = ops.vjp(ops.jvp(u))
        norm = jnp.linalg.norm(w)
        return w / jnp.maximum(norm, jnp.finfo(w.dtype).tiny), norm

    start = jnp.cos(jnp.arange(theta.size, dtype=theta.dtype) * 0.7 + 0.3)
    u0 = start / jnp.linalg.norm(start)
    _, lam = jax.lax.fori_loop(0, iterations, body, (u0, jnp.zeros((), theta.dtype)))
    return lam
