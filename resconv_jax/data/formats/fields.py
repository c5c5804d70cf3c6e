"""Checks shared by the data loaders' own config sections (Jena, SST-2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def int_field(cfg: Any, name: str, default: int, minimum: int, *, error: type, label: str) -> int:
    """`cfg.name` (or `default` when absent) as an int >= `minimum`, else `error` in one line
    ("<label> config: <name> must be an integer >= <minimum>, got <value>")."""
    value = getattr(cfg, name, default)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise error(f"{label} config: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def made_folder(folder: str | Path, *, error: type, label: str, field: str) -> Path:
    """`folder`, created if missing; `error` in one line when it cannot be
    ("<label> config: <field>=<folder> cannot be created (<reason>)")."""
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise error(f"{label} config: {field}={folder} cannot be created ({reason})") from None
    return path


def check_read_by_source(c: dict[str, Any], readers: dict[str, tuple[str, ...]], *, error, label):
    """`error` in one line when a field of `c` is set that `c["source"]` does not read (a path
    given with source='bundled' trained on the packaged data, the path never opened).
    readers: {field: the sources that read it}."""
    for field, sources in readers.items():
        if c[field] and c["source"] not in sources:
            readers_text = " or ".join(repr(s) for s in sources)
            raise error(
                f"{label} config: {field} is read by source={readers_text} only; "
                f"source={c['source']!r} would not read {str(c[field])!r} (choose the source "
                f"that reads it, or leave {field} empty)"
            )
