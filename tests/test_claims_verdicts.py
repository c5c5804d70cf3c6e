"""The claims table's verdicts, read from synthetic run directories (docs/protocol.md's
first reading of each claim; the second reading: test_claims_second_reading.py)."""

import json

import numpy as np
import pytest

from resconv_jax.experiments import (
    claims,
    classification,
    conditioning,
    convergence,
    depth,
    descent,
    rank_collapse,
)
from resconv_jax.reproducing import report
from resconv_jax.reproducing.outcomes import Outcome
from resconv_jax.reproducing.report import claims_table
from resconv_jax.runtime.workdir import write_csv


def _summary(folder, runs, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(runs))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_linear_convergence_holds_only_when_every_beta_fits(tmp_path):
    good = _summary(
        tmp_path / "a", [{"beta_attn": b, "rate": 0.9, "rate_r2": 0.995} for b in (0, 1)]
    )
    bad = _summary(
        tmp_path / "b",
        [{"beta_attn": 0, "rate": 0.9, "rate_r2": 0.995},
         {"beta_attn": 1, "rate": 0.9, "rate_r2": 0.9}],
    )  # fmt: skip
    assert convergence.linear_convergence(good).verdict == claims.HOLDS
    row = convergence.linear_convergence(bad)
    assert row.verdict == claims.FAILS and "β=1: 0.9000" in row.value
    missing = convergence.linear_convergence(None)
    assert missing.verdict == claims.NOT_RUN and missing.note == "experiment not run"
    assert "summary.json missing" in convergence.linear_convergence(str(tmp_path / "c")).note


@pytest.mark.parametrize("rate", [1.005, 1.0], ids=["growing", "constant"])
def test_a_straight_log_loss_that_does_not_fall_is_not_linear_convergence(tmp_path, rate):
    """R² alone passed a finite run whose loss grew by 1.005 per step (R² 1.0000) or stayed
    put: rows 1, 4 and 4b also need the fitted ρ below 1."""
    runs = [{"beta_attn": 0, "rate": 0.9, "rate_r2": 0.995},
            {"beta_attn": 1, "rate": rate, "rate_r2": 1.0}]  # fmt: skip
    row = convergence.linear_convergence(_summary(tmp_path / "a", runs))
    assert row.verdict == claims.FAILS and f"β=1: fitted ρ = {rate:.5f} ≥ 1" in row.note, row
    cells = [{"num_layers": L, "beta_attn": b, "beta_ffn": b, "rate": rate if (L, b) == (2, 1)
              else 0.9, "rate_r2": 1.0} for L in (1, 2) for b in (0, 1)]  # fmt: skip
    (tmp_path / "d").mkdir()
    write_csv(tmp_path / "d" / "depth_runs.csv", cells)
    for small_branches in (False, True):
        row = depth.multilayer(str(tmp_path / "d"), small_branches=small_branches)
        assert row.verdict == claims.FAILS and f"fitted ρ = {rate:.5f} ≥ 1" in row.note, row


def _table(rho_square, rho_wide):
    return [
        {"dim": 64, "runs": 15, "dim_over_pm": 1.0, "rho_z_ratio_sq_init": rho_square,
         "rho_eta_lambda_min_init": 0.9, "rho_beta": 0.96},
        {"dim": 128, "runs": 15, "dim_over_pm": 2.0, "rho_z_ratio_sq_init": rho_wide,
         "rho_eta_lambda_min_init": 0.95, "rho_beta": 0.97},
    ]  # fmt: skip


def test_rate_vs_conditioning_is_held_at_the_wide_widths_only(tmp_path):
    for name, (square, wide, verdict) in {
        "a": (0.4, 0.95, claims.HOLDS),  # d = P·M is reported, not held to the threshold
        "b": (0.95, 0.85, claims.FAILS),
    }.items():
        (tmp_path / name).mkdir()
        write_csv(tmp_path / name / "conditioning_table.csv", _table(square, wide))
        row = conditioning.rate_vs_conditioning(str(tmp_path / name))
        assert row.verdict == verdict, name
        assert f"d=64 (1·P·M): ρ={square:.3f}" in row.value
        # β alone orders the speeds too (a confound; row 2″ holds β fixed): said beside ρ
        assert "ρ against β alone: d=64: 0.960, d=128: 0.970" in row.note, row.note


