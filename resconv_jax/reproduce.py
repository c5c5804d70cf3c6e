"""Every claim of the paper, checked by one command: runs (or resumes, or reuses) each experiment
in DIR/<name>/ and writes DIR/REPORT.md, the claims table of docs/protocol.md with a verdict per
claim, then each experiment's tables and figures, the machine, versions and wall times (each
experiment's seconds, CPU seconds, and seconds compiling and writing its report).

    python -m resconv_jax.reproduce --workdir=DIR [--scale=small|paper|tiny] [--readme=README.md]
        [--only=NAME,...] [--jobs=N|auto]

`--only` runs and reports just the named experiments (REPORT.md's names, e.g.
`--only=conditioning --scale=paper` for claim 2's full sweep); `--readme` needs them all.
`--jobs=N` runs N experiments at a time, each in a worker process with its output in
DIR/logs/NAME.log (`reproducing.workers`): the same numbers, sooner on a CPU with cores to spare.
The default, `--jobs=auto`, is 2 on a CPU with two cores or more (1 at --scale=paper, whose
experiments are sized to fill a machine) and 1 on an accelerator;
`--jobs=1` runs them one after another in this process, their output on the terminal.

`small` takes ~5 minutes on 2 CPU cores from scratch (7 one at a time; README.md); `paper`
is the full protocol (a GPU or a pod); `tiny` is a smoke test whose numbers mean nothing. A finished
experiment is reused, not rerun, only when its files pass the checks a resume makes (its task's
`why_unfinished`: this scale's config, every run's line at every logged step up to the last, the
checkpoint's record of those lines, summary.json as they give it); an interrupted or damaged one is
resumed from its last good checkpoint, and the report says why. An experiment whose weights are not
found runs its fallback instead (SST-2: the random-init GPT-2), labelled so.

Exit status: 0 when every experiment ran, resumed or was reused, and also after a SIGTERM
(preemption: the running experiments stop at a safe point, their checkpoints saved; the last line
says to rerun the same command, as `main` does); 1 when one could not run or a claim could not be
evaluated from its files (the report says which and why), 2 for bad flags or a workdir that
cannot be written, 3 when another process holds DIR, 141 when the output pipe closed (`| head`:
the running experiments stop at a safe point, as after a SIGTERM), 130 after Ctrl-C (one line;
with --jobs > 1 the running experiments first stop at a safe point, a second Ctrl-C stops them at
once; rerun the same command to go on).
"""

from __future__ import annotations

import contextlib
import os
import sys

if __name__ == "__main__":  # before numpy loads OpenBLAS and before the slow imports
    from resconv_jax.runtime import signals

    signals.install()
    signals.exit_on_interrupt()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in main: threaded OpenBLAS slows LAPACK


import json  # noqa: E402
import time  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from resconv_jax import experiments  # noqa: E402
from resconv_jax.errors import (  # noqa: E402
    Interrupted,
    Preempted,
    WorkdirBusy,
    WorkdirWriteError,
    exit_on_help,
    exit_with,
)
from resconv_jax.experiments import claims  # noqa: E402
from resconv_jax.experiments.record import SCALES, Experiment  # noqa: E402
from resconv_jax.reproducing import report  # noqa: E402
from resconv_jax.reproducing.outcomes import Outcome, finished_before, run_experiment  # noqa: E402
from resconv_jax.runtime import compile_cache, host, signals  # noqa: E402
from resconv_jax.runtime import workdir as wd  # noqa: E402
from resconv_jax.runtime.metrics import METRICS_FILE  # noqa: E402
from resconv_jax.validation import check_workdir  # noqa: E402

TIMES_FILE = wd.TIMES_FILE


def _is_time_entry(entry) -> bool:
    """{"seconds": a number, "scale": a name, "code": a commit (optional)}, as `record` writes."""
    if not isinstance(entry, dict) or not isinstance(entry.get("scale"), str):
        return False
    seconds = entry.get("seconds")
    return isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0


def read_times(path) -> dict:
    """reproduce.json's {experiment: {"seconds", "scale", "code"}} (hints for --jobs' order and
    the report's wall times); {} when there is none. A damaged file (unreadable, torn, or JSON
    of another shape) is said in one line and rewritten with its well-formed entries."""
    if not path.exists():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        loaded, problem = None, f"{type(error).__name__}: {str(error)[:80]}"
    else:
        problem = "not its format"
    kept = {}
    if isinstance(loaded, dict):
        kept = {name: entry for name, entry in loaded.items() if _is_time_entry(entry)}
    if kept != loaded:
        print(
            f"warning: {path} is damaged ({problem}): the times it recorded are dropped "
            f"({len(kept)} kept) and it is rewritten; they only order --jobs and the report",
            flush=True,
        )
        wd.write_json(path, kept)
    return kept


