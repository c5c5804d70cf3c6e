"""The second reading of the claims (rows marked ″, docs/protocol.md) from synthetic run
directories: each verdict, holds, fails or undecided, can be reached."""

import json

import numpy as np
import pytest

from resconv_jax.experiments import claims, conditioning, convergence, descent, rank_collapse
from resconv_jax.runtime.workdir import write_csv

BETAS = (0, 0.25, 0.5, 0.75, 1)

pytestmark = pytest.mark.usefixtures("fewer_draws")


def _descent_dir(folder, steps_of, initial_loss_of, seeds=range(3)):
    rows = [{"run": i, "seed": s, "beta_attn": b, "beta_ffn": b,
             "initial_loss": initial_loss_of(b, s), "window_steps": 300,
             "steps_to_0.5": steps_of(b, s) / 2, "steps_to_0.2": steps_of(b, s)}
            for i, (s, b) in enumerate((s, b) for s in seeds for b in BETAS)]  # fmt: skip
    folder.mkdir()
    write_csv(folder / descent.TABLE_FILE, rows)
    return str(folder)


def test_5a_second_reading_holds_when_beta_orders_every_seed_whatever_the_start(tmp_path):
    start = np.random.default_rng(0).uniform(1, 2, (5, 3))
    row = descent.jena_descent_fixed_start(
        _descent_dir(
            tmp_path / "a", lambda b, s: 100 - 50 * b + s, lambda b, s: start[int(4 * b), s]
        )  # fmt: skip
    )
    assert row.verdict == claims.HOLDS, row
    assert "exact over 1,728,000" in row.value and "power 1.00" in row.value


def test_5a_second_reading_is_not_held_when_the_start_explains_the_speed(tmp_path):
    # Larger β starts lower, and the steps follow the start alone (with noise).
    noise = np.random.default_rng(1).normal(0, 3, (5, 10))
    row = descent.jena_descent_fixed_start(
        _descent_dir(
            tmp_path / "a",
            lambda b, s: 100 - 50 * b + noise[int(4 * b), s],
            lambda b, s: 2 - b + noise[int(4 * b), s] / 50,
            seeds=range(10),
        )  # fmt: skip
    )
    assert "τ = -" in row.value  # the unconditional ordering is there
    assert row.verdict in (claims.UNDECIDED, claims.FAILS), row


def test_5a_second_reading_fails_when_larger_beta_is_slower(tmp_path):
    start = np.random.default_rng(2).uniform(1, 2, (5, 10))
    row = descent.jena_descent_fixed_start(
        _descent_dir(
            tmp_path / "a",
            lambda b, s: 100 + 50 * b + s % 3,
            lambda b, s: start[int(4 * b), s],
            seeds=range(10),
        )  # fmt: skip
    )
    assert row.verdict == claims.FAILS, row
    assert "10,000 draws" in row.value  # 120^10 permutations: drawn, and it says so


def _conditioning_dir(folder, speed_of):
    rng = np.random.default_rng(3)
    rows = []
    for dim in (64, 128):
        for seed in range(3):  # 6^5 within-β permutations: exact
            for beta in BETAS:
                ratio = rng.uniform(0.1, 1.0) * (1 + beta)
                rows.append({"dim": dim, "seed": seed, "beta_attn": beta, "speed":
                             speed_of(ratio, beta, rng), "z_ratio_sq_init": ratio,
                             "eta_lambda_min_init": ratio})  # fmt: skip
    folder.mkdir()
    write_csv(folder / conditioning.RUNS_FILE, rows)
    table = [{"dim": 64, "dim_over_pm": 1.0}, {"dim": 128, "dim_over_pm": 2.0}]
    write_csv(folder / conditioning.TABLE_FILE, table)
    return str(folder)


def test_2_second_reading_looks_within_each_beta(tmp_path):
    with_ratio = _conditioning_dir(tmp_path / "a", lambda r, b, rng: 0.01 * r + 1e-4 * b)
    row = conditioning.rate_vs_conditioning_within_beta(with_ratio)
    assert row.verdict == claims.HOLDS, row
    # Faster with β, but within a β against the ratio: the pooled reading would be fooled.
    against = _conditioning_dir(tmp_path / "b", lambda r, b, rng: 0.01 * b - 1e-4 * r)
    row = conditioning.rate_vs_conditioning_within_beta(against)
    assert row.verdict == claims.FAILS, row
    noise = _conditioning_dir(tmp_path / "c", lambda r, b, rng: rng.normal())
    row = conditioning.rate_vs_conditioning_within_beta(noise)
    assert row.verdict in (claims.UNDECIDED, claims.FAILS), row


def test_3_second_reading_judges_the_stacked_matrices_by_their_seed_range(tmp_path):
    def rows(attn, z):
        return [{"qk_init": "1/d_qk", "d_qk": 4096, "num_seeds": 5,
                 "attn_ratio_stacked/mean": np.mean(attn), "attn_ratio_stacked/min": attn[0],
                 "attn_ratio_stacked/max": attn[1], "z_ratio_stacked/mean": np.mean(z),
                 "z_ratio_stacked/min": z[0], "z_ratio_stacked/max": z[1]}]  # fmt: skip

    for name, values, verdict in (
        ("a", ((1e-6, 5e-6), (0.2, 0.3)), claims.HOLDS),
        ("b", ((1e-3, 2e-3), (0.2, 0.3)), claims.FAILS),
        ("c", ((5e-5, 2e-4), (0.2, 0.3)), claims.UNDECIDED),  # seeds on both sides of 1e-4
    ):
        (tmp_path / name).mkdir()
        write_csv(tmp_path / name / rank_collapse.CSV_FILE, rows(*values))
        row = rank_collapse.residual_conditioning_stacked(str(tmp_path / name))
        assert row.verdict == verdict, (name, row)


def _theory_dir(folder, contraction, bound):
    """One float64 run whose loss contracts by `contraction` per step, with a certificate bound
    of `bound` logged every 20 steps."""
    folder.mkdir()
    lines = [{"run": 0, "step": t, "loss": contraction**t}
             | ({"ntk/bound": bound} if t % 20 == 0 else {}) for t in range(0, 200, 5)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = [{"run": 0, "beta_attn": 1.0, "rate": contraction, "rate_r2": 1.0}]
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps({"model": {"dtype": "float64"}}))
    return str(folder)


def test_1_second_reading_holds_when_the_loss_stays_under_the_certified_envelope(tmp_path):
    assert convergence.linear_convergence_bound(
        _theory_dir(tmp_path / "a", 0.95, 0.97)
    ).verdict == (claims.HOLDS)
    slower = convergence.linear_convergence_bound(_theory_dir(tmp_path / "b", 0.98, 0.97))
    assert slower.verdict == claims.FAILS and "bound broken" in slower.value
