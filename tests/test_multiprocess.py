"""Several processes as on a pod (`launch.local`: 2 processes x 4 CPU devices, gloo collectives,
a loopback coordinator) against one process with 8 devices; preemption and a lost process."""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from launch import local
from resconv_jax.runtime.metrics import METRICS_FILE

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")
JENA = os.path.join(ROOT, "configs", "jena.py")
# float64: the all-reduce's summation order differs between gloo and one process (float32 losses
# differ by ~1e-7 at step 0 and ~1e-4 by the time the theory regime reaches its floor).
THEORY = [f"--config={TINY}", "--config.model.dtype=float64", "--config.train.num_steps=40"]
JENA_SHORT = [
    f"--config={JENA}",
    "--config.sweep.seed=(0,)",
    "--config.sweep.beta=(0.0,1.0)",
    "--config.data.num_train=32",
    "--config.train.num_steps=20",
    "--config.train.log_every=5",
]
TIMEOUT = 240
HEARTBEAT = 30  # main's --heartbeat_timeout in the tests that kill a process (`coordinated`)

pytestmark = pytest.mark.slow


def one_process(args: list[str], workdir) -> subprocess.CompletedProcess:
    """resconv_jax.main as one process with 8 CPU devices (this test session's setting)."""
    command = [sys.executable, "-m", "resconv_jax.main", *args, f"--workdir={workdir}"]
    return subprocess.run(
        command, cwd=ROOT, env=local.process_env(8), capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip


def why_it_stopped(stderr: str) -> str:
    """A failed process's stderr in short: its glog lines (a C++ abort says why there), its
    "error: " lines, and its last 1500 characters without the interpreter's list of extension
    modules (which fills a fatal error's tail)."""
    said = [line for line in stderr.splitlines() if re.match(r"([EFW]\d{4} |error: )", line)]
    tail = re.sub(r"\nExtension modules:.*?\(total: \d+\)", "", stderr, flags=re.DOTALL)
    return "\n".join(said[-20:]) + "\n...\n" + tail[-1500:]


def launcher(args: list[str], workdir, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "launch.local", "--processes=2", "--devices_per_process=4",
        *extra, "--", *args, f"--workdir={workdir}",
    ]  # fmt: skip


def two_processes(args: list[str], workdir, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        launcher(args, workdir, *extra), cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip


def metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, METRICS_FILE)) as f:
        return [json.loads(line) for line in f]


def worst_relative(a: list[dict], b: list[dict]) -> dict[str, float]:
    """{key: largest relative difference} over the float values of two metrics files.

    A singular value is accurate to rounding times the largest one (Weyl), so a σ_min is compared
    relative to its matrix's σ_max: a rank-collapsed sample's σ_min of 1e-7 (float32's floor
    under a σ_max of 100) is all rounding, and its relative difference is noise.
    """
    assert [(r["step"], r["run"]) for r in a] == [(r["step"], r["run"]) for r in b]
    worst: dict[str, float] = {}

    def compare(key, value, other, floor):
        if isinstance(value, list):  # step_losses: a chunk's per-step losses
            assert isinstance(other, list) and len(value) == len(other), key
            for v, o in zip(value, other, strict=True):
                compare(key, v, o, floor)
        elif isinstance(value, float) and math.isfinite(value):
            scale = max(abs(value), abs(other), floor)
            worst[key] = max(worst.get(key, 0.0), abs(value - other) / scale)
        else:
            assert value == other, key

    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key, value in x.items():
            prefix, _, name = key.rpartition("/")
            floor = x.get(f"{prefix}/sigma_max", 0.0) if name.endswith("sigma_min") else 1e-300
            compare(key, value, y[key], floor)
    return worst


def child_pid(workdir, index: int) -> int | None:
    """The PID of process `index` of the run in `workdir`, from /proc."""
    needle = [f"--workdir={workdir}", f"--process_id={index}"]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode().split("\0")
        except OSError:
            continue
        if "resconv_jax.main" in args and all(n in args for n in needle):
            return int(pid)
    return None


