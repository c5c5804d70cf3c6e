"""Pure training functions: the GD step of one run, vmapped over the runs of a sweep, and a loop of
steps that runs on device between log steps.

A train state is `{"params": ..., "opt_state": ...}` with a leading run axis R on every leaf.
Per-run settings that are not trained (β_a, β_f) travel as `hp`, a `models.RunSettings` of (R,)
arrays; the step size lives in the optimizer state (`optax.inject_hyperparams`), so it can differ
per run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from resconv_jax.analysis import jacobian
from resconv_jax.analysis.probe import collapse_residual
from resconv_jax.models.interface import Model

# The step size is each run's, set in its optimizer state by `init_opt_state` only; NaN until
# then, so that a state built without it cannot train.
_UNSET = float("nan")


def make_optimizer(optim_cfg) -> optax.GradientTransformation:
    """Plain GD (`optax.sgd`), or the momentum / Adam ablations (`optim_cfg.name`, `.momentum`),
    with the step size a hyperparameter in the state (`init_opt_state`)."""
    if optim_cfg.name == "sgd":
        return optax.inject_hyperparams(optax.sgd)(learning_rate=_UNSET)
    if optim_cfg.name == "momentum":
        return optax.inject_hyperparams(optax.sgd)(
            learning_rate=_UNSET, momentum=optim_cfg.momentum
        )
    return optax.inject_hyperparams(optax.adam)(learning_rate=_UNSET)


def init_opt_state(optimizer: optax.GradientTransformation, params, lrs: jax.Array):
    """Optimizer states for stacked params (R, ...) with per-run step sizes lrs (R,)."""

    def init_one(p, lr):
        state = optimizer.init(p)
        state.hyperparams["learning_rate"] = jnp.asarray(
            lr, state.hyperparams["learning_rate"].dtype
        )
        return state

    return jax.vmap(init_one)(params, lrs)


def squared_loss(pred: jax.Array, target: jax.Array, reduction: str) -> jax.Array:
    """½Σ‖pred − target‖² ("sum", the paper's), or ½·mean of the squares ("mean")."""
    squares = jnp.square(pred - target)
    return 0.5 * (jnp.sum(squares) if reduction == "sum" else jnp.mean(squares))


def is_classification(target) -> bool:
    """Integer targets are class labels (P,); float targets are regression targets."""
    return jnp.issubdtype(target.dtype, jnp.integer)


def task_loss(pred: jax.Array, target: jax.Array, reduction: str, kind: str) -> jax.Array:
    """The task's loss of one run's outputs.

    Regression (float target, same shape as pred): the squared loss. Classification (pred (P, C)
    logits, target (P,) int labels): "squared", the squared loss on one-hot labels (the paper's
    analysis), or "cross_entropy"; summed over samples ("sum") or averaged ("mean").
    """
    if not is_classification(target):
        return squared_loss(pred, target, reduction)
    if kind == "squared":
        return squared_loss(
            pred, jax.nn.one_hot(target, pred.shape[-1], dtype=pred.dtype), reduction
        )
    losses = optax.softmax_cross_entropy_with_integer_labels(pred, target)
    return jnp.sum(losses) if reduction == "sum" else jnp.mean(losses)


def weighted_task_loss(
    pred: jax.Array,
    target: jax.Array,
    weights: jax.Array,
    num_samples: int,
    reduction: str,
    kind: str,
) -> jax.Array:
    """`task_loss`'s share of the samples of one microbatch of a batch of `num_samples`: each
    sample's loss times its weight (n,) (1: counted here, 0: counted by another microbatch),
    summed, and for the "mean" reduction divided by the whole batch's count of squares (or of
    samples, for cross-entropy), so that the shares of all microbatches add up to `task_loss`."""
    if is_classification(target) and kind == "cross_entropy":
        per_sample = optax.softmax_cross_entropy_with_integer_labels(pred, target)
        entries = 1
    else:
        if is_classification(target):
            target = jax.nn.one_hot(target, pred.shape[-1], dtype=pred.dtype)
        squares = jnp.square(pred - target).reshape(pred.shape[0], -1)
        per_sample = 0.5 * jnp.sum(squares, axis=-1)
        entries = squares.shape[-1]
    total = jnp.sum(weights.astype(per_sample.dtype) * per_sample)
    return total if reduction == "sum" else total / (num_samples * entries)


def _masked(inter: dict) -> tuple[jax.Array, jax.Array]:
    """attn, z (R, L, P, T, d) with padding rows zeroed (row_mask (R, P, T)): the stacked singular
    values are those of the real rows alone."""
    if "row_mask" not in inter:
        return inter["attn"], inter["z"]
    mask = inter["row_mask"][:, None, :, :, None]
    return inter["attn"] * mask, inter["z"] * mask


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """Functions of one model and optimizer; see `make_step_functions`."""

    loss: Callable  # (params, hp, x, y) -> scalar, one run
    step: Callable  # (state, hp, x, y) -> (state, metrics, {"attn", "z"}), all runs
    evaluate: Callable  # (params, hp, x, y) -> (R,) losses, all runs
    error: Callable  # (params, hp, x, labels) -> (R,) fraction misclassified, all runs
    scores: Callable  # (params, hp, x, labels) -> ((R,) losses, (R,) errors), one forward pass
    run_steps: Callable  # (state, hp, x, y, num_steps) -> (state, buffers)
    gradient: Callable  # (params, hp, x, y) -> ((R,) losses, (R, ...) gradients), all runs
    predict: Callable  # (params, hp, x) -> F(X), one run, the whole batch at once
    linearize: Callable  # (params, hp, x) -> jacobian.JacobianOps of one run (the certificate)


def over_runs(fn: Callable, runs_per_chunk: int) -> Callable:
    """fn(a, hp) of one run -> the same of all runs, stacked (R, ...): vmapped over the leading
    run axis of a and hp, or `runs_per_chunk` runs at a time (lax.map, vmapped within a chunk)."""

    def all_runs(a, hp):
        if not runs_per_chunk or runs_per_chunk >= jax.tree.leaves(hp)[0].shape[0]:
            return jax.vmap(fn)(a, hp)
        return jax.lax.map(lambda run: fn(*run), (a, hp), batch_size=runs_per_chunk)

    return all_runs


def make_step_functions(
    model: Model,
    optimizer: optax.GradientTransformation,
    reduction: str,
    steps_per_call: int,
    *,
    probe: Callable | None = None,
    runs_per_chunk: int = 0,
    loss_kind: str = "squared",
    microbatch_size: int = 0,
    data_shards: int = 1,
) -> StepFunctions:
    """Builds the per-run loss and step, their vmaps over runs, and the on-device step loop.

    `microbatch_size` n > 0: every full-batch value (the step's loss and gradient, the probe,
    evaluate, error, the Jacobian's products) is taken over microbatches of n samples of each of
    the `data_shards` shards of the 'data' axis (`step_microbatched`), the same values in one
    microbatch's memory; `probe` must then be a `probe.SpectralProbe`. 0: the whole batch at once.

    x (the model's inputs: (P, M, d) windows, or {"ids", "mask"} (P, T) tokens) and y ((P, M, d_y)
    targets, or (P,) labels: `task_loss` with `loss_kind`) are shared by all runs.
    `run_steps(state, hp, x, y, num_steps, probe_now=True)` does num_steps ≤ `steps_per_call`
    steps (compiled once for any num_steps) and returns every step's metrics in buffers of shape
    (steps_per_call, R), NaN past `num_steps` (`chunk_loop`). The loss reported for a step is the
    loss of the parameters that step starts from.

    `probe(attn, z)` maps the (R, L, P, M, d) intermediates of the call's first step to a dict of
    (R, L) arrays, returned as buffers of shape (1, R, L) (NaN unless `probe_now`). They come
    from a forward pass of their own at the call's starting parameters, before its steps: the
    same values bit for bit as the first step's loss computes (tests/test_probe_forward.py), so
    that the loop holds the only copy of the step and one program serves probed and unprobed
    calls. Padding rows (the model's "row_mask") are zeroed. With the probe, also Dong et al.'s
    rank-collapse residual of Attn and Z per layer, over real rows (`probe.collapse_residual`:
    keys "attn/collapse_residual", "z/collapse_residual").

    `runs_per_chunk` > 0 steps the runs that many at a time (`jax.lax.map` over the run axis,
    vmapped within a chunk) instead of all at once: the same results up to float rounding, with
    one chunk's working set, which is faster on a CPU once the temporaries of all runs no longer
    fit in its cache.
    Single-device meshes only (the run axis must not be sharded).
    """

    if microbatch_size:
        from resconv_jax import step_microbatched  # it builds on this module's functions

        return step_microbatched.make_step_functions(
            model,
            optimizer,
            reduction,
            steps_per_call,
            probe=probe,
            runs_per_chunk=runs_per_chunk,
            loss_kind=loss_kind,
            microbatch_size=microbatch_size,
            data_shards=data_shards,
        )

    def loss_and_intermediates(params, hp, x, y):
        pred, inter = model.apply_for_grad(params, x, hp, return_intermediates=True)
        return task_loss(pred, y, reduction, loss_kind), inter

    def loss(params, hp, x, y):
        return loss_and_intermediates(params, hp, x, y)[0]

    def predict(params, hp, x):
        return model.apply(params, x, hp)

    def scores(params, hp, x, labels):
        pred = predict(params, hp, x)
        wrong = jnp.mean(jnp.argmax(pred, axis=-1) != labels)
        return task_loss(pred, labels, reduction, loss_kind), wrong

    def error(params, hp, x, labels):
        return scores(params, hp, x, labels)[1]  # XLA drops the unused loss

    def step_one(state, hp, x, y):
        grad_fn = jax.value_and_grad(loss_and_intermediates, has_aux=True)
        (value, inter), grads = grad_fn(state["params"], hp, x, y)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state}, metrics, inter

    def step(state, hp, x, y):
        return over_runs(lambda s, h: step_one(s, h, x, y), runs_per_chunk)(state, hp)

    def plain_loss(params, hp, x, y):  # no gradient taken: the model as written (`fast_ops` aside)
        return task_loss(predict(params, hp, x), y, reduction, loss_kind)

    evaluate = jax.vmap(plain_loss, in_axes=(0, 0, None, None))

    def probe_of(params, hp, x):
        def intermediates(p, h):  # the forward pass of the step's loss at p, bit for bit
            return model.apply(p, x, h, return_intermediates=True)[1]

        inter = over_runs(intermediates, runs_per_chunk)(params, hp)
        probed = probe(*_masked(inter))
        mask = inter.get("row_mask")
        return probed | {
            f"{name}/collapse_residual": collapse_residual(inter[name], mask)
            for name in ("attn", "z")
        }

    return StepFunctions(
        loss=loss,
        step=step,
        evaluate=evaluate,
        error=jax.vmap(error, in_axes=(0, 0, None, None)),
        scores=jax.vmap(scores, in_axes=(0, 0, None, None)),
        run_steps=chunk_loop(step, probe_of if probe is not None else None, steps_per_call),
        gradient=jax.vmap(jax.value_and_grad(loss), in_axes=(0, 0, None, None)),
        predict=predict,
        linearize=lambda params, hp, x: jacobian.of_function(lambda p: predict(p, hp, x), params),
    )


