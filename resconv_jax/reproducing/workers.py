"""`reproduce --jobs=N`: the experiments run N at a time, each in a worker process of its own.

What is finished is reused by the parent itself (`reproduce`); the rest goes to the workers.
Each worker is a fresh Python process (multiprocessing's "spawn": nothing of the parent's JAX
state is inherited) that runs one experiment after another, as `reproduce` runs them one at a
time (`run_experiment`: ran, resumed, reused or its fallback), with its output in
DIR/logs/NAME.log. The parent hands out the experiments longest first (`longest_first`) and
prints each one's start, outcome and tables.

The programs are the ones a single process compiles, so every number is the same bit for bit;
what changes is the wall time: XLA compiles on one core and small programs do not fill the
others, so two experiments at once finish sooner than one after the other on a 2-core CPU.
On a GPU the workers share the device: GPU memory is allocated as needed, not preallocated.

A SIGTERM to the parent is passed to the workers: each stops at its next safe point with its
checkpoint saved, and `Preempted` is raised once all have stopped. A Ctrl-C does the same and
raises `Interrupted` (the workers ignore SIGINT: a terminal sends it to all of them, and only the
parent decides); a second Ctrl-C stops the workers at once (their last checkpoints stay good).
A worker that dies (killed, out of memory) marks its experiment "not run", naming its log; the
others go on.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

from resconv_jax.errors import Interrupted, Preempted
from resconv_jax.runtime import signals

LOGS = "logs"
POLL_SECONDS = 0.5


def log_path(root: str, name: str) -> Path:
    """Where experiment `name`'s output goes under --jobs."""
    return Path(root) / LOGS / f"{name}.log"


def _redirect_output(path: Path) -> None:
    """Points this process's stdout and stderr (the file descriptors: XLA's and absl's output
    too) at the end of the file `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM to this process once its parent `parent` is gone (killed without a chance to pass
    a SIGTERM on): the experiment stops at its next safe point with its checkpoint saved."""
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)


def _work(conn: Connection, scale: str, root: str, times: dict, cache: str) -> None:
    """A worker's life: runs each experiment it receives until it receives None (or its parent
    is gone)."""
    from absl import logging

    from resconv_jax.reproducing.outcomes import run_experiment
    from resconv_jax.reproducing.report import compute_claims
    from resconv_jax.runtime import compile_cache

    signals.install()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes a Ctrl-C on as SIGTERM
    # The parent blocks both while it starts a worker (`signals.ignored_by_children`), and
    # the worker may inherit that mask.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    conn.send(("ready", None))  # from now on a SIGTERM stops the experiment at a safe point
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable(cache)
    while (experiment := _receive(conn)) is not None:
        _redirect_output(log_path(root, experiment.name))
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: reproduce --jobs worker, pid "
              f"{os.getpid()}", flush=True)  # fmt: skip
        try:
            outcome = run_experiment(experiment, scale, root, times)
            compute_claims(outcome, scale)  # here, beside the other workers' experiments
            message = ("done", outcome)
        except Preempted as stop:
            print(stop, flush=True)
            message = ("preempted", str(stop))
        except BaseException as error:  # noqa: BLE001 - the parent reports it and stops
            traceback.print_exc()
            message = ("failed", f"{type(error).__name__}: {error}")
        try:
            conn.send(message)
        except OSError:  # the parent is gone
            return
        if message[0] != "done":
            return