def wait_for_lines(workdir, count: int, process: subprocess.Popen) -> None:
    path = os.path.join(workdir, METRICS_FILE)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {count} metrics lines in {path}")


@pytest.mark.slow
def test_two_processes_equal_one_for_theory_and_jena(tmp_path):
    for name, args in (("theory", THEORY), ("jena", JENA_SHORT)):
        single, double = tmp_path / f"{name}_1x8", tmp_path / f"{name}_2x4"
        assert one_process(args, single).returncode == 0
        result = two_processes(args, double)
        assert result.returncode == 0, result.stderr[-2000:]
        worst = worst_relative(metrics(single), metrics(double))
        assert max(worst.values()) <= 1e-5, (name, worst)
        # Only process 0 prints and writes: one table, one summary per run.
        assert "[1] " not in result.stdout and result.stdout.count("per-β table") == 1
        # jax.distributed's absl INFO lines (3 per process) said nothing a user acts on.
        assert "distributed.py" not in result.stderr, result.stderr[-2000:]
        assert (double / "summary.json").exists() and (double / "beta_table.csv").exists()
    # The step counts, settings and non-float fields are equal by construction (asserted above);
    # which float metrics came out bitwise equal is printed for the record.
    print({k: v for k, v in worst.items() if v == 0.0})