def chunk_loop(step: Callable, probe_of: Callable | None, steps_per_call: int) -> Callable:
    """`run_steps(state, hp, x, y, num_steps, probe_now=True)`: num_steps ≤ `steps_per_call`
    steps in one on-device loop, compiled once for any num_steps and either probe_now, every
    step's metrics in buffers of shape (steps_per_call, R), NaN past num_steps.

    With `probe_of` ((params, hp, x) -> the probe's values {name: (R, L)} of the forward pass at
    params), also its values at the chunk's starting parameters (the intermediates of its first
    step) as buffers (1, R, L), computed only when `probe_now` (`lax.cond`; NaN otherwise): one
    program serves the probed chunks and the others, and holds one copy of the step.
    """

    def run_steps(state, hp, x, y, num_steps, probe_now=True):
        def body(i, carry):
            state, buffers = carry
            state, metrics, _ = step(state, hp, x, y)
            return state, {k: buffers[k].at[i].set(metrics[k]) for k in buffers}

        metrics = jax.eval_shape(step, state, hp, x, y)[1]
        buffers = {  # in the training dtype (float32, or float64 with model.dtype=float64)
            k: jnp.full((steps_per_call, *v.shape), jnp.nan, v.dtype) for k, v in metrics.items()
        }

        def probed(params):  # a float64 probe of a float32 model stays float64
            values = probe_of(params, hp, x)
            return {
                k: v.astype(jnp.promote_types(metrics["loss"].dtype, v.dtype))
                for k, v in values.items()
            }

        def not_probed(params):
            return {k: jnp.full(v.shape, jnp.nan, v.dtype) for k, v in shapes.items()}

        values = {}
        if probe_of is not None:
            shapes = jax.eval_shape(probed, state["params"])
            values = jax.lax.cond(probe_now, probed, not_probed, state["params"])
        state, buffers = jax.lax.fori_loop(0, num_steps, body, (state, buffers))
        return state, buffers | {k: v[None] for k, v in values.items()}

    return run_steps