def test_an_undefined_rho_leaves_claim_2_not_run_and_says_why(tmp_path):
    """Fewer than 3 runs of a held width with a rate fit: ρ is NaN, which compared as 'fails'."""
    table = [row | {"fitted_runs": 15} for row in _table(0.4, float("nan"))]
    table[1]["fitted_runs"] = 2
    write_csv(tmp_path / "conditioning_table.csv", table)
    row = conditioning.rate_vs_conditioning(str(tmp_path))
    assert row.verdict == claims.NOT_RUN, row
    assert "ρ is undefined at d=128 (2 of 15 runs have a rate fit)" in row.note


def test_an_undefined_ratio_leaves_claim_3_not_run_and_says_why(tmp_path):
    rows = [{"qk_init": "1/d_qk", "d_qk": 4096, "attn_ratio_p_mean/max": float("nan"),
             "z_ratio_p_mean/min": 0.2}]  # fmt: skip
    write_csv(tmp_path / "rank_collapse.csv", rows)
    row = rank_collapse.residual_conditioning(str(tmp_path))
    assert row.verdict == claims.NOT_RUN and "non-finite" in row.note


def test_residual_conditioning_uses_the_worst_seed(tmp_path):
    def rows(attn_max, z_min):
        return [{"qk_init": "1/d_qk", "d_qk": 4096, "attn_ratio_p_mean/max": attn_max,
                 "z_ratio_p_mean/min": z_min}]  # fmt: skip

    for name, values, verdict in (
        ("a", (5e-6, 0.2), claims.HOLDS),
        ("b", (2e-4, 0.2), claims.FAILS),
        ("c", (5e-6, 0.05), claims.FAILS),
    ):
        (tmp_path / name).mkdir()
        write_csv(tmp_path / name / "rank_collapse.csv", rows(*values))
        assert rank_collapse.residual_conditioning(str(tmp_path / name)).verdict == verdict


def test_claim_3_gives_the_worst_sample_of_every_seed_in_its_note(tmp_path):
    """Claim 3 says rank one per sample; the row tests the per-seed means of the samples' ratios
    (as first defined) and says, beside, how far the worst single sample is."""
    row = {"qk_init": "1/d_qk", "d_qk": 4096, "attn_ratio_p_mean/max": 5e-6,
           "z_ratio_p_mean/min": 0.2, "attn_ratio_p_max/max": 3.2e-4,
           "z_ratio_p_min/min": 0.15}  # fmt: skip
    write_csv(tmp_path / "rank_collapse.csv", [row])
    claim = rank_collapse.residual_conditioning(str(tmp_path))
    assert claim.verdict == claims.HOLDS
    assert "worst single sample of any seed: Attn(X) 0.00032, Attn(X) + X 0.15" in claim.note


def _certificate_dir(folder, fraction, activation, lam_max):
    config = {"model": {"transformer": {"activation": activation}}, "optim": {"reduction": "sum"},
              "data": {"num_samples": 8, "seq_len": 8}}  # fmt: skip
    runs = [{"beta_attn": 0, "certificate_hold_fraction": fraction, "certificate_checks": 10}]
    _summary(folder, runs, config)
    line = {"step": 0, "run": 0, "lr": 1e-3, "ntk/stable_lr": 2 / lam_max}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    return str(folder)


def test_certificate_is_judged_only_inside_its_premise(tmp_path):
    holds = _certificate_dir(tmp_path / "a", 1.0, "softplus", 900.0)
    assert convergence.certificate(holds).verdict == claims.HOLDS
    assert convergence.certificate(
        _certificate_dir(tmp_path / "b", 0.9, "gelu", 900.0)
    ).verdict == (claims.FAILS)
    relu = convergence.certificate(_certificate_dir(tmp_path / "c", 0.4, "relu", 900.0))
    assert relu.verdict == claims.NOT_RUN and "outside the claim's premise" in relu.note
    too_large = convergence.certificate(_certificate_dir(tmp_path / "d", 1.0, "softplus", 2000.0))
    assert too_large.verdict == claims.NOT_RUN  # η·λ_max = 2 > 1


