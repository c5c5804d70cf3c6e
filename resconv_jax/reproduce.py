"""Every claim of the paper, checked by one command: runs (or resumes, or reuses) each experiment
in DIR/<name>/ and writes DIR/REPORT.md, the claims table of docs/protocol.md with a verdict per
claim, then each experiment's tables and figures, the machine, versions and wall times.

    python -m resconv_jax.reproduce --workdir=DIR [--scale=small|paper|tiny] [--readme=README.md]
        [--only=NAME,...] [--jobs=N|auto]

`--only` runs and reports just the named experiments (REPORT.md's names, e.g.
`--only=conditioning --scale=paper` for claim 2's full sweep); `--readme` needs them all.
`--jobs=N` runs N experiments at a time, each in a worker process with its output in
DIR/logs/NAME.log (`reproduce_workers`): the same numbers, sooner on a CPU with cores to spare.
The default, `--jobs=auto`, is 2 on a CPU with two cores or more (1 at --scale=paper, whose
experiments are sized to fill a machine) and 1 on an accelerator;
`--jobs=1` runs them one after another in this process, their output on the terminal.

`small` takes ~6 minutes on 2 CPU cores from scratch (7 one at a time; README.md); `paper`
is the full protocol (a GPU or a pod); `tiny` is a smoke test whose numbers mean nothing. A finished
experiment is reused, not rerun, only when its files pass the checks a resume makes (its task's
`why_unfinished`: this scale's config, every run's line at every logged step up to the last, the
checkpoint's record of those lines, summary.json as they give it); an interrupted or damaged one is
resumed from its last good checkpoint, and the report says why. An experiment whose weights are not
found runs its fallback instead (SST-2: the random-init GPT-2), labelled so.

Exit status: 0 when every experiment ran, resumed or was reused, 1 when one could not run (the
report says which and why), 2 for bad flags or a workdir that cannot be written, 3 when another
process holds DIR.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before numpy loads OpenBLAS and before the slow imports
    from resconv_jax.runtime import signals

    signals.install()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in main: threaded OpenBLAS slows LAPACK


import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from resconv_jax import experiments  # noqa: E402
from resconv_jax.analysis import stats  # noqa: E402
from resconv_jax.errors import (  # noqa: E402
    Preempted,
    TrainingDiverged,
    WeightsNotFound,
    WorkdirBusy,
    WorkdirWriteError,
    exit_with,
)
from resconv_jax.experiments import claims, results_cache  # noqa: E402
from resconv_jax.experiments.claims import Claim  # noqa: E402
from resconv_jax.experiments.record import SCALES, Experiment  # noqa: E402
from resconv_jax.runtime import compile_cache, host  # noqa: E402
from resconv_jax.runtime import workdir as wd  # noqa: E402
from resconv_jax.runtime.workdir import read_saved_config  # noqa: E402
from resconv_jax.validation import check_workdir  # noqa: E402

REPORT_FILE = "REPORT.md"
TIMES_FILE = "reproduce.json"


def experiment_sizes(experiment: Experiment, scale: str) -> str:
    """One line: the sizes `experiment` runs at `scale` (its task's `describe_sizes`)."""
    config = experiment.load(scale)
    return f"`{experiment.name}`: {experiments.task_module(config.task).describe_sizes(config)}"


def sizes_block(scale: str, chosen: tuple[Experiment, ...] | None = None) -> str:
    """The sizes of every experiment of `scale` (or of those `chosen`), one line each, for above
    the claims table."""
    lines = [f"Sizes at `--scale={scale}`:", ""]
    for experiment in chosen or experiments.experiment_list():
        lines.append(f"- {experiment_sizes(experiment, scale)}")
        if experiment.fallback is not None:
            substitute = experiment_sizes(experiment.fallback, scale)
            lines.append(f"- {substitute} (when the pretrained weights are not found)")
    return "\n".join(lines)


@dataclasses.dataclass
class Outcome:
    """What happened to one experiment in this invocation."""

    experiment: Experiment
    workdir: str
    status: str  # "ran", "resumed" (found unfinished or damaged), "reused" or "not run"
    seconds: float | None
    tables: list[str]
    reason: str = ""
    missing_weights: bool = False  # stopped because the pretrained weights were not found
    label: str = ""  # prefixed to the notes of its claims
    wall: float = 0.0  # seconds this invocation spent on it (reused: the checks and the report)

    def status_line(self) -> str:
        """'   NAME: STATUS, SECONDS s', as printed when it is done."""
        return f"   {self.experiment.name}: {self.status}, {self.wall:.1f} s"


def _unfinished_reason(config, workdir: str) -> str | None:
    """None when `workdir` holds this config's result, finished and intact (its task's
    `why_unfinished`), else why not; "" when it holds no run of it at all."""
    if not wd.path(workdir).exists() or read_saved_config(workdir) is None:
        return ""
    return experiments.task_module(config.task).why_unfinished(config, workdir)


def _x64(config):
    """The x64 setting that `config`'s run, and the checks of its files, need."""
    return jax.enable_x64(config.model.dtype == "float64" or config.probe.dtype == "float64")


def _finished_before(experiment: Experiment, scale: str, root: str) -> bool:
    """Whether `root` holds `experiment`'s finished, intact result at `scale` (its own, or, when
    its own folder holds no run, its fallback's: `run_experiment` then reuses that one unless
    the pretrained weights are found now, and runs the experiment itself)."""
    for candidate in (experiment, experiment.fallback):
        if candidate is None:
            return False
        config = candidate.load(scale)
        with _x64(config):
            problem = _unfinished_reason(config, os.path.join(root, candidate.name))
        if problem != "":
            return problem is None
    return False


def _run_one(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    config = experiment.load(scale)
    task = experiments.task_module(config.task)
    workdir = os.path.join(root, experiment.name)
    print(f"== {experiment.name}: {experiment.title} ({workdir})", flush=True)
    with _x64(config):
        problem = _unfinished_reason(config, workdir)
        if problem is None:
            tables = experiments.report_tables(task, workdir)
            seconds = times.get(experiment.name, {}).get("seconds")
            print(f"   finished before: reused ({workdir})", flush=True)
            return Outcome(experiment, workdir, "reused", seconds, tables)
        status, reason = "ran", ""
        if problem:
            status, reason = "resumed", f"not reusable: {problem}"
            print(f"   {reason}: resuming from the last good checkpoint", flush=True)
        start = time.perf_counter()
        task.run(config, workdir)
        tables = experiments.report_tables(task, workdir)
        for text in tables:
            print(text, flush=True)
        return Outcome(experiment, workdir, status, time.perf_counter() - start, tables, reason)


def _attempt(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    try:
        return _run_one(experiment, scale, root, times)
    except (ValueError, TrainingDiverged, WorkdirBusy, WorkdirWriteError) as error:
        reason = str(error).splitlines()[0]
        print(f"   not run: {reason}", flush=True)
        workdir = os.path.join(root, experiment.name)
        missing = isinstance(error, WeightsNotFound)
        return Outcome(experiment, workdir, "not run", None, [], reason, missing)


def run_experiment(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    """Runs, resumes or reuses `experiment` at `scale` in `root`/its name, or its fallback when
    its weights are not found; an error that stops it (bad input, including data and weights:
    ValueError; divergence; a busy or unwritable workdir) becomes a "not run" outcome.
    Preempted is raised: the whole command stops, and a rerun resumes."""
    start = time.perf_counter()
    outcome = _attempt(experiment, scale, root, times)
    outcome.label = experiment.label
    fallback = experiment.fallback
    if outcome.missing_weights and fallback is not None:
        print(f"   weights unavailable: running {fallback.name} instead ({fallback.title})",
              flush=True)  # fmt: skip
        substitute = _attempt(fallback, scale, root, times)
        substitute.label = f"{fallback.label} ({outcome.reason})"
        outcome = substitute
    outcome.wall = time.perf_counter() - start
    print(outcome.status_line(), flush=True)
    return outcome


def claims_table(outcomes: list[Outcome]) -> list[Claim]:
    """The claims table: every claim of every experiment, read from its run directory (None when
    it did not run), in the order of their ranks. A claim that was measured carries its
    experiment's label in its note, and a fallback's `substitute` in its verdict."""
    checks = sorted(
        ((claim, outcome) for outcome in outcomes for claim in outcome.experiment.claims),
        key=lambda pair: pair[0].rank,
    )
    rows = []
    for claim, outcome in checks:
        workdir = outcome.workdir if outcome.status != "not run" else None
        try:
            row = _checked(claim.check, workdir)
        except Exception as error:  # noqa: BLE001 - one unreadable file must not lose the report
            note = f"could not be evaluated: {type(error).__name__}: {error}"
            row = Claim(claim.check.__name__, "-", "-", note=note.splitlines()[0])
        if row.verdict != claims.NOT_RUN:  # measured: holds, fails or undecided
            note = "; ".join(text for text in (outcome.label, row.note) if text)
            verdict = row.verdict + outcome.experiment.substitute
            row = dataclasses.replace(row, note=note, verdict=verdict)
        rows.append(row)
    return rows


def _checked(check, workdir: str | None) -> Claim:
    """check(workdir), or the row it gave before for the same files, code and draw counts
    (`results_cache`)."""
    if workdir is None or not wd.path(workdir).is_dir():
        return check(workdir)
    counts = ",".join(f"{name}={value}" for name, value in stats.current_counts().items())
    name = f"claim:{check.__module__}.{check.__qualname__}:{counts}:{workdir}"
    compute = functools.partial(check, workdir)
    return results_cache.cached(workdir, name, compute, encode=dataclasses.asdict,
                                decode=lambda row: Claim(**row))  # fmt: skip


def code_version() -> str:
    """The git commit of this checkout ('+ changes' when its tracked files differ), or
    'unknown' outside a git checkout."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"], timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.returncode else "")


def machine() -> list[str]:
    """Lines describing this machine and the versions of the main packages."""
    devices = jax.devices()
    packages = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "scipy")
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return [
        f"- machine: {host.cpu_model()}, {host.usable_cores()} of {os.cpu_count()} CPU cores "
        f"usable, {platform.platform()}, Python {platform.python_version()}",
        f"- JAX devices: {len(devices)} × {devices[0].device_kind} ({devices[0].platform})",
        "- versions: " + ", ".join(versions),
    ]


def format_report(
    scale: str,
    outcomes: list[Outcome],
    table: list[Claim],
    times: dict,
    chosen: tuple[Experiment, ...] | None = None,
    total: float = 0.0,
    jobs: int = 1,
) -> str:
    """REPORT.md: the claims table, then one section per experiment (those `chosen`, or all),
    then this invocation's wall times (`total`: the whole command's seconds; `jobs`
    experiments at a time) and the machine."""
    lines = [
        "# resconv_jax: the paper's claims, checked",
        "",
        f"`python -m resconv_jax.reproduce --workdir=… --scale={scale}`, written "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}. Claims, measures and thresholds: "
        "docs/protocol.md (our protocol; the paper states none).",
        "",
        sizes_block(scale, chosen),
        "",
        claims.format_claims_table(table),
        "",
    ]
    for o in outcomes:
        wall = f"{o.seconds:.0f} s" if o.seconds is not None else "wall time not recorded"
        code = times.get(o.experiment.name, {}).get("code", "unknown")
        status = {
            "ran": f"ran in {wall}, code {code}",
            "reused": f"reused (finished before; {wall}, code {code})",
            "resumed": f"{o.reason}: resumed and finished in {wall}, code {code}",
        }.get(o.status, f"not run: {o.reason}")
        lines += [f"## {o.experiment.title}", "", f"`{o.workdir}`, config `configs/"
                  f"{o.experiment.config_arg(scale)}`; {status}.", ""]  # fmt: skip
        for text in o.tables:
            lines += ["```", text, "```", ""]
        folder = wd.path(o.workdir)
        if folder.exists():
            root = folder.parent
            for png in sorted(folder.glob("*.png")):
                lines += [f"![{o.experiment.name}: {png.stem}]({png.relative_to(root)})", ""]
    lines += ["## Wall times", "", *wall_times(outcomes, total, jobs), ""]
    lines += ["## Machine", "", *machine(), ""]
    return "\n".join(lines)


def wall_times(outcomes: list[Outcome], total: float, jobs: int = 1) -> list[str]:
    """This invocation's seconds per experiment and in all, as a Markdown table."""
    rows = []
    if jobs > 1:
        rows = [f"{jobs} experiments at a time (`--jobs`): their times overlap.", ""]
    rows += ["| experiment | status | seconds |", "|---|---|---|"]
    rows += [f"| {o.experiment.name} | {o.status} | {o.wall:.1f} |" for o in outcomes]
    return rows + [f"| all, from the first experiment to the claims table | | {total:.1f} |"]


README_START, README_END = "<!-- claims table: start -->", "<!-- claims table: end -->"


def splice_readme(readme: str, scale: str, table: list[Claim] | None) -> None:
    """Replaces the claims table between README_START and README_END in the file `readme` with
    `table` (the README's table is generated, never typed); `table` None only checks the file.
    ValueError when the file or its markers are missing."""
    try:
        text = Path(readme).read_text()
    except OSError as error:
        raise ValueError(f"--readme={readme}: cannot read it ({error.strerror})") from None
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"--readme={readme}: no '{README_START}' … '{README_END}' block")
    if table is None:
        return
    body = (
        f"{README_START}\n<!-- generated by python -m resconv_jax.reproduce --scale={scale} "
        f"--readme; do not edit -->\n{sizes_block(scale)}\n\n"
        f"{claims.format_claims_table(table)}\n"
    )
    with wd.atomic_open(readme) as f:
        f.write(text[:start] + body + text[end:])


def selected(only: tuple[str, ...] = ()) -> tuple[Experiment, ...]:
    """The experiments named in `only` (all when empty), in the claims table's order;
    ValueError naming the known ones for a name that is none of them."""
    everything = experiments.experiment_list()
    names = [experiment.name for experiment in everything]
    if unknown := [name for name in only if name not in names]:
        raise ValueError(
            f"--only={','.join(unknown)}: no such experiment; there are {', '.join(names)}"
        )
    return tuple(e for e in everything if not only or e.name in only)


def resolve_jobs(jobs: int | str, root: str, scale: str, experiments: int) -> int:
    """`jobs` as a number ("auto": `reproduce_workers.automatic_jobs`, at most `experiments`,
    said in one line)."""
    if jobs != "auto":
        return int(jobs)
    from resconv_jax import reproduce_workers

    number, why = reproduce_workers.automatic_jobs(root, scale)
    if number > experiments:
        number, why = experiments, f"{experiments} experiment{'s' * (experiments > 1)} chosen"
    if number > 1:
        print(f"--jobs=auto: up to {number} experiments at a time ({why}), each in a worker "
              f"process with its output in {os.path.join(root, reproduce_workers.LOGS)}/; "
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
    table into that file: `splice_readme`); the exit status. Holds `root`'s lock throughout:
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
        splice_readme(readme, scale, None)  # the markers are there: checked before any run
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
    times = json.loads(times_path.read_text()) if times_path.exists() else {}

    def record(outcome: Outcome) -> None:
        if outcome.status in ("ran", "resumed"):
            times[outcome.experiment.name] = {
                "seconds": outcome.seconds,
                "scale": scale,
                "code": code_version(),
            }
            wd.write_json(times_path, times)

    done = {}
    if jobs > 1:  # what is finished is reused here, without starting a worker for it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts here
        for experiment in chosen:
            if _finished_before(experiment, scale, root):
                done[experiment.name] = run_experiment(experiment, scale, root, times)
                record(done[experiment.name])
    rest = tuple(e for e in chosen if e.name not in done)
    jobs = max(1, min(jobs, len(rest)))  # one experiment runs in this process
    if jobs > 1:
        from resconv_jax import reproduce_workers

        def finished(outcome: Outcome) -> None:
            print(outcome.status_line(), flush=True)
            if outcome.status in ("ran", "resumed"):
                for text in outcome.tables:
                    print(text, flush=True)
            record(outcome)

        outcomes = reproduce_workers.run_all(
            rest, scale, root, dict(times), jobs, compilation_cache, finished
        )
        done.update(zip((e.name for e in rest), outcomes, strict=True))
    else:
        for experiment in rest:
            done[experiment.name] = run_experiment(experiment, scale, root, times)
            record(done[experiment.name])
    outcomes = [done[e.name] for e in chosen]
    smoke_test = stats.counts(**stats.SMOKE_TEST_COUNTS) if scale == "tiny" else nullcontext()
    with smoke_test:  # tiny's numbers mean nothing: fewer random draws for its statistics
        table = claims_table(outcomes)
    total = time.perf_counter() - start
    report = format_report(scale, outcomes, table, times, chosen, total, jobs)
    with wd.atomic_open(wd.path(root) / REPORT_FILE) as f:
        f.write(report)
    print(claims.format_claims_table(table), flush=True)
    spent = ", ".join(f"{o.experiment.name} {o.wall:.0f} s" for o in outcomes)
    print(f"{total:.0f} s from the first experiment to the claims table ({spent})", flush=True)
    print(f"wrote {wd.path(root) / REPORT_FILE}", flush=True)
    if readme:
        splice_readme(readme, scale, table)
        print(f"wrote the claims table into {readme}", flush=True)
    return 0 if all(o.status != "not run" for o in outcomes) else 1


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
        lambda value: value == "auto" or (value.isdigit() and int(value) >= 1),
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
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        exit_with(f"bad flag: {error}", 2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        exit_with(f"unexpected arguments: {' '.join(argv[1:])}", 2)
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable(flags.FLAGS.compilation_cache)
    workdir, scale, readme = flags.FLAGS.workdir, flags.FLAGS.scale, flags.FLAGS.readme
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
        print(f"{stop}; rerun the same reproduce command to go on", flush=True)
        sys.exit(0)
    except WorkdirBusy as error:
        exit_with(str(error), 3)
    except (WorkdirWriteError, ValueError) as error:
        exit_with(str(error), 2)


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=parse_flags)
