"""A run directory's report and claim rows are computed once per state of its files and code."""

from __future__ import annotations

import types

import pytest

from resconv_jax import experiments
from resconv_jax.analysis import stats
from resconv_jax.experiments import results_cache
from resconv_jax.experiments.claims import HOLDS, Claim
from resconv_jax.reproducing import report
from resconv_jax.runtime import workdir as wd


def _counting_task(tables):
    """A task whose report writes figure.png from metrics.jsonl and counts its calls."""
    calls = []

    def report(workdir):
        calls.append(workdir)
        folder = wd.path(workdir)
        (folder / "figure.png").write_bytes(
            b"drawn from " + (folder / "metrics.jsonl").read_bytes()
        )
        return list(tables)

    return types.SimpleNamespace(__name__="tests.counting_task", report=report), calls


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    return tmp_path


def test_a_report_is_drawn_once_while_nothing_changes(run_dir):
    task, calls = _counting_task(["| table |"])
    assert experiments.report_tables(task, str(run_dir)) == ["| table |"]
    figure = (run_dir / "figure.png").stat().st_mtime_ns
    for _ in range(2):
        assert experiments.report_tables(task, str(run_dir)) == ["| table |"]
    assert len(calls) == 1
    assert (run_dir / "figure.png").stat().st_mtime_ns == figure


def test_checkpoints_and_the_lock_do_not_count_as_changes(run_dir):
    task, calls = _counting_task([])
    experiments.report_tables(task, str(run_dir))
    (run_dir / "checkpoints" / "2").mkdir()
    (run_dir / wd.LOCK_FILE).write_text("123 host")
    assert experiments.report_tables(task, str(run_dir)) == []
    assert len(calls) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "metrics.jsonl").write_text('{"step": 2}\n'),  # an input changed
        lambda d: (d / "figure.png").unlink(),  # an output deleted
        lambda d: (d / "figure.png").write_bytes(b"edited"),  # an output edited
        lambda d: (d / "group").mkdir() or (d / "group" / "metrics.jsonl").write_text("{}\n"),
        lambda d: (d / results_cache.CACHE_FILE).write_text("not json"),  # a damaged cache
    ],
)
def test_any_change_under_the_folder_redraws_the_report(run_dir, change):
    task, calls = _counting_task(["t"])
    experiments.report_tables(task, str(run_dir))
    change(run_dir)
    experiments.report_tables(task, str(run_dir))
    assert len(calls) == 2
    assert (run_dir / "figure.png").read_bytes() == b"drawn from " + (
        run_dir / "metrics.jsonl"
    ).read_bytes()


def test_a_change_to_the_code_redraws_the_report(run_dir, monkeypatch):
    task, calls = _counting_task(["t"])
    experiments.report_tables(task, str(run_dir))
    monkeypatch.setattr(results_cache, "code_digest", lambda: "another version of the code")
    experiments.report_tables(task, str(run_dir))
    assert len(calls) == 2


def test_a_folder_where_the_cache_cannot_be_written_computes_every_time(run_dir, monkeypatch):
    def refuse(*_):
        raise wd.WorkdirWriteError("cannot write results_cache.json (No space left on device)")

    monkeypatch.setattr(wd, "write_json", refuse)
    task, calls = _counting_task(["t"])
    assert experiments.report_tables(task, str(run_dir)) == ["t"]
    assert experiments.report_tables(task, str(run_dir)) == ["t"]
    assert len(calls) == 2
    assert not (run_dir / results_cache.CACHE_FILE).exists()


def test_a_claim_row_is_kept_per_folder_state_and_draw_counts(run_dir):
    calls = []

    def check_something(workdir):
        calls.append(stats.current_counts()["DRAWS"])
        return Claim("c", "m", "t", value=str(len(calls)), verdict=HOLDS, note=str(workdir))

    first = report.checked(check_something, str(run_dir))
    assert report.checked(check_something, str(run_dir)) == first
    assert len(calls) == 1
    with stats.counts(DRAWS=7):  # other draw counts: other statistics
        assert report.checked(check_something, str(run_dir)).value == "2"
    (run_dir / "metrics.jsonl").write_text('{"step": 3}\n')
    assert report.checked(check_something, str(run_dir)).value == "3"
    assert calls == [stats.DRAWS, 7, stats.DRAWS]
    assert report.checked(check_something, None).note == "None"  # not run: nothing kept


def test_the_code_digest_follows_the_versions_of_what_computes_the_reports(monkeypatch):
    before = results_cache.code_digest()
    results_cache.code_digest.cache_clear()
    real = results_cache.metadata.version
    monkeypatch.setattr(
        results_cache.metadata, "version", lambda name: "0.0" if name == "scipy" else real(name)
    )
    try:
        assert results_cache.code_digest() != before
    finally:
        results_cache.code_digest.cache_clear()
