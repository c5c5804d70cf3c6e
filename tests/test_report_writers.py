"""Every experiment's report writer on one synthetic metrics history, and each claim read back
from the files its writer wrote (the columns by the constants both use), in seconds."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest

from resconv_jax.experiments import claims, classification, conditioning, depth, descent

STEPS = range(0, 101, 10)
WINDOW = 30  # steps with every step's loss logged ("step_losses")


def _loss(step: int, beta: float, seed: int, dim: int) -> float:
    rate = 0.03 * (1 + beta) * dim / 64
    return float((2 + beta) * np.exp(-rate * step) * (1 + 0.01 * seed))


def sweep_history() -> list[dict]:
    """Metrics lines of a width × depth × seed × β sweep: the loss falls faster for larger β and
    wider d, the conditioning of Z is better for larger β, the error falls with β and depth."""
    lines, run = [], 0
    for dim in (64, 128):
        for layers in (1, 2):
            for seed in (0, 1):
                for beta in (0.0, 0.5, 1.0):
                    settings = {"run": run, "seed": seed, "lr": 1e-3, "beta_attn": beta,
                                "beta_ffn": beta, "num_layers": layers, "dim": dim}  # fmt: skip
                    run += 1
                    for step in STEPS:
                        line = settings | {"step": step, "loss": _loss(step, beta, seed, dim)}
                        for layer in range(layers):
                            ratio = 0.1 * (1 + beta) / (1 + layer)
                            line |= {
                                f"layer{layer}/z/sigma_min": ratio,
                                f"layer{layer}/z/sigma_max": 1.0,
                                f"layer{layer}/attn/sigma_min": 0.01,
                                f"layer{layer}/z/sigma_min_over_fro": ratio / 4,
                                f"layer{layer}/z/collapse_residual": 1 - ratio,
                                f"layer{layer}/attn/collapse_residual": 0.9,
                            }
                        error = 0.5 - 0.002 * step * (1 + beta) * layers
                        line |= {"error": max(error, 0.0), "val_error": 0.5}
                        if step == 0:
                            line |= {"ntk/lambda_min": 10.0 * (1 + beta), "ntk/lambda_max": 500.0,
                                     "ntk/stable_lr": 2 / 500.0}  # fmt: skip
                        if step < WINDOW:
                            line["step_losses"] = [
                                _loss(s, beta, seed, dim) for s in range(step, step + 10)
                            ]
                        lines.append(line)
    return lines


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_each_writer_writes_what_its_claim_reads(tmp_path):
    history = sweep_history()
    config = {"data": {"num_samples": 8, "seq_len": 8, "out_dim": 1}, "optim": {"reduction": "sum"}}
    table = conditioning.write_conditioning_report(tmp_path, history, config, floor=1e-12)
    assert "rate against conditioning" in table
    row = conditioning.rate_vs_conditioning(str(tmp_path))
    assert row.verdict == claims.HOLDS and "d=128 (2·P·M)" in row.value, row

    assert "L" in depth.write_depth_report(tmp_path, history, floor=1e-12)
    row = depth.multilayer(str(tmp_path))
    assert row.verdict == claims.HOLDS and row.value.startswith("L=1: 1.000, L=2: 1.000"), row

    assert "τ" in descent.write_descent_report(tmp_path, _one_setting(history))
    row = descent.jena_descent(str(tmp_path))
    assert row.value.startswith("τ = -") and row.verdict in (claims.HOLDS, claims.FAILS), row

    accuracy = classification.write_classification_report(tmp_path, history)
    assert accuracy and classification.FINAL_ERROR in accuracy[0]
    row = classification.sst2_ordering(str(tmp_path))
    assert row.verdict == claims.FAILS, row  # deeper is better at β = 0 too: not the claimed order
    for name in (conditioning.TABLE_FILE, depth.RUNS_FILE, descent.TABLE_FILE,
                 classification.ACCURACY_FILE, "rate_scatter.png", "depth_sigma.png",
                 "descent_by_beta.png", "errors.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name


def _one_setting(history):
    """The lines of d = 64, L = 1: runs that differ only in β and seed."""
    return [line for line in history if line["dim"] == 64 and line["num_layers"] == 1]


def _untied(history):
    return [line | {"beta_ffn": 0.0} for line in _one_setting(history)]


def _lr_sweep(history):
    history = _one_setting(history)
    runs = 1 + max(line["run"] for line in history)
    return history + [line | {"run": line["run"] + runs, "lr": 2e-3} for line in history]


@pytest.mark.parametrize(
    "make, reason",
    [
        (_untied, "runs set β_a ≠ β_f (β_a=0.5 β_f=0, β_a=1 β_f=0)"),
        (lambda history: history, "the runs differ in L (1, 2) and d (64, 128) as well as"),
        (_lr_sweep, "the runs differ in lr (0.001, 0.002) as well as in β and seed"),
    ],
)
def test_the_descent_ordering_is_not_computed_over_runs_that_differ_in_more_than_beta(
    tmp_path, make, reason
):
    """τ(β, steps) ordered runs by β_a and pooled every other setting: β_f = 0 and 1 merged,
    and an lr or depth sweep ranked against each other as if they were seeds' runs."""
    history = make(sweep_history())
    summary = descent.write_descent_report(tmp_path, history)
    assert "no ordering by β" in summary and reason in summary, summary
    assert not (tmp_path / "descent_by_beta.png").exists()
    for claim in (descent.jena_descent, descent.jena_descent_fixed_start):
        row = claim(str(tmp_path))
        assert row.verdict == claims.NOT_RUN and reason in row.note, row
