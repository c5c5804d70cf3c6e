"""`run(config, workdir)`: data -> mesh -> compiled step -> workdir (lock, checks) -> state
(restore or init) -> step loop -> summary.

Every run of a sweep (of one depth) advances in one program, stepped by `loop.run_loop`, which
hands control back to Python only at log steps. Everything that can refuse the input (config,
data, memory, a workdir holding another run) is checked before the first write into the workdir.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from resconv_jax import sharding
from resconv_jax.analysis import probe
from resconv_jax.analysis.certificate import (
    loss_scale,
    make_kernel,
    power_lambda_max,
    with_kernel_lrs,
)
from resconv_jax.analysis.summary import fit_floor, run_summaries
from resconv_jax.data import data_module, load_dataset
from resconv_jax.errors import Preempted, TrainingDiverged
from resconv_jax.finished import RUNS_FILE, SUMMARY_FILE
from resconv_jax.loop import LoopSettings, Program, run_loop
from resconv_jax.models import Model, RunSettings, build_model, model_module
from resconv_jax.resumable import check_resumable, recorded_kernel_lrs
from resconv_jax.runners import ChunkRunners, check_runs_per_chunk, compile_chunks
from resconv_jax.runtime import multihost, signals
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.checkpoint import Checkpointer, checkpoint_losses_finite
from resconv_jax.runtime.metrics import (
    METRICS_FILE,
    MetricsWriter,
    lines_digest,
    read_metrics_lines,
    step_flops,
    valid_prefix,
)
from resconv_jax.runtime.workdir import (
    CONFIG_FILE,
    WorkdirLock,
    WorkdirWriteError,
    atomic_open,
    make_folder,
    write_json,
)
from resconv_jax.runtime.workdir_start import lock_on_process_0, remove_untrained_workdir
from resconv_jax.step import (
    init_opt_state,
    is_classification,
    make_optimizer,
    make_step_functions,
)
from resconv_jax.sweep import expand_runs, group_config, group_folder, group_runs, run_settings
from resconv_jax.validation import check_workdir, validate_config

__all__ = ["SUMMARY_FILE", "Preempted", "TrainingDiverged", "run"]


def _num_outputs(model: Model, inputs, params) -> int:
    """Entries of one run's output F(inputs): the rows of its Jacobian."""
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    out = jax.eval_shape(lambda p, x: model.apply(p, x, RunSettings()), params, structs)
    return int(np.prod(out.shape))


def _state(params, runs, optimizer):
    """Train state from stacked initial params (R, ...), with each run's step size."""
    lrs = jnp.asarray([run.lr for run in runs], jax.tree.leaves(params)[0].dtype)
    return {"params": params, "opt_state": init_opt_state(optimizer, params, lrs)}


def initial_state(model: Model, runs, optimizer) -> dict:
    """The train state {"params", "opt_state"} of `runs` before any step, stacked (R, ...):
    each run's parameters from its seed, its optimizer state with its step size."""
    return _state(model.init_runs([run.seed for run in runs]), runs, optimizer)


def _stop_before_training(what: str) -> None:
    """Raises Preempted if a SIGTERM is pending, before any step of this process ran."""
    if signals.requested():
        signals.acknowledge()
        raise Preempted(
            f"SIGTERM during start-up ({what}): nothing was trained yet; rerun the same command "
            "to start"
        )


