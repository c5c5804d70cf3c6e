"""Tables and claim rows computed from a run directory's files, kept beside them for as long as
those files and this package's code stay as they were.

FOLDER/results_cache.json holds the digest of every file under FOLDER (its checkpoint folders,
lock and this file aside: no report or claim reads them), of every source file of this package
and of the versions of NumPy, SciPy, matplotlib and JAX, with what was computed from them. A
call that finds the same digests returns what was stored instead of computing it again: a
finished run's rerun prints its tables without drawing its figures again, and a reused
experiment's claims come back without their statistics being recomputed. Any change to a file
under FOLDER (a metrics line, a figure deleted or edited), to the code or to those versions
computes afresh. The cache is only ever a copy: a folder where it cannot be written (read-only,
full) computes every time, with the same results.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path

from resconv_jax.runtime import workdir as wd

CACHE_FILE = "results_cache.json"
_SKIPPED = {CACHE_FILE, wd.LOCK_FILE, "checkpoints"}


# The packages whose versions can change a report's numbers or figures.
_DEPENDENCIES = ("numpy", "scipy", "matplotlib", "jax", "jaxlib")


@functools.cache
def code_digest() -> str:
    """SHA-256 over the path and content of every .py file of the resconv_jax package and the
    versions of the packages that compute the reports (`_DEPENDENCIES`)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    for name in _DEPENDENCIES:
        try:
            digest.update(f"{name}=={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name} absent".encode())
    return digest.hexdigest()


def skipped(name: str) -> bool:
    """Whether `files_digest` leaves out a file or folder of this name: checkpoint folders, the
    lock, the cache, and temporary names (".tmp-": atomic writes, check_workdir's probe)."""
    return name in _SKIPPED or ".tmp-" in name


def files_digest(folder) -> str:
    """SHA-256 over the relative path and content of every file under `folder`, in sorted
    order, skipping checkpoint folders, the lock, the cache and temporary files."""
    root = wd.path(folder)
    digest = hashlib.sha256()
    pending = [root]
    found = []
    while pending:
        for entry in pending.pop().iterdir():
            if skipped(entry.name):
                continue
            (pending if entry.is_dir() else found).append(entry)
    for entry in sorted(found, key=lambda e: str(e.relative_to(root))):
        digest.update(str(entry.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(entry.read_bytes()).digest())
    return digest.hexdigest()


def _read(folder) -> dict:
    try:
        stored = json.loads((wd.path(folder) / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _kept_for(stored: dict, files: str) -> bool:
    """Whether `stored` was kept for these files (`files_digest`) and the code as it is."""
    return stored.get("code") == code_digest() and stored.get("files") == files


def lookup(folder, name: str):
    """What `store` kept under `name` for the files `folder` holds now and the code as it is,
    else None."""
    stored = _read(folder)
    return stored.get("entries", {}).get(name) if _kept_for(stored, files_digest(folder)) else None


def store(folder, name: str, value) -> None:
    """Keeps `value` (JSON) under `name` for the files `folder` holds now; entries kept for
    other files are dropped. A folder that cannot be written keeps nothing."""
    files = files_digest(folder)
    stored = _read(folder)
    if not _kept_for(stored, files):
        stored = {"code": code_digest(), "files": files, "entries": {}}
    stored["entries"][name] = value
    try:
        wd.write_json(wd.path(folder) / CACHE_FILE, stored)
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only not kept
        pass


def cached(folder, name: str, compute, *, encode=lambda v: v, decode=lambda v: v):
    """decode(the value kept under `name`) when `lookup` finds one, else compute(), kept by
    `store` as encode(value) for the files `folder` holds once it has run."""
    kept = lookup(folder, name)
    if kept is not None:
        return decode(kept)
    value = compute()
    store(folder, name, encode(value))
    return value
