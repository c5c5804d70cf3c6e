"""Run outputs: metrics.jsonl, TensorBoard events, progress lines; written by process 0 only.

metrics.jsonl holds one JSON object per run per log step, with the run's index and settings, and
only quantities that are a function of the computation (no timings), so a resumed run's file is
identical to an uninterrupted run's. Timings go to TensorBoard and the progress lines. In a local
workdir the file is only ever appended to, or replaced whole by a rename (`MetricsWriter`), never
rewritten in place; on object storage, which cannot append, it is replaced whole (see there).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary

from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import atomic_open, writing

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics_lines(workdir) -> list[tuple[str, dict]]:
    """(text, record) of every complete line of `workdir/metrics.jsonl`, up to the first bad one.

    A torn or unparsable line ends the list: what follows it cannot be trusted to be in order."""
    try:
        data = (wd.path(workdir) / METRICS_FILE).read_bytes()
    except FileNotFoundError:
        return []
    lines = []
    for raw in io.BytesIO(data):
        if not raw.endswith(b"\n"):
            break
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            break
        lines.append((raw.decode(), record))
    return lines


def lines_digest(texts) -> str:
    """SHA-256 (hex) of metrics lines' text, in order: what a checkpoint records of the lines
    before its step, so that a resume can tell whether they were changed since."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()


def read_metrics(workdir) -> list[dict]:
    """The records of `read_metrics_lines`."""
    return [record for _, record in read_metrics_lines(workdir)]


def valid_prefix(
    lines: list[tuple[str, dict]], settings: list[dict], log_every: int
) -> tuple[list[tuple[str, dict]], int]:
    """The longest prefix of `lines` that a run of `settings` can have written, and its reach.

    A valid file starts at step 0, holds one line per run at every logged step (runs in order,
    each with all of its `settings`: index, seed, lr, β, depth), and its steps rise by at most
    `log_every`. Returns (prefix,
    reach): a resume from any step <= reach finds every line it needs before that step; a
    file with no valid line has reach 0.
    """
    num_runs = len(settings)
    prefix, last_step = [], None
    for start in range(0, len(lines) - num_runs + 1, num_runs):
        block = lines[start : start + num_runs]
        step = block[0][1]["step"]
        gap_ok = step == 0 if last_step is None else 0 < step - last_step <= log_every
        same_step = all(record["step"] == step for _, record in block)
        labelled = all(
            {k: record.get(k) for k in want} == want
            for (_, record), want in zip(block, settings, strict=True)
        )
        if not (gap_ok and same_step and labelled):
            break
        prefix.extend(block)
        last_step = step
    return prefix, 0 if last_step is None else last_step + log_every


def _json_value(value):
    if isinstance(value, list | tuple) or np.ndim(value) > 0:
        return [_json_value(v) for v in value]
    if isinstance(value, int | np.integer):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _scalars_of(lines: list[dict]) -> dict[str, float]:
    return {
        f"run{line['run']}/{key}": value
        for line in lines
        for key, value in line.items()
        if key not in ("step", "run") and isinstance(value, float)
    }


