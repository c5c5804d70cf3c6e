"""A full batch taken in microbatches inside a compiled function (train.microbatch_size).

The P samples are split over the mesh's 'data' axis into S shards of P/S. Microbatch k takes, from
every shard at once, its samples [k·n, (k+1)·n): a (S·n,) batch still split over 'data', so the
devices work in parallel and nothing moves between them. When n does not divide P/S the last
microbatch starts at P/S − n instead, and the samples an earlier microbatch already took get
weight 0: every sample counts exactly once and no array is padded or copied. Sums over
microbatches (losses, gradients, the probe's sums) run in a `jax.lax.fori_loop` of static length,
accumulated in the dtype of what is summed (the training dtype).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Microbatches:
    """The microbatches of a batch of `num_samples` split into `num_shards` equal shards.

    size: n, samples per shard per microbatch (at most the shard's); count: ⌈(P/S)/n⌉.
    """

    num_samples: int
    num_shards: int
    requested: int

    @property
    def shard(self) -> int:
        """P/S, the samples of one shard."""
        return self.num_samples // self.num_shards

    @property
    def size(self) -> int:
        return min(self.requested, self.shard)

    @property
    def count(self) -> int:
        return math.ceil(self.shard / self.size)

    @property
    def batch(self) -> int:
        """S·n, the samples of one microbatch (all shards)."""
        return self.num_shards * self.size

    def _start(self, k):
        return jnp.minimum(k * self.size, self.shard - self.size)

    def take(self, tree, k):
        """Microbatch k of every (P, ...) leaf of `tree`: (S·n, ...) leaves."""

        def one(leaf):
            shards = leaf.reshape(self.num_shards, self.shard, *leaf.shape[1:])
            part = jax.lax.dynamic_slice_in_dim(shards, self._start(k), self.size, axis=1)
            return part.reshape(self.batch, *leaf.shape[1:])

        return jax.tree.map(one, tree)

    def weights(self, k, dtype) -> jax.Array:
        """(S·n,) 1 for the samples microbatch k counts, 0 for those an earlier one took."""
        position = self._start(k) + jnp.arange(self.size)
        new = (position >= k * self.size).astype(dtype)
        return jnp.tile(new, self.num_shards)

    def put(self, out: jax.Array, k, part: jax.Array) -> jax.Array:
        """`out` (P, ...) with microbatch k's rows replaced by `part` (S·n, ...)."""
        shards = out.reshape(self.num_shards, self.shard, *out.shape[1:])
        part = part.reshape(self.num_shards, self.size, *part.shape[1:])
        shards = jax.lax.dynamic_update_slice_in_dim(shards, part, self._start(k), axis=1)
        return shards.reshape(out.shape)

    def sum(self, fn, init):
        """Σ_k fn(k) over the microbatches, a pytree like `init` (zeros), in a fori loop."""

        def body(k, total):
            return jax.tree.map(jnp.add, total, fn(k))

        return jax.lax.fori_loop(0, self.count, body, init)

    def describe(self) -> str:
        """'microbatches of n samples per device (k per step)'."""
        samples = "sample" if self.size == 1 else "samples"
        return f"microbatches of {self.size} {samples} per device ({self.count} per step)"


def zeros_like(tree):
    """Zeros of the shapes and dtypes of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
