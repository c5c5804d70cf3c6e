"""The training task (`config.task = "training"`): full-batch GD on every run of the config's
sweep (`train.run`), then the training report (`run_report`: the per-β table and figures, and
what the metrics hold: early descent, widths, depths, classification errors)."""

from __future__ import annotations

from resconv_jax import finished
from resconv_jax.data import data_module
from resconv_jax.models import model_module
from resconv_jax.sweep import expand_runs


def run(config, workdir: str) -> list[dict]:
    """`train.run`: the per-run summaries."""
    from resconv_jax import train  # a finished run's rerun builds nothing: not imported then

    return train.run(config, workdir)


def report(workdir: str) -> list[str]:
    """`run_report.write_run_report`: the tables, as printed."""
    from resconv_jax.experiments import run_report  # matplotlib: not imported for a kept report

    return run_report.write_run_report(workdir)


def why_unfinished(config, workdir: str) -> str | None:
    """`finished.why_unfinished`: None when every run is trained to the end, its record whole."""
    return finished.why_unfinished(config, workdir)


def _values(values) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


def describe_sizes(config) -> str:
    """The data (its module's `describe_sizes`), the model's kind (its module's, if any), the
    depths, the runs and what they sweep, the steps and the dtype."""
    shape = data_module(config.data.name).describe_sizes(config)
    describe_model = getattr(model_module(config.model.name), "describe_sizes", None)
    if describe_model is not None:
        shape += describe_model(config.model)
    swept = [
        f"{len(values)} {name}"
        for name, values in (
            ("β", config.sweep.beta or config.sweep.beta_attn),
            ("seeds", config.sweep.seed),
            ("widths", config.sweep.dim),
            ("depths", config.sweep.num_layers),
        )
        if len(values) > 1
    ]
    depths = config.sweep.num_layers
    depths = _values(depths) if depths else str(config.model.num_layers)
    count = len(expand_runs(config))
    return (
        f"{shape}, L={depths}; {count} runs{' (' + ' × '.join(swept) + ')' if swept else ''}, "
        f"{config.train.num_steps} steps, {config.model.dtype}"
    )
