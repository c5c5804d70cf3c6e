"""The claims table's verdicts from synthetic run directories, and the reproduce command."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch import local
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
from resconv_jax.reproducing.outcomes import Outcome, run_experiment, unfinished_reason
from resconv_jax.reproducing.report import claims_table
from resconv_jax.runtime.workdir import write_csv


def _summary(folder, runs, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(runs))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_linear_convergence_holds_only_when_every_beta_fits(tmp_path):
    good = _summary(tmp_path / "a", [{"beta_attn": b, "rate_r2": 0.995} for b in (0, 1)])
    bad = _summary(
        tmp_path / "b", [{"beta_attn": 0, "rate_r2": 0.995}, {"beta_attn": 1, "rate_r2": 0.9}]
    )
    assert convergence.linear_convergence(good).verdict == claims.HOLDS
    row = convergence.linear_convergence(bad)
    assert row.verdict == claims.FAILS and "β=1: 0.9000" in row.value
    missing = convergence.linear_convergence(None)
    assert missing.verdict == claims.NOT_RUN and missing.note == "experiment not run"
    assert "summary.json missing" in convergence.linear_convergence(str(tmp_path / "c")).note


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
    rows = [{"num_layers": L, "beta_attn": b, "beta_ffn": b, "rate_r2": r2} for L, b, r2 in values]
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


def test_a_fallback_marks_an_undecided_claim_too(tmp_path):
    from resconv_jax.experiments.record import ClaimCheck, Experiment

    def undecided(workdir):
        return claims.Claim("x″", "m", "t", "v", claims.UNDECIDED, "its note")

    substitute = Experiment("x_random", "X", "tiny.py", {}, (ClaimCheck(1, undecided),),
                            substitute=" (substitute)")  # fmt: skip
    (row,) = claims_table([Outcome(substitute, str(tmp_path), "ran", 1.0, [], label="why")])
    assert (row.verdict, row.note) == ("undecided (substitute)", "why; its note")


def check_the_sst2_random_run(folder):
    """configs/sst2.py:random_small,tiny end to end (a random GPT-2 at L ∈ {1, 2}, 16 sentences
    and 32 dev sentences): metrics with error rates, σ(Z) at step 0, the per-(L, β) tables."""
    from resconv_jax.runtime.metrics import read_metrics

    summaries = json.loads((folder / "summary.json").read_text())
    assert [(s["num_layers"], s["beta_attn"]) for s in summaries] == [
        (1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)
    ]  # fmt: skip
    lines = read_metrics(str(folder))
    last = [r for r in lines if r["step"] == 10]
    # Error rates over 16 sentences (train) and 32 (validation): whole multiples of 1/16, 1/32.
    rates = np.array([[r["error"] * 16, r["val_error"] * 32] for r in last])
    assert len(last) == 4
    np.testing.assert_allclose(rates, np.round(rates), atol=1e-4)
    assert all(r["layer0/z/sigma_max"] > 0 for r in lines if r["step"] == 0)
    for name in ("beta_table.csv", "loss_by_beta.png", "errors.png", "accuracy_table.csv"):
        assert (folder / name).exists(), name
    layers = (folder / "layers_table.csv").read_text().splitlines()
    assert len(layers) == 1 + 2 * 1 + 2 * 2  # header, then one row per run and layer
    assert "z/collapse_residual/start" in layers[0]


@pytest.mark.slow
def test_reproduce_tiny_writes_every_claim_and_knows_its_runs_finished(tmp_path):
    from resconv_jax import experiments

    command = [sys.executable, "-m", "resconv_jax.reproduce", f"--workdir={tmp_path}",
               "--scale=tiny"]  # fmt: skip
    # One CPU device as a user has, at the suite's XLA optimization level (conftest.py).
    env = local.process_env(
        1, os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    )
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    written = (tmp_path / "REPORT.md").read_text()
    for claim in ("1. linear", "2. rate", "3. residual", "certificate (smooth", "4. multi-layer",
                  "4b. multi-layer", "5a. Jena", "5b. SST-2"):  # fmt: skip
        assert f"| {claim}" in written, claim
    assert "random-init GPT-2, not the pretrained model (GPT-2 weights" in written
    assert "## Machine" in written and "jax " in written
    assert "| theory | ran |" in written and "| sst2_random | ran |" in written  # wall times
    assert "s from the first experiment to the claims table (theory " in first.stdout
    assert first.stdout.startswith("--jobs=auto: ")  # the default: 2 at a time on 2 CPU cores
    check_the_sst2_random_run(tmp_path / "sst2_random")
    # A second invocation reuses every experiment (checked end to end by hand: 7 of 7 reused):
    # each one's workdir is recognised as this config's, finished.
    for experiment in experiments.experiment_list():
        experiment = experiment.fallback or experiment  # no pretrained weights here
        workdir = str(tmp_path / experiment.name)
        config = experiment.load("tiny")
        assert unfinished_reason(config, workdir) is None, experiment.name
    longer = experiments.experiment_list()[0].load("tiny")
    longer.train.num_steps = 60
    assert unfinished_reason(longer, str(tmp_path / "theory"))


@pytest.mark.slow
def test_reproduce_refuses_a_bad_scale_or_jobs(tmp_path):
    command = [sys.executable, "-m", "resconv_jax.reproduce", f"--workdir={tmp_path / 'w'}",
               "--scale=huge"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: bad flag: flag --scale=huge")
    command[-1] = "--jobs=two"
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: bad flag: flag --jobs=two: give a positive number")
    assert len(result.stderr.strip().splitlines()) == 1
    command[-1] = "--jobs=²"  # a digit to str.isdigit, not to int(): a traceback before
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "w").exists()


def test_a_run_that_never_reaches_the_level_ranks_as_the_slowest():
    from resconv_jax.experiments import descent

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


def _edit_loss(path, line_number: int) -> None:
    """Changes the loss of one metrics line in place, keeping the file's length."""
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[line_number])
    text = lines[line_number].replace(json.dumps(record["loss"]), json.dumps(record["loss"] * 2))
    lines[line_number] = text
    path.write_text("".join(lines))


