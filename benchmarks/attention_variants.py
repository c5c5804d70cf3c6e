"""Formulations of the attention block at the Jena-like size, timed against the library's.

    python -m benchmarks.attention_variants [--runs 1] [--repeats 9]

One GD step (value_and_grad of ½‖F − Y‖², plain update, 5 steps per call in a fori_loop, vmapped
over --runs runs) of a one-layer model of the paper's shape at P=512, M=24, d=d_QK=6, d_h=32,
d_y=1, with the attention written five ways:

  library     resconv_jax.models.fast_ops: Q Kᵀ and S V as canonical batched dots, as written
  transposed  the same, with the narrow products (S V, ∂logits K: (M × M)(M × d)) computed
              transposed (`fast_ops.products(transpose_narrow=True)`)
  bcast       Q Kᵀ and S V as broadcast-multiply-and-reduce (no dots; d = 6 is tiny)
  prescale    the 1/sqrt(d_QK) scale folded into W_Q (one less pass over the M × M logits)
  keys_major  logits stored keys-major (P, M_k, M_q), softmax over the non-minor axis

The losses after 5 steps are printed for every variant before the times. "bcast" sums in another
order than the dot kernels: its Attn(X) agrees to 1e-6 and its gradient to 1e-7 relative, and its
loss after 5 steps to ~3e-4 (these large steps, the loss halving in 5, amplify rounding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from resconv_jax.models.fast_ops import products, softmax, softmax_rows  # noqa: E402

P, M, D, D_QK, D_H = 512, 24, 6, 6, 32
STEPS_PER_CALL = 5


def attention(variant: str, x: jax.Array, w_q, w_k, w_v) -> jax.Array:
    """Attn(X): (P, M, d) -> (P, M, d), written as `variant`."""
    scale = 1 / np.sqrt(D_QK)
    matmul, matmul_nt = products(transpose_narrow=variant == "transposed")
    if variant == "prescale":
        w_q = w_q * scale
    qkv = matmul(x, jnp.concatenate([w_q, w_k, w_v], axis=1))
    q, k, v = qkv[..., :D_QK], qkv[..., D_QK : 2 * D_QK], qkv[..., 2 * D_QK :]
    if variant in ("library", "transposed"):
        return matmul(softmax_rows(matmul_nt(q, k) * scale), v)
    if variant == "prescale":
        return matmul(softmax_rows(matmul_nt(q, k)), v)
    if variant == "bcast":
        logits = jnp.sum(q[:, :, None, :] * k[:, None, :, :], -1) * scale
        return jnp.sum(softmax_rows(logits)[..., None] * v[:, None, :, :], axis=2)
    if variant == "keys_major":
        s_t = softmax(matmul_nt(k, q) * scale, axis=-2)  # (P, M_k, M_q), over the keys
        return matmul(jax.lax.optimization_barrier(jnp.swapaxes(s_t, -1, -2)), v)
    raise ValueError(variant)


def _difference(params, reference) -> str:
    """'the same bits' or the largest difference relative to each weight's largest entry."""
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True))
    if all(np.array_equal(a, b) for a, b in pairs):
        return "the same bits"
    worst = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
    return f"{worst:.1e} relative"


def make_steps(variant: str, x: jax.Array, y: jax.Array):
    """Jitted (params with a run axis) -> (params, (R,) losses) after STEPS_PER_CALL steps."""

    def loss(p):
        z = attention(variant, x, p["w_q"], p["w_k"], p["w_v"]) + x
        matmul = products(transpose_narrow=variant == "transposed")[0]
        h = matmul(jax.nn.relu(matmul(z, p["w_1"])), p["w_2"]) + z
        return 0.5 * jnp.sum((h @ p["w_u"] - y) ** 2)

    def step(p):
        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, g: a - 1e-5 * g, p, grads), value

    def steps(params):
        runs = jax.tree.leaves(params)[0].shape[0]
        body = lambda _, carry: jax.vmap(step)(carry[0])  # noqa: E731
        return jax.lax.fori_loop(0, STEPS_PER_CALL, body, (params, jnp.zeros(runs)))

    return jax.jit(steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    keys = jax.random.split(jax.random.key(0), 8)
    shapes = {
        "w_q": (D, D_QK),
        "w_k": (D, D_QK),
        "w_v": (D, D),
        "w_1": (D, D_H),
        "w_2": (D_H, D),
        "w_u": (D, 1),
    }
    params = {
        name: jnp.stack([jax.random.normal(key, shape) / np.sqrt(shape[0])] * args.runs)
        for key, (name, shape) in zip(keys, shapes.items(), strict=False)
    }
    x = jax.random.normal(keys[6], (P, M, D))
    y = jax.random.normal(keys[7], (P, M, 1))
    variants = ("library", "transposed", "bcast", "prescale", "keys_major")
    fns = {v: make_steps(v, x, y) for v in variants}
    after = {}
    for v, f in fns.items():
        after[v], losses = f(params)
        print(
            f"{v}: losses after {STEPS_PER_CALL} steps {np.asarray(losses)}, "
            f"{_difference(after[v], after['library'])} from the library's parameters"
        )
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f(params))
            times[v].append((time.perf_counter() - start) / STEPS_PER_CALL)
    base = np.median(times["library"])
    print(f"P={P} M={M} d={D} d_qk={D_QK} d_h={D_H}, {args.runs} run(s), load {os.getloadavg()}")
    for v in variants:
        t = np.median(times[v])
        print(f"  {v:11s} {t * 1e3:7.2f} ms/step  {base / t:5.2f}x of library")


if __name__ == "__main__":
    main()
