"""What the trainer needs from a model, written once; the paper's Transformer and GPT-2 have it.

The trainer, the step, the probe, the tangent kernel and the checkpoints see a `Model` only: a
graph definition, a pure forward function, and an initializer per seed. The loss belongs to the
task (step.py), not to the model. A model module (`models/NAME.py` or `models/NAME/`) provides
`default_config()` (its section `config.model.NAME`) and `build(model_cfg, dataset) -> Model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from flax import nnx


class RunSettings(NamedTuple):
    """The values a run gives its model that training does not learn (a sweep varies them).

    Each is a scalar for one run, or an array (R,) over the runs of a sweep (a pytree: vmapped
    with the parameters). beta_attn: β_a in Z = Attn(X) + β_a X; beta_ffn: β_f in
    H = MLP(Z) + β_f Z (1: the usual residual, 0: none).
    """

    beta_attn: jax.Array | float = 1.0
    beta_ffn: jax.Array | float = 1.0


def _check_settings(settings) -> None:
    if not isinstance(settings, RunSettings):
        raise TypeError(f"settings: expected a RunSettings, got {type(settings).__name__}")


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the trainer sees it.

    graphdef: the NNX graph. forward: the pure `forward(graphdef, params, inputs, settings, *,
    return_intermediates)` with `settings` a `RunSettings`. forward_for_grad: the same function,
    for reverse-mode differentiation only, which a model may make faster (the paper's
    Transformer: custom-VJP products); None: `forward`. init: seed -> the parameters of one run
    (a plain pytree).
    """

    graphdef: nnx.GraphDef
    forward: Callable
    init: Callable[[int], dict]
    description: str
    forward_for_grad: Callable | None = None

    def apply(self, params, inputs, settings: RunSettings, *, return_intermediates=False):
        """F(inputs) for one run with its `settings`.

        With `return_intermediates`, also {"attn", "z"}: per layer the attention sublayer's output
        and the residual stream right after it, each (L, P, T, d), plus "row_mask" (P, T) when
        some rows are padding.
        """
        _check_settings(settings)
        return self.forward(
            self.graphdef, params, inputs, settings, return_intermediates=return_intermediates
        )

    def apply_for_grad(self, params, inputs, settings: RunSettings, *, return_intermediates=False):
        """`apply`, to be differentiated in reverse mode only (jax.grad, jax.vjp)."""
        _check_settings(settings)
        forward = self.forward_for_grad or self.forward
        return forward(
            self.graphdef, params, inputs, settings, return_intermediates=return_intermediates
        )

    def init_runs(self, seeds) -> dict:
        """The parameters of one run per seed, stacked on a leading run axis (R, ...)."""
        params = [self.init(int(seed)) for seed in seeds]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)
