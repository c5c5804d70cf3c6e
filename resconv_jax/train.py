"""`run(config, workdir)`: mesh -> data -> state (restore or init) -> compiled step loop -> summary.

Every run of a sweep advances in one program. The loop hands control back to Python only at log
steps, where it writes metrics, checks the tangent-kernel certificate, checks for divergence,
checkpoints, and honours SIGTERM.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from resconv_jax import probe, report, sharding, theory
from resconv_jax.checkpoint import Checkpointer
from resconv_jax.config_defaults import base_config
from resconv_jax.data import load_dataset
from resconv_jax.metrics import MetricsWriter, progress_line, step_flops
from resconv_jax.models import transformer
from resconv_jax.runners import ChunkRunners, check_runs_per_chunk
from resconv_jax.step import init_opt_state, make_optimizer, make_step_functions
from resconv_jax.summary import fit_floor, run_summaries
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
    # A field added since the run started took its default there.
    defaults = _flatten(json.loads(base_config().to_json_best_effort()))
    saved = {k: v for k, v in defaults.items() if k in current} | saved
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


def _prepare_workdir(workdir: str, config_json: dict) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--workdir={workdir}: cannot create it ({error.strerror})") from None
    if jax.process_index() == 0:
        with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
            json.dump(config_json, f, indent=2)


def _init_params(model_cfg, runs) -> dict:
    params = [transformer.init_params(model_cfg, run.seed)[1] for run in runs]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)


def _init_state(params, runs, optimizer):
    """Train state from stacked initial params (R, ...), with each run's step size."""
    lrs = jnp.asarray([run.lr for run in runs], jax.tree.leaves(params)[0].dtype)
    return {"params": params, "opt_state": init_opt_state(optimizer, params, lrs)}


def _loss_scale(config, y: np.ndarray) -> float:
    """d loss / d(½‖F − Y‖²): 1 for the sum reduction, 1/N for the mean over N entries."""
    return 1.0 if config.optim.reduction == "sum" else 1.0 / y.size


def _jacobian_fits(config, y: np.ndarray, params: dict) -> bool:
    """Whether J (y.size outputs × the parameters of one run) fits theory.max_jacobian_entries."""
    num_params = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    return y.size * num_params <= config.theory.max_jacobian_entries


@dataclasses.dataclass
class _Kernel:
    """The tangent-kernel certificate: jitted eigenvalues and the latest λ_max per run."""

    eigenvalues: object  # jitted (params, hp, x) -> (λ_min (R,), λ_max (R,))
    loss_scale: float
    lam_max: np.ndarray | None = None

    def records(self, params, hp, x, lrs: np.ndarray, contraction: np.ndarray) -> list[dict]:
        lam_min, lam_max = (np.asarray(v) for v in self.eigenvalues(params, hp, x))
        self.lam_max = lam_max
        bound = theory.certificate_bound(lrs, lam_min, loss_scale=self.loss_scale, lam_max=lam_max)
        holds = theory.bound_holds(contraction, bound)
        stable = theory.stable_lr(lam_max, loss_scale=self.loss_scale)
        return [
            {
                "ntk/lambda_min": lam_min[r],
                "ntk/lambda_max": lam_max[r],
                "ntk/bound": bound[r],
                "ntk/holds": float(holds[r]),
                "ntk/stable_lr": stable[r],
            }
            for r in range(len(lrs))
        ]


