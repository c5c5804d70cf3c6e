"""The run directory: a lock held for the run's lifetime, atomic writes, and the saved config.

A workdir is a researcher's record of an experiment, so nothing in it is rewritten in place: every
file that is replaced (config.json, summary.json, CSVs, figures, a cut-back metrics.jsonl) is
written to a temporary file and renamed over the old one, and a failed write surfaces as one
`WorkdirWriteError` line instead of a traceback.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import json
import math
import os
import socket
import time

from resconv_jax.config_defaults import base_config
from resconv_jax.validation import ConfigError

CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirWriteError(RuntimeError):
    """A write into the workdir failed (disk full, vanished, read-only); one line, no traceback."""


def describe_os_error(error: OSError) -> str:
    """'No space left on device' (the strerror), or the error's text."""
    if error.errno is not None:
        return error.strerror or os.strerror(error.errno)
    return str(error) or type(error).__name__


@contextlib.contextmanager
def writing(what: str):
    """Turns an OSError raised while writing `what` into a one-line WorkdirWriteError."""
    try:
        yield
    except OSError as error:
        raise WorkdirWriteError(f"cannot write {what} ({describe_os_error(error)})") from None


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs):
    """A file object whose content replaces `path` only once the block ends without error.

    Writes `path.tmp-<pid>`, fsyncs it, renames it over `path` and fsyncs the folder; on an
    exception the temporary file is removed and `path` is untouched. OSError -> WorkdirWriteError.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    with writing(path):
        try:
            with open(tmp, mode, **kwargs) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        _fsync_directory(os.path.dirname(os.path.abspath(path)))


def json_safe(value):
    """`value` with every non-finite float replaced by None, so that it serializes as JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str, value) -> None:
    """`value` as indented, strictly valid JSON (non-finite floats -> null), atomically."""
    text = json.dumps(json_safe(value), indent=2, allow_nan=False) + "\n"
    with atomic_open(path) as f:
        f.write(text)


def write_csv(path: str, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys, the first's order) as a CSV with a header, atomically."""
    with atomic_open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_saved_config(workdir: str) -> dict | None:
    """The config a run in `workdir` started with (config.json), or None when there is none.

    Raises ConfigError (one line naming the file and what to do) when the file is unreadable.
    """
    path = os.path.join(workdir, CONFIG_FILE)
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = describe_os_error(error) if isinstance(error, OSError) else str(error)
        raise ConfigError(
            f"{path} is unreadable ({reason}); it records the run's config: restore it from a "
            "copy, or delete it (the resume is then checked against the latest checkpoint's "
            "copy of the config), or use a new --workdir"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} does not hold a config (a JSON object); use a new --workdir")
    return saved


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            fields = f.read().split()
    except OSError:
        fields = []
    if len(fields) >= 2:
        since = f" since {fields[2]}" if len(fields) > 2 else ""
        return f"PID {fields[0]} on host {fields[1]}{since}"
    return "another process"


class WorkdirLock:
    """An exclusive `flock` on `workdir/.lock`, held until `release` or the process's death.

    The kernel drops the lock when the process dies (SIGKILL included), so a lock is never stale;
    the file's content (PID, host, start time) only names the holder in the refusal.
    """

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._file = None

    def acquire(self) -> None:
        """Takes the lock or raises WorkdirBusy naming the holder. The workdir must exist."""
        with writing(self.path):
            f = open(self.path, "a+")  # noqa: SIM115 - held open while the lock is held
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            f.close()
            if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise WorkdirBusy(
                    f"--workdir={os.path.dirname(self.path)} is in use by {_holder(self.path)}; "
                    "wait for that run to end, or use another --workdir"
                ) from None
            raise WorkdirWriteError(
                f"cannot lock {self.path} ({describe_os_error(error)})"
            ) from None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        with writing(self.path):
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()} {socket.gethostname()} {stamp}\n")
            f.flush()
        self._file = f

    def release(self) -> None:
        """Drops the lock (the file stays: removing it would race with a waiting process)."""
        if self._file is not None:
            self._file.close()
            self._file = None


RESUMABLE_CHANGES = ("train.num_steps", "train.print_every")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_run(workdir: str, saved: dict, current: dict, where: str) -> None:
    """Raises ConfigError unless `current` may resume the run that `saved` (config JSON) started.

    Only RESUMABLE_CHANGES may differ. A field that `saved` lacks (added since the run started)
    took its `base_config()` default there, if `current` has it. `where` names the saved copy.
    """
    defaults = _flatten(json.loads(base_config().to_json_best_effort()))
    saved, current = _flatten(saved), _flatten(current)
    saved = {k: v for k, v in defaults.items() if k in current} | saved
    changed = [
        k
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k) and k not in RESUMABLE_CHANGES
    ]
    if changed:
        k = changed[0]
        raise ConfigError(
            f"--workdir={workdir} holds a run with another config ({k}: {saved.get(k)!r} -> "
            f"{current.get(k)!r}, per {where}); use a new --workdir"
        )
