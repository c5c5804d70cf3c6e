"""`reproduce --jobs`: experiments in worker processes, the same files as one at a time; a
SIGTERM stops every worker at a safe point; a worker that dies costs only its experiment."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resconv_jax import reproduce
from resconv_jax.errors import Interrupted, Preempted
from resconv_jax.experiments.record import Experiment, scale_variants
from resconv_jax.reproducing import workers
from resconv_jax.reproducing.outcomes import finished_before, run_experiment
from resconv_jax.runtime import host, signals

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.py"
# Steps that take ~50 s here, far longer than these tests wait for: a missed signal fails the test
# (its experiment finishes) instead of hanging it.
LONG = 20_000


def experiment(folder: Path, name: str, **overrides) -> Experiment:
    """An experiment record `name` of configs/tiny.py with `overrides`, two runs, no probe."""
    overrides = {"sweep.beta": (0.0, 1.0), "probe.enabled": False,
                 "train.async_checkpoints": False} | overrides  # fmt: skip
    config = folder / f"{name}.py"
    config.write_text(
        "from resconv_jax.config_defaults import load_config_file\n\n\n"
        f"def get_config(arg=None):\n    return load_config_file({str(TINY)!r}, **{overrides!r})\n"
    )
    return Experiment(name, name, str(config), scale_variants("", "", ""))


def outputs(folder: Path) -> dict[str, bytes]:
    """Every metrics and summary file under `folder`, by relative path."""
    files = [*folder.rglob("metrics.jsonl"), *folder.rglob("summary.json"), *folder.rglob("*.csv")]
    return {str(path.relative_to(folder)): path.read_bytes() for path in files}


def when_training(root: Path, names: list[str], then, timeout: float = 300.0) -> threading.Thread:
    """Calls then({name: worker pid}) once every experiment of `names` printed a training
    line to its log (in a thread, so the caller can block in run_all)."""

    def watch():
        deadline, pids = time.monotonic() + timeout, {}
        while time.monotonic() < deadline and len(pids) < len(names):
            for name in names:
                log = workers.log_path(str(root), name)
                text = log.read_text() if log.exists() else ""
                if "steps/s" in text:
                    pids[name] = int(re.search(r"pid (\d+)", text).group(1))
            time.sleep(0.2)
        then(pids)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_all(chosen, root: Path, jobs: int = 2):
    return workers.run_all(tuple(chosen), "paper", str(root), {}, jobs, "", lambda o: 0)


@pytest.mark.slow
def test_two_workers_write_the_same_files_as_one_process(tmp_path):
    chosen = [experiment(tmp_path, name, **{"train.num_steps": 20}) for name in ("a", "b")]
    alone, together = tmp_path / "alone", tmp_path / "together"
    for e in chosen:
        assert run_experiment(e, "paper", str(alone), {}).status == "ran"
    outcomes = run_all(chosen, together)
    assert [(o.experiment.name, o.status) for o in outcomes] == [("a", "ran"), ("b", "ran")]
    expected = outputs(alone)
    assert len(expected) >= 4 and outputs(together) == expected
    log = workers.log_path(str(together), "a").read_text()
    assert "a: ran" in log and "step 20/20" in log
    # A finished experiment is reused by a worker as by one process.
    assert [o.status for o in run_all(chosen, together)] == ["reused", "reused"]


def _ctrl_c(pids: dict) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the parent and to every worker."""
    for pid in (os.getpid(), *pids.values()):
        os.kill(pid, signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop, raised, words",
    [
        (lambda pids: os.kill(os.getpid(), signal.SIGTERM), Preempted, "preempted"),
        (_ctrl_c, Interrupted, r"interrupted \(Ctrl-C\)"),  # was a KeyboardInterrupt traceback
    ],
)
def test_a_sigterm_or_ctrl_c_stops_every_worker_at_a_safe_point(tmp_path, stop, raised, words):
    long = {"train.num_steps": LONG}
    chosen = [experiment(tmp_path, name, **long) for name in ("a", "b", "c")]
    previous = signals.install()
    try:
        when_training(tmp_path, ["a", "b"], stop)
        with pytest.raises(raised, match=words + r": .*stopped at a safe point .*; 0 of 3 fini"):
            run_all(chosen, tmp_path)
    finally:
        signals.acknowledge()
        signals.restore(previous)
    for name in ("a", "b"):
        log = workers.log_path(str(tmp_path), name).read_text()
        assert re.search(r"preempted at step \d+: checkpoint saved", log), log[-2000:]
        assert any((tmp_path / name / "checkpoints").iterdir())
    assert not (tmp_path / "c").exists()  # not started after the signal


