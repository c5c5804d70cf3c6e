"""Every claim of the paper, checked by one command: runs (or resumes, or reuses) each experiment
in DIR/<name>/ and writes DIR/REPORT.md, the claims table of docs/protocol.md with a verdict per
claim, then each experiment's tables and figures, the machine, versions and wall times.

    python -m resconv_jax.reproduce --workdir=DIR [--scale=small|paper|tiny] [--readme=README.md]

`small` took 7 minutes on 2 CPU cores (2026-12-01, from scratch); `paper` is the full protocol
(a GPU or a pod); `tiny` is a smoke test whose numbers mean nothing. A finished experiment is
reused, not rerun, only when its files pass the checks a resume makes (`finished.why_unfinished`:
this scale's config, every run's line at every logged step up to the last, the checkpoint's
record of those lines, summary.json as they give it); an interrupted or damaged one is resumed
from its last good checkpoint, and the report says why. SST-2 uses the pretrained GPT-2 when its
weights are found (see configs/sst2.py) and otherwise the random-init variant, labelled so.

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
import shlex  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from resconv_jax import experiments, train  # noqa: E402
from resconv_jax.config_defaults import load_config_file  # noqa: E402
from resconv_jax.errors import (  # noqa: E402
    Preempted,
    TrainingDiverged,
    WeightsNotFound,
    WorkdirBusy,
    WorkdirWriteError,
    exit_with,
)
from resconv_jax.experiments import claims, rank_collapse  # noqa: E402
from resconv_jax.experiments.run_report import write_run_report  # noqa: E402
from resconv_jax.finished import why_config_differs, why_unfinished  # noqa: E402
from resconv_jax.runtime import workdir as wd  # noqa: E402
from resconv_jax.runtime.workdir import read_saved_config  # noqa: E402
from resconv_jax.sweep import expand_runs  # noqa: E402
from resconv_jax.validation import check_workdir  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REPORT_FILE = "REPORT.md"
TIMES_FILE = "reproduce.json"
SCALES = ("tiny", "small", "paper")
FLOAT64 = {"model.dtype": "float64", "probe.dtype": "float64"}
# The certificate's premise, η ≤ 1/λ_max(K): each run's η = 0.9/λ_max(K) at its initialization.
SMOOTH = {
    "model.transformer.activation": "softplus",
    "optim.lr_rule": "lambda_max",
    "optim.lr_factor": 0.9,
}


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment of the report: a config file (`file:arg`) with overrides, in DIR/name."""

    name: str
    config: str
    overrides: dict
    title: str

    def load(self):
        path, _, arg = self.config.partition(":")
        return load_config_file(str(CONFIGS / path), arg or None, **self.overrides)