class MetricsWriter:
    """Appends metrics lines and TensorBoard scalars after the lines a resume keeps.

    `kept` are the (text, record) lines of the file before the resume step (`valid_prefix`, cut
    at that step). The file is replaced atomically by exactly those lines, and the TensorBoard
    events are rebuilt from them, so neither holds a line twice or a line from after the resume
    step; then both are appended to. Timing scalars of earlier segments are not in metrics.jsonl
    and are not rebuilt. OSError -> WorkdirWriteError.

    Local workdir: each line is appended (and flushed) as it comes, the events written to
    WORKDIR/tensorboard as they come; `sync` has nothing to do.

    Object storage cannot append, so the lines are kept in memory and `sync` writes the whole
    metrics.jsonl, one atomic object write, and copies the TensorBoard events, which are written
    to a local temporary folder, to WORKDIR/tensorboard. `sync` runs at every checkpoint save,
    before the save starts (`Checkpointer.on_save`), and at the end of the run (`close`).
    Nothing is lost by not writing in between: a resume always goes back to a checkpoint and
    recomputes the lines after it, so it needs only the lines before the checkpoint, which the
    sync at that checkpoint wrote first (`train._restore` cuts the file back to them, as it
    does a local file). Between syncs the remote files lag behind the run.
    """

    def __init__(self, workdir, kept: list[tuple[str, dict]]):
        self.enabled = jax.process_index() == 0
        self.history = [record for _, record in kept]
        self._digest = hashlib.sha256()
        for text, _ in kept:
            self._digest.update(text.encode())
        if not self.enabled:
            return
        self._workdir = wd.path(workdir)
        self._path = self._workdir / METRICS_FILE
        self._local = wd.is_local(self._path)
        self._file = None
        if self._local:
            with atomic_open(self._path) as f:
                f.writelines(text for text, _ in kept)
            with writing(self._path):
                self._file = open(self._path, "a")  # noqa: SIM115 - held open for the run
        else:
            self._lines = [text for text, _ in kept]  # written by the sync at the end of __init__
        tensorboard = self._workdir / TENSORBOARD_DIR
        with writing(tensorboard, remote=not self._local):
            if self._local:
                with contextlib.suppress(OSError):  # what is left, mkdir refuses
                    tensorboard.rmtree()
                tensorboard.mkdir(parents=True)
                self._events_dir = os.fspath(tensorboard)
            else:
                tensorboard.rmtree(missing_ok=True)
                self._events_dir = tempfile.mkdtemp(prefix="resconv_tensorboard_")
            self._events = EventsWriter(os.path.join(self._events_dir, "events"))
        self._dirty = True
        by_step: dict[int, list[dict]] = {}
        for record in self.history:
            by_step.setdefault(record["step"], []).append(record)
        for step, lines in by_step.items():
            self._add_scalars(step, _scalars_of(lines), flush=False)
        with writing(f"TensorBoard events in {self._workdir}"):
            self._events.flush()
        if not self._local:
            self.sync()

    def write(self, step: int, records: list[dict]) -> None:
        """One metrics line per record (each a run's settings and values) at `step`."""
        lines = [{"step": step, **{k: _json_value(v) for k, v in r.items()}} for r in records]
        self.history.extend(lines)
        texts = [json.dumps(line) + "\n" for line in lines]
        for text in texts:
            self._digest.update(text.encode())
        if not self.enabled:
            return
        if self._local:
            with writing(self._path):
                self._file.writelines(texts)
                self._file.flush()
        else:
            self._lines.extend(texts)
        self._add_scalars(step, _scalars_of(lines))
        self._dirty = True

    def checkpoint_meta(self, meta: dict, step: int) -> dict:
        """`meta` for the checkpoint of `step`: with the step and the `lines_digest` of every
        line written so far (those of the steps before it)."""
        return meta | {"step": step, "metrics_sha256": self._digest.hexdigest()}

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Run-wide scalars (timings, FLOP/s) to TensorBoard only."""
        if self.enabled:
            self._add_scalars(step, values)
            self._dirty = True

    def sync(self, step: int | None = None) -> None:
        """Object storage: writes metrics.jsonl whole and copies the TensorBoard events (the
        `Checkpointer.on_save` hook; `step` unused). Local: nothing to do. -> WorkdirWriteError.
        """
        if not self.enabled or self._local or not self._dirty:
            return
        with atomic_open(self._path) as f:
            f.writelines(self._lines)
        tensorboard = self._workdir / TENSORBOARD_DIR
        for name in sorted(os.listdir(self._events_dir)):
            with open(os.path.join(self._events_dir, name), "rb") as f:
                wd.write_object(tensorboard / name, f.read())
        self._dirty = False

    def _add_scalars(self, step: int, values: dict[str, float], flush: bool = True) -> None:
        # One event holding every scalar of the step: one event per value cost seconds per
        # thousand log steps of a sweep (20k values: 3.6 s against 0.5 s). Written synchronously
        # (tensorboardX's SummaryWriter writes from a thread, where a full disk is a traceback).
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        with writing(f"TensorBoard events in {self._workdir}"):
            self._events.write_event(Event(wall_time=time.time(), step=step, summary=summary))
            if flush:
                self._events.flush()

    def close(self) -> None:
        """Flushes and closes the files. Object storage: a last `sync`, best effort (the run's
        normal end calls `sync` itself first, so that a failure there is reported)."""
        if not self.enabled:
            return
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        with contextlib.suppress(OSError):
            self._events.close()
        if not self._local:
            with contextlib.suppress(Exception):
                self.sync()
            shutil.rmtree(self._events_dir, ignore_errors=True)


def step_flops(step_fn, *args) -> float:
    """FLOPs of one call of `step_fn(*args)`, from XLA's cost analysis (0 if unavailable)."""
    analysis = jax.jit(step_fn).lower(*args).cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def format_duration(seconds: float) -> str:
    """'1h02m', '3m05s' or '12s'."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _run_labels(settings: list[dict]) -> list[str]:
    """'r3 β=0.5 seed 1': each run's index and the settings that differ between the runs."""
    varies = {
        k
        for k in ("num_layers", "beta_attn", "beta_ffn", "seed", "lr")
        if len({s.get(k) for s in settings}) > 1
    }
    labels = []
    for s in settings:
        parts = [f"r{s['run']}"]
        if "num_layers" in varies:
            parts.append(f"L={s['num_layers']}")
        if varies & {"beta_attn", "beta_ffn"}:
            if all(t["beta_attn"] == t["beta_ffn"] for t in settings):
                parts.append(f"β={s['beta_attn']:g}")
            else:
                parts.append(f"β_a={s['beta_attn']:g} β_f={s['beta_ffn']:g}")
        if "seed" in varies:
            parts.append(f"seed {s['seed']}")
        if "lr" in varies:
            parts.append(f"lr={s['lr']:.3g}")
        labels.append(" ".join(parts))
    return labels