def _with_kernel_lrs(config, runs, kernel: _Kernel, params, hp, x):
    """lr_rule="lambda_max": each run's η = lr_factor / (λ_max(K)·loss_scale) at initialization."""
    _, lam_max = (np.asarray(v) for v in kernel.eigenvalues(params, hp, x))
    lrs = config.optim.lr_factor / (lam_max * kernel.loss_scale)
    return [dataclasses.replace(run, lr=float(lr)) for run, lr in zip(runs, lrs, strict=True)]


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
    check_runs_per_chunk(config.train.runs_per_chunk, mesh)
    graphdef, one_run_params = transformer.init_params(model_cfg, runs[0].seed)
    kernel_fits = _jacobian_fits(config, y_np, one_run_params)
    if config.optim.lr_rule == "lambda_max" and not kernel_fits:
        raise ConfigError(
            "config.optim.lr_rule=lambda_max needs the Jacobian to fit "
            f"theory.max_jacobian_entries={config.theory.max_jacobian_entries}"
        )
    _prepare_workdir(workdir, config_json)

    put_data = functools.partial(sharding.put, sharding=sharding.data_sharding(mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x, y = put_data(x_np), put_data(y_np)
    x_val, y_val = None, None
    if dataset.x_val is not None:
        # Validation sets rarely divide the 'data' axis; they are small, so replicate those.
        divisible = dataset.x_val.shape[0] % mesh.shape["data"] == 0
        put_val = put_data if divisible else functools.partial(sharding.put, sharding=replicated)
        x_val, y_val = put_val(dataset.x_val), put_val(dataset.y_val)
    on_runs = sharding.run_sharding(mesh)
    hp = sharding.put_tree(run_hparams(runs), on_runs)
    optimizer = make_optimizer(config.optim)
    train = config.train
    probe_fn = None
    if config.probe.enabled:
        probe_fn = functools.partial(
            probe.probe_attention,
            mesh=mesh,
            dtype=jnp.dtype(config.probe.dtype),
            per_sample=config.probe.per_sample,
        )
    make_fns = functools.partial(
        make_step_functions, graphdef, optimizer, config.optim.reduction, train.log_every
    )
    fns = make_fns()  # loss, step, evaluate, kernel: the chunk runners add the probe
    kernel = None
    if (config.theory.every or config.optim.lr_rule == "lambda_max") and kernel_fits:
        kernel = _Kernel(jax.jit(fns.kernel_eigenvalues), _loss_scale(config, y_np))
    elif config.theory.every:
        print(
            f"theory: tangent-kernel certificate skipped: J ({y_np.size} outputs x params) "
            f"exceeds theory.max_jacobian_entries={config.theory.max_jacobian_entries}",
            flush=True,
        )
    params = _init_params(model_cfg, runs)
    if config.optim.lr_rule == "lambda_max":
        runs = _with_kernel_lrs(config, runs, kernel, params, hp, x)
    state = sharding.put_tree(_init_state(params, runs, optimizer), on_runs)

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
        print(f"resuming from step {step} ({checkpointer.directory})", flush=True)
    writer = MetricsWriter(workdir, resume_step=step)

    t0 = time.perf_counter()
    runners = ChunkRunners(make_fns, probe_fn, config, mesh, (state, hp, x, y))
    evaluate = jax.jit(fns.evaluate)
    flops = step_flops(fns.step, state, hp, x, y)
    print(
        f"{len(runs)} runs, mesh {dict(mesh.shape)}, {dataset.description}; compiled in "
        f"{time.perf_counter() - t0:.1f}s{runners.description}; {flops:.3g} FLOP per step "
        "(all runs)",
        flush=True,
    )

    preempt = {"signal": False}
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: preempt.update(signal=True))
    settings = [r.settings() for r in runs]
    lrs = np.array([r.lr for r in runs])
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
            params_at_step = state["params"]
            certify = kernel is not None and config.theory.every and step % config.theory.every == 0
            if certify:  # the kernel needs the parameters the chunk is about to donate
                params_at_step = jax.tree.map(jnp.copy, params_at_step)
            state, buffers = runners.at(step)(state, hp, x, y, jnp.int32(num))
            buffers = jax.tree.map(np.asarray, buffers)
            ntk = None
            if certify and num > 1:  # before the finiteness check, which reports its λ_max
                contraction = buffers["loss"][1] / buffers["loss"][0]
                ntk = kernel.records(params_at_step, hp, x, lrs, contraction)
            _check_finite(buffers["loss"][:num], step, runs, checkpointer, kernel)
            records = _log_records(settings, buffers, num, val)
            if ntk is not None:
                records = [r | n for r, n in zip(records, ntk, strict=True)]
            writer.write(step, records)
            step += num
            checkpointer.save(step, state, {"step": step}, force=step == total)
            if step % train.print_every == 0 or step == total:
                now = time.perf_counter()
                rate = (step - last_print_step) / max(now - last_print, 1e-9)
                print(progress_line(step, total, buffers["loss"][num - 1], rate), flush=True)
                writer.scalars(step, {"steps_per_sec": rate, "flops_per_sec": rate * flops})
                last_print, last_print_step = now, step
        if not writer.history or writer.history[-1]["step"] < total:
            final = {"loss": np.asarray(evaluate(state["params"], hp, x, y))}
            if x_val is not None:
                final["val_loss"] = np.asarray(evaluate(state["params"], hp, x_val, y_val))
            writer.write(
                total, [s | {k: v[r] for k, v in final.items()} for r, s in enumerate(settings)]
            )
        checkpointer.wait()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        checkpointer.close()
        writer.close()
    floor = fit_floor(config.model.dtype)
    summaries = run_summaries(writer.history, settings, floor)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summaries, f, indent=2)
        rows = report.write_reports(workdir, writer.history, config.report.loss_threshold, floor)
        if len(rows) > 1:
            print(report.format_beta_table(rows), flush=True)
    return summaries


def _log_records(settings: list[dict], buffers: dict, num: int, val) -> list[dict]:
    """One record per run for the chunk's first step: loss, contraction, probe values."""
    records = []
    for r, run_settings in enumerate(settings):
        record = dict(run_settings)
        record["loss"] = buffers["loss"][0, r]
        record["grad_norm"] = buffers["grad_norm"][0, r]
        if num > 1:
            record["contraction"] = buffers["loss"][1, r] / buffers["loss"][0, r]
        if val is not None:
            record["val_loss"] = val[r]
        for key, values in buffers.items():
            if "/" in key and np.isfinite(values[0, r]).all():
                record |= {f"layer{i}/{key}": v for i, v in enumerate(values[0, r])}
        records.append(record)
    return records


def _check_finite(losses: np.ndarray, step: int, runs, checkpointer, kernel) -> None:
    """Raises TrainingDiverged naming the first non-finite loss of `losses` (steps × runs)."""
    bad = ~np.isfinite(losses)
    if not bad.any():
        return
    offset, r = np.argwhere(bad)[0]
    run = runs[r]
    last = checkpointer.latest_step()
    where = f"step {last} in {checkpointer.directory}" if last is not None else "none"
    if kernel is not None and kernel.lam_max is not None:
        stable = theory.stable_lr(kernel.lam_max[r], loss_scale=kernel.loss_scale)
        advice = f"the tangent kernel's stable step size 2/lambda_max was {stable:.3g}; try "
        advice += f"--config.optim.lr={0.5 * stable:.3g}"
    else:
        advice = f"try a smaller step size, e.g. --config.optim.lr={run.lr / 4:g}"
    raise TrainingDiverged(
        f"run {r} (beta_attn={run.beta_attn}, beta_ffn={run.beta_ffn}, seed={run.seed}) diverged: "
        f"loss {losses[offset, r]} at step {step + offset}; last good checkpoint: {where}; {advice}"
    )