def run(config, workdir: str) -> list[dict]:
    """Trains every run of `config`'s sweep in `workdir` (resuming there if possible).

    Returns one summary dict per run. Raises, each with a one-line message: ConfigError before
    writing anything for bad input (config, data, a size that cannot fit, a workdir that holds
    another run); WorkdirBusy if another process holds the workdir; TrainingDiverged on a
    non-finite loss; WorkdirWriteError when a write fails (the last checkpoint stays good);
    Preempted after SIGTERM (a checkpoint saved, or nothing trained yet).
    """
    previous_handler = signals.install() if jax.process_count() == 1 else None
    try:
        validate_config(config)
        check_workdir(workdir)
        groups = group_runs(expand_runs(config))
        if len(groups) == 1:  # a one-element depth or width sweep is that setting, given
            config = group_config(config, groups[0][0])
        data_kind = data_module(config.data.name)
        widest = max(config.sweep.dim, default=0)
        if hasattr(data_kind, "check_size"):  # from the config alone, before anything is drawn
            data_kind.check_size(config.data, widest)
        shapes = data_kind.shapes(config.data, widest) if hasattr(data_kind, "shapes") else None
        if shapes is not None:
            _check_model_size(config, shapes, groups)
        model_kind = model_module(config.model.name)
        if hasattr(model_kind, "check_available"):  # missing weights: one line, before the rest
            model_kind.check_available(config.model, _deepest(config))
        # A width sweep draws each width's own data (`_run_groups`), never data.dim's.
        dataset = None if config.sweep.dim else load_dataset(config)
        if shapes is None:
            _check_model_size(config, _data_shapes(dataset), groups)
        # (a width sweep, synthetic data only, draws its data later: its size is in `shapes`)
        samples = shapes["num_samples"] if dataset is None else dataset.num_train
        _check_mesh(config, groups, samples)
        _stop_before_training("loading the data")
        created = not wd.path(workdir).exists()
        lock = WorkdirLock(workdir)
        lock_on_process_0(workdir, lock)
        try:
            if len(groups) == 1:
                return _run_locked(config, wd.path(workdir), dataset, groups[0][1])
            return _run_groups(config, wd.path(workdir), dataset, groups)
        except (ValueError, Preempted):  # ConfigError, data or weights errors: nothing kept
            if created and jax.process_index() == 0:
                remove_untrained_workdir(wd.path(workdir))  # under the lock: no start between
            raise
        finally:
            lock.release()
    finally:
        signals.restore(previous_handler)


def _check_mesh(config, groups, num_samples: int) -> None:
    """Every group's mesh and train.runs_per_chunk, checked before process 0 locks the workdir:
    every process of a multi-process run refuses the same config at once, and none leaves a
    new workdir behind (`make_mesh` and `ChunkRunners` check the same again)."""
    for _, runs in groups:
        sweep, data = sharding.mesh_shape(len(runs), num_samples, config.mesh)
        check_runs_per_chunk(config.train.runs_per_chunk, {"sweep": sweep, "data": data})


def _data_shapes(dataset) -> dict[str, int]:
    """{num_samples, seq_len, d, d_y} of a data set of (P, M, d) windows and (P, M, d_y) targets
    ({} for any other)."""
    x, y = dataset.x_train, dataset.y_train
    if not hasattr(x, "shape") or x.ndim != 3 or y.ndim != 3:
        return {}
    samples, seq_len, d = x.shape
    return {"num_samples": samples, "seq_len": seq_len, "d": d, "d_y": y.shape[-1]}


def _check_model_size(config, shapes: dict[str, int], groups) -> None:
    """The model's `check_size` (if it has one) for the data's `shapes` (`_data_shapes`), the
    deepest L and the most runs of one program (of `groups`)."""
    check_size = getattr(model_module(config.model.name), "check_size", None)
    if check_size is None or not shapes:
        return
    check_size(
        config.model,
        **shapes,
        num_layers=_deepest(config),
        runs=max(len(runs) for _, runs in groups),
    )


def _deepest(config) -> int:
    """The largest L that `config` trains."""
    return max(config.sweep.num_layers, default=config.model.num_layers)


