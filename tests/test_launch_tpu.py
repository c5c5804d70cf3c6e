"""launch/tpu.sh: the gcloud commands of --dry-run, the worker-side run wrapper (run here under a
fake HOME), and create/babysit against a fake gcloud (tests/fakes/fake_gcloud.py) that plays a
queued resource: WAITING -> ACTIVE -> PREEMPTED -> (delete, create) -> ACTIVE -> finished.

No JAX, no network: every test takes a second or two.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TPU_SH = REPO / "launch" / "tpu.sh"
FAKE_GCLOUD = Path(__file__).resolve().parent / "fakes" / "fake_gcloud.py"
WORKDIR = "gs://my-bucket/resconv/jena"
MAIN_FLAGS = ["--config=configs/jena.py", f"--workdir={WORKDIR}"]
MAIN_LINE = f"python -m resconv_jax.main --config=configs/jena.py --workdir={WORKDIR}"
JAX_RANGE = next(
    line.split("#")[0].replace(" ", "")[len("jax") :]
    for line in (REPO / "requirements.txt").read_text().splitlines()
    if line.startswith("jax") and line[3:4] in "<>=!~ "
)
# `sync` archives this checkout's HEAD; the worker-side wrapper needs setsid and ps.
needs_git = pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
needs_procps = pytest.mark.skipif(
    not (shutil.which("setsid") and shutil.which("ps")), reason="no setsid or ps here"
)


@pytest.fixture
def env(tmp_path):
    """Environment for tpu.sh: the fake gcloud first on PATH, polls of 0 s, a fresh QR state."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "gcloud"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {FAKE_GCLOUD} "$@"\n')
    shim.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "FAKE_"))}
    e.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        TMPDIR=str(tmp_path),
        TPU_NAME="resconv-jena",
        TPU_ZONE="us-west4-a",
        TPU_POLL_SECONDS="0",
        TPU_TIMEOUT_SECONDS="30",
        TPU_SSH_RETRIES="1",
        TPU_MAX_RESTARTS="5",
        FAKE_GCLOUD_STATE=str(tmp_path / "qr.json"),
        FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
    )
    return e