def _short_tiny(folder, **more):
    """An experiment record of configs/tiny.py at 20 steps, two runs, with `more` overrides, from
    a config file written into `folder` (a record names a config file; it carries no overrides)."""
    from resconv_jax.experiments.record import Experiment, scale_variants

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
    overrides = {"train.num_steps": 20, "train.checkpoint_every": 10, "sweep.beta": (0.0, 1.0),
                 "train.async_checkpoints": False, "probe.enabled": False, **more}  # fmt: skip
    digest = hashlib.sha256(repr(sorted(more.items())).encode()).hexdigest()[:8]
    path = folder / f"short_tiny_{digest}.py"  # one file per set of overrides
    path.write_text(
        "from resconv_jax.config_defaults import load_config_file\n\n\n"
        f"def get_config(arg=None):\n    return load_config_file({tiny!r}, **{overrides!r})\n"
    )
    return Experiment("tiny", "tiny", str(path), scale_variants("", "", ""))


@pytest.mark.slow
def test_a_damaged_finished_run_is_resumed_not_reused(tmp_path):
    experiment = _short_tiny(tmp_path)
    assert run_experiment(experiment, "paper", str(tmp_path), {}).status == "ran"
    assert run_experiment(experiment, "paper", str(tmp_path), {}).status == "reused"
    metrics, summary = tmp_path / "tiny" / "metrics.jsonl", tmp_path / "tiny" / "summary.json"
    good_metrics, good_summary = metrics.read_bytes(), summary.read_bytes()
    damages = {
        "a torn metrics.jsonl": lambda: metrics.write_bytes(good_metrics[: len(good_metrics) // 2]),
        "a loss edited in place": lambda: _edit_loss(metrics, 2),
        "the last line edited": lambda: _edit_loss(metrics, -1),
        "a garbage summary.json": lambda: summary.write_text("{garbage"),
    }
    for damage, apply in damages.items():
        apply()
        outcome = run_experiment(experiment, "paper", str(tmp_path), {})
        assert outcome.status == "resumed", damage
        assert outcome.reason.startswith("not reusable: "), damage
        assert metrics.read_bytes() == good_metrics and summary.read_bytes() == good_summary
    assert run_experiment(experiment, "paper", str(tmp_path), {}).status == "reused"


@pytest.mark.slow
def test_a_finished_run_of_another_config_is_not_run_and_not_said_to_resume(tmp_path, capsys):
    """It said "not reusable: config.json holds another config: resuming from the last good
    checkpoint", then "not run: ... holds a run with another config"."""
    assert run_experiment(_short_tiny(tmp_path), "paper", str(tmp_path), {}).status == "ran"
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "tiny").rglob("*"))
    capsys.readouterr()
    changed = _short_tiny(tmp_path, **{"optim.lr": 0.002})
    outcome = run_experiment(changed, "paper", str(tmp_path), {})
    out = capsys.readouterr().out
    assert outcome.status == "not run" and "optim.lr: 0.004 -> 0.002" in outcome.reason
    assert outcome.reason.endswith("or remove this one to start it over")  # reproduce: this one
    assert "resum" not in out and "not reusable: config.json holds another config" in out, out
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "tiny").rglob("*")) == before


