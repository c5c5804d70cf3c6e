"""`step.make_step_functions` with train.microbatch_size = n > 0: every full-batch value in one
microbatch's memory.

One GD step is still one step on the exact full-batch gradient: the loss shares and gradients of the
microbatches (`microbatch.Microbatches`: n samples of every 'data' shard at a time) are summed in a
`fori_loop` inside the compiled step, in the training dtype, and the optimizer is applied once.
Each 'data' shard's gradient is summed over the microbatches on its own device and the shards'
sums are added after the loop: one all-reduce per step, not one per microbatch. The probe of a
chunk's first step is accumulated over the same microbatches (`probe_running`) in a forward pass
of its own at the chunk's starting parameters (`step.chunk_loop`), evaluate, error and scores sum
over microbatches, and the tangent kernel sees J through products formed microbatch by
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

    def grad_share(params, hp, x, y, weights, num):
        pred = model.apply_for_grad(params, x, hp)
        return weighted_task_loss(pred, y, weights, num, reduction, loss_kind)

    def eval_share(params, hp, x, y, weights, num):
        pred = model.apply(params, x, hp)
        return weighted_task_loss(pred, y, weights, num, reduction, loss_kind)

    def gradient(params, hp, x, y):
        """(R,) losses and the (R, ...) gradients."""
        batches = batches_of(y)
        value_and_grad = jax.value_and_grad(grad_share)

        def microbatch(k):
            """Microbatch k's x, y and sample weights, (S·n, ...) split over 'data'."""
            return batches.take(x, k), batches.take(y, k), batches.weights(k, floats(params))

        def share(xk, yk, weights):
            """(R,) loss shares, (R, ...) gradients over these samples."""

            def one_run(p, h):
                return value_and_grad(p, h, xk, yk, weights, batches.num_samples)

            return over_runs(one_run, runs_per_chunk)(params, hp)

        if batches.num_shards > 1:
            # Each shard's gradient summed over the microbatches on its own device ((S, R, ...)
            # partial sums), the S sums added after the loop: one all-reduce per step, not one
            # per microbatch.
            def by_shard(tree):
                return jax.tree.map(lambda a: a.reshape(batches.num_shards, -1, *a.shape[1:]), tree)

            def shard_part(k):
                return jax.vmap(share)(*by_shard(microbatch(k)))

            loss, grads = batches.sum(shard_part, zeros_like(jax.eval_shape(shard_part, 0)))
            return loss.sum(0), jax.tree.map(lambda g: g.sum(0), grads)

        def part(k):
            return share(*microbatch(k))

        return batches.sum(part, zeros_like(jax.eval_shape(part, 0)))

    def step(state, hp, x, y):
        params = state["params"]
        loss, grads = gradient(params, hp, x, y)
        updates, opt_state = jax.vmap(optimizer.update)(grads, state["opt_state"], params)
        params = jax.vmap(optax.apply_updates)(params, updates)
        metrics = {"loss": loss, "grad_norm": jax.vmap(optax.tree.norm)(grads)}
        return {"params": params, "opt_state": opt_state}, metrics, {}

    def probe_of(params, hp, x):
        """The probe's (R, L) values of the forward pass at `params`, over the microbatches."""
        batches = batches_of(x)

        def part(k):
            xk, weights = batches.take(x, k), batches.weights(k, floats(params))

            def intermediates(p, h):
                return model.apply(p, xk, h, return_intermediates=True)[1]

            return over_runs(intermediates, runs_per_chunk)(params, hp), weights

        inter_shape = jax.eval_shape(part, 0)[0]

        def body(k, running):
            return probe_running.update(probe, running, *part(k))

        start = probe_running.start(probe, inter_shape)
        running = jax.lax.fori_loop(0, batches.count, body, start)
        seq_len = inter_shape["z"].shape[3]
        return probe_running.finish(probe, running, batches.num_samples, seq_len)

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
        run_steps=chunk_loop(step, probe_of if probe is not None else None, steps_per_call),
        gradient=gradient,
        predict=predict,
        linearize=linearize,
    )
