"""Config checks that run before anything is written: each failure is one line naming the field."""

from __future__ import annotations

import math
import os
import tempfile

import jax

from resconv_jax.config_defaults import RENAMED, base_config
from resconv_jax.data import data_module, data_names
from resconv_jax.errors import ConfigError
from resconv_jax.models import model_module, model_names
from resconv_jax.runtime import workdir as wd

CHOICES = {
    "optim.loss": ("squared", "cross_entropy"),
    "data.target": ("gaussian", "teacher"),
    "optim.name": ("sgd", "momentum", "adam"),
    "optim.reduction": ("sum", "mean"),
    "optim.lr_rule": ("fixed", "lambda_max"),
    "model.dtype": ("float32", "float64"),
    "probe.dtype": ("float32", "float64"),
}
_POSITIVE_INTS = (
    "model.num_layers",
    "data.num_samples",
    "data.seq_len",
    "data.dim",
    "data.out_dim",
    "train.log_every",
    "train.print_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "certificate.lanczos_iterations",
)
_NON_NEGATIVE_INTS = (
    "train.num_steps",
    "mesh.sweep",
    "mesh.data",
    "certificate.every",
    "probe.every",
    "train.step_losses_until",
    "certificate.max_jacobian_entries",
)
INT_MINIMUM = (
    dict.fromkeys(_POSITIVE_INTS, 1)
    | dict.fromkeys(_NON_NEGATIVE_INTS, 0)
    | {"train.runs_per_chunk": -1}  # -1: automatic
)
FLOAT64_FIELDS = ("model.dtype", "probe.dtype")
POSITIVE_FLOATS = ("optim.lr", "optim.lr_factor")
NON_NEGATIVE_FLOATS = ("model.beta_attn", "model.beta_ffn")


def wants_float64(config) -> bool:
    """Whether the config asks for float64 anywhere (weights or the probe)."""
    return any(_get(config, field) == "float64" for field in FLOAT64_FIELDS)


def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        if part not in value:
            return None
        value = value[part]
    return value


def _fields(node, prefix: str = "config"):
    """(dotted name, key, value) of every field of the config that is not a section."""
    for key, value in node.items():
        if hasattr(value, "items"):
            yield from _fields(value, f"{prefix}.{key}")
        else:
            yield f"{prefix}.{key}", key, value


def _check_finite(config) -> None:
    """Every float of the config, alone or in a tuple, must be finite (no inf, no nan)."""
    for field, _, value in _fields(config):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{field}={value}: must be a finite number")
        if isinstance(value, tuple | list) and any(
            isinstance(v, float) and not math.isfinite(v) for v in value
        ):
            raise ConfigError(f"{field}={tuple(value)}: must be finite")