def _receive(conn: Connection):
    """The next experiment, or None: no more, or the parent is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


@dataclasses.dataclass
class _Worker:
    process: multiprocessing.Process
    conn: Connection
    experiment: object = None  # the Experiment it runs, None when idle
    started: float = 0.0
    ready: bool = False  # its SIGTERM handler is in place (it said so)
    stop_when_ready: bool = False  # a stop was asked before it was ready


class _Pool:
    """The workers, started on demand; `args`: what `_work` takes after its pipe."""

    def __init__(self, args: tuple):
        self.args = args
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []

    def start(self) -> _Worker:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=_work, args=(child, *self.args), daemon=True)
        with signals.ignored_by_children():
            process.start()
        child.close()
        worker = _Worker(process, parent)
        self.workers.append(worker)
        return worker

    def idle(self) -> list[_Worker]:
        return [w for w in self.workers if w.experiment is None and w.process.is_alive()]

    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.experiment is not None]

    def signal_busy(self) -> None:
        """SIGTERM to every busy worker: now if it is ready, else once it says it is."""
        for worker in self.busy():
            if worker.ready and worker.process.is_alive():
                os.kill(worker.process.pid, signal.SIGTERM)
            worker.stop_when_ready = not worker.ready

    def kill(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()

    def close(self, timeout: float = 60.0) -> None:
        """Stops idle workers; waits for the rest (SIGTERM first, then SIGKILL)."""
        for worker in self.workers:
            if worker.process.is_alive() and worker.experiment is None:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(10)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()


def automatic_jobs(root: str, scale: str) -> tuple[int, str]:
    """`--jobs=auto`: (experiments at a time, why in words). Two at --scale=tiny or small on a CPU
    backend with two cores or more (XLA compiles on one core and small programs leave the other
    idle: 1.24x at --scale=small on 2 cores, the same bytes; more than 2 not measured); one at
    --scale=paper (its experiments are sized to fill a machine's memory), on an accelerator (the
    experiments would share one device), on one core, or for a workdir that is not local (the
    workers' logs are local files). Starts JAX's backend in this process unless it returns first.
    """
    from resconv_jax.runtime import host
    from resconv_jax.runtime import workdir as wd

    if not wd.is_local(root):
        return 1, "a workdir that is not local"
    if scale == "paper":
        return 1, "--scale=paper: each experiment may need the whole machine"
    import jax

    platform = jax.default_backend()
    if platform != "cpu":
        return 1, f"a {platform} backend: one device to share"
    cores = host.usable_cores()
    return min(2, cores), f"a CPU backend with {cores} core{'s' if cores > 1 else ''}"


def longest_first(chosen: tuple, scale: str, times: dict) -> list:
    """`chosen` (Experiments) by expected seconds, longest first: the time reproduce.json
    (`times`) recorded at this scale, else the `typical_seconds` hint, of the experiment or else
    of its fallback; one with neither goes first, as it may be the longest. Ties keep `chosen`'s
    order."""
    recorded = {n: t.get("seconds") or 0.0 for n, t in times.items() if t.get("scale") == scale}

    def expected(experiment) -> float:
        family = [e for e in (experiment, experiment.fallback) if e is not None]
        known = [recorded.get(e.name) for e in family] + [
            e.typical_seconds.get(scale) for e in family
        ]
        return next((seconds for seconds in known if seconds is not None), float("inf"))

    return sorted(chosen, key=lambda experiment: -expected(experiment))


@dataclasses.dataclass
class _Progress:
    queue: list  # the Experiments not handed out yet
    outcomes: dict = dataclasses.field(default_factory=dict)  # name -> Outcome
    stopped: str = ""  # "preempted" (SIGTERM) or "interrupted" (Ctrl-C)
    interrupt_passed_on: bool = False
    failure: str = ""  # an experiment that raised, and what


def run_all(
    chosen: tuple,
    scale: str,
    root: str,
    times: dict,
    jobs: int,
    cache: str,
    on_outcome,
) -> list:
    """Runs `chosen` (Experiments) `jobs` at a time; `on_outcome(outcome)` as each finishes;
    the Outcomes in `chosen`'s order. Raises Preempted after a SIGTERM and Interrupted after a
    Ctrl-C (every busy worker stopped at a safe point), RuntimeError when a worker's experiment
    raised something else."""
    (Path(root) / LOGS).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the workers share a GPU
    pool = _Pool((scale, root, times, cache))
    progress = _Progress(longest_first(chosen, scale, times))
    try:
        with signals.interrupt_as_stop():
            while progress.queue or pool.busy():
                _pass_on_a_stop(progress, pool)
                _hand_out(progress, pool, jobs, root)
                _collect(progress, pool, root, on_outcome)
    except KeyboardInterrupt:  # a second Ctrl-C: no waiting for the safe points
        pool.kill()
        raise
    finally:
        complete = len(progress.outcomes) == len(chosen)
        if progress.failure or not (progress.stopped or complete):
            pool.signal_busy()
        pool.close()
    if progress.failure:
        raise RuntimeError(progress.failure)
    if progress.stopped:
        interrupted = progress.stopped == "interrupted"
        finished = sum(o.status != "not run" for o in progress.outcomes.values())
        raise (Interrupted if interrupted else Preempted)(
            f"{'interrupted (Ctrl-C)' if interrupted else 'preempted'}: every experiment that "
            "was running stopped at a safe point (its checkpoint saved, or nothing trained yet; "
            f"its log says which); {finished} of {len(chosen)} finished"
        )
    return [progress.outcomes[e.name] for e in chosen]


def _pass_on_a_stop(progress: _Progress, pool: _Pool) -> None:
    """A SIGTERM or the first Ctrl-C to this process: nothing new starts, and every busy worker
    gets SIGTERM. Each new signal is passed on, also after a worker was preempted by itself."""
    if signals.requested():
        signals.acknowledge()
        kind = "preempted"
    elif signals.interrupted() and not progress.interrupt_passed_on:
        progress.interrupt_passed_on = True
        kind = "interrupted"
    else:
        return
    if kind == "interrupted" or not progress.stopped:  # the message names a Ctrl-C first
        progress.stopped = kind
    progress.queue.clear()
    pool.signal_busy()


def _hand_out(progress: _Progress, pool: _Pool, jobs: int, root: str) -> None:
    """Gives queued experiments to idle workers, starting workers up to `jobs`."""
    while progress.queue and not progress.failure:
        worker = (pool.idle() or [None])[0]
        if worker is None and len(pool.busy()) < jobs:
            worker = pool.start()
        if worker is None:
            return
        worker.experiment, worker.started = progress.queue.pop(0), time.perf_counter()
        worker.conn.send(worker.experiment)
        name = worker.experiment.name
        print(f"== {name}: {worker.experiment.title} (worker pid {worker.process.pid}, output "
              f"in {log_path(root, name)})", flush=True)  # fmt: skip


def _collect(progress: _Progress, pool: _Pool, root: str, on_outcome) -> None:
    """Waits up to POLL_SECONDS for busy workers, and takes in what each one that answered (or
    ended) has to say."""
    from resconv_jax.reproducing.outcomes import Outcome

    busy = pool.busy()
    ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], POLL_SECONDS)
    for worker in busy:
        if worker.conn not in ready and worker.process.sentinel not in ready:
            continue
        experiment = worker.experiment
        try:
            kind, value = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(10)
            kind, value = "died", worker.process.exitcode
        if kind == "ready":
            worker.ready = True
            if worker.stop_when_ready and worker.process.is_alive():
                os.kill(worker.process.pid, signal.SIGTERM)
            continue
        worker.experiment = None
        if kind == "done":
            progress.outcomes[experiment.name] = value
            on_outcome(value)
        elif kind == "preempted":
            print(f"   {experiment.name}: {value}", flush=True)
            progress.stopped = progress.stopped or "preempted"
            progress.queue.clear()  # nothing new starts after a preemption
        elif kind == "failed":
            progress.failure = progress.failure or f"{experiment.name}: {value} (see its log)"
            progress.queue.clear()
        else:  # the process ended without a word: killed, or out of memory
            reason = (f"its worker process exited with status {value} (see "
                      f"{log_path(root, experiment.name)})")  # fmt: skip
            outcome = Outcome(experiment, os.path.join(root, experiment.name), "not run", None,
                              [], reason)  # fmt: skip
            outcome.wall = time.perf_counter() - worker.started
            outcome.cpu = outcome.compiling = outcome.reporting = None  # died with it
            progress.outcomes[experiment.name] = outcome
            print(f"   {experiment.name}: not run: {reason}", flush=True)
            on_outcome(outcome)