def test_a_second_reproduce_on_a_busy_folder_is_refused_at_once(tmp_path, capsys):
    """(`resconv_jax.reproduce` turns WorkdirBusy into its one line and exit status 3.)"""
    from resconv_jax import reproduce
    from resconv_jax.errors import WorkdirBusy
    from resconv_jax.runtime.workdir import WorkdirLock

    holder = WorkdirLock(str(tmp_path))
    holder.acquire()
    try:
        with pytest.raises(WorkdirBusy, match=f"in use by PID {os.getpid()}"):
            reproduce.reproduce(str(tmp_path), "tiny")
    finally:
        holder.release()
    assert capsys.readouterr().out == "" and sorted(os.listdir(tmp_path)) == [".lock"]


def test_the_readme_block_states_each_experiments_sizes(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nstale\n{report.README_END}\nrest\n")
    report.splice_readme(str(readme), "small", [])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{report.README_END}\nrest\n")
    assert (
        "- `jena`: P=256 Jena windows of M=24 h, d=6, L=1; 15 runs (5 β × 3 seeds), 300 steps"
        in text
    )
    assert "- `conditioning`: P=8 Gaussian samples of M=8, d={64, 128}, L=1; 30 runs" in text
    assert "stale" not in text


@pytest.mark.parametrize(
    "text",
    [
        "the block starts at `{s}` and ends at `{e}`.\n{s}\nstale\n{e}\n",  # quoted in prose
        "{s}\nstale\n{e}\n{s}\nstale too\n{e}\n",  # two blocks: the second stayed stale
    ],
    ids=["markers quoted in prose", "two blocks"],
)
def test_the_readme_markers_must_be_one_pair_of_lines(tmp_path, text):
    """A marker quoted in prose made the splice delete the text from there to the real block."""
    readme = tmp_path / "README.md"
    readme.write_text(text.format(s=report.README_START, e=report.README_END))
    before = readme.read_text()
    with pytest.raises(ValueError, match="one line each"):
        report.splice_readme(str(readme), "small", [])
    assert readme.read_text() == before


def test_a_readme_table_is_not_replaced_by_one_with_experiments_not_run(tmp_path, monkeypatch):
    """--readme wrote the table even when experiments did not run (exit 1), so 'not run' rows
    replaced the README's measured ones."""
    from resconv_jax import reproduce
    from resconv_jax.reproducing.outcomes import Outcome

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nmeasured\n{report.README_END}\n")
    before = readme.read_text()

    def not_run(experiment, scale, root, times):
        return Outcome(experiment, os.path.join(root, experiment.name), "not run", None, [],
                       "a test's reason")  # fmt: skip

    monkeypatch.setattr(reproduce, "run_experiment", not_run)
    assert reproduce.reproduce(str(tmp_path / "w"), "small", str(readme)) == 1
    assert readme.read_text() == before


def test_only_names_known_experiments_and_keeps_the_readme_whole(tmp_path):
    from resconv_jax import reproduce

    assert [e.name for e in reproduce.selected(("conditioning",))] == ["conditioning"]
    assert len(reproduce.selected()) == len(reproduce.experiments.experiment_list())
    with pytest.raises(ValueError, match="--only=nonsense: no such experiment; there are theory"):
        reproduce.reproduce(str(tmp_path / "w"), "tiny", only=("nonsense",))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- claims table: start -->\n<!-- claims table: end -->\n")
    with pytest.raises(ValueError, match="--readme writes the whole claims table"):
        reproduce.reproduce(str(tmp_path / "w"), "small", str(readme), only=("conditioning",))
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_only_runs_and_reports_just_the_named_experiment(tmp_path):
    from resconv_jax import reproduce

    # --jobs=2 with one experiment: it runs in this process, and the report says nothing of jobs
    assert reproduce.reproduce(str(tmp_path), "tiny", only=("rank_collapse",), jobs=2) == 0
    written = (tmp_path / "REPORT.md").read_text()
    assert "at a time" not in written
    assert "| 3. residual" in written and "| 3″. residual" in written
    assert "| 1. linear" not in written and "`theory`" not in written
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["rank_collapse"]


def test_reproduce_refuses_a_run_folder_of_main(tmp_path):
    """It wrote its experiments and REPORT.md beside a run's files, after which run_report
    refused that run as 'a reproduce folder'."""
    from resconv_jax import reproduce

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds a run of main"):
        reproduce.reproduce(str(tmp_path), "tiny", only=("rank_collapse",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "metrics.jsonl"]


def test_a_damaged_times_file_is_said_and_rewritten_not_fatal(tmp_path, capsys):
    """reproduce.json only records each experiment's seconds: torn, or JSON of another shape, it
    used to stop reproduce (exit 2 with a bare JSON error, or a traceback)."""
    from resconv_jax import reproduce

    assert reproduce.reproduce(str(tmp_path), "tiny", only=("rank_collapse",)) == 0
    times = tmp_path / reproduce.TIMES_FILE
    good = json.loads(times.read_text())
    assert good["rank_collapse"]["scale"] == "tiny"
    for damage in (times.read_text()[:30], "[]", '{"rank_collapse": 5}'):
        times.write_text(damage)
        capsys.readouterr()
        assert reproduce.reproduce(str(tmp_path), "tiny", only=("rank_collapse",)) == 0
        out = capsys.readouterr().out
        said = [line for line in out.splitlines() if reproduce.TIMES_FILE in line]
        assert len(said) == 1 and "damaged" in said[0], out
        assert "finished before: reused" in out
        assert json.loads(times.read_text()) == {}  # what was readable of it: nothing


def test_the_report_names_the_cpu_and_the_cores_this_process_may_use(monkeypatch):
    """The printed digits of a few claims depend on the CPU and on how many cores XLA:CPU splits
    its work over (README, claims section), so REPORT.md says both."""
    from resconv_jax.runtime import host

    monkeypatch.setattr(host, "cpu_model", lambda: "Test CPU 9000")
    monkeypatch.setattr(host, "usable_cores", lambda: 1)
    line = report.machine()[0]
    assert line.startswith("- machine: Test CPU 9000, 1 of ") and " CPU cores usable, " in line
    monkeypatch.undo()
    assert 1 <= host.usable_cores() <= os.cpu_count() and host.cpu_model()


def depth_history(cells) -> list[dict]:
    """Metrics lines of one run per (L, β_a, β_f) in `cells`, each descending at its own rate
    (β_f = 1 three times faster), with layer 0's σ(Z) logged (its own per run)."""
    lines = []
    for run, (layers, beta_attn, beta_ffn) in enumerate(cells):
        rate = 0.01 * (1 + beta_attn) * (3 if beta_ffn else 1)
        for step in range(0, 101, 10):
            lines.append({"run": run, "seed": 0, "lr": 1e-3, "num_layers": layers,
                          "beta_attn": beta_attn, "beta_ffn": beta_ffn, "step": step,
                          "loss": float(np.exp(-rate * step)) + 1e-3,
                          "layer0/z/sigma_min": 1.0 + 0.1 * run,
                          "layer0/z/sigma_max": 2.0})  # fmt: skip
    return lines


def test_the_depth_table_keeps_runs_that_differ_in_beta_ffn_apart():
    """β_a and β_f swept apart: one row per (L, β_a, β_f); merging the β_f of one β_a averaged
    two different descents into one rate."""
    from resconv_jax.experiments import depth

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    rows = depth.depth_rows(depth_history(cells))
    table = depth.format_depth_table(rows).splitlines()
    assert "beta_a" in table[1] and "beta_f" in table[1]
    body = [line.split() for line in table[2:-1]]
    assert [(int(b[0]), float(b[1]), float(b[2]), int(b[3])) for b in body] == [
        (L, a, f, 1) for L, a, f in cells
    ]
    rates = {(L, a, f): float(b[4]) for (L, a, f), b in zip(cells, body, strict=True)}
    assert rates[1, 0.0, 1.0] < rates[1, 0.0, 0.0]


def test_the_depth_table_counts_a_ratio_below_the_probes_precision_as_zero(tmp_path):
    """A float32 probe's σ_min/σ_max below its epsilon is zero to its precision: the table
    printed 1.6e-16 and 4.5e-65 as measurements and ranked them in its Spearman ρ."""
    from resconv_jax.experiments import depth

    cells = [(1, 0.0, 0.0), (2, 0.0, 0.0), (1, 1.0, 1.0), (2, 1.0, 1.0)]
    lines = depth_history(cells)
    tiny = {0: 1e-30, 1: 1e-20}  # σ_min of runs 0 and 1: ratios² 2.5e-61 and 2.5e-41
    for line in lines:
        if line["run"] in tiny:
            line["layer0/z/sigma_min"] = tiny[line["run"]]
    text = depth.write_depth_report(tmp_path, lines, 0.0, probe_dtype="float32")
    rows = claims.read_csv(tmp_path / depth.RUNS_FILE)
    assert [r["slowest_ratio_sq_init"] for r in rows[:2]] == [0.0, 0.0]
    assert rows[2]["slowest_ratio_sq_init"] > 0
    assert "0: at or below float32's epsilon², zero to the probe's precision" in text


def test_claim_4_names_beta_ffn_in_its_note_when_it_is_swept(tmp_path):
    from resconv_jax.experiments import depth
    from resconv_jax.runtime.workdir import write_csv

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    write_csv(tmp_path / depth.RUNS_FILE, depth.depth_rows(depth_history(cells)))
    note = depth.multilayer(str(tmp_path)).note
    assert "1/β_a=0,β_f=1: " in note and note.count("/β_a=") == 8


def test_the_depth_figure_draws_beta_ffn_apart(tmp_path, monkeypatch):
    from resconv_jax.experiments import depth

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    lines = depth_history(cells)
    saved = []
    monkeypatch.setattr(depth, "save_figure", lambda fig, path: saved.append(fig))
    depth.plot_depth_sigma(lines, depth.depth_rows(lines), tmp_path / "depth_sigma.png", 1e-6)
    labels = [text.get_text() for text in saved[0].legends[0].get_texts()]
    assert labels[-4:] == ["β_a=0, β_f=0", "β_a=0, β_f=1", "β_a=1, β_f=0", "β_a=1, β_f=1"]
    styles = {line.get_linestyle() for line in saved[0].axes[0].get_lines()}
    assert len(styles) == 4
