"""Test helper: the largest array a compiled program's collectives move, read from its HLO text
(the probe and the step must never all-gather Z)."""

from __future__ import annotations

import re

_COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "collective-permute",
    "all-to-all",
    "reduce-scatter",
    "collective-broadcast",
    "ragged-all-to-all",
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")


def _max_elements(text: str) -> int:
    sizes = [1]
    for dims in _SHAPE.findall(text):
        n = 1
        for size in filter(None, dims.split(",")):
            n *= int(size)
        sizes.append(n)
    return max(sizes)


def _split_type(rest: str) -> tuple[str, str]:
    """'(f32[2], f32[3]) op(...)' or 'f32[2]{0} op(...)' -> (type, 'op(...)')."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


def largest_collective_elements(hlo_text: str) -> int:
    """Largest element count among the results and operands of collectives in HLO text (0: none).

    Use on ``jitted.lower(...).compile().as_text()`` to check that a step moves no large array.
    Compiled HLO names operands without their shapes, so operand shapes are looked up by name.
    """
    sizes: dict[str, int] = {}
    collectives: list[tuple[str, str]] = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.groups()
        result_type, call = _split_type(rest)
        sizes[name] = _max_elements(result_type)
        op = call.partition("(")[0]
        if op.removesuffix("-start").removesuffix("-done") in _COLLECTIVES:
            collectives.append((name, call.partition("(")[2].partition(")")[0]))
    largest = 0
    for name, operands in collectives:
        operand_sizes = [sizes.get(o, 0) for o in re.findall(r"%([^\s,)]+)", operands)]
        largest = max(largest, sizes[name], _max_elements(operands), *operand_sizes)
    return largest


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")


def collectives_in_loops(hlo_text: str, trip_count: int) -> list[str]:
    """The collectives run in the body of a while loop of static `trip_count` iterations (XLA's
    `known_trip_count`), as "body: instruction" strings; [] when there are none."""
    bodies, found, current = set(), [], None
    for line in hlo_text.splitlines():
        if " while(" in line and f'"known_trip_count":{{"n":"{trip_count}"}}' in line:
            bodies.add(re.search(r"body=%?([^\s,]+)", line).group(1))
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
        elif (m := _INSTRUCTION.match(line)) and current in bodies:
            op = _split_type(m.group(2))[1].partition("(")[0]
            if op.removesuffix("-start").removesuffix("-done") in _COLLECTIVES:
                found.append(f"{current}: {m.group(1)}")
    return found