@pytest.mark.slow
def test_a_ctrl_c_while_the_workers_start_stops_them_at_a_safe_point(tmp_path, capsys):
    """Ctrl-C to every process as soon as the workers exist, during their imports: it killed
    them with tracebacks ("not run: exited with status -15") and the message said "2 of 2
    finished" with checkpoints saved. Now they ignore it until ready, then stop cleanly."""
    chosen = [experiment(tmp_path, name, **{"train.num_steps": LONG}) for name in ("a", "b")]

    def ctrl_c_once_started():
        # Both started, and out of `signals.ignored_by_children` (which ignores SIGINT in this
        # process too while a worker starts: a Ctrl-C then, taken by this thread, was lost).
        while (
            len(multiprocessing.active_children()) < 2
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        ):
            time.sleep(0.01)
        _ctrl_c({c.name: c.pid for c in multiprocessing.active_children()})

    threading.Thread(target=ctrl_c_once_started, daemon=True).start()
    with pytest.raises(Interrupted, match=r"nothing trained yet; its log says which\); 0 of 2"):
        run_all(chosen, tmp_path)
    assert "not run" not in capsys.readouterr().out
    for name in ("a", "b"):
        log = workers.log_path(str(tmp_path), name).read_text()
        assert "Traceback" not in log and "SIGTERM during start-up" in log, log[-2000:]


@pytest.mark.slow
def test_a_ctrl_c_after_a_worker_was_preempted_alone_still_stops_the_others(tmp_path):
    """Once one worker had reported its own preemption, the parent passed no later SIGTERM or
    Ctrl-C on, and waited for the other experiment to finish."""
    chosen = [experiment(tmp_path, name, **{"train.num_steps": LONG}) for name in ("a", "b")]

    def preempt_a_then_ctrl_c(pids):
        os.kill(pids["a"], signal.SIGTERM)
        log = workers.log_path(str(tmp_path), "a")
        while "preempted at step" not in log.read_text():
            time.sleep(0.1)
        time.sleep(1.0)  # the parent has read a's "preempted"
        os.kill(os.getpid(), signal.SIGINT)

    when_training(tmp_path, ["a", "b"], preempt_a_then_ctrl_c)
    with pytest.raises(Interrupted):
        run_all(chosen, tmp_path)
    log = workers.log_path(str(tmp_path), "b").read_text()
    assert re.search(r"preempted at step \d+: checkpoint saved", log), log[-2000:]