def selected(only: tuple[str, ...] = ()) -> tuple[Experiment, ...]:
    """The experiments named in `only` (all when empty), in the claims table's order;
    ValueError naming the known ones for a name that is none of them."""
    everything = experiments.experiment_list()
    names = [experiment.name for experiment in everything]
    if unknown := [name for name in only if name not in names]:
        stands_in_for = {e.fallback.name: e.name for e in everything if e.fallback}
        if all(name in stands_in_for for name in unknown):  # names REPORT.md's wall times give
            parent = stands_in_for[unknown[0]]
            raise ValueError(
                f"--only={unknown[0]}: that is {parent}'s stand-in, run when {parent} cannot be: "
                f"--only={parent}"
            )
        raise ValueError(
            f"--only={','.join(unknown)}: no such experiment; there are {', '.join(names)}"
        )
    return tuple(e for e in everything if not only or e.name in only)


def resolve_jobs(jobs: int | str, root: str, scale: str, experiments: int) -> int:
    """`jobs` as a number ("auto": `workers.automatic_jobs`, at most `experiments`,
    said in one line)."""
    if jobs != "auto":
        return int(jobs)
    from resconv_jax.reproducing import workers

    number, why = workers.automatic_jobs(root, scale)
    if number > experiments:
        number, why = experiments, f"{experiments} experiment{'s' * (experiments > 1)} chosen"
    if number > 1:
        print(f"--jobs=auto: up to {number} experiments at a time ({why}), each in a worker "
              f"process with its output in {os.path.join(root, workers.LOGS)}/; "
              "--jobs=1 runs them one after another here", flush=True)  # fmt: skip
    else:
        print(f"--jobs=auto: one experiment at a time ({why})", flush=True)
    return number


def reproduce(
    root: str,
    scale: str,
    readme: str | None = None,
    only: tuple[str, ...] = (),
    jobs: int | str = 1,
    compilation_cache: str = "",
) -> int:
    """Runs every experiment of `scale` (or those named in `only`) in `root`, `jobs` at a time
    (a number, or "auto": `resolve_jobs`), and writes REPORT.md (and, given `readme`, its claims
    table into that file: `report.splice_readme`); the exit status. Holds `root`'s lock throughout:
    WorkdirBusy when another process holds it. `compilation_cache`: the workers' setting
    (`compile_cache.enable`) when `jobs` > 1."""
    if jobs != "auto":  # "auto" is resolved under the lock, to a number that passes these
        jobs = int(jobs)
        if jobs < 1:
            raise ValueError(f"--jobs={jobs}: give 1 or more experiments at a time")
        if jobs > 1 and not wd.is_local(root):
            raise ValueError(
                f"--jobs={jobs}: the workers write their output to a local WORKDIR/logs/; "
                f"run --workdir={root} with --jobs=1, or use a local --workdir"
            )
    chosen = selected(only)
    if readme and only:
        raise ValueError("--readme writes the whole claims table: run it without --only")
    if readme:
        if scale == "tiny":
            raise ValueError("--readme: --scale=tiny numbers mean nothing; use small or paper")
        report.splice_readme(readme, scale, None)  # the markers are there: checked before any run
    if any((wd.path(root) / name).exists() for name in (wd.CONFIG_FILE, METRICS_FILE)):
        raise ValueError(
            f"--workdir={root} holds a run of main (config.json, metrics.jsonl): give reproduce "
            "a folder of its own; it writes one folder per experiment in it"
        )
    wd.make_folder(root, f"--workdir={root}")
    lock = wd.WorkdirLock(root)
    lock.acquire()  # another reproduce on this folder: WorkdirBusy, naming it
    try:
        jobs = resolve_jobs(jobs, root, scale, len(chosen))
        return _reproduce_locked(root, scale, readme, chosen, jobs, compilation_cache)
    finally:
        lock.release()


