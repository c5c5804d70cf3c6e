"""Run outputs: metrics.jsonl, TensorBoard events, progress lines; written by process 0 only.

metrics.jsonl holds one JSON object per run per log step, with the run's index and settings, and
only quantities that are a function of the computation (no timings), so a resumed run's file is
identical to an uninterrupted run's. Timings go to TensorBoard and the progress lines.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str) -> list[dict]:
    """All complete lines of `workdir/metrics.jsonl` (a torn last line is ignored)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def _json_value(value):
    if isinstance(value, int | np.integer):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsWriter:
    """Appends metrics lines and TensorBoard scalars; resuming at step s drops lines from s on."""

    def __init__(self, workdir: str, *, resume_step: int):
        self.enabled = jax.process_index() == 0
        self.history = [r for r in read_metrics(workdir) if r["step"] < resume_step]
        if not self.enabled:
            return
        path = os.path.join(workdir, METRICS_FILE)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.history)
        self._file = open(path, "a")  # noqa: SIM115 - held open for the run
        self._tensorboard = SummaryWriter(
            os.path.join(workdir, "tensorboard"), purge_step=resume_step or None
        )

    def write(self, step: int, records: list[dict]) -> None:
        """One metrics line per record (each a run's settings and values) at `step`."""
        lines = [{"step": step, **{k: _json_value(v) for k, v in r.items()}} for r in records]
        self.history.extend(lines)
        if not self.enabled:
            return
        self._file.writelines(json.dumps(line) + "\n" for line in lines)
        self._file.flush()
        self._add_scalars(
            step,
            {
                f"run{line['run']}/{key}": value
                for line in lines
                for key, value in line.items()
                if key not in ("step", "run") and isinstance(value, float)
            },
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Run-wide scalars (timings, FLOP/s) to TensorBoard only."""
        if self.enabled:
            self._add_scalars(step, values)

    def _add_scalars(self, step: int, values: dict[str, float]) -> None:
        # One event holding every scalar of the step: `add_scalar` writes one event per value,
        # which cost seconds per thousand log steps of a sweep (20k values: 3.6 s against 0.5 s).
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._tensorboard.file_writer.add_summary(summary, step)

    def close(self) -> None:
        """Flushes and closes the files."""
        if self.enabled:
            self._file.close()
            self._tensorboard.close()


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


def progress_line(step: int, total: int, losses, steps_per_sec: float) -> str:
    """'step 100/2000  loss 1.2e-01 3.4e-02 ...  850.0 steps/s  ETA 2s' (one loss per run)."""
    shown = " ".join(f"{float(v):.3e}" for v in losses[:8])
    more = f" (+{len(losses) - 8} runs)" if len(losses) > 8 else ""
    eta = format_duration((total - step) / steps_per_sec) if steps_per_sec > 0 else "?"
    return f"step {step}/{total}  loss {shown}{more}  {steps_per_sec:.1f} steps/s  ETA {eta}"
