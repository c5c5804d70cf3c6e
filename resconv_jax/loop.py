"""The step loop of one compiled program: from a step to train.num_steps, one log chunk at a time.

At each log step it writes the metrics lines (with the validation loss and, for classification,
the errors), checks the tangent-kernel certificate, stops a diverging run with one line, saves
checkpoints, and honours SIGTERM / pod preemption.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from resconv_jax.analysis import theory
from resconv_jax.analysis.certificate import Kernel, above_stable_lr
from resconv_jax.errors import Preempted, TrainingDiverged, WorkdirWriteError
from resconv_jax.runners import ChunkRunners
from resconv_jax.runtime import signals
from resconv_jax.runtime.checkpoint import Checkpointer
from resconv_jax.runtime.divergence import diverged_message, diverging_runs
from resconv_jax.runtime.metrics import format_duration, progress_line
from resconv_jax.runtime.multihost import to_host


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What the step loop reads from the config (`from_config`)."""

    num_steps: int  # train.num_steps: the step the runs end at
    log_every: int  # train.log_every: steps per chunk between metrics lines
    print_every: int  # train.print_every: steps between progress lines
    step_losses_until: int  # train.step_losses_until: log every step's loss before this step
    certificate_every: int  # certificate.every: steps between tangent-kernel checks (0: off)
    sweeps_lr: bool  # whether the runs sweep the step size (the divergence message's advice)
    lr_factor: float | None  # optim.lr_factor under optim.lr_rule=lambda_max, else None

    @classmethod
    def from_config(cls, config) -> LoopSettings:
        train = config.train
        return cls(
            num_steps=train.num_steps,
            log_every=train.log_every,
            print_every=train.print_every,
            step_losses_until=train.step_losses_until,
            certificate_every=config.certificate.every,
            sweeps_lr=bool(config.sweep.lr),
            lr_factor=config.optim.lr_factor if config.optim.lr_rule == "lambda_max" else None,
        )


@dataclasses.dataclass
class Program:
    """What the step loop needs: the placed arrays, the compiled chunks and the run settings."""

    runs: list
    state: object
    hp: dict
    x: jax.Array
    y: jax.Array
    x_val: jax.Array | None
    y_val: jax.Array | None
    description: str  # the model's
    runners: ChunkRunners
    evaluate: object
    error: object  # jitted (params, hp, x, labels) -> (R,) fraction misclassified
    scores: object  # jitted (params, hp, x, labels) -> ((R,) losses, (R,) errors), one forward
    classification: bool
    kernel: Kernel | None
    lambda_max_at_init: object  # () -> (R,) λ_max(K) at initialization, power iteration
    loss_scale: float
    flops: float
    compile_seconds: float


def _resume_hint(checkpointer: Checkpointer) -> str:
    steps = checkpointer.steps()
    last = f"step {steps[-1]} in {checkpointer.directory}" if steps else "none"
    return f"last checkpoint: {last}; free space (or fix the folder) and rerun the same command"


