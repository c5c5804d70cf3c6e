"""`step.make_step_functions` with train.microbatch_size = n > 0: every full-batch value in one
microbatch's memory.

One GD step is still one step on the exact full-batch gradient: the loss shares and gradients of the
microbatches (`microbatch.Microbatches`: n samples of every 'data' shard at a time) are summed in a
`fori_loop` inside the compiled step, in the training dtype, and the optimizer is applied once.
Without the probe each 'data' shard's gradient is summed over the microbatches on its own device and
the shards' sums are added after the loop: one all-reduce per step, not one per microbatch (with the
probe, a chunk's first step, the loop all-reduces each microbatch's). The probe of a chunk's first
step is accumulated over the same microbatches (`probe_running`), evaluate, error and scores
sum over microbatches, and the tangent kernel sees J through products formed microbatch by
microbatch (`jacobian.microbatched`).

Float32: the shares are summed without compensation, a blocked summation; on
configs/jena.py:full its gradient is closer to float64's than the whole batch's single reduction
(1e-7 against 1e-6 relative; `docs/measure_accumulation.py`, figures in docs/protocol.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from resconv_jax.analysis import jacobian, probe_running
from resconv_jax.analysis.probe import SpectralProbe
from resconv_jax.microbatch import Microbatches, zeros_like
from resconv_jax.step import StepFunctions, chunk_loop, over_runs, weighted_task_loss


def make_step_functions(
    model,
    optimizer: optax.GradientTransformation,
    reduction: str,
    steps_per_call: int,
    *,
    probe: SpectralProbe | None,
    runs_per_chunk: int,
    loss_kind: str,
    microbatch_size: int,
    data_shards: int,
) -> StepFunctions:
    """See `step.make_step_functions`; x and y are (P, ...) leaves split over 'data'."""
    if probe is not None and not isinstance(probe, SpectralProbe):
        raise TypeError("a microbatched step takes its probe as a probe.SpectralProbe")

    def batches_of(tree) -> Microbatches:
        num = jax.tree.leaves(tree)[0].shape[0]  # a validation set may not divide 'data'
        return Microbatches(num, data_shards if num % data_shards == 0 else 1, microbatch_size)

    def floats(params):
        return jax.tree.leaves(params)[0].dtype

    def grad_share(params, hp, x, y, weights, num, with_inter):
        out = model.apply_for_grad(params, x, hp, return_intermediates=with_inter)
        pred, inter = out if with_inter else (out, {})
        return weighted_task_loss(pred, y, weights, num, reduction, loss_kind), inter

    def eval_share(params, hp, x, y, weights, num):
        pred = model.apply(params, x, hp)
        return weighted_task_loss(pred, y, weights, num, reduction, loss_kind)

    def gradient(params, hp, x, y, with_probe: bool):
        """(R,) losses, the (R, ...) gradients and the probe's values (or None)."""
        batches = batches_of(y)
        value_and_grad = jax.value_and_grad(grad_share, has_aux=True)

        def microbatch(k):
            """Microbatch k's x, y and sample weights, (S·n, ...) split over 'data'."""
            return batches.take(x, k), batches.take(y, k), batches.weights(k, floats(params))

        def share(xk, yk, weights):
            """((R,) loss shares, intermediates), (R, ...) gradients over these samples."""

            def one_run(p, h):
                return value_and_grad(p, h, xk, yk, weights, batches.num_samples, with_probe)

            return over_runs(one_run, runs_per_chunk)(params, hp)

        if not with_probe and batches.num_shards > 1:
            # Each shard's gradient summed over the microbatches on its own device ((S, R, ...)
            # partial sums), the S sums added after the loop: one all-reduce per step, not one
            # per microbatch.
            def by_shard(tree):
                return jax.tree.map(lambda a: a.reshape(batches.num_shards, -1, *a.shape[1:]), tree)

            def shard_part(k):
                (loss, _), grads = jax.vmap(share)(*by_shard(microbatch(k)))
                return loss, grads

            loss, grads = batches.sum(shard_part, zeros_like(jax.eval_shape(shard_part, 0)))
            return loss.sum(0), jax.tree.map(lambda g: g.sum(0), grads), None

        def part(k):
            xk, yk, weights = microbatch(k)
            (loss, inter), grads = share(xk, yk, weights)
            return loss, grads, inter, weights

        loss_shape, grads_shape, inter_shape, _ = jax.eval_shape(part, 0)
        running = probe_running.start(probe, inter_shape) if with_probe else None

        def body(k, carry):
            loss, grads, running = carry
            loss_k, grads_k, inter, weights = part(k)
            if with_probe:
                running = probe_running.update(probe, running, inter, weights)
            return loss + loss_k, jax.tree.map(jnp.add, grads, grads_k), running

        init = (zeros_like(loss_shape), zeros_like(grads_shape), running)
        loss, grads, running = jax.lax.fori_loop(0, batches.count, body, init)
        if not with_probe:
            return loss, grads, None
        seq_len = inter_shape["z"].shape[3]
        return loss, grads, probe_running.finish(probe, running, batches.num_samples, seq_len)

    def any_step(state, hp, x, y, with_probe: bool):
        params = state["params"]
        loss, grads, probed = gradient(params, hp, x, y, with_probe)
        updates, opt_state = jax.vmap(optimizer.update)(grads, state["opt_state"], params)
        params = jax.vmap(optax.apply_updates)(params, updates)
        metrics = {"loss": loss, "grad_norm": jax.vmap(optax.tree.norm)(grads)}
        return {"params": params, "opt_state": opt_state}, metrics, probed

    def step(state, hp, x, y):
        state, metrics, _ = any_step(state, hp, x, y, False)
        return state, metrics, {}

    def probed_step(state, hp, x, y):
        return any_step(state, hp, x, y, probe is not None)

    def evaluate(params, hp, x, y):
        batches = batches_of(y)

        def part(k):
            xk, yk = batches.take(x, k), batches.take(y, k)
            weights = batches.weights(k, floats(params))
            share = over_runs(
                lambda p, h: eval_share(p, h, xk, yk, weights, batches.num_samples),
                runs_per_chunk,
            )
            return share(params, hp)

        return batches.sum(part, zeros_like(jax.eval_shape(part, 0)))

    def predict(params, hp, x):
        return model.apply(params, x, hp)

    def scores(params, hp, x, labels):
        batches = batches_of(labels)

        def part(k):
            xk, labels_k = batches.take(x, k), batches.take(labels, k)
            weights = batches.weights(k, floats(params))

            def loss_and_wrong(p, h):
                pred = predict(p, h, xk)
                missed = jnp.argmax(pred, axis=-1) != labels_k
                share = weighted_task_loss(
                    pred, labels_k, weights, batches.num_samples, reduction, loss_kind
                )
                return share, jnp.sum(weights * missed)

            return over_runs(loss_and_wrong, runs_per_chunk)(params, hp)

        loss, wrong = batches.sum(part, zeros_like(jax.eval_shape(part, 0)))
        return loss, wrong / batches.num_samples

    def error(params, hp, x, labels):
        return scores(params, hp, x, labels)[1]  # XLA drops the unused loss

    def loss(params, hp, x, y):
        one_run = jax.tree.map(lambda a: a[None], params), jax.tree.map(jnp.atleast_1d, hp)
        return evaluate(*one_run, x, y)[0]

    def linearize(params, hp, x):
        return jacobian.microbatched(lambda p, xk: predict(p, hp, xk), params, x, batches_of(x))

    return StepFunctions(
        loss=loss,
        step=step,
        evaluate=evaluate,
        error=error,
        scores=scores,
        run_steps=chunk_loop(step, probed_step, steps_per_call),
        gradient=lambda params, hp, x, y: gradient(params, hp, x, y, False)[:2],
        predict=predict,
        linearize=linearize,
    )
