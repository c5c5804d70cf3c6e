"""What the trainer needs from a model, written once; the paper's Transformer and GPT-2 have it.

The trainer, the step, the probe, the tangent kernel and the checkpoints see a `Model` only: a
graph definition, a pure forward function, and an initializer per seed. The loss belongs to the
task (step.py), not to the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the trainer sees it.

    graphdef: the NNX graph. forward: the module's pure `apply(graphdef, params, inputs, beta_attn,
    beta_ffn, *, return_intermediates, [fast_backward])`. init: seed -> the parameters of one run
    (a plain pytree). fast_backward: whether forward takes `fast_backward` (custom-VJP products).
    """

    graphdef: nnx.GraphDef
    forward: Callable
    init: Callable[[int], dict]
    description: str
    fast_backward: bool = False

    def apply(self, params, inputs, hparams, *, return_intermediates=False, fast_backward=False):
        """F(inputs) for one run; `hparams` holds its β_a, β_f ("beta_attn", "beta_ffn").

        With `return_intermediates`, also {"attn", "z"}: per layer the attention sublayer's output
        and the residual stream right after it, each (L, P, T, d), plus "row_mask" (P, T) when
        some rows are padding.
        """
        kwargs = {"return_intermediates": return_intermediates}
        if self.fast_backward:
            kwargs["fast_backward"] = fast_backward
        beta_attn, beta_ffn = hparams["beta_attn"], hparams["beta_ffn"]
        return self.forward(self.graphdef, params, inputs, beta_attn, beta_ffn, **kwargs)

    def init_runs(self, seeds) -> dict:
        """The parameters of one run per seed, stacked on a leading run axis (R, ...)."""
        params = [self.init(int(seed)) for seed in seeds]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)