def _reproduce_locked(
    root: str,
    scale: str,
    readme: str | None,
    chosen: tuple[Experiment, ...],
    jobs: int = 1,
    compilation_cache: str = "",
) -> int:
    start = time.perf_counter()
    times_path = wd.path(root) / TIMES_FILE
    times = read_times(times_path)

    def record(outcome: Outcome) -> None:
        if outcome.status in ("ran", "resumed"):
            times[outcome.experiment.name] = {
                "seconds": outcome.seconds,
                "scale": scale,
                "code": report.code_version(),
            }
            wd.write_json(times_path, times)

    done = {}
    if jobs > 1:  # what is finished is reused here, without starting a worker for it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts here
        for experiment in chosen:
            if finished_before(experiment, scale, root):
                done[experiment.name] = run_experiment(experiment, scale, root, times)
                record(done[experiment.name])
    rest = tuple(e for e in chosen if e.name not in done)
    jobs = max(1, min(jobs, len(rest)))  # one experiment runs in this process
    if jobs > 1:
        from resconv_jax.reproducing import workers

        def finished(outcome: Outcome) -> None:
            print(outcome.status_line(), flush=True)
            if outcome.status in ("ran", "resumed"):
                for text in outcome.tables:
                    print(text, flush=True)
            record(outcome)

        outcomes = workers.run_all(
            rest, scale, root, dict(times), jobs, compilation_cache, finished
        )
        done.update(zip((e.name for e in rest), outcomes, strict=True))
    else:
        for experiment in rest:
            done[experiment.name] = run_experiment(experiment, scale, root, times)
            record(done[experiment.name])
    outcomes = [done[e.name] for e in chosen]
    table_start = time.perf_counter()
    with report.draw_counts(scale):
        table = report.claims_table(outcomes)
    table_seconds = time.perf_counter() - table_start
    total = time.perf_counter() - start
    text = report.format_report(scale, outcomes, table, times, chosen, total, jobs)
    with wd.atomic_open(wd.path(root) / report.REPORT_FILE) as f:
        f.write(text)
    print(claims.format_claims_table(table), flush=True)
    spent = ", ".join(f"{o.experiment.name} {o.wall:.0f} s" for o in outcomes)
    print(
        f"{total:.0f} s from the first experiment to the claims table ({spent}; the table "
        f"{table_seconds:.0f} s); {report.cpu_line(outcomes, host.usable_cores())}; "
        f"{report.making_line(outcomes)}",
        flush=True,
    )
    print(f"wrote {wd.path(root) / report.REPORT_FILE}", flush=True)
    not_run = [o.experiment.name for o in outcomes if o.status == "not run"]
    unmeasured = report.unevaluated(table)
    if unmeasured:
        print(f"error: {', '.join(unmeasured)} could not be evaluated from its files (REPORT.md "
              "says why); remove that experiment's folder and rerun", flush=True)  # fmt: skip
    if readme and (not_run or unmeasured):  # its rows would read "not run" over measured ones
        why = f"{', '.join(not_run)} did not run" if not_run else "a claim could not be evaluated"
        print(f"not written into {readme}: {why}", flush=True)
    elif readme:
        report.splice_readme(readme, scale, table)
        print(f"wrote the claims table into {readme}", flush=True)
    return 1 if not_run or unmeasured else 0


def _define_flags() -> None:
    """The command's flags, defined only when it runs (the module is also a library)."""
    flags.DEFINE_string("workdir", None, "Folder of the experiments and REPORT.md.")
    flags.DEFINE_enum("scale", "small", SCALES, "Sizes: tiny, small or paper.")
    flags.DEFINE_string(
        "readme", None, "Also write the claims table into this file's marked block (README.md)."
    )
    flags.DEFINE_list(
        "only",
        [],
        "Run and report only these experiments (names as in REPORT.md), e.g. "
        "--only=conditioning; every one when empty.",
    )
    flags.DEFINE_string(
        "jobs",
        "auto",
        "Experiments run at a time, each in a worker process (output in WORKDIR/logs/); 1: one "
        "after another in this process; auto: 2 on a CPU with 2 cores or more at --scale=tiny or "
        "small, else 1.",
    )
    flags.register_validator(
        "jobs",
        lambda value: value == "auto" or (value.isascii() and value.isdigit() and int(value) >= 1),
        message="give a positive number of experiments at a time, or auto",
    )
    flags.DEFINE_string(
        "compilation_cache",
        "",
        "Folder of JAX's persistent compilation cache, or 'off' (as resconv_jax.main's flag).",
    )
    flags.mark_flags_as_required(["workdir"])


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad or missing flag as one line and exit status 2."""
    exit_on_help(argv)
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        exit_with(f"bad flag: {error}", 2)


def main(argv: list[str]) -> None:
    signals.interrupts_raise()
    if len(argv) > 1:
        exit_with(f"unexpected arguments: {' '.join(argv[1:])}", 2)
    logging.set_verbosity(logging.WARNING)
    signals.stop_when_output_closes()
    compile_cache.enable(flags.FLAGS.compilation_cache)
    workdir, scale, readme = flags.FLAGS.workdir, flags.FLAGS.scale, flags.FLAGS.readme
    workdir = os.path.expanduser(workdir)  # --workdir=~/x: the shell leaves the ~
    try:
        check_workdir(workdir)
        status = reproduce(
            workdir,
            scale,
            readme,
            tuple(flags.FLAGS.only),
            flags.FLAGS.jobs,
            flags.FLAGS.compilation_cache,
        )
        if status:  # an experiment's failed checkpoint save leaves Orbax threads that block exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        sys.exit(status)
    except Preempted as stop:
        if signals.output_closed():
            with contextlib.suppress(OSError):  # `2>&1 | head`: stderr is that closed pipe too
                print("error: the output pipe closed (| head?): stopped, every experiment at a "
                      "safe point (its checkpoint saved); rerun the same reproduce command to go "
                      "on", file=sys.stderr, flush=True)  # fmt: skip
            sys.exit(signals.EXIT_PIPE_CLOSED)
        print(f"{stop}; rerun the same reproduce command to go on", flush=True)
        sys.exit(0)
    except (Interrupted, KeyboardInterrupt) as stop:
        what = (
            str(stop)
            or "interrupted (Ctrl-C); the last checkpoints and the lines before them are kept"
        )
        print(f"error: {what}; rerun the same reproduce command to go on", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # As after a failed save: Orbax's threads could block exit.
        os._exit(signals.EXIT_INTERRUPTED)
    except WorkdirBusy as error:
        exit_with(str(error), 3)
    except (WorkdirWriteError, ValueError) as error:
        exit_with(str(error), 2)


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=parse_flags)
