"""`run(config, workdir)`: mesh -> data -> state (restore or init) -> compiled step loop -> summary.

Every run of a sweep advances in one program. The loop hands control back to Python only at log
steps, where it writes metrics, checks for divergence, checkpoints, and honours SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from resconv_jax import sharding
from resconv_jax.checkpoint import Checkpointer
from resconv_jax.data import load_dataset
from resconv_jax.metrics import MetricsWriter, progress_line, step_flops
from resconv_jax.models import transformer
from resconv_jax.step import init_opt_state, make_optimizer, make_step_functions
from resconv_jax.summary import run_summaries
from resconv_jax.sweep import expand_runs, run_hparams
from resconv_jax.validation import ConfigError, check_workdir, validate_config

CONFIG_FILE = "config.json"
RESUMABLE_CHANGES = ("train.num_steps", "train.print_every")


class TrainingDiverged(RuntimeError):
    """A run's loss became non-finite; the message is one line saying what to do."""


class Preempted(RuntimeError):
    """SIGTERM or a pod preemption: a checkpoint was saved and the run can be resumed."""


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_resumable(workdir: str, config_json: dict) -> None:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = _flatten(json.load(f))
    current = _flatten(config_json)
    changed = [
        k
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k) and k not in RESUMABLE_CHANGES
    ]
    if changed:
        k = changed[0]
        raise ConfigError(
            f"--workdir={workdir} holds a run with another config ({k}: {saved.get(k)!r} -> "
            f"{current.get(k)!r}); use a new --workdir"
        )


def _init_state(config, model_cfg, runs, optimizer):
    params = [transformer.init_params(model_cfg, run.seed)[1] for run in runs]
    params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)
    lrs = jnp.asarray([run.lr for run in runs], jnp.float32)
    return {"params": params, "opt_state": init_opt_state(optimizer, params, lrs)}