def experiment_list(scale: str) -> list[Experiment]:
    """The experiments of `scale`, in the order they run."""
    small, tiny = scale == "small", scale == "tiny"
    short = {"train.num_steps": 40, "train.checkpoint_every": 20, "train.print_every": 20}
    theory = short if tiny else {}
    size = "small" if small or tiny else ""
    conditioning = depth = {}
    if tiny:
        conditioning = short | {
            "sweep.dim": (64, 128),
            "sweep.seed": (0, 1),
            "sweep.beta": (0.0, 1.0),
        }
        conditioning |= {"certificate.every": 40, "probe.every": 20}
        depth = short | {"sweep.num_layers": (1, 2), "sweep.seed": (0,), "probe.every": 20}
    jena = {}
    if small or tiny:
        steps = 20 if tiny else 300
        jena = {"train.num_steps": steps, "train.checkpoint_every": steps // 2}
        jena |= {"train.print_every": steps // 2, "train.step_losses_until": steps}
    sst2 = {}
    if small or tiny:
        sst2 = {"data.num_train": 16 if tiny else 64, "data.max_tokens": 8 if tiny else 16}
        sst2 |= {"train.num_steps": 10 if tiny else 100, "train.checkpoint_every": 10}
        sst2 |= {"train.print_every": 10}
        if tiny:
            sst2 |= {"sweep.num_layers": (1, 2), "data.num_val": 32}
    rank = {"rank_collapse.seeds": (0, 1), "rank_collapse.d_qk_values": (1, 4096)} if tiny else {}
    return [
        Experiment("theory", "theory.py", FLOAT64 | theory, "Theory regime, ReLU, float64"),
        Experiment(
            "theory_softplus",
            "theory.py",
            FLOAT64 | theory | SMOOTH,
            "Theory regime, softplus (smooth: Assumption 1), float64",
        ),
        Experiment(
            "conditioning", f"conditioning.py:{size}", conditioning, "Rate against conditioning"
        ),
        Experiment("rank_collapse", "rank_collapse.py", rank, "Rank collapse at initialization"),
        Experiment("depth", f"depth.py:{size}", depth, "Linear convergence per depth"),
        Experiment(
            "depth_branches",
            f"depth.py:{size + ',' if size else ''}branches",
            depth,
            "Linear convergence per depth, small residual branches (β = 1, float64)",
        ),
        Experiment("jena", "jena.py", jena, "Jena Climate β sweep"),
        Experiment("sst2", "sst2.py", sst2, "SST-2, pretrained GPT-2"),
    ]


def _values(values) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


def experiment_sizes(experiment: Experiment) -> str:
    """One line: the sizes `experiment` runs at (data, P, M, d, runs, steps), from its config."""
    c = experiment.load()
    if c.task == "rank_collapse":
        r = c.rank_collapse
        return (
            f"`{experiment.name}`: P={c.data.num_samples} Gaussian samples of M={c.data.seq_len}, "
            f"d={c.data.dim}; d_QK ∈ {_values(r.d_qk_values)}, {len(r.seeds)} seeds"
        )
    data = c.data
    if data.name == "synthetic":
        widths = _values(c.sweep.dim) if c.sweep.dim else str(data.dim)
        shape = f"P={data.num_samples} Gaussian samples of M={data.seq_len}, d={widths}"
    elif data.name == "jena":
        d = data.lift_dim or len(data.features) or ("6" if data.source == "bundled" else "all")
        shape = f"P={data.num_train} Jena windows of M={data.seq_len} h, d={d}"
    else:
        shape = f"P={data.num_train} SST-2 sentences of ≤ {data.max_tokens} tokens"
    if c.model.name == "gpt2":
        kind = "random-init" if c.model.gpt2.weights == "random" else "pretrained"
        shape += f", GPT-2 ({kind})"
    runs = [
        f"{len(values)} {name}"
        for name, values in (
            ("β", c.sweep.beta or c.sweep.beta_attn),
            ("seeds", c.sweep.seed),
            ("widths", c.sweep.dim),
            ("depths", c.sweep.num_layers),
        )
        if len(values) > 1
    ]
    depths = _values(c.sweep.num_layers) if c.sweep.num_layers else str(c.model.num_layers)
    count = len(expand_runs(c))
    return (
        f"`{experiment.name}`: {shape}, L={depths}; {count} runs"
        f"{' (' + ' × '.join(runs) + ')' if runs else ''}, {c.train.num_steps} steps, "
        f"{c.model.dtype}"
    )


def sizes_block(scale: str) -> str:
    """The sizes of every experiment of `scale`, one line each, for above the claims table."""
    lines = [f"Sizes at `--scale={scale}`:", ""]
    for experiment in experiment_list(scale):
        lines.append(f"- {experiment_sizes(experiment)}")
        if experiment.name == "sst2":
            substitute = experiment_sizes(_random_sst2(experiment))
            lines.append(f"- {substitute} (when the pretrained weights are not found)")
    return "\n".join(lines)


def _random_sst2(experiment: Experiment) -> Experiment:
    return dataclasses.replace(
        experiment,
        name="sst2_random",
        config="sst2.py:random_small",
        title="SST-2, random-init GPT-2 (not the pretrained model)",
    )


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


def _unfinished_reason(config, workdir: str) -> str | None:
    """None when `workdir` holds this config's run, finished and intact (`finished`), else why
    not; "" when it holds no run of it at all."""
    folder = wd.path(workdir)
    if not folder.exists() or read_saved_config(workdir) is None:
        return ""
    if config.task != "rank_collapse":
        return why_unfinished(config, workdir)
    problem = why_config_differs(config, folder)  # the task trains nothing: its CSV is its result
    if problem is None and not (folder / rank_collapse.CSV_FILE).exists():
        problem = f"no {rank_collapse.CSV_FILE}"
    return problem


def _run_one(experiment: Experiment, root: str, times: dict) -> Outcome:
    config = experiment.load()
    workdir = os.path.join(root, experiment.name)
    float64 = config.model.dtype == "float64" or config.probe.dtype == "float64"
    print(f"== {experiment.name}: {experiment.title} ({workdir})", flush=True)
    with jax.enable_x64(float64):
        problem = _unfinished_reason(config, workdir)
        if problem is None:
            tables = [] if config.task == "rank_collapse" else write_run_report(workdir)
            seconds = times.get(experiment.name, {}).get("seconds")
            print(f"   finished before: reused ({workdir})", flush=True)
            return Outcome(experiment, workdir, "reused", seconds, tables)
        status, reason = "ran", ""
        if problem:
            status, reason = "resumed", f"not reusable: {problem}"
            print(f"   {reason}: resuming from the last good checkpoint", flush=True)
        start = time.perf_counter()
        if config.task == "rank_collapse":
            experiments.run(config, workdir)
            tables = []
        else:
            train.run(config, workdir)
            tables = write_run_report(workdir)
            for text in tables:
                print(text, flush=True)
        return Outcome(experiment, workdir, status, time.perf_counter() - start, tables, reason)


def run_experiment(experiment: Experiment, root: str, times: dict) -> Outcome:
    """Runs, resumes or reuses `experiment`; an error that stops it (bad input, including data and
    weights: ValueError; divergence; a busy or unwritable workdir) becomes a "not run" outcome.
    Preempted is raised: the whole command stops, and a rerun resumes."""
    try:
        return _run_one(experiment, root, times)
    except (ValueError, TrainingDiverged, WorkdirBusy, WorkdirWriteError) as error:
        reason = str(error).splitlines()[0]
        print(f"   not run: {reason}", flush=True)
        workdir = os.path.join(root, experiment.name)
        missing = isinstance(error, WeightsNotFound)
        return Outcome(experiment, workdir, "not run", None, [], reason, missing)


def run_sst2(experiment: Experiment, root: str, times: dict) -> tuple[Outcome, str]:
    """The pretrained SST-2 run, or (weights not found) the random-init one; (outcome, label)."""
    outcome = run_experiment(experiment, root, times)
    if not outcome.missing_weights:
        return outcome, "pretrained GPT-2"
    print("   pretrained weights unavailable: running the random-init variant instead", flush=True)
    label = f"random-init GPT-2, not the pretrained model ({outcome.reason})"
    return run_experiment(_random_sst2(experiment), root, times), label


def claims_of(outcomes: dict[str, Outcome], sst2_label: str) -> list[claims.Claim]:
    """The claims table from the experiments' run directories."""

    def folder(name):
        outcome = outcomes.get(name)
        return outcome.workdir if outcome and outcome.status != "not run" else None

    checks = [
        (claims.linear_convergence, folder("theory")),
        (claims.rate_vs_conditioning, folder("conditioning")),
        (claims.residual_conditioning, folder("rank_collapse")),
        (claims.certificate, folder("theory_softplus")),
        (claims.multilayer, folder("depth")),
        (functools.partial(claims.multilayer, small_branches=True), folder("depth_branches")),
        (claims.jena_descent, folder("jena")),
        (functools.partial(claims.sst2_ordering, label=sst2_label), folder("sst2")),
    ]
    rows = []
    for check, workdir in checks:
        try:
            rows.append(check(workdir))
        except Exception as error:  # noqa: BLE001 - one unreadable file must not lose the report
            name = getattr(check, "func", check).__name__
            note = f"could not be evaluated: {type(error).__name__}: {error}"
            rows.append(claims.Claim(name, "-", "-", note=note.splitlines()[0]))
    return rows


def code_version() -> str:
    """The git commit of this checkout ('+ changes' when its tracked files differ), or
    'unknown' outside a git checkout."""
    repo = CONFIGS.parent
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
        f"- machine: {platform.platform()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}",
        f"- JAX devices: {len(devices)} × {devices[0].device_kind} ({devices[0].platform})",
        "- versions: " + ", ".join(versions),
    ]


def format_report(
    scale: str, outcomes: list[Outcome], table: list[claims.Claim], times: dict
) -> str:
    """REPORT.md: the claims table, then one section per experiment, then the machine."""
    lines = [
        "# resconv_jax: the paper's claims, checked",
        "",
        f"`python -m resconv_jax.reproduce --workdir=… --scale={scale}`, written "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}. Claims, measures and thresholds: "
        "docs/protocol.md (our protocol; the paper states none).",
        "",
        sizes_block(scale),
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
                  f"{o.experiment.config}`; {status}.", ""]  # fmt: skip
        if o.experiment.overrides:
            overrides = " ".join(
                shlex.quote(f"--config.{k}={v}") for k, v in o.experiment.overrides.items()
            )
            lines += [f"Overrides: `{overrides}`", ""]
        for text in o.tables:
            lines += ["```", text, "```", ""]
        folder = wd.path(o.workdir)
        if folder.exists():
            root = folder.parent
            for png in sorted(folder.glob("*.png")):
                lines += [f"![{o.experiment.name}: {png.stem}]({png.relative_to(root)})", ""]
    lines += ["## Machine", "", *machine(), ""]
    return "\n".join(lines)


