"""The reproduce command: end to end, its flags, reuse and refusal, the README block."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch import local
from resconv_jax.reproducing import report
from resconv_jax.reproducing.outcomes import Outcome, run_experiment, unfinished_reason


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
    first = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
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


def test_a_folder_that_lost_its_config_json_is_not_reusable_and_says_why(tmp_path):
    """It counted as holding no run at all: reproduce resumed it as "ran", with no line saying
    why, and recorded the resume's seconds and code as the experiment's."""
    from resconv_jax import experiments

    config = experiments.experiment_list()[0].load("tiny")
    (tmp_path / "theory").mkdir()
    assert unfinished_reason(config, str(tmp_path / "theory")) == ""  # empty: nothing there
    (tmp_path / "theory" / ".lock").write_text("")
    assert unfinished_reason(config, str(tmp_path / "theory")) == ""
    (tmp_path / "theory" / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "theory" / "checkpoints").mkdir()
    reason = unfinished_reason(config, str(tmp_path / "theory"))
    assert reason == "config.json is missing (the folder holds checkpoints, metrics.jsonl)"


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
    ran = run_experiment(experiment, "paper", str(tmp_path), {})
    assert ran.status == "ran" and 0 < ran.cpu  # its CPU seconds, for REPORT.md's wall times
    assert 0 < ran.compiling < ran.wall and 0 < ran.reporting < ran.wall  # where they went
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
def test_a_finished_experiment_another_process_holds_is_not_run_not_reused(tmp_path):
    """A `main` still writing the last files of a finished experiment's folder: reproduce said
    "finished before: reused" and read the folder under it (main refuses such a folder)."""
    from resconv_jax.runtime.workdir import WorkdirLock

    experiment = _short_tiny(tmp_path)
    assert run_experiment(experiment, "paper", str(tmp_path), {}).status == "ran"
    holder = WorkdirLock(str(tmp_path / "tiny"))
    holder.acquire()
    try:
        outcome = run_experiment(experiment, "paper", str(tmp_path), {})
    finally:
        holder.release()
    assert outcome.status == "not run" and f"in use by PID {os.getpid()}" in outcome.reason
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

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nmeasured\n{report.README_END}\n")
    before = readme.read_text()

    def not_run(experiment, scale, root, times):
        return Outcome(experiment, os.path.join(root, experiment.name), "not run", None, [],
                       "a test's reason")  # fmt: skip

    monkeypatch.setattr(reproduce, "run_experiment", not_run)
    assert reproduce.reproduce(str(tmp_path / "w"), "small", str(readme)) == 1
    assert readme.read_text() == before


def test_a_readme_table_is_not_replaced_by_one_with_claims_not_measured(tmp_path, monkeypatch):
    """A claim that could not be evaluated (a damaged file of a reused experiment) is a "not run"
    row: --readme wrote it over the measured one, and the command exited 0."""
    from resconv_jax import reproduce
    from resconv_jax.experiments.claims import Claim

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nmeasured\n{report.README_END}\n")
    before = readme.read_text()

    def reused(experiment, scale, root, times):
        return Outcome(experiment, os.path.join(root, experiment.name), "reused", 1.0, [])

    def table(outcomes):
        return [Claim("3. residual fixes conditioning", "-", "-", note="could not be evaluated")]

    monkeypatch.setattr(reproduce, "run_experiment", reused)
    monkeypatch.setattr(report, "claims_table", table)
    assert reproduce.reproduce(str(tmp_path / "w"), "small", str(readme)) == 1
    assert readme.read_text() == before


def test_only_names_known_experiments_and_keeps_the_readme_whole(tmp_path):
    from resconv_jax import reproduce

    assert [e.name for e in reproduce.selected(("conditioning",))] == ["conditioning"]
    assert len(reproduce.selected()) == len(reproduce.experiments.experiment_list())
    with pytest.raises(ValueError, match="--only=nonsense: no such experiment; there are theory"):
        reproduce.reproduce(str(tmp_path / "w"), "tiny", only=("nonsense",))
    # REPORT.md's wall times name the stand-in that ran (sst2_random): the error says what runs it.
    with pytest.raises(ValueError, match="--only=sst2_random: .*sst2's stand-in.*--only=sst2"):
        reproduce.selected(("sst2_random",))
    with pytest.raises(ValueError, match="--only=sst2_random,nonsense: no such experiment"):
        reproduce.selected(("sst2_random", "nonsense"))
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


def test_the_wall_times_give_each_experiments_cpu_and_the_floor_it_sets(monkeypatch):
    """Where `reproduce`'s time goes: wall seconds overlap with --jobs, CPU seconds add up, and
    their sum over the usable cores is a wall time no schedule of the same work can beat."""
    from resconv_jax.experiments.record import Experiment, scale_variants
    from resconv_jax.runtime import host

    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    outcomes = []
    for name, wall, cpu in (("a", 100.0, 150.0), ("b", 90.0, 130.0)):
        outcome = Outcome(Experiment(name, name, "x.py", scale_variants("", "", "")), name,
                          "ran", wall, [])  # fmt: skip
        outcome.wall, outcome.cpu, outcome.compiling, outcome.reporting = wall, cpu, 20.0, 5.0
        outcomes.append(outcome)
    rows = report.wall_times(outcomes, 120.0, jobs=2)
    assert "| experiment | status | seconds | CPU seconds | compiling | reports |" in rows
    assert "| a | ran | 100.0 | 150.0 | 20.0 | 5.0 |" in rows
    assert (
        "| all, from the first experiment to the claims table | | 120.0 | 280.0 | 40.0 | 10.0 |"
        in rows
    )
    assert rows[-1] == "CPU 280 s in all, 140 s over the 2 usable cores."
    assert report.making_line(outcomes) == (
        "compiling 40 s, reports 10 s, summed over the experiments"
    )


def test_an_experiment_whose_worker_died_has_no_cpu_seconds_and_the_sum_says_so(monkeypatch):
    """A worker killed mid-experiment takes its CPU count with it: the table shows a dash, not
    0.0, and the sum is a lower bound."""
    from resconv_jax.experiments.record import Experiment, scale_variants
    from resconv_jax.runtime import host

    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    outcomes = []
    for name, status, count in (("a", "ran", 150.0), ("b", "not run", None)):
        outcome = Outcome(Experiment(name, name, "x.py", scale_variants("", "", "")), name,
                          status, None, [])  # fmt: skip
        outcome.wall, outcome.cpu, outcome.compiling, outcome.reporting = 60.0, count, None, None
        if count:
            outcome.compiling, outcome.reporting = 20.0, 5.0
        outcomes.append(outcome)
    rows = report.wall_times(outcomes, 120.0, jobs=2)
    assert "| b | not run | 60.0 | — | — | — |" in rows
    assert (
        "| all, from the first experiment to the claims table | | 120.0 | ≥ 150.0 | ≥ 20.0 | "
        "≥ 5.0 |" in rows
    )
    assert rows[-1] == (
        "CPU ≥ 150 s in all, ≥ 75 s over the 2 usable cores (b: its worker died, its CPU "
        "seconds unknown)."
    )
    assert report.making_line(outcomes).startswith("compiling ≥ 20 s, reports ≥ 5 s, ")