def run(config, workdir: str) -> list[dict]:
    """Trains every run of `config`'s sweep in `workdir` (resuming there if possible).

    Returns one summary dict per run. Raises ConfigError before writing anything for bad input,
    TrainingDiverged on a non-finite loss, Preempted after saving on SIGTERM.
    """
    validate_config(config)
    check_workdir(workdir)
    runs = expand_runs(config)
    dataset = load_dataset(config)
    config_json = json.loads(config.to_json_best_effort())
    _check_resumable(workdir, config_json)

    x_np, y_np = dataset.x_train, dataset.y_train
    model_cfg = transformer.model_config(config.model, d=x_np.shape[-1], d_y=y_np.shape[-1])
    mesh = sharding.make_mesh(len(runs), x_np.shape[0], config.mesh)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--workdir={workdir}: cannot create it ({error.strerror})") from None
    if jax.process_index() == 0:
        with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
            json.dump(config_json, f, indent=2)
    logging.info("data: %s; mesh %s; %d runs", dataset.description, dict(mesh.shape), len(runs))

    put_data = lambda a: None if a is None else sharding.put(a, sharding.data_sharding(mesh))  # noqa: E731
    x, y, x_val, y_val = map(put_data, (x_np, y_np, dataset.x_val, dataset.y_val))
    hp = sharding.put_tree(run_hparams(runs), sharding.run_sharding(mesh))
    optimizer = make_optimizer(config.optim)
    graphdef = transformer.init_params(model_cfg, 0)[0]
    state = sharding.put_tree(
        _init_state(config, model_cfg, runs, optimizer), sharding.run_sharding(mesh)
    )

    train = config.train
    checkpointer = Checkpointer(
        workdir,
        every=train.checkpoint_every,
        keep=train.keep_checkpoints,
        use_async=train.async_checkpoints,
    )
    step = 0
    restored = checkpointer.restore_latest(state)
    if restored is not None:
        step, state, _ = restored
        logging.info("resumed from the checkpoint at step %d", step)
        print(f"resuming from step {step} ({checkpointer.directory})", flush=True)
    writer = MetricsWriter(workdir, resume_step=step)

    fns = make_step_functions(graphdef, optimizer, config.optim.reduction, train.log_every)
    state_sharding = jax.tree.map(lambda _: sharding.run_sharding(mesh), state)
    t0 = time.perf_counter()
    run_steps = (
        jax.jit(fns.run_steps, donate_argnums=0, out_shardings=(state_sharding, None))
        .lower(state, hp, x, y, jnp.int32(train.log_every))
        .compile()
    )
    evaluate = jax.jit(fns.evaluate)
    flops = step_flops(fns.step, state, hp, x, y)
    print(
        f"{len(runs)} runs, mesh {dict(mesh.shape)}, {dataset.description}; compiled in "
        f"{time.perf_counter() - t0:.1f}s; {flops:.3g} FLOP per step (all runs)",
        flush=True,
    )

    preempt = {"signal": False}
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: preempt.update(signal=True))
    settings = [r.settings() for r in runs]
    total = train.num_steps
    try:
        last_print, last_print_step = time.perf_counter(), step
        while step < total:
            if preempt["signal"] or checkpointer.reached_preemption(step):
                if checkpointer.latest_step() != step:
                    checkpointer.save(step, state, {"step": step}, force=True)
                checkpointer.wait()
                raise Preempted(
                    f"preempted at step {step}: checkpoint saved in {checkpointer.directory}; "
                    "rerun the same command to resume"
                )
            num = min(train.log_every, total - step)
            val = None if x_val is None else np.asarray(evaluate(state["params"], hp, x_val, y_val))
            state, buffers = run_steps(state, hp, x, y, jnp.int32(num))
            buffers = jax.tree.map(np.asarray, buffers)
            _check_finite(buffers["loss"][:num], step, runs, checkpointer)
            records = []
            for r, run_settings in enumerate(settings):
                record = {**run_settings, "loss": buffers["loss"][0, r]}
                record["grad_norm"] = buffers["grad_norm"][0, r]
                if num > 1:
                    record["contraction"] = buffers["loss"][1, r] / buffers["loss"][0, r]
                if val is not None:
                    record["val_loss"] = val[r]
                records.append(record)
            writer.write(step, records)
            step += num
            checkpointer.save(step, state, {"step": step}, force=step == total)
            if step % train.print_every == 0 or step == total:
                now = time.perf_counter()
                rate = (step - last_print_step) / max(now - last_print, 1e-9)
                print(progress_line(step, total, buffers["loss"][num - 1], rate), flush=True)
                writer.scalars(step, {"steps_per_sec": rate, "flops_per_sec": rate * flops})
                last_print, last_print_step = now, step
        final = {"loss": np.asarray(evaluate(state["params"], hp, x, y))}
        if x_val is not None:
            final["val_loss"] = np.asarray(evaluate(state["params"], hp, x_val, y_val))
        if not writer.history or writer.history[-1]["step"] < total:
            records = [{**s, **{k: v[r] for k, v in final.items()}} for r, s in enumerate(settings)]
            writer.write(total, records)
        checkpointer.wait()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        checkpointer.close()
        writer.close()
    summaries = run_summaries(writer.history, settings)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summaries, f, indent=2)
    return summaries


def _check_finite(losses: np.ndarray, step: int, runs, checkpointer: Checkpointer) -> None:
    """Raises TrainingDiverged naming the first non-finite loss of `losses` (steps × runs)."""
    bad = ~np.isfinite(losses)
    if not bad.any():
        return
    offset, r = np.argwhere(bad)[0]
    run = runs[r]
    last = checkpointer.latest_step()
    where = f"step {last} in {checkpointer.directory}" if last is not None else "none"
    raise TrainingDiverged(
        f"run {r} (beta_attn={run.beta_attn}, beta_ffn={run.beta_ffn}, seed={run.seed}) diverged: "
        f"loss {losses[offset, r]} at step {step + offset}; last good checkpoint: {where}; "
        f"try a smaller step size, e.g. --config.optim.lr={run.lr / 4:g}"
    )
