"""Matrix products and softmax with hand-written derivatives that run fast on XLA:CPU.

XLA:CPU sends a dot to its fast (YNNPACK) kernels only in canonical form: lhs (batch, m, k), rhs
(batch, k, n), both row-major. The backward pass of `a @ b` is full of products contracted over the
rows of both operands (∂W = Xᵀ G over all tokens, ∂V = Sᵀ G, ∂K = ∂logitsᵀ Q). Under `jax.vmap`
over the runs of a sweep XLA folds the transposes into the dots' dimension numbers, the fast
kernels reject them, and they fall back to a per-matrix loop: at P=512, M=24, d=6 the vmapped
5-run step was 0.8× the speed of five single-run steps (benchmarks/RESULTS.md). Here the
backward products multiply by an explicitly transposed copy, kept as a copy by an optimization
barrier, so every backward dot is canonical, vmapped or not.

Canonical batched products can also be slow when their result is narrow: at M=24, d=6 the
(M × M)·(M × d) products S·V and ∂logits·K. With `products(transpose_narrow=True)`
(`config.model.transformer.transpose_narrow_products`) a narrow batched product (n < m) is
computed transposed, (bᵀ aᵀ)ᵀ (`_narrow_times`): each output element is the same sum
of the same terms, but the kernels may add them in another order, so the result agrees within
rounding, and bitwise only on some CPUs. Measured: on an AMD EPYC, the same bits and the
Jena-size step 1.11× faster (2026-12-03, `benchmarks.op_profile --P 2041` before and after);
on an AVX-512 Intel Xeon, other bits (parameters 7.9e-8 apart, relative, after 5 steps) and
0.96–0.98× the step's speed at P = 512 (2026-12-04, `python -m benchmarks.attention_variants`).
Off by default, so that a run's numbers are those of the products as written on every CPU;
`benchmarks.attention_variants` times both on the machine at hand.

`products`' `matmul` and `matmul_nt` have a custom VJP: reverse mode only. Forward-mode
differentiation (`jax.jvp`, `jax.jacfwd`) through them raises, so the model uses them only when
asked (`fast_backward=True`, the training loss); the tangent kernel differentiates the plain model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _materialized_transpose(a: jax.Array) -> jax.Array:
    """`a` (..., m, n) -> (..., n, m), as a real copy the consuming dot cannot fold away."""
    return jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))


def _transposed_times(a: jax.Array, g: jax.Array) -> jax.Array:
    """aᵀ g over the last two axes, a: (..., n, k), g: (..., n, m) -> (..., k, m), canonically.

    The narrower operand is the one copied transposed; when that is g, (gᵀ a)ᵀ is computed and
    its small (m, k) result transposed back.
    """
    if a.shape[-1] <= g.shape[-1]:
        return _materialized_transpose(a) @ g
    return _materialized_transpose(jax.lax.optimization_barrier(_materialized_transpose(g) @ a))


def _narrow_times(a: jax.Array, b: jax.Array) -> jax.Array:
    """a b over the last two axes, a: (..., m, k), b: (..., k, n) -> (..., m, n); a result
    narrower than it is tall (n < m) computed as (bᵀ aᵀ)ᵀ, a wide product."""
    if b.shape[-1] < a.shape[-2]:
        return _materialized_transpose(
            jax.lax.optimization_barrier(_materialized_transpose(b) @ _materialized_transpose(a))
        )
    return a @ b


@functools.cache
def products(transpose_narrow: bool = False) -> tuple[Callable, Callable]:
    """(`matmul`, `matmul_nt`) with canonical backward dots; with `transpose_narrow`, their
    narrow batched products computed transposed (`_narrow_times`, see above)."""
    times = _narrow_times if transpose_narrow else jnp.matmul

    def times_transposed(g, b):  # g bᵀ: (..., m, n)(..., k, n) -> (..., m, k)
        if transpose_narrow:
            return _narrow_times(g, _materialized_transpose(b))
        return g @ jnp.swapaxes(b, -1, -2)  # as written: XLA folds the transpose into the dot

    def weight_or_batched_times(a, b):
        return a @ b if b.ndim == 2 else times(a, b)

    @jax.custom_vjp
    def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
        """`a @ b`: a (..., n, k) with b a weight (k, m) or batched like a (..., k, m)."""
        return weight_or_batched_times(a, b)

    def matmul_fwd(a, b):
        return weight_or_batched_times(a, b), (a, b)

    def matmul_bwd(residuals, g):
        a, b = residuals
        if b.ndim == 2:  # a weight: contract over every leading axis of a, as one matrix product
            db = _transposed_times(a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1]))
            return (g @ b.T).astype(a.dtype), db.astype(b.dtype)
        return times_transposed(g, b).astype(a.dtype), _transposed_times(a, g).astype(b.dtype)

    matmul.defvjp(matmul_fwd, matmul_bwd)

    @jax.custom_vjp
    def matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
        """`a @ bᵀ` over the last two axes (Q Kᵀ): a (..., n, k), b (..., m, k) -> (..., n, m)."""
        return a @ jnp.swapaxes(b, -1, -2)

    def matmul_nt_fwd(a, b):
        return a @ jnp.swapaxes(b, -1, -2), (a, b)

    def matmul_nt_bwd(residuals, g):
        a, b = residuals
        return times(g, b).astype(a.dtype), _transposed_times(g, a).astype(b.dtype)

    matmul_nt.defvjp(matmul_nt_fwd, matmul_nt_bwd)
    return matmul, matmul_nt


def plain_matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ bᵀ` over the last two axes, differentiated by JAX (forward and reverse mode)."""
    return a @ jnp.swapaxes(b, -1, -2)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def softmax(logits: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax over `axis`, differentiated as y ⊙ (ẋ − Σ y ⊙ ẋ) (forward and reverse mode).

    `jax.nn.softmax` is differentiated through exp(x − max) / Σ, a longer chain of passes over the
    (..., M, M) logits.
    """
    unnormalized = jnp.exp(logits - jax.lax.stop_gradient(logits.max(axis, keepdims=True)))
    return unnormalized / unnormalized.sum(axis, keepdims=True)


@softmax.defjvp
def _softmax_jvp(axis, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = softmax(x, axis)
    return y, y * (x_dot - jnp.sum(y * x_dot, axis=axis, keepdims=True))


def softmax_rows(logits: jax.Array) -> jax.Array:
    """`softmax` over the last axis: (..., M, M) attention logits -> rows of weights."""
    return softmax(logits, -1)