def tpu(env, *args, timeout=30, check=True):
    result = subprocess.run(
        ["bash", str(TPU_SH), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"tpu.sh {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def calls(env) -> list[dict]:
    path = Path(env["FAKE_GCLOUD_LOG"])
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def command_of(argv: list[str]) -> str:
    (command,) = [a.split("=", 1)[1] for a in argv if a.startswith("--command=")]
    return command


def commands(stdout: str) -> list[list[str]]:
    """The printed command lines, each split as a POSIX shell would (comments left out)."""
    return [shlex.split(line) for line in stdout.splitlines() if not line.startswith("#")]


def assert_in_order(haystack: str, needles: list[str]) -> None:
    at = 0
    for needle in needles:
        found = haystack.find(needle, at)
        assert found >= 0, f"{needle!r} missing after position {at} in:\n{haystack}"
        at = found + len(needle)


# --- --dry-run ----------------------------------------------------------------------------------


def test_dry_run_prints_the_gcloud_commands_in_order(env):
    out = ""
    for args in (
        ["create", "--spot"],
        ["sync"],
        ["setup"],
        ["run", "--", *MAIN_FLAGS],
        ["delete"],
    ):
        result = tpu(env, "--dry-run", *args)
        for words in commands(result.stdout):  # every line is a command a shell can run
            assert words[0] in ("gcloud", "git"), words
        out += result.stdout
    assert calls(env) == [], "--dry-run ran gcloud"
    assert_in_order(
        out,
        [
            "gcloud compute tpus queued-resources create resconv-jena --node-id=resconv-jena",
            "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot",
            "--zone=us-west4-a",
            "gcloud compute tpus queued-resources describe resconv-jena",
            "--format='value(state.state)'",
            "git -C",
            "archive --format=tar.gz -o",
            "HEAD",
            "gcloud compute tpus tpu-vm scp",
            "resconv-jena:resconv_jax.tar.gz --worker=all",
            "gcloud compute tpus tpu-vm ssh resconv-jena --worker=all",
            "tar -xzf ~/resconv_jax.tar.gz",
            "gcloud compute tpus tpu-vm ssh resconv-jena --worker=all",
            "-m venv .venv",
            f'"jax[tpu]{JAX_RANGE}" -r requirements.txt',
            "pip install -q -e .",
            "gcloud compute tpus tpu-vm ssh resconv-jena --worker=all",
            "sudo lsof -t /dev/accel* /dev/vfio/*",
            "sudo rm -f /tmp/libtpu_lockfile",
            "nohup",
            MAIN_LINE,
            "logs/run.log",
            "gcloud compute tpus queued-resources delete resconv-jena --force --quiet",
        ],
    )


def test_dry_run_run_is_one_command_for_all_workers(env):
    result = tpu(env, "--dry-run", "run", "--", *MAIN_FLAGS)
    (words,) = commands(result.stdout)
    assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "resconv-jena"]
    assert "--worker=all" in words and not any(
        w.startswith("--worker=") and w != "--worker=all" for w in words
    )
    assert MAIN_LINE in command_of(words)


def test_options_flags_env_and_errors(env):
    out = tpu(
        env,
        "--dry-run",
        "create",
        "--name=other",
        "--zone",
        "europe-west4-b",
        "--project=p1",
        "--accelerator",
        "v4-32",
        "--runtime=tpu-ubuntu2204-base",
        "--reserved",
    ).stdout
    assert "create other --node-id=other --accelerator-type=v4-32" in out
    assert (
        "--runtime-version=tpu-ubuntu2204-base --reserved --zone=europe-west4-b --project=p1" in out
    )
    assert "usage: launch/tpu.sh" in tpu(env, "-h").stdout
    no_name = {k: v for k, v in env.items() if k != "TPU_NAME"}
    bad = tpu(no_name, "--dry-run", "delete", check=False)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "TPU_NAME" in bad.stderr
    assert tpu(env, "--dry-run", "create", "--spot", "--reserved", check=False).returncode != 0
    assert "needs main's flags" in tpu(env, "--dry-run", "run", check=False).stderr


# --- the run wrapper, run on this machine as a worker would ---------------------------------------


def _fake_worker(
    env, tmp_path, line: str, status: int, sleep: float = 0.0, slow_start: float = 0.0
):
    """A HOME with ~/resconv_jax/.venv whose `python` (standing in for main) records its argv,
    prints `line` and exits with `status` after `sleep` seconds; a `sudo` that does nothing.
    `slow_start`: seconds the venv's activation takes (a loaded machine)."""
    home = tmp_path / "home"
    venv_bin = home / "resconv_jax" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'sleep {slow_start}\nPATH="{venv_bin}:$PATH"\n')
    argv_file = tmp_path / "main_argv.json"
    fake_main = venv_bin / "python"
    fake_main.write_text(
        f"#!{sys.executable}\nimport json, sys, time\n"
        f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n"
        f"time.sleep({sleep})\nprint({line!r})\nsys.exit({status})\n"
    )
    fake_main.chmod(0o755)
    fake_sudo = Path(env["PATH"].split(os.pathsep)[0]) / "sudo"
    fake_sudo.write_text("#!/bin/sh\nexit 0\n")
    fake_sudo.chmod(0o755)
    return {**env, "HOME": str(home)}, home / "resconv_jax" / "logs", argv_file


