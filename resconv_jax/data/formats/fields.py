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