def test_the_certificate_row_gives_its_margin_and_the_largest_eta_lambda_max(tmp_path):
    """The premise is η·λ_max(K) ≤ 1 at initialization (the protocol's); the row also says how
    far past 1 it went at later checks and how close the closest check came to its bound, so a
    verdict on a knife edge reads as one."""
    folder = tmp_path / "a"
    config = {"model": {"transformer": {"activation": "softplus"}, "dtype": "float64"},
              "optim": {"reduction": "sum"}}  # fmt: skip
    runs = [{"run": 0, "beta_attn": 0, "certificate_hold_fraction": 1.0, "certificate_checks": 2}]
    _summary(folder, runs, config)
    checks = [  # (step, loss, 2/λ_max(K), L_{t+1}/L_t, bound)
        (0, 10.0, 2 / 900, 0.5, 0.6),
        (10, 5.0, 2 / 1120, 0.599999, 0.6),
        (20, 1e-30, 2 / 5000, 0.7, 0.6),  # below the fit floor: not a check of the claim
    ]
    keys = ("step", "loss", "ntk/stable_lr", "contraction", "ntk/bound")
    extra = {"run": 0, "lr": 1e-3, "ntk/holds": 1.0}  # as every check line of a run has
    lines = [dict(zip(keys, check, strict=True)) | extra for check in checks]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = convergence.certificate(str(folder))
    assert row.verdict == claims.HOLDS, row
    assert "smallest margin 1 − (L_{t+1}/L_t)/bound over the checks: 1.7e-06" in row.note
    assert "largest η·λ_max(K) over the checks: 1.12" in row.note


def test_multilayer_needs_every_depth(tmp_path):
    values = ((1, 0, 0.999), (1, 1, 0.995), (2, 0, 0.97), (2, 1, 0.999))
    rows = [{"num_layers": L, "beta_attn": b, "beta_ffn": b, "rate": 0.9, "rate_r2": r2}
            for L, b, r2 in values]  # fmt: skip
    (tmp_path / "a").mkdir()
    write_csv(tmp_path / "a" / "depth_runs.csv", rows)
    row = depth.multilayer(str(tmp_path / "a"))
    assert row.verdict == claims.FAILS and row.value == "L=1: 0.995, L=2: 0.970"


def test_jena_descent_needs_a_significant_negative_tau(tmp_path):
    def rows(steps_of):
        return [{"run": i, "seed": s, "beta_attn": b, "beta_ffn": b, "initial_loss": 1.0,
                 "window_steps": 300, "steps_to_0.5": 1, "steps_to_0.2": steps_of(b, s)}
                for i, (s, b) in enumerate((s, b) for s in range(3)
                                            for b in (0, 0.25, 0.5, 0.75, 1))]  # fmt: skip

    for name, steps_of, verdict in (
        ("a", lambda b, s: 100 - 50 * b + s, claims.HOLDS),  # monotone in every seed
        ("b", lambda b, s: 100 + 50 * b, claims.FAILS),  # larger β slower
        ("c", lambda b, s: [40, 20, 60, 30, 50][int(4 * b)] + s, claims.FAILS),  # no order
    ):
        (tmp_path / name).mkdir()
        write_csv(tmp_path / name / "descent_table.csv", rows(steps_of))
        row = descent.jena_descent(str(tmp_path / name))
        assert row.verdict == verdict, name
        # the first rows' p is two-sided, beside the second reading's one-sided "less p"
        assert "two-sided p < 0.05" in row.threshold and ", two-sided p = " in row.value
        assert "0.5·L_0: τ = " in row.note and "two-sided p = " in row.note


def test_sst2_ordering(tmp_path):
    def rows(errors):
        return [{"num_layers": L, "beta_attn": b, "beta_ffn": b, "runs": 1, "final_error": e,
                 "final_val_accuracy": 0.5} for (L, b), e in errors.items()]  # fmt: skip

    claimed = {(2, 0.0): 0.3, (6, 0.0): 0.35, (2, 1.0): 0.2, (6, 1.0): 0.1}
    both_fall = claimed | {(6, 0.0): 0.25}
    for name, errors, verdict in (("a", claimed, claims.HOLDS), ("b", both_fall, claims.FAILS)):
        (tmp_path / name).mkdir()
        write_csv(tmp_path / name / "accuracy_table.csv", rows(errors))
        assert classification.sst2_ordering(str(tmp_path / name)).verdict == verdict, name