def _on_worker(worker_env, words: list[str]) -> str:
    """Runs the --command of a printed gcloud ssh line here, as the worker's shell would."""
    return subprocess.run(
        ["bash", "-c", command_of(words)],
        env=worker_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout.strip()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int) -> bool:
    """Not running: no such process (any more), or a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _run_state(env, worker_env) -> str:
    status_words = commands(tpu(env, "--dry-run", "status").stdout)[1]
    query = _on_worker(worker_env, status_words)
    assert query.startswith("resconv-status ") and query.count("\n") == 0, query
    return query.split(" ", 2)[2]


@needs_procps
@pytest.mark.parametrize(
    ("mode", "expected"),
    [("finish", "done"), ("preempt", "exit 0 preempted at step 5"), ("diverge", "exit 1 error:")],
)
def test_run_wrapper_on_a_worker(env, tmp_path, mode, expected):
    """The exact text the ssh of `run` sends, run by bash under a fake HOME; then the run-state
    query of babysit reads the outcome: done only for exit 0 without a preemption line."""
    line, status = {
        "finish": ("run 0 (beta_attn=0, ...): final loss 4.8e+02", 0),
        "preempt": ("preempted at step 5: checkpoint saved in gs://x; rerun the same command", 0),
        "diverge": ("error: run 0 diverged at step 7", 1),
    }[mode]
    worker_env, logs, argv_file = _fake_worker(env, tmp_path, line, status)
    odd = '--config.note=it\'s "quoted" $HOME `x` \\ end'
    flags = [*MAIN_FLAGS, odd]
    _on_worker(worker_env, commands(tpu(env, "--dry-run", "run", "--", *flags).stdout)[0])
    deadline = time.monotonic() + 15
    while not (logs / "exit_status").exists():
        assert time.monotonic() < deadline, "the run wrapper wrote no exit_status"
        time.sleep(0.05)
    assert json.loads(argv_file.read_text()) == ["-m", "resconv_jax.main", *flags]
    assert _run_state(env, worker_env).startswith(expected)
    assert line in (logs / "run.log").read_text()


@needs_procps
def test_run_again_replaces_a_running_run(env, tmp_path):
    """A second `run` kills the first one's process group and keeps its log as run.log.prev,
    even when the first had not yet opened its log (slow to start: under load the log was only
    opened by the background wrapper, and CI saw no run.log.prev); a run killed without an exit
    status reads as lost (babysit starts it again)."""
    worker_env, logs, _ = _fake_worker(env, tmp_path, "never printed", 0, sleep=60, slow_start=1)
    run_words = commands(tpu(env, "--dry-run", "run", "--", *MAIN_FLAGS).stdout)[0]
    pids = []
    try:
        for _ in range(2):
            _on_worker(worker_env, run_words)
            pids.append(int((logs / "run.pid").read_text()))
            state = _run_state(env, worker_env)
            assert state == "running", (state, pids, sorted(p.name for p in logs.iterdir()))
        assert pids[0] != pids[1]
        assert _gone(pids[0]), pids  # the first wrapper was killed (its whole process group)
        assert (logs / "run.log.prev").exists() and not (logs / "exit_status").exists()
    finally:
        for pid in pids:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while not _gone(pids[1]):
        assert time.monotonic() < deadline, f"process group {pids[1]} survived SIGKILL"
        time.sleep(0.05)
    if _zombie(pids[1]):  # this container's PID 1 reaps no orphans: kill -0 still sees it
        return
    while (state := _run_state(env, worker_env)) != "lost":
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


# --- against the fake gcloud ----------------------------------------------------------------------


def test_create_waits_until_active(env):
    env["FAKE_WAITING_DESCRIBES"] = "3"
    start = time.monotonic()
    tpu(env, "create", "--spot")
    log = calls(env)
    kinds = [c["kind"] for c in log]
    assert kinds[0] == "describe" and log[0]["rc"] == 1  # none yet: create it
    assert kinds[1] == "create" and "--spot" in log[1]["argv"]
    assert kinds[2:] == ["describe"] * 4
    assert [c["state"] for c in log[2:]] == ["WAITING_FOR_RESOURCES"] * 3 + ["ACTIVE"]
    assert time.monotonic() - start < 30  # the fake's polls, not real minutes


def test_create_fails_in_one_line_when_the_queued_resource_fails(env):
    env["FAKE_CREATE_OUTCOME"] = "FAILED"
    result = tpu(env, "create", check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "FAILED" in errors[0], result.stderr


def _bring_up_and_run(env):
    for args in (["create", "--spot"], ["sync"], ["setup"], ["run", "--", *MAIN_FLAGS]):
        tpu(env, *args)
    (first_run,) = [c for c in calls(env) if c["kind"] == "run"]
    return len(calls(env)), command_of(first_run["argv"])


@needs_git
def test_babysit_recreates_a_preempted_pod_and_resumes_until_finished(env):
    env["FAKE_PREEMPT"] = "1"
    before, first_command = _bring_up_and_run(env)
    assert "--worker=all" in calls(env)[before - 1]["argv"]
    start = time.monotonic()
    result = tpu(env, "babysit", "--spot", "--", *MAIN_FLAGS, timeout=120)
    assert time.monotonic() - start < 60  # the fake's polls, not real minutes
    assert "finished" in result.stderr
    log = calls(env)[before:]
    kinds = [c["kind"] for c in log]
    # Watch (running), see the preemption, delete, wait until gone, create, wait for ACTIVE,
    # sync, set up, rerun, watch: finished.
    assert kinds[:2] == ["describe", "status"], kinds
    assert log[2]["kind"] == "describe" and log[2]["state"] == "PREEMPTED"
    rest = kinds[3:]
    assert rest[:2] == ["delete", "describe"] and log[4]["rc"] == 1  # gone
    assert rest[2] == "create" and "--spot" in log[5]["argv"]
    i = rest.index("scp")
    assert set(rest[3:i]) == {"describe"} and log[3 + i - 1]["state"] == "ACTIVE"
    assert rest[i:] == ["scp", "sync", "setup", "run", "describe", "status"], rest
    reruns = [c for c in log if c["kind"] == "run"]
    assert len(reruns) == 1
    assert command_of(reruns[0]["argv"]) == first_command  # the same command, same gs:// workdir
    assert MAIN_LINE in first_command
    for c in log:
        if c["kind"] in ("scp", "sync", "setup", "run", "status"):
            assert "--worker=all" in c["argv"], c
    assert json.loads(Path(env["FAKE_GCLOUD_STATE"]).read_text())["creates"] == 2


@needs_git
def test_babysit_starts_a_run_on_an_active_pod_that_never_ran(env):
    env["FAKE_DONE_AFTER_RUNS"] = "1"
    tpu(env, "create")
    before = len(calls(env))
    tpu(env, "babysit", "--", *MAIN_FLAGS)
    kinds = [c["kind"] for c in calls(env)[before:]]
    assert kinds == ["describe", "status", "scp", "sync", "setup", "run", "describe", "status"]


@needs_git
def test_babysit_waits_out_describe_errors_that_are_not_not_found(env):
    """A describe that fails for another reason than NOT_FOUND (network, quota) is no reason to
    delete and recreate a pod: babysit waits and asks again."""
    env["FAKE_DONE_AFTER_RUNS"] = "1"
    before, _ = _bring_up_and_run(env)
    env["FAKE_DESCRIBE_ERRORS"] = "3"
    result = tpu(env, "babysit", "--", *MAIN_FLAGS)
    assert "UNKNOWN" in result.stderr
    log = calls(env)[before:]
    assert [c["kind"] for c in log] == ["describe"] * 4 + ["status"]
    assert [c["rc"] for c in log[:3]] == [1, 1, 1]


@needs_git
def test_babysit_reruns_when_a_worker_was_lost_and_the_others_stopped_for_it(env):
    """A rebooted worker ("lost") leaves the others stopped with status 5 ("rerun the same
    command on every process"): babysit read the 5 as a failure and gave up."""
    env["FAKE_LOST_WORKER"] = "1"
    before, first_command = _bring_up_and_run(env)
    result = tpu(env, "babysit", "--", *MAIN_FLAGS)
    assert "finished" in result.stderr
    reruns = [c for c in calls(env)[before:] if c["kind"] == "run"]
    assert [command_of(c["argv"]) for c in reruns] == [first_command]


@needs_git
def test_babysit_stops_on_a_failed_run_in_one_line(env):
    env["FAKE_MAIN_RESULT"] = "exit 1"
    before, _ = _bring_up_and_run(env)
    result = tpu(env, "babysit", "--", *MAIN_FLAGS, check=False)
    assert result.returncode == 1  # main's exit status
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    assert "main exited with status 1 on t1v-n-" in errors[0]
    assert "a run diverged at step 7" in errors[0]
    assert [c["kind"] for c in calls(env)[before:]] == ["describe", "status"]


def test_delete_and_logs(env):
    tpu(env, "create")
    assert "[t1v-n-0]" in tpu(env, "logs").stdout
    tpu(env, "logs", "--worker=1")
    tpu(env, "delete")
    log = calls(env)
    logs_calls = [c for c in log if c["kind"] == "logs"]
    assert "--worker=all" in logs_calls[0]["argv"] and "--worker=1" in logs_calls[1]["argv"]
    assert log[-1]["kind"] == "delete" and {"--force", "--quiet"} <= set(log[-1]["argv"])
    assert log[-1]["state"] is None