def renamed_flag(argv: list[str]) -> str | None:
    """The one-line refusal of the first `--config.OLD=...` in `argv` whose field moved
    (`config_defaults.RENAMED`), naming where it is now; None when every name is current."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        field = arg[len("--config.") :].split("=", 1)[0]
        for old, new in RENAMED.items():
            if field == old or field.startswith(old + "."):
                now = new + field[len(old) :]
                return f"--config.{field} is now --config.{now} (renamed; the old name is not read)"
    return None


def check_sections(config) -> None:
    """Raises ConfigError naming the first top-level field or section of `base_config()` that
    `config` lacks."""
    missing = [name for name in base_config() if name not in config]
    if missing:
        raise ConfigError(
            f"the config has no {missing[0]!r} field or section: a config file's get_config() "
            "starts from resconv_jax.config_defaults.base_config() and overrides values"
        )


def check_known_fields(config) -> None:
    """Raises ConfigError naming the first field that no code reads: one of neither
    `base_config()` nor the data set's `default_config()`, outside the task's own section
    (config.rank_collapse for task "rank_collapse"). The command line cannot add fields; a
    config file can, and a misspelt one would train with the default in its place."""
    reference = base_config()
    reference.data = data_module(config.data.name).default_config()
    known = {field for field, _, _ in _fields(reference)}
    for field, _, _ in _fields(config):
        section = field.split(".")[1]
        if field in known or section == config.task:
            continue
        if section == "data":
            raise ConfigError(
                f"{field}: not a field of data set {config.data.name!r} (a typo, or the section "
                f"of another data set: config.data = resconv_jax.data.{config.data.name}."
                "default_config(), then override its values)"
            )
        raise ConfigError(
            f"{field}: no such field (a typo?); the fields are those of resconv_jax."
            "config_defaults.base_config() and of the data set's default_config()"
        )


def validate_config(config) -> None:
    """Raises ConfigError (one line) for the first value that cannot be run."""
    check_sections(config)
    _check_finite(config)
    if config.model.name not in model_names():
        raise ConfigError(
            f"config.model.name={config.model.name!r}: expected one of {', '.join(model_names())} "
            "(the modules of resconv_jax/models/)"
        )
    if config.data.name not in data_names():
        raise ConfigError(
            f"config.data.name={config.data.name!r}: expected one of {', '.join(data_names())} "
            "(the modules of resconv_jax/data/)"
        )
    check_known_fields(config)
    validate_model = getattr(model_module(config.model.name), "validate", None)
    if validate_model is not None:
        validate_model(config.model)
    for field, allowed in CHOICES.items():
        value = _get(config, field)
        if value is not None and value not in allowed:
            raise ConfigError(f"config.{field}={value!r}: expected one of {', '.join(allowed)}")
    for field in FLOAT64_FIELDS:
        if _get(config, field) == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError(
                f"config.{field}=float64 needs jax_enable_x64: run python -m resconv_jax.main "
                "(which turns it on for float64 configs) or set JAX_ENABLE_X64=1"
            )
    for field, minimum in INT_MINIMUM.items():
        value = _get(config, field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.{field}={value!r}: expected an integer >= {minimum}")
        if value < minimum:
            bound = {1: "positive", 0: "non-negative"}.get(minimum, f">= {minimum}")
            raise ConfigError(f"config.{field}={value}: must be {bound}")
    _check_microbatch_size(config.train.get("microbatch_size", 0))
    _check_seeds(config)
    for field in POSITIVE_FLOATS:
        if _get(config, field) is not None:
            _check_lr(f"config.{field}", _get(config, field))
    for field in NON_NEGATIVE_FLOATS:
        if _get(config, field) is not None:
            _check_beta(f"config.{field}", _get(config, field))
    for value in config.sweep.lr:
        _check_lr("config.sweep.lr", value)
    for field in ("num_layers", "dim"):
        for value in config.sweep.get(field, ()):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.sweep.{field}={value!r}: expected integers >= 1")
    if config.sweep.get("dim", ()) and config.data.name != "synthetic":
        raise ConfigError(
            f"config.sweep.dim sweeps the width of synthetic data; data.name={config.data.name!r} "
            "has its own width: leave sweep.dim empty"
        )
    for name in ("beta", "beta_attn", "beta_ffn"):
        for value in config.sweep[name]:
            _check_beta(f"config.sweep.{name}", value)
    for name, values in config.sweep.items():  # one run twice: counted twice by every table
        if isinstance(values, tuple | list) and len(set(values)) < len(values):
            raise ConfigError(f"config.sweep.{name}={tuple(values)}: a value is repeated")
    if config.optim.lr_rule == "lambda_max" and config.sweep.lr:
        raise ConfigError(
            f"config.sweep.lr={tuple(config.sweep.lr)}: optim.lr_rule=lambda_max sets every run's "
            "step size (optim.lr_factor / λ_max): leave sweep.lr empty, or use lr_rule=fixed"
        )
    momentum = config.optim.momentum
    if not isinstance(momentum, int | float) or isinstance(momentum, bool) or not 0 <= momentum < 1:
        raise ConfigError(f"config.optim.momentum={momentum!r}: must be in [0, 1)")
    if config.sweep.beta and (config.sweep.beta_attn or config.sweep.beta_ffn):
        raise ConfigError("config.sweep.beta sets both residuals: leave beta_attn/beta_ffn empty")
    log_every = config.train.log_every
    multiples = {f"train.{k}": config.train[k] for k in ("print_every", "checkpoint_every")}
    for section in ("certificate", "probe"):
        if section in config:
            multiples[f"{section}.every"] = config[section].every
    for field, value in multiples.items():
        if value % log_every:
            raise ConfigError(
                f"config.{field}={value}: must be a multiple of train.log_every={log_every}"
            )


def _check_microbatch_size(value) -> None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise ConfigError(
        f"config.train.microbatch_size={value!r}: expected 0 (the whole batch), a number of "
        "samples per device > 0, or auto"
    )


SEED_LIMIT = 2**32


def _is_seed(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEED_LIMIT


def _check_seeds(config) -> None:
    """Every field named seed or *_seed, alone or a tuple (sweep.seed), must hold integers in
    [0, 2**32): what jax.random.key and NumPy's generators take alike."""
    for field, key, value in _fields(config):
        if key != "seed" and not key.endswith("_seed"):
            continue
        values = tuple(value) if isinstance(value, tuple | list) else (value,)
        if not all(map(_is_seed, values)):
            shown = values if isinstance(value, tuple | list) else value
            raise ConfigError(f"{field}={shown!r}: a seed is an integer in [0, 2**32)")


def _check_lr(field: str, value) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{field}={value!r}: the step size must be a number > 0")


def _check_beta(field: str, value) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ConfigError(f"{field}={value!r}: a residual coefficient must be a number >= 0")


def check_workdir(workdir: str, *, checkpoints: bool = True) -> None:
    """Raises ConfigError unless `workdir` exists as a writable folder or can be created.

    An object-storage URL (gs://, s3://) is checked without writing: that its store can be
    reached (its client installed) and that the URL is not an object; a store that refuses
    writes is found at the first write (exit status 4). With `checkpoints`, only gs:// is
    accepted: Orbax writes checkpoints to local folders and GCS only. An empty one is refused
    (it would mean the current folder).
    """
    if not str(workdir).strip():
        raise ConfigError("--workdir is empty: give the run's folder (--workdir=.: this one)")
    if not wd.is_local(workdir):
        if checkpoints and not str(workdir).startswith("gs://"):
            raise ConfigError(
                f"--workdir={workdir}: checkpoints can be written to a local folder or to gs:// "
                "only (Orbax); use one of those"
            )
        try:
            remote = wd.path(workdir)
            if remote.exists() and not remote.is_dir():
                raise ConfigError(f"--workdir={workdir}: exists and is not a folder")
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - the store's own errors, in one line
            raise ConfigError(
                f"--workdir={workdir}: cannot reach it ({wd.describe_os_error(error)})"
            ) from None
        return
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir={workdir}: exists and is not a folder")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir={workdir}: {existing} is not writable")
    # os.access answers yes to root where a write still fails (/proc, some mounts). The probe's
    # name holds ".tmp-", which readers of a workdir skip (results_cache), so that one walking it
    # at this moment never meets a folder that vanishes under it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tmp-resconv-check-", dir=existing))
    except OSError as error:
        raise ConfigError(
            f"--workdir={workdir}: a folder cannot be created there ({wd.describe_os_error(error)})"
        ) from None