def test_a_closed_output_pipe_is_a_stop_request_and_later_prints_vanish(monkeypatch):
    """What `reproduce ... | head` relies on: the print that meets the closed pipe raises
    nothing, the run loops see `requested()` as after a SIGTERM, and the parent's later lines
    (the workers' `run_all` prints as it hands out and collects) go nowhere."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(signals, "_closed", threading.Event())
    try:
        signals.stop_when_output_closes()
        assert not signals.output_closed()
        print("first line", flush=True)
        assert signals.output_closed() and signals.requested()
        print("a later line", flush=True)
    finally:
        signals.acknowledge()
        stream.close()


def test_within_interrupt_as_stop_the_first_ctrl_c_is_a_flag_and_the_second_raises():
    with signals.interrupt_as_stop():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals.interrupted()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow
def test_a_worker_that_dies_costs_only_its_experiment(tmp_path):
    doomed = experiment(tmp_path, "doomed", **{"train.num_steps": LONG})
    fine = experiment(tmp_path, "fine", **{"train.num_steps": 400})

    def kill(pids):
        if "doomed" in pids:
            os.kill(pids["doomed"], signal.SIGKILL)

    when_training(tmp_path, ["doomed"], kill)
    outcomes = run_all([doomed, fine], tmp_path)
    assert [o.status for o in outcomes] == ["not run", "ran"]
    assert outcomes[0].reason.startswith("its worker process exited with status -9 (see ")
    assert outcomes[0].cpu is None and outcomes[1].cpu > 0  # unknown, not 0.0
    assert outcomes[0].compiling is None and outcomes[1].compiling > 0


@pytest.mark.slow
def test_finished_experiments_are_reused_without_starting_a_worker(tmp_path, monkeypatch):
    """Only what is not finished goes to workers: here one experiment, so it runs in this
    process and no worker starts at all."""
    chosen = tuple(experiment(tmp_path, name, **{"train.num_steps": 10}) for name in "abc")
    root = str(tmp_path / "w")
    for done in chosen[:2]:
        assert run_experiment(done, "paper", root, {}).status == "ran"
    handed, preallocate = [], set()
    monkeypatch.setattr(workers, "run_all", lambda rest, *_: handed.append(rest))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)

    def checked(*args):  # reading a finished folder starts JAX: on a GPU, not preallocating
        preallocate.add(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
        return finished_before(*args)

    monkeypatch.setattr(reproduce, "finished_before", checked)
    assert reproduce._reproduce_locked(root, "paper", None, chosen, jobs=2) == 0
    assert handed == [] and preallocate == {"false"}
    report = (tmp_path / "w" / "REPORT.md").read_text()
    assert "| a | reused |" in report and "| b | reused |" in report and "| c | ran |" in report
    assert "at a time" not in report
    # One whose weights were missing: finished when its own folder holds no run and its
    # fallback's is finished; not when its own folder holds some other run.
    pretrained = experiment(tmp_path, "p", **{"train.num_steps": 20})
    pretrained = dataclasses.replace(pretrained, fallback=chosen[0])
    assert finished_before(pretrained, "paper", root)
    shutil.copytree(tmp_path / "w" / "a", tmp_path / "w" / "p")
    assert not finished_before(pretrained, "paper", root)


def test_the_longest_experiment_starts_first_by_its_recorded_time_else_its_hint():
    def record(name, hint=None, fallback=None):
        seconds = {} if hint is None else {"small": hint}
        return Experiment(name, name, "", {}, fallback=fallback, typical_seconds=seconds)

    def order(scale, times):
        return [e.name for e in workers.longest_first(chosen, scale, times)]

    pretrained = record("pretrained", fallback=record("random_init", 90))
    chosen = (record("short", 5), record("unknown"), record("long", 200))
    chosen += (pretrained, record("mid", 40))
    assert order("small", {}) == ["unknown", "long", "pretrained", "mid", "short"]
    times = {
        "short": {"scale": "small", "seconds": 300.0},
        "mid": {"scale": "paper", "seconds": 1e4},
        "random_init": {"scale": "small", "seconds": 1.0},
    }
    assert order("small", times) == ["unknown", "short", "long", "mid", "pretrained"]
    assert order("tiny", {}) == [e.name for e in chosen]


def test_jobs_below_one_or_on_object_storage_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"--jobs=0: give 1 or more"):
        reproduce.reproduce(str(tmp_path / "w"), "tiny", jobs=0)
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match=r"--jobs=2: the workers write .* local WORKDIR/logs/"):
        reproduce.reproduce("gs://bucket/w", "tiny", jobs=2)
    assert not Path("gs:").exists()


def test_jobs_auto_is_two_on_a_cpu_with_two_cores_and_one_elsewhere(tmp_path, monkeypatch):
    import jax

    cores = [2]
    monkeypatch.setattr(host, "usable_cores", lambda: cores[0])
    root = str(tmp_path / "w")

    def auto(scale="small", where=root):
        return workers.automatic_jobs(where, scale)

    assert auto() == (2, "a CPU backend with 2 cores")
    assert auto("tiny")[0] == 2
    cores[0] = 16  # not measured beyond 2 jobs: compiles overlap, each process uses every core
    assert auto()[0] == 2
    # paper-scale experiments are sized to fill a machine: two at once could run out of memory
    assert auto("paper") == (1, "--scale=paper: each experiment may need the whole machine")
    cores[0] = 1
    assert auto() == (1, "a CPU backend with 1 core")
    cores[0] = 2
    assert auto(where="gs://bucket/w") == (1, "a workdir that is not local")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert auto() == (1, "a gpu backend: one device to share")
    assert reproduce.resolve_jobs("3", root, "small", 9) == 3
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert reproduce.resolve_jobs("auto", root, "small", 1) == 1  # --only=one: in this process
    assert not (tmp_path / "w").exists()


ORPHAN_PARENT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_reproduce_jobs import experiment, run_all
root = Path({root!r})
run_all([experiment(root, name, **{{"train.num_steps": {steps}}}) for name in ("a", "b")], root)
"""


@pytest.mark.slow
def test_workers_whose_parent_is_killed_stop_at_a_safe_point(tmp_path):
    """A SIGKILL to `reproduce` (no chance to pass anything on) leaves no worker training:
    each sees its parent gone, saves its checkpoint and exits."""
    script = ORPHAN_PARENT.format(tests=str(Path(__file__).parent), root=str(tmp_path), steps=LONG)
    parent = subprocess.Popen([sys.executable, "-c", script])
    pids = {}
    when_training(tmp_path, ["a", "b"], pids.update).join()
    parent.kill()
    parent.wait(30)
    assert set(pids) == {"a", "b"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids.values()), "orphaned workers still running"
    for name in ("a", "b"):
        log = workers.log_path(str(tmp_path), name).read_text()
        assert re.search(r"preempted at step \d+: checkpoint saved", log), log[-2000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_the_claims_a_worker_computed_are_read_back_not_computed_again(tmp_path):
    """`compute_claims` (a worker, as soon as its experiment is done) keeps each row in the run
    folder's results cache, where the parent's claims table finds it."""
    from resconv_jax.experiments import claims
    from resconv_jax.experiments.record import ClaimCheck
    from resconv_jax.reproducing import report
    from resconv_jax.reproducing.outcomes import Outcome

    calls = []

    def check(workdir):
        calls.append(workdir)
        return claims.Claim("c", "m", "t", value="1", verdict=claims.HOLDS)

    folder = tmp_path / "e"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 0}\n')
    claimed = dataclasses.replace(experiment(tmp_path, "e"), claims=(ClaimCheck(1.0, check),))
    outcome = Outcome(claimed, str(folder), "ran", 1.0, [])
    report.compute_claims(outcome, "small")
    rows = report.claims_table([outcome])
    assert calls == [str(folder)] and (rows[0].value, rows[0].verdict) == ("1", claims.HOLDS)
