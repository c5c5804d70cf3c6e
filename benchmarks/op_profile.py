"""Where one training step's time goes: the compiled step's ops, ranked by time per step.

    python -m benchmarks.op_profile                      # the Jena-like size, one run
    python -m benchmarks.op_profile --size jena --P 2041 --top 20
    python -m benchmarks.op_profile --scaling gpt2 --P 256    # a benchmarks/scaling.py case

Runs the library's step (`common.build_runs`, the fast_backward model, one run, K steps per call
as resconv_jax.train runs them) under `jax.profiler.trace`, reads the Perfetto trace it writes and
prints, per XLA op (a fusion, a dot, a copy; not the loops, whose events span the ops they run):
microseconds per step, its share of the step, its output shape and what it computes (a fusion's
opcodes and operand shapes, and the HLO's op_name where XLA kept it). The untraced step time, taken
first in the same process, is the baseline; the profiler adds a few microseconds per op, so the
shares, not the absolute times, are what to read. Shapes and names come from the compiled HLO.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks import common  # noqa: E402

# name = type opcode(...); a tuple type "(f32[2], f32[3])" (multi-output fusions) included
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) \((.*)\) -> \S+ \{")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PLUMBING = {"parameter", "bitcast", "constant", "broadcast", "tuple", "get-tuple-element"}
_CONTROL_FLOW = {"while", "conditional", "call"}  # their trace events span the ops they run


def _fused_summaries(hlo_text: str) -> dict[str, str]:
    """{computation name: 'its opcodes (but plumbing, unless that is all) of (its parameter
    shapes)'}."""
    summaries, name, params, opcodes = {}, None, "", []
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            name, opcodes = header.group(1), []
            params = re.sub(r"[\w.]+: ", "", header.group(2))
        elif name and line.startswith("}"):
            work = [op for op in opcodes if op not in _PLUMBING] or opcodes  # a fill: broadcast
            summaries[name] = f"{'+'.join(dict.fromkeys(work))} of ({params})"
            name = None
        elif name:
            match = _INSTRUCTION.match(line)
            if match and match.group(3) != "parameter":
                opcodes.append(match.group(3))
    return summaries


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (output type, what it computes)} of a compiled HLO module, control flow
    left out: a fusion's opcodes and operand shapes, else its opcode, with the JAX op_name's last
    part when known."""
    fused = _fused_summaries(hlo_text)
    ops = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(3) not in _CONTROL_FLOW:
            calls, op_name = _CALLS.search(line), _OP_NAME.search(line)
            what = fused.get(calls.group(1), match.group(3)) if calls else match.group(3)
            if op_name:
                what += f" [{op_name.group(1).rpartition('/')[2]}]"
            ops[match.group(1)] = (match.group(2), what)
    return ops


def op_times(trace_dir: str, names: set[str]) -> collections.Counter:
    """Total microseconds of each op in `names` over the Perfetto trace under `trace_dir`."""
    (path,) = Path(trace_dir).rglob("*.trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in names:
            totals[event["name"]] += event.get("dur", 0)
    return totals


def ranked_ops(call, hlo_text: str, steps_per_call: int, calls: int, top: int) -> str:
    """The untraced step time of `call` (one compiled call of `steps_per_call` steps, warmed up)
    and the table of the `top` slowest ops of its compiled HLO `hlo_text`, per step."""
    untraced = [common.timed(call) / steps_per_call for _ in range(calls)]
    ops = hlo_ops(hlo_text)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        totals = op_times(trace_dir, set(ops))
    steps = calls * steps_per_call
    traced = sum(totals.values()) / steps
    rows = []
    for name, micros in totals.most_common(top):
        shape, what = ops[name]
        share = f"{100 * micros / steps / traced:.1f}%"
        rows.append([name, f"{micros / steps:.1f}", share, shape.partition("{")[0], what])
    lines = [
        f"untraced step {common.fmt_time(min(untraced))} (fastest of {calls} calls of "
        f"{steps_per_call} step{'s' if steps_per_call > 1 else ''}); traced ops "
        f"{common.fmt_time(traced * 1e-6)} per step over {len(totals)} ops",
        "",
        common.table(["op", "us/step", "share", "output", "computes"], rows),
    ]
    return "\n".join(lines)


def profile(size: common.Size, steps_per_call: int, calls: int, top: int) -> str:
    """The ranked ops of one run's step at `size`, `steps_per_call` steps per call."""
    runs = common.build_runs(size, (1.0,), steps_per_call)
    case = common.Case(runs.fns.run_steps, [runs], steps_per_call)
    for _ in range(2):
        jax.block_until_ready(case())
    table = ranked_ops(case, case.compiled.as_text(), steps_per_call, calls, top)
    return f"{size.name} size, {size.describe()}, 1 run: {table}"


def profile_scaling_case(
    model: str, num_samples: int, microbatch: int, steps_per_call: int, calls: int, top: int
):
    """The ranked ops of one of benchmarks/scaling.py's cases, `steps_per_call` steps per call
    (`scaling.case_config`: the program `train.build_program` makes, without the probe)."""

    from benchmarks import scaling
    from resconv_jax import train

    config = scaling.case_config(model, num_samples, microbatch, steps_per_call)
    program = train.build_program(config)
    state = program.state

    def call():
        nonlocal state
        args = (program.hp, program.x, program.y, steps_per_call)
        state, buffers = program.runners.run(0, state, *args)
        return buffers

    for _ in range(2):
        jax.block_until_ready(call())
    table = ranked_ops(call, program.runners.compiled.as_text(), steps_per_call, calls, top)
    return f"scaling case {model}, P={num_samples}, microbatches of {microbatch}: {table}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="jena", choices=sorted(common.SIZES))
    parser.add_argument("--P", type=int, default=0, help="samples (0: the size's own)")
    parser.add_argument(
        "--steps", type=int, help="steps per call (default 50; with --scaling, scaling's 10)"
    )
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--scaling",
        choices=("gpt2", "transformer"),
        help="profile benchmarks/scaling.py's case of this model at --P (default 256) instead",
    )
    parser.add_argument("--microbatch", type=int, default=64, help="with --scaling")
    args = parser.parse_args(argv)
    print(common.machine())
    if args.scaling:
        samples = args.P or 256
        from benchmarks import scaling

        steps = args.steps or scaling.STEPS_PER_CALL
        print(
            profile_scaling_case(
                args.scaling, samples, args.microbatch, steps, args.calls, args.top
            )
        )
        return
    size = common.SIZES[args.size]()
    if args.P:
        size = dataclasses.replace(size, P=args.P)
    print(profile(size, args.steps or 50, args.calls, args.top))


if __name__ == "__main__":
    main()