def progress_line(
    step: int,
    total: int,
    loss_step: int,
    losses,
    steps_per_sec: float,
    settings: list[dict] | None = None,
) -> str:
    """One progress line: `step` of `total` reached, the runs' training losses at `loss_step`.

    `losses`: (R,), one per run, in the order of `settings` (the runs' settings dicts; without
    them runs are named by position). Up to 4 runs each loss is shown with its run's label (its
    index and the settings that differ between the runs); more, the min, median and max over
    the runs, with the runs of the min and max:

      step 500/2000  loss@499: r0 β=0 5.781e-04, r1 β=0.5 1.465e-06  219.5 steps/s  ETA 7s
      step 200/2000  loss@199: min 4.261e+02 (r4 β=1 seed 0), median 4.725e+02, max 5.342e+02
      (r5 β=0 seed 1) over 15 runs  81.2 steps/s  ETA 22s
    """
    losses = np.asarray(losses, float).reshape(-1)
    settings = settings or [{"run": r} for r in range(losses.size)]
    labels = _run_labels(settings) if len(settings) > 1 else [f"r{settings[0]['run']}"]
    if losses.size <= 4:
        shown = ", ".join(f"{label} {v:.3e}" for label, v in zip(labels, losses, strict=True))
    else:
        finite = np.isfinite(losses)
        if finite.any():
            low = int(np.flatnonzero(finite)[np.argmin(losses[finite])])
            high = int(np.flatnonzero(finite)[np.argmax(losses[finite])])
            shown = (
                f"min {losses[low]:.3e} ({labels[low]}), median {np.median(losses[finite]):.3e}, "
                f"max {losses[high]:.3e} ({labels[high]}) over {losses.size} runs"
            )
        else:
            shown = f"no finite loss over {losses.size} runs"
        if not finite.all():
            shown += f" ({int((~finite).sum())} non-finite)"
    eta = format_duration((total - step) / steps_per_sec) if steps_per_sec > 0 else "?"
    return f"step {step}/{total}  loss@{loss_step}: {shown}  {steps_per_sec:.1f} steps/s  ETA {eta}"