def test_a_fallback_marks_the_claims_it_measured(tmp_path):
    """The claims table prefixes an experiment's label to its measured claims' notes, and a
    fallback's `substitute` to their verdicts; a claim not measured keeps its reason alone."""
    sst2 = classification.EXPERIMENTS[0]
    (tmp_path / "sst2_random").mkdir()
    errors = {(2, 0.0): 0.3, (6, 0.0): 0.35, (2, 1.0): 0.2, (6, 1.0): 0.1}
    write_csv(tmp_path / "sst2_random" / classification.ACCURACY_FILE, [
        {"num_layers": L, "beta_attn": b, "beta_ffn": b, classification.FINAL_ERROR: e}
        for (L, b), e in errors.items()])  # fmt: skip
    ran = Outcome(sst2.fallback, str(tmp_path / "sst2_random"), "ran", 1.0, [], label="why")
    row, with_seeds = claims_table([ran])  # rows 5b and 5b″
    assert row.verdict == "holds (random-init substitute, not the claim's model)"
    assert row.note.startswith("why; β=1 lower at every L: True")
    assert with_seeds.verdict == claims.NOT_RUN and "run_errors.csv missing" in with_seeds.note
    not_run = claims_table([Outcome(sst2, str(tmp_path / "sst2"), "not run", None, [], "gone")])
    expected = {(claims.NOT_RUN, "experiment not run: gone")}  # the reason, as in its section
    assert {(row.verdict, row.note) for row in not_run} == expected


def test_the_report_shows_no_figures_of_an_experiment_it_did_not_run(tmp_path):
    """A folder refused as another config keeps its earlier run's figures; REPORT.md showed them
    under "not run" as if they were this report's."""
    sst2 = classification.EXPERIMENTS[0]
    for name in ("sst2", "sst2_random"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "loss_by_beta.png").write_bytes(b"png")
    outcomes = [
        Outcome(sst2, str(tmp_path / "sst2"), "not run", None, [], "another config"),
        Outcome(sst2.fallback, str(tmp_path / "sst2_random"), "ran", 1.0, []),
    ]
    text = report.format_report("small", outcomes, claims_table(outcomes), {})
    assert "(sst2_random/loss_by_beta.png)" in text and "(sst2/loss_by_beta.png)" not in text
    assert "not run: another config; its folder's figures are not this report's." in text
    gone = [Outcome(sst2, str(tmp_path / "absent"), "not run", None, [], "no weights")]
    assert "; not run: no weights.\n" in report.format_report("small", gone, [], {})


def test_a_report_of_some_experiments_says_it_is_not_the_whole_report(tmp_path):
    """`--only` into a folder with every experiment replaced the whole REPORT.md with a part of
    it whose first line named the whole command."""
    sst2 = classification.EXPERIMENTS[0]
    outcomes = [Outcome(sst2, str(tmp_path / "sst2"), "not run", None, [], "gone")]
    part = report.format_report("small", outcomes, [], {}, chosen=(sst2,))
    assert "--scale=small --only=sst2`" in part
    assert "only the experiments named by --only" in part
    whole = report.format_report("small", outcomes, [], {})
    assert "--only" not in whole


def test_a_fallback_marks_an_undecided_claim_too(tmp_path):
    from resconv_jax.experiments.record import ClaimCheck, Experiment

    def undecided(workdir):
        return claims.Claim("x″", "m", "t", "v", claims.UNDECIDED, "its note")

    substitute = Experiment("x_random", "X", "tiny.py", {}, (ClaimCheck(1, undecided),),
                            substitute=" (substitute)")  # fmt: skip
    (row,) = claims_table([Outcome(substitute, str(tmp_path), "ran", 1.0, [], label="why")])
    assert (row.verdict, row.note) == ("undecided (substitute)", "why; its note")


def test_a_run_that_never_reaches_the_level_ranks_as_the_slowest():
    rows = [
        {"run": i, "seed": 0, "beta_attn": b, "window_steps": 300, "steps_to_0.2": steps}
        for i, (b, steps) in enumerate(((0.0, 10.0), (0.5, 5.0), (1.0, float("nan"))))
    ]
    ordering = descent.ordering(rows)
    assert ordering["tau"] == pytest.approx(1 / 3)  # dropping the NaN run would give -1
    assert ordering["reached"] == 2


def test_the_descent_p_value_permutes_beta_within_seeds():
    from scipy import stats

    from resconv_jax.analysis import stats as stats_module

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, (30, 15)).astype(float), rng.integers(0, 9, 15).astype(float)
    expected = [stats.kendalltau(row, y).statistic for row in x]
    np.testing.assert_allclose(stats_module.tau_b(x, y), expected, atol=1e-12)
    betas = np.tile([0, 0.25, 0.5, 0.75, 1], 3)
    seeds = np.repeat([0, 1, 2], 5)
    monotone = 100 - 50 * betas + seeds
    assert stats_module.stratified_p_value(betas, monotone, seeds) < 0.001  # every seed in order
    assert stats_module.stratified_p_value(betas, rng.permutation(monotone), seeds) > 0.05