@pytest.mark.slow
def test_sigterm_to_one_process_saves_on_all_at_one_step_and_resumes_exactly(tmp_path):
    args = [*THEORY, "--config.train.num_steps=200", "--config.train.checkpoint_every=1000"]
    reference, workdir = tmp_path / "reference", tmp_path / "preempted"
    assert two_processes(args, reference).returncode == 0
    process = subprocess.Popen(
        launcher(args, workdir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    wait_for_lines(workdir, 3 * 10, process)  # step 45 of 200: ~5 s of steps left here
    os.kill(child_pid(workdir, 1), signal.SIGTERM)
    out, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err[-2000:]
    stopped = [line for line in out.splitlines() if "preempted at step" in line]
    assert len(stopped) == 1, out[-2000:]  # process 0's line; process 1 prints nothing
    step = int(stopped[0].split("preempted at step ")[1].split(":")[0])
    saved = sorted(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
    assert 0 < step < 200 and saved[-1] == step
    assert "Reached preemption sync point" in err  # both processes, through JAX's sync point
    result = two_processes(args, workdir)
    assert result.returncode == 0 and f"resuming from step {step}" in result.stdout
    assert metrics(workdir) == metrics(reference)


def coordinated(args: list[str], workdir, port: int, index: int) -> subprocess.Popen:
    """Process `index` of 2 (4 CPU devices), started by hand rather than by the launcher so that
    a test can kill it or close its pipes."""
    command = [
        sys.executable, "-m", "resconv_jax.main", *args, f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={index}",
        # JAX aborts a process at its own timeout; the watchdog acts at half of it. 30 s leaves a
        # loaded CI machine 15 s for the watchdog's thread to run (6 s and 10 s were flaky there,
        # and 20 s once, on 2026-12-07, beside the spawning tests of test_reproduce_jobs.py:
        # JAX's abort came first).
        f"--heartbeat_timeout={HEARTBEAT}",
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, env=local.process_env(4), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_a_killed_process_stops_the_other_with_one_line_and_a_rerun_resumes(tmp_path):
    args = [*THEORY, "--config.train.num_steps=200", "--config.train.checkpoint_every=25"]
    workdir = tmp_path / "killed"
    port = local.free_port()
    processes = [coordinated(args, workdir, port, index) for index in range(2)]
    wait_for_lines(workdir, 3 * 12, processes[0])  # step 55: checkpoint 50 done or being written
    processes[1].kill()
    killed_at = time.monotonic()
    _, err = processes[0].communicate(timeout=60)
    waited = time.monotonic() - killed_at
    processes[1].communicate()
    assert processes[0].returncode == 5, why_it_stopped(err)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "process 1 of 2 stopped responding" in errors[0], err[-4000:]
    assert waited < HEARTBEAT + 5  # lost after half the heartbeat timeout, checked every second
    result = two_processes(args, workdir)
    assert result.returncode == 0 and "resuming from step" in result.stdout, result.stderr[-2000:]
    steps = [r["step"] for r in metrics(workdir) if r["run"] == 0]
    assert steps == list(range(0, 201, 5))


@pytest.mark.slow
def test_a_process_whose_output_pipes_close_ends_both_instead_of_hanging(tmp_path):
    # Process 0's stdout and stderr readers go away (a closed terminal, `| head`): its first
    # line fails, and so does printing that error. It used to leave through the interpreter's
    # exit, where JAX's shutdown waits for process 1, which waits in a collective for process 0.
    port = local.free_port()
    processes = [coordinated(THEORY, tmp_path / "closed", port, index) for index in range(2)]
    # A closed pipe is no sign of a lost process: process 0 exits 141 as one process does,
    # without first watching HEARTBEAT / 2 + 2 s for a loss that could explain it (it exited 1).
    # And it ends with process 1, which says it has read that status: process 0 waited
    # HEARTBEAT / 2 more for a word process 1 never wrote.
    processes[0].stdout.close()
    processes[0].stderr.close()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 150
    while len(ended) < 2 and time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic()
        time.sleep(0.05)
    if len(ended) < 2:
        for process in processes:
            process.kill()
        pytest.fail("a process with closed output pipes left the run hanging")
    err = processes[1].stderr.read()
    assert processes[0].returncode == 141
    assert processes[1].returncode == 5, why_it_stopped(err)
    assert "process 0 of 2 exited with status 141" in err
    assert ended[0] - ended[1] < HEARTBEAT / 4, ended


@pytest.mark.slow
def test_a_mesh_that_leaves_devices_out_is_refused_in_one_line_per_process(tmp_path):
    workdir = tmp_path / "mesh"
    result = two_processes([*THEORY, "--config.mesh.data=4", "--config.mesh.sweep=1"], workdir)
    assert result.returncode == 2
    errors = {
        index: [e for e in result.stderr.splitlines() if e.startswith(f"[{index}] error:")]
        for index in range(2)
    }
    # Each process finds the same mesh and says so, unless the other's exit reached it first
    # (its watchdog then points at the other's line): one line each either way, and the launcher
    # exits with the refusal's status, not with the stopped process's 5.
    refusal = "needs every device in its mesh"
    said = [len(errors[i]) == 1 and refusal in errors[i][0] for i in (0, 1)]
    assert any(said), result.stderr
    for index, other in ((0, 1), (1, 0)):
        assert len(errors[index]) == 1, result.stderr
        assert said[index] or (
            f"process {other} of 2 exited with status 2" in errors[index][0]
            and f"see process {other}'s error line" in errors[index][0]
        ), result.stderr
    assert not workdir.exists()  # refused before process 0 created it


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((None, 2, None), "--coordinator_address, --process_id missing"),
        (("127.0.0.1:1234", 2, 2), "--process_id=2 --num_processes=2: need 0 <= process_id <"),
        (("127.0.0.1", 2, 0), "--coordinator_address=127.0.0.1: expected HOST:PORT"),
        # a segmentation fault and a hang in jax.distributed before
        (("localhost:abc", 2, 0), "--coordinator_address=localhost:abc: expected HOST:PORT"),
        ((":", 1, 0), "--coordinator_address=:: expected HOST:PORT"),
        (("host:70000", 2, 0), "--coordinator_address=host:70000: expected HOST:PORT"),
    ],
)
def test_the_launch_flags_are_checked_before_anything_starts(flags, expected):
    from resconv_jax.errors import ConfigError
    from resconv_jax.runtime import multihost

    with pytest.raises(ConfigError, match=re.escape(expected)):
        multihost.resolve_launch(*flags)
    launch = multihost.resolve_launch("127.0.0.1:1234", 2, 1, heartbeat_timeout_seconds=10)
    assert launch.multi_process and (launch.num_processes, launch.process_id) == (2, 1)
    assert multihost._is_loopback("127.0.0.1") and not multihost._is_loopback("10.1.2.3")


def test_the_launcher_keeps_a_heartbeat_timeout_given_for_main():
    """Its own --heartbeat_timeout came after main's flags, so a user's was silently replaced
    (absl keeps the last)."""
    given = local.commands(2, 1234, ["--config=c.py", "--heartbeat_timeout=50"], heartbeat=10)
    for command in given:
        assert [a for a in command if a.startswith("--heartbeat_timeout")] == [
            "--heartbeat_timeout=50"
        ]
    default = local.commands(1, 1234, ["--config=c.py"], heartbeat=10)[0]
    assert "--heartbeat_timeout=10" in default


def test_incomplete_multi_process_flags_are_one_line(tmp_path):
    command = [sys.executable, "-m", "resconv_jax.main", f"--config={TINY}"]
    result = subprocess.run(
        [*command, f"--workdir={tmp_path / 'w'}", "--num_processes=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: multi-process flags: --coordinator_address, --process_id missing; give all of "
        "--coordinator_address, --num_processes and --process_id, or none (a cluster JAX "
        "detects: TPU, srun, mpirun)"
    ]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--processes=x", "--", "--workdir=w"], "--processes: invalid int value: 'x'"),
        (["--processes=0", "--", "--workdir=w"], "--processes and --devices_per_process must be"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        ([], "give main's flags after --"),
    ],
)
def test_launch_flag_errors_are_one_line_status_2(capsys, argv, expected):
    """They were argparse's usage and error, 5 lines."""
    with pytest.raises(SystemExit) as stop:
        local.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert err.startswith("error: ") and "(python -m launch.local --help)" in err


class ClosedPipe:
    """The launcher's stdout or stderr after its reader went away (`| head`): every write fails,
    once lines of `after_processes` processes ("[0] ", "[1] ", ...) have been written."""

    def __init__(self, after_processes: int = 0):
        self.after_processes, self.seen = after_processes, set()

    def write(self, text):
        self.seen.add(text[:3])
        if len(self.seen) >= self.after_processes:
            raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass

    def fileno(self):
        raise io.UnsupportedOperation("fileno")


def test_the_launcher_stops_every_process_when_its_output_pipe_closes(monkeypatch, capsys):
    """`launch.local ... | head`: its output thread died with a BrokenPipeError traceback, the
    processes ran on unread, and the launcher exited with their status. Now a closed pipe is a
    preemption (SIGTERM to every process: they save at one step), one line, exit 141."""
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "for i in range(3000):\n"
        "    print(i, flush=True); time.sleep(0.01)\n"
        "sys.exit(3)\n"  # ran to the end: the SIGTERM never came
    )
    monkeypatch.setattr(local, "commands", lambda num, *_: [[sys.executable, "-c", child]] * num)

    # It closes once both processes have printed (and so handle SIGTERM).
    monkeypatch.setattr(sys, "stdout", ClosedPipe(after_processes=2))
    assert local.run(2, 1, ["--workdir=unused"]) == 141
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output pipe closed" in err and "Traceback" not in err, err


def two_children(tmp_path, first_then: str, second_then: str, prints: bool = False) -> list:
    """The commands of two child processes that ignore SIGTERM (as main does under JAX's
    handler) and, with `prints`, print a line once they do; the second then runs `second_then`,
    and the first runs `first_then` once the second has got that far (Python lines)."""
    ready = tmp_path / "ready"
    start = "import os, pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    start += "print('x', flush=True)\n" if prints else ""
    first = f"{start}while not os.path.exists({str(ready)!r}): time.sleep(0.01)\n{first_then}"
    second = f"{start}pathlib.Path({str(ready)!r}).touch()\n{second_then}"
    return [[sys.executable, "-c", code] for code in (first, second)]


def test_a_failed_process_after_the_pipe_closed_is_its_status_without_a_traceback(
    monkeypatch, capsys, tmp_path
):
    """`launch.local ... 2>&1 | head`: stderr is the closed pipe too. A process that then failed
    made the launcher's own line about it raise BrokenPipeError: a traceback, exit 1, and the
    other processes left without their SIGKILL."""
    # The pipe closes once both have printed; the first then fails, the second stays until its
    # SIGKILL.
    commands = two_children(tmp_path, "time.sleep(0.5)\nsys.exit(3)\n", "time.sleep(60)\n", True)
    monkeypatch.setattr(local, "commands", lambda *_: commands)
    monkeypatch.setattr(local, "GRACE_SECONDS", 0.5)

    monkeypatch.setattr(sys, "stdout", ClosedPipe(after_processes=2))
    monkeypatch.setattr(sys, "stderr", ClosedPipe())
    started = time.monotonic()
    assert local.run(2, 1, ["--workdir=unused"]) == 3
    assert time.monotonic() - started < 30  # the second one was killed, not waited for


def test_the_launcher_exits_with_the_cause_not_with_the_status_of_a_process_it_stopped(
    monkeypatch, tmp_path
):
    """Process 1 refused the run (status 2), and process 0's watchdog, seeing that first,
    stopped process 0 with status 5 before process 0 reached the same refusal: the launcher
    exited 5, "stopped by another", for a bad flag."""
    commands = two_children(tmp_path, "sys.exit(5)\n", "time.sleep(0.5)\nsys.exit(2)\n")
    monkeypatch.setattr(local, "commands", lambda *_: commands)
    assert local.run(2, 1, ["--workdir=unused"]) == 2


def test_a_process_the_launcher_had_to_kill_is_not_the_cause(monkeypatch, tmp_path):
    """Process 0 stopped (status 5: process 1 stopped responding); process 1, hung, ends by the
    launcher's SIGKILL (137). The run's status stays 5, the documented one for a lost process."""
    commands = two_children(tmp_path, "sys.exit(5)\n", "time.sleep(60)\n")
    monkeypatch.setattr(local, "commands", lambda *_: commands)
    monkeypatch.setattr(local, "GRACE_SECONDS", 0.5)
    assert local.run(2, 1, ["--workdir=unused"]) == 5


def test_the_launcher_stops_the_others_when_a_later_process_fails_first():
    """`any()` over a generator stopped polling at the first running child: process 1's failure
    went unseen while process 0 ran on (in a real run: JAX's 300 s wait for the dead peer, then
    its abort, status 134)."""
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
    ]
    try:
        assert local._wait(children) == 3
        assert children[0].returncode == -signal.SIGTERM  # stopped, not left to finish
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.slow
def test_sigterm_while_waiting_for_the_other_processes_exits_0_with_one_line(tmp_path):
    """SIGTERM was at its default while jax.distributed waited (up to 300 s) for the others to
    join: the process died with status 143 and printed nothing, which babysit reads as a
    failure."""
    import socket

    port = local.free_port()
    command = [sys.executable, "-m", "resconv_jax.main", f"--config={TINY}",
               f"--workdir={tmp_path / 'w'}", f"--coordinator_address=127.0.0.1:{port}",
               "--num_processes=2", "--process_id=0"]  # fmt: skip
    alone = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "XLA_FLAGS": ""})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # process 0 hosts the coordinator: listening means it waits for process 1
            assert alone.poll() is None and time.monotonic() < deadline, alone.communicate()
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(1.0)  # inside the wait for the other process
        alone.send_signal(signal.SIGTERM)
        out, err = alone.communicate(timeout=30)
    finally:
        alone.kill()
    assert alone.returncode == 0, (alone.returncode, out, err)
    assert "SIGTERM during start-up: nothing was trained yet; rerun the same command" in out
    assert not (tmp_path / "w").exists()