README_START, README_END = "<!-- claims table: start -->", "<!-- claims table: end -->"


def splice_readme(readme: str, scale: str, table: list[claims.Claim] | None) -> None:
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


def reproduce(root: str, scale: str, readme: str | None = None) -> int:
    """Runs every experiment of `scale` in `root` and writes REPORT.md (and, given `readme`, its
    claims table into that file: `splice_readme`); the exit status. Holds `root`'s lock
    throughout: WorkdirBusy when another process holds it."""
    if readme:
        if scale == "tiny":
            raise ValueError("--readme: --scale=tiny numbers mean nothing; use small or paper")
        splice_readme(readme, scale, None)  # the markers are there: checked before any run
    wd.make_folder(root, f"--workdir={root}")
    lock = wd.WorkdirLock(root)
    lock.acquire()  # another reproduce on this folder: WorkdirBusy, naming it
    try:
        return _reproduce_locked(root, scale, readme)
    finally:
        lock.release()


def _reproduce_locked(root: str, scale: str, readme: str | None) -> int:
    times_path = wd.path(root) / TIMES_FILE
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    outcomes, sst2_label = {}, ""
    for experiment in experiment_list(scale):
        if experiment.name == "sst2":
            outcome, sst2_label = run_sst2(experiment, root, times)
            outcomes["sst2"] = outcome
        else:
            outcomes[experiment.name] = run_experiment(experiment, root, times)
        outcome = outcomes[experiment.name]
        if outcome.status in ("ran", "resumed"):
            times[outcome.experiment.name] = {
                "seconds": outcome.seconds,
                "scale": scale,
                "code": code_version(),
            }
            wd.write_json(times_path, times)
    table = claims_of(outcomes, sst2_label)
    report = format_report(scale, list(outcomes.values()), table, times)
    with wd.atomic_open(wd.path(root) / REPORT_FILE) as f:
        f.write(report)
    print(claims.format_claims_table(table), flush=True)
    print(f"wrote {wd.path(root) / REPORT_FILE}", flush=True)
    if readme:
        splice_readme(readme, scale, table)
        print(f"wrote the claims table into {readme}", flush=True)
    return 0 if all(o.status != "not run" for o in outcomes.values()) else 1


def _define_flags() -> None:
    """The command's flags, defined only when it runs (the module is also a library)."""
    flags.DEFINE_string("workdir", None, "Folder of the experiments and REPORT.md.")
    flags.DEFINE_enum("scale", "small", SCALES, "Sizes: tiny, small or paper.")
    flags.DEFINE_string(
        "readme", None, "Also write the claims table into this file's marked block (README.md)."
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
    workdir, scale, readme = flags.FLAGS.workdir, flags.FLAGS.scale, flags.FLAGS.readme
    try:
        check_workdir(workdir)
        status = reproduce(workdir, scale, readme)
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