def _build(config, parts: _Parts, runs, lrs_recorded: bool = False) -> Program:
    """Places data and state on the mesh, compiles the chunks, refuses what cannot fit.
    lrs_recorded: lr_rule=lambda_max's step sizes are already those of `runs`."""
    dataset, mesh, model = parts.dataset, parts.mesh, parts.model
    num_outputs, num_params = parts.num_outputs, parts.num_params
    put_data = functools.partial(sharding.put_tree, sharding=sharding.data_sharding(mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x, y = put_data(dataset.x_train), put_data(dataset.y_train)
    x_val, y_val = None, None
    if dataset.x_val is not None:
        # Validation sets rarely divide the 'data' axis; they are small, so replicate those.
        divisible = dataset.num_val % mesh.shape["data"] == 0
        put_val = (
            put_data if divisible else functools.partial(sharding.put_tree, sharding=replicated)
        )
        x_val, y_val = put_val(dataset.x_val), put_val(dataset.y_val)
    on_runs = sharding.run_sharding(mesh)
    hp = sharding.put_tree(run_settings(runs), on_runs)
    optimizer = make_optimizer(config.optim)
    probe_fn = None
    if config.probe.enabled:
        probe_fn = probe.SpectralProbe(
            mesh, jnp.dtype(config.probe.dtype), per_sample=config.probe.per_sample
        )
    make_fns = functools.partial(
        make_step_functions,
        model,
        optimizer,
        config.optim.reduction,
        config.train.log_every,
        loss_kind=config.optim.loss,
        data_shards=mesh.shape["data"],
    )
    params = model.init_runs([run.seed for run in runs])
    state = sharding.put_tree(_state(params, runs, optimizer), on_runs)
    t0 = time.perf_counter()
    runners, microbatch_size = compile_chunks(
        functools.partial(
            ChunkRunners,
            make_fns,
            probe_fn,
            mesh,
            (state, hp, x, y),
            log_every=config.train.log_every,
            runs_per_chunk=config.train.runs_per_chunk,
            probe_every=config.probe.every,
        ),
        config.train.microbatch_size,
        dataset.num_train // mesh.shape["data"],
        mesh,
    )
    compile_seconds = time.perf_counter() - t0
    fns = make_fns(microbatch_size=microbatch_size)  # evaluate, error, scores, linearize
    scale = loss_scale(config.optim.reduction, num_outputs)
    kernel = None
    if config.certificate.every or config.optim.lr_rule == "lambda_max":
        kernel = make_kernel(
            fns.linearize,
            scale,
            num_outputs,
            num_params,
            max_entries=config.certificate.max_jacobian_entries,
            iterations=config.certificate.lanczos_iterations,
        )
    if config.optim.lr_rule == "lambda_max" and not lrs_recorded:  # the chunks stay as compiled
        runs = with_kernel_lrs(config.optim.lr_factor, runs, kernel, params, hp, x)
        state = sharding.put_tree(_state(params, runs, optimizer), on_runs)

    def lambda_max_at_init():
        initial = sharding.put_tree(model.init_runs([run.seed for run in runs]), on_runs)
        return multihost.to_host(jax.jit(power_lambda_max(fns.linearize))(initial, hp, x))

    return Program(
        runs=runs,
        state=state,
        hp=hp,
        x=x,
        y=y,
        x_val=x_val,
        y_val=y_val,
        description=model.description,
        runners=runners,
        evaluate=jax.jit(fns.evaluate),
        error=jax.jit(fns.error),
        scores=jax.jit(fns.scores),
        classification=bool(is_classification(dataset.y_train)),
        kernel=kernel,
        lambda_max_at_init=lambda_max_at_init,
        loss_scale=scale,
        flops=step_flops(make_fns().step, state, hp, x, y),  # the whole batch's: the same FLOPs
        compile_seconds=compile_seconds,
    )


def _run_groups(config, workdir: epath.Path, dataset, groups) -> list[dict]:
    """A sweep over depths or widths: each shape's runs are one program, trained in
    WORKDIR/layers_<L> or dim_<d> (`group_folder`: checkpoints, metrics, summary; resumable on
    its own), one after another; WORKDIR gets the merged metrics.jsonl and summary.json."""
    config_json = check_resumable(config, workdir, sweep=True)
    for shape, _ in groups:  # every shape's folder too, before anything is written
        check_resumable(group_config(config, shape), workdir / group_folder(shape))
    if jax.process_index() == 0:
        write_json(workdir / CONFIG_FILE, config_json)
        write_json(workdir / RUNS_FILE, [run.settings() for _, runs in groups for run in runs])
    summaries, lines = [], []
    for (layers, dim), runs in groups:
        group_dir = workdir / group_folder((layers, dim))
        make_folder(group_dir)
        shape = ", ".join(
            f"{name}={value}" for name, value in (("L", layers), ("d", dim)) if value is not None
        )
        print(f"{shape}: runs {runs[0].index}-{runs[-1].index} in {group_dir}", flush=True)
        shape_config = group_config(config, (layers, dim))
        group_data = dataset if dim is None else load_dataset(shape_config)
        summaries += _run_locked(shape_config, group_dir, group_data, runs)
        lines += read_metrics_lines(group_dir)
    if jax.process_index() == 0:
        with atomic_open(workdir / METRICS_FILE) as f:
            f.writelines(text for text, _ in lines)
        write_json(workdir / SUMMARY_FILE, summaries)
    return summaries


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What a program is built from: the model, its data (teacher targets filled in), the mesh,
    and one run's output and parameter counts (the Jacobian's shape)."""

    model: Model
    dataset: object
    mesh: jax.sharding.Mesh
    num_outputs: int
    num_params: int


def _parts(config, dataset, runs) -> _Parts:
    model = build_model(config.model, dataset)
    if dataset.teacher_seed is not None:
        dataset = dataset.with_teacher_targets(model, RunSettings())  # the teacher's β = 1
    mesh = sharding.make_mesh(len(runs), dataset.num_train, config.mesh)
    one_run_params = model.init(runs[0].seed)
    num_outputs = _num_outputs(model, dataset.x_train, one_run_params)
    num_params = sum(np.size(leaf) for leaf in jax.tree.leaves(one_run_params))
    return _Parts(model, dataset, mesh, num_outputs, num_params)


def build_program(config, dataset=None, runs=None) -> Program:
    """The program `run` trains, built and compiled but not run: data and initial state placed
    on the mesh, the chunks compiled (for benchmarks and tests).

    dataset: the data (default: `config.data` loaded); runs: those of one shape (default: the
    first group of `config`'s sweep, `sweep.group_runs`). Raises ConfigError for a size that
    cannot fit.
    """
    if runs is None:
        shape, runs = group_runs(expand_runs(config))[0]
        config = group_config(config, shape)
    dataset = load_dataset(config) if dataset is None else dataset
    parts = _parts(config, dataset, runs)
    return _build(config, parts, runs)


def _run_locked(config, workdir: epath.Path, dataset, runs) -> list[dict]:
    """`run` once the workdir is locked, for `runs` of one shape: checks, restore, the step loop,
    the summary."""
    config_json = check_resumable(config, workdir)
    runs, lrs_recorded = recorded_kernel_lrs(config, workdir, runs)
    parts = _parts(config, dataset, runs)
    dataset = parts.dataset
    train = config.train
    checkpointer = Checkpointer(
        workdir,
        every=train.checkpoint_every,
        keep=train.keep_checkpoints,
        use_async=train.async_checkpoints,
    )
    try:
        program = _build(config, parts, runs, lrs_recorded)
        _stop_before_training("compiling")
        if jax.process_index() == 0:
            write_json(workdir / CONFIG_FILE, config_json)
            write_json(workdir / RUNS_FILE, [run.settings() for run in program.runs])
        step, state, kept = _restore(config, workdir, checkpointer, program)
        program.state = state
        writer = MetricsWriter(workdir, kept)
        checkpointer.on_save = writer.sync  # object storage: metrics written whole before a save
        try:
            loop = LoopSettings.from_config(config)
            run_loop(loop, program, checkpointer, writer, step, config_json, dataset)
            _final_sync(writer, checkpointer)
        finally:
            writer.close()
    finally:
        checkpointer.close()
    settings = [r.settings() for r in program.runs]
    summaries = run_summaries(writer.history, settings, fit_floor(config.model.dtype))
    if jax.process_index() == 0:
        write_json(workdir / SUMMARY_FILE, summaries)
    return summaries


def _final_sync(writer: MetricsWriter, checkpointer: Checkpointer) -> None:
    """The metrics lines after the last checkpoint, to object storage (`MetricsWriter.sync`)."""
    try:
        writer.sync()
    except WorkdirWriteError as error:
        steps = checkpointer.steps()
        last = f"step {steps[-1]} in {checkpointer.directory}" if steps else "none"
        raise WorkdirWriteError(
            f"{error}; last checkpoint: {last}, and every metrics line before it is saved; "
            "rerun the same command"
        ) from None


def _restore(config, workdir: epath.Path, checkpointer: Checkpointer, program: Program):
    """(step, state, metrics lines kept) of the newest good checkpoint that the metrics cover.

    metrics.jsonl must hold every line before the resume step; when it does not (a torn or cut
    file), an earlier checkpoint (or step 0) is used so that the missing lines are recomputed.
    """
    settings = [r.settings() for r in program.runs]
    prefix, reach = valid_prefix(read_metrics_lines(workdir), settings, config.train.log_every)
    latest = checkpointer.latest_step()
    if latest is not None and latest > reach:
        print(
            f"{workdir / METRICS_FILE} holds the lines of the steps before {reach} "
            f"only, the latest checkpoint is at step {latest}: resuming from an earlier "
            "checkpoint (or step 0) to recompute the missing lines",
            flush=True,
        )

    def accept(state, meta: dict) -> str | None:
        saved = meta.get("metrics_sha256")
        before = [text for text, record in prefix if record["step"] < meta["step"]]
        if saved is not None and saved != lines_digest(before):
            return (
                f"does not match the lines of {METRICS_FILE} before it (they were changed after "
                "it was saved)"
            )
        return checkpoint_losses_finite(
            multihost.to_host(program.evaluate(state["params"], program.hp, program.x, program.y))
        )

    restored = checkpointer.restore_latest(program.state, max_step=reach, accept=accept)
    if restored is None:
        return 0, program.state, []
    step, state, _ = restored
    print(f"resuming from step {step} ({checkpointer.directory})", flush=True)
    return step, state, [line for line in prefix if line[1]["step"] < step]
