"""What `reproduce` writes: REPORT.md (the claims table, each experiment's tables and figures,
the wall times, the machine) and the claims table spliced into the README's marked block; with
the claim rows (`checked`: kept in each run folder's results cache) and the commit the times are
recorded under (`code_version`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import jax

from resconv_jax import experiments
from resconv_jax.analysis import stats
from resconv_jax.experiments import claims, results_cache
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.record import Experiment
from resconv_jax.reproducing.outcomes import Outcome
from resconv_jax.runtime import host
from resconv_jax.runtime import workdir as wd

REPORT_FILE = wd.REPORT_FILE


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


UNEVALUATED = "could not be evaluated"  # the note of a claim whose check raised


def unevaluated(table: list[Claim]) -> list[str]:
    """The claims of `table` whose check raised (a damaged file that the reuse checks missed)."""
    return [row.claim for row in table if row.note.startswith(UNEVALUATED)]


def claims_table(outcomes: list[Outcome]) -> list[Claim]:
    """The claims table: every claim of every experiment, read from its run directory (None when
    it did not run), in the order of their ranks. A claim that was measured carries its
    experiment's label in its note, and a fallback's `substitute` in its verdict; one of an
    experiment that did not run says why."""
    checks = sorted(
        ((claim, outcome) for outcome in outcomes for claim in outcome.experiment.claims),
        key=lambda pair: pair[0].rank,
    )
    rows = []
    for claim, outcome in checks:
        workdir = outcome.workdir if outcome.status != "not run" else None
        try:
            row = checked(claim.check, workdir)
        except Exception as error:  # noqa: BLE001 - one unreadable file must not lose the report
            note = f"{UNEVALUATED}: {type(error).__name__}: {error}"
            row = Claim(claim.check.__name__, "-", "-", note=note.splitlines()[0])
        if workdir is None and outcome.reason:
            row = dataclasses.replace(row, note=f"{row.note}: {outcome.reason}")
        if row.verdict != claims.NOT_RUN:  # measured: holds, fails or undecided
            note = "; ".join(text for text in (outcome.label, row.note) if text)
            verdict = row.verdict + outcome.experiment.substitute
            row = dataclasses.replace(row, note=note, verdict=verdict)
        rows.append(row)
    return rows


def draw_counts(scale: str):
    """The draw counts of the claims' statistics at `scale`: fewer at tiny, whose numbers mean
    nothing (`stats.SMOKE_TEST_COUNTS`)."""
    return stats.counts(**stats.SMOKE_TEST_COUNTS) if scale == "tiny" else contextlib.nullcontext()


def compute_claims(outcome: Outcome, scale: str) -> None:
    """Evaluates the claims of one experiment into its folder's results cache (`checked`), where
    `claims_table` then finds them: a `--jobs` worker does this as soon as its experiment is done,
    beside the experiments still running, instead of the parent after the last one."""
    if outcome.status == "not run":
        return
    with draw_counts(scale):
        for claim in outcome.experiment.claims:
            with contextlib.suppress(Exception):  # claims_table evaluates it again and says why
                checked(claim.check, outcome.workdir)


def checked(check, workdir: str | None) -> Claim:
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
    repo = Path(__file__).resolve().parents[2]
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
    every = experiments.experiment_list()
    only = ""
    if chosen is not None and len(chosen) < len(every):
        only = f" --only={','.join(e.name for e in chosen)}"
    lines = [
        "# resconv_jax: the paper's claims, checked",
        "",
        f"`python -m resconv_jax.reproduce --workdir=… --scale={scale}{only}`, written "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}. Claims, measures and thresholds: "
        "docs/protocol.md (our protocol; the paper states none).",
        "",
    ]
    if only:
        lines += [
            "This report has only the experiments named by --only and their claims; the folder's "
            "others, if any, are not in it (the same command without --only reports them all).",
            "",
        ]
    lines += [
        sizes_block(scale, chosen),
        "",
        claims.format_claims_table(table),
        "",
    ]
    for o in outcomes:
        wall = f"{o.seconds:.0f} s" if o.seconds is not None else "wall time not recorded"
        code = times.get(o.experiment.name, {}).get("code", "unknown")
        folder = wd.path(o.workdir)
        figures = sorted(folder.glob("*.png")) if folder.exists() else []
        not_run = f"not run: {o.reason}"
        if figures and o.status == "not run":  # an earlier run's, not this report's
            not_run, figures = f"{not_run}; its folder's figures are not this report's", []
        status = {
            "ran": f"ran in {wall}, code {code}",
            "reused": f"reused (finished before; {wall}, code {code})",
            "resumed": f"{o.reason}: resumed and finished in {wall}, code {code}",
        }.get(o.status, not_run)
        lines += [f"## {o.experiment.title}", "", f"`{o.workdir}`, config `configs/"
                  f"{o.experiment.config_arg(scale)}`; {status}.", ""]  # fmt: skip
        for text in o.tables:
            lines += ["```", text, "```", ""]
        for png in figures:
            lines += [f"![{o.experiment.name}: {png.stem}]({png.relative_to(folder.parent)})", ""]
    lines += ["## Wall times", "", *wall_times(outcomes, total, jobs), ""]
    lines += ["## Machine", "", *machine(), ""]
    return "\n".join(lines)


def wall_times(outcomes: list[Outcome], total: float, jobs: int = 1) -> list[str]:
    """This invocation's seconds per experiment and in all, as a Markdown table, with the CPU
    seconds of each (`cpu_line`)."""
    rows = []
    if jobs > 1:
        rows = [f"{jobs} experiments at a time (`--jobs`): their times overlap.", ""]
    rows += [
        "| experiment | status | seconds | CPU seconds | compiling | reports |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        counts = " | ".join("—" if v is None else f"{v:.1f}" for v in _counts(o))
        rows.append(f"| {o.experiment.name} | {o.status} | {o.wall:.1f} | {counts} |")
    sums = " | ".join(f"{at_least}{value:.1f}" for value, at_least in _sums(outcomes))
    rows += [f"| all, from the first experiment to the claims table | | {total:.1f} | {sums} |"]
    return rows + [
        "",
        "compiling: tracing, lowering and compiling programs, or loading them from the "
        "compilation cache (the reports' included); reports: writing each experiment's report "
        "(figures and tables) after its run.",
        "",
        cpu_line(outcomes, host.usable_cores()) + ".",
    ]


def _counts(outcome: Outcome) -> tuple[float | None, float | None, float | None]:
    return outcome.cpu, outcome.compiling, outcome.reporting


def _sums(outcomes: list[Outcome]) -> list[tuple[float, str]]:
    """Per count of `_counts`: (the sum of the known values, "≥ " when one is unknown, else
    "")."""
    sums = []
    for values in zip(*map(_counts, outcomes), strict=True):
        known = [v for v in values if v is not None]
        sums.append((sum(known), "≥ " if len(known) < len(values) else ""))
    return sums or [(0.0, "")] * 3


def cpu_line(outcomes: list[Outcome], cores: int) -> str:
    """'CPU N s ...': the experiments' CPU seconds (every thread of their processes, XLA's
    included), and that over the `cores` this process may use: no schedule of the same work
    takes less wall time here (a thread pool's spinning counts as work). An experiment whose
    worker died has no count: the sums are then lower bounds, and the line names it."""
    cpu, at_least = _sums(outcomes)[0]
    line = (
        f"CPU {at_least}{cpu:.0f} s in all, {at_least}{cpu / cores:.0f} s over the {cores} "
        "usable cores"
    )
    lost = [o.experiment.name for o in outcomes if o.cpu is None]
    if lost:
        line += f" ({', '.join(lost)}: its worker died, its CPU seconds unknown)"
    return line


def making_line(outcomes: list[Outcome]) -> str:
    """'compiling C s, reports R s, summed over the experiments' (`Outcome.compiling`,
    `.reporting`)."""
    (compiling, at_least), (reporting, at_least_r) = _sums(outcomes)[1:]
    return (
        f"compiling {at_least}{compiling:.0f} s, reports {at_least_r}{reporting:.0f} s, summed "
        "over the experiments"
    )


README_START, README_END = "<!-- claims table: start -->", "<!-- claims table: end -->"


def splice_readme(readme: str, scale: str, table: list[Claim] | None) -> None:
    """Replaces the claims table between README_START and README_END in the file `readme` with
    `table` (the README's table is generated, never typed); `table` None only checks the file.
    ValueError when the file or its markers are missing."""
    try:
        text = Path(readme).read_text()
    except OSError as error:
        raise ValueError(f"--readme={readme}: cannot read it ({error.strerror})") from None
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == README_START]
    ends = [i for i, line in enumerate(lines) if line.strip() == README_END]
    if README_START not in text and README_END not in text:
        raise ValueError(f"--readme={readme}: no '{README_START}' … '{README_END}' block")
    mentions = text.count(README_START) + text.count(README_END)
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0] or mentions != 2:
        raise ValueError(
            f"--readme={readme}: the markers '{README_START}' and '{README_END}' must be "
            "one line each, once, in that order, and appear nowhere else"
        )
    if table is None:
        return
    start = sum(len(line) for line in lines[: starts[0]])
    end = sum(len(line) for line in lines[: ends[0]])
    body = (
        f"{README_START}\n<!-- generated by python -m resconv_jax.reproduce --scale={scale} "
        f"--readme; do not edit -->\n{sizes_block(scale)}\n\n"
        f"{claims.format_claims_table(table)}\n"
    )
    with wd.atomic_open(readme) as f:
        f.write(text[:start] + body + text[end:])