def run_loop(
    train: LoopSettings, program: Program, checkpointer, writer, step: int, config_json, dataset
) -> None:
    """Steps every run from `step` to train.num_steps, one log chunk at a time."""
    runs, kernel = program.runs, program.kernel
    print(program.description, flush=True)
    print(
        f"{len(runs)} runs, mesh {dict(program.y.sharding.mesh.shape)}, {dataset.description}; "
        f"compiled in {program.compile_seconds:.1f}s{program.runners.description}; "
        f"{program.flops:.3g} FLOP per step (all runs); "
        f"{program.runners.memory_description(program.y.sharding.mesh)}",
        flush=True,
    )
    settings = [r.settings() for r in runs]
    lrs = np.array([r.lr for r in runs])
    total, start, state = train.num_steps, step, program.state
    meta = {"config": config_json}
    try:
        last_print, last_print_step = time.perf_counter(), step
        # JAX's preemption sync point counts calls: every process asks at every chunk
        # (`Checkpointer.reached_preemption`); after a SIGTERM to any of them, all agree on the
        # next call.
        while step < total:
            if signals.requested() or checkpointer.reached_preemption():
                signals.acknowledge()
                if step == start:
                    raise Preempted(
                        f"SIGTERM before the first step: nothing was trained in this start "
                        f"(the run is at step {step}); rerun the same command to go on"
                    )
                if checkpointer.latest_step() != step:
                    checkpointer.save(step, state, writer.checkpoint_meta(meta, step), force=True)
                checkpointer.wait()
                raise Preempted(
                    f"preempted at step {step}: checkpoint saved in {checkpointer.directory}; "
                    "rerun the same command to resume"
                )
            # To the next multiple of log_every: a run that ended off the grid (num_steps not a
            # multiple) and was extended goes back on it, where checkpoints and probes fall.
            num = min(train.log_every - step % train.log_every, total - step)
            chunk_start = time.perf_counter()
            evaluated = _evaluate(program, state["params"])
            params_at_step = state["params"]
            every = train.certificate_every
            certify = kernel is not None and every and step % every == 0
            if certify:  # the kernel needs the parameters the chunk is about to donate
                params_at_step = jax.tree.map(jnp.copy, params_at_step)
            state, buffers = program.runners.run(step, state, program.hp, program.x, program.y, num)
            buffers = to_host(buffers)
            records = _log_records(settings, buffers, num, evaluated)
            if step < train.step_losses_until:
                for r, record in enumerate(records):
                    record["step_losses"] = buffers["loss"][:num, r]
            losses = buffers["loss"][:num]
            if certify and num > 1 and np.isfinite(buffers["loss"][0]).all():
                contraction = buffers["loss"][1] / buffers["loss"][0]
                ntk = kernel.records(params_at_step, program.hp, program.x, lrs, contraction)
                records = [r | n for r, n in zip(records, ntk, strict=True)]
                if step == 0 and (warning := above_stable_lr(records)):
                    print(warning, flush=True)
            writer.write(step, records)
            if diverging_runs(losses).size:
                message = _diverged(train, program, checkpointer, writer, step, losses)
                raise TrainingDiverged(message)
            if step == start and step + num < total:  # the first chunk after compiling
                print(_projection(num, time.perf_counter() - chunk_start, total - step), flush=True)
            step += num
            checkpointer.save(step, state, writer.checkpoint_meta(meta, step), force=step == total)
            if step % train.print_every == 0 or step == total:
                now = time.perf_counter()
                rate = (step - last_print_step) / max(now - last_print, 1e-9)
                print(  # buffers["loss"][num - 1]: the loss at step - 1, before its update
                    progress_line(step, total, step - 1, buffers["loss"][num - 1], rate, settings),
                    flush=True,
                )
                writer.scalars(step, {"steps_per_sec": rate, "flops_per_sec": rate * program.flops})
                last_print, last_print_step = now, step
        if not writer.history or writer.history[-1]["step"] < total:
            # (1, R): the loss after the last update, which no chunk has checked.
            params = state["params"]
            last = to_host(program.evaluate(params, program.hp, program.x, program.y))[None]
            if diverging_runs(last).size:
                raise TrainingDiverged(_diverged(train, program, checkpointer, writer, total, last))
            final = {"loss": last[0]} | _evaluate(program, params)
            writer.write(
                total, [s | {k: v[r] for k, v in final.items()} for r, s in enumerate(settings)]
            )
        checkpointer.wait()
    except WorkdirWriteError as error:
        raise WorkdirWriteError(f"{error}; {_resume_hint(checkpointer)}") from None


def _projection(num: int, seconds: float, remaining: int) -> str:
    """The line after the first chunk: its time, and the time all `remaining` steps of this
    program would take at that rate (evaluation, probe and logging included)."""
    return (
        f"first {num} steps in {seconds:.2f} s: at that rate the {remaining} steps of this "
        f"program take about {format_duration(seconds * remaining / num)}"
    )


def _evaluate(program: Program, params) -> dict[str, np.ndarray]:
    """Per-run values at a log step besides the training loss: the validation loss and, for a
    classification task, the training and validation errors (fraction misclassified; the
    validation loss and error from one forward pass)."""
    hp, x_val = program.hp, program.x_val
    if not program.classification:
        if x_val is None:
            return {}
        return {"val_loss": to_host(program.evaluate(params, hp, x_val, program.y_val))}
    error = program.error(params, hp, program.x, program.y)
    if x_val is None:
        return {"error": to_host(error)}
    val_loss, val_error = to_host(program.scores(params, hp, x_val, program.y_val))
    return {"val_loss": val_loss, "error": to_host(error), "val_error": val_error}


def _diverged(train: LoopSettings, program: Program, checkpointer, writer, step, losses) -> str:
    kernel = program.kernel

    def stable_lrs():
        if kernel is not None and kernel.lam_max is not None:
            lam, source = kernel.lam_max, "lambda_max from the latest tangent-kernel certificate"
        else:
            lam = program.lambda_max_at_init()
            source = "lambda_max at initialization, power iteration"
        return theory.stable_lr(np.asarray(lam, float), loss_scale=program.loss_scale), source

    checkpointer.wait()
    return diverged_message(
        losses,
        step,
        program.runs,
        writer.history,
        checkpointer.steps(),
        checkpointer.directory,
        stable_lrs,
        train.sweeps_lr,
        train.lr_factor,
    )


def _log_records(settings: list[dict], buffers: dict, num: int, evaluated: dict) -> list[dict]:
    """One record per run for the chunk's first step: loss, contraction, probe values, and the
    `evaluated` values ({name: (R,)}: validation loss, classification errors)."""
    records = []
    for r, run_settings in enumerate(settings):
        record = dict(run_settings)
        record["loss"] = buffers["loss"][0, r]
        record["grad_norm"] = buffers["grad_norm"][0, r]
        if num > 1:
            record["contraction"] = buffers["loss"][1, r] / buffers["loss"][0, r]
        record |= {name: values[r] for name, values in evaluated.items()}
        for key, values in buffers.items():
            if "/" in key and np.isfinite(values[0, r]).all():
                record |= {f"layer{i}/{key}": v for i, v in enumerate(values[0, r])}
        records.append(record)
    return records
