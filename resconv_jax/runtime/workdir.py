"""The run directory: a lock held for the run's lifetime, atomic writes, and the saved config.

A workdir is a researcher's record of an experiment, so nothing in it is rewritten in place: every
file that is replaced (config.json, summary.json, CSVs, figures, a cut-back metrics.jsonl) is
written whole or not at all, and a failed write surfaces as one `WorkdirWriteError` line instead
of a traceback.

A workdir is a local folder or an object-storage URL (`gs://bucket/run`, `s3://...`): every
read and write of one goes through `etils.epath` (`path`), and the two kinds differ only where
their guarantees do (`is_local`):

- local: a replaced file is written to `FILE.tmp-<pid>`, fsynced and renamed over FILE (the
  folder fsynced too); metrics.jsonl is appended line by line; the lock is an `flock`.
- object storage has no rename, no append and no flock, but an object write is atomic (it is
  visible whole once the upload completes, or not at all). So `atomic_open` buffers in memory and
  writes the object once when the block ends; `metrics.MetricsWriter` rewrites metrics.jsonl
  whole (see there); the lock is an object (`WorkdirLock`). A `gs://` workdir needs gcsfs
  (`pip install 'etils[epath-gcs]'`: epath reaches GCS through fsspec). Training needs a local
  or `gs://` workdir (Orbax writes checkpoints to nothing else); the rank-collapse task, which
  writes no checkpoint, also takes `s3://` (with s3fs).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import json
import math
import os
import re
import socket
import sys
import time

from etils import epath

from resconv_jax.errors import ConfigError, WorkdirBusy, WorkdirWriteError

CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"
# What `reproduce` writes at the top of its folder: its report and its experiments' times.
REPORT_FILE, TIMES_FILE = "REPORT.md", "reproduce.json"
REPRODUCE_FILES = (REPORT_FILE, TIMES_FILE)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def path(workdir: str | os.PathLike) -> epath.Path:
    """`workdir` (or a file in it) as an `epath.Path`: a local path, `gs://...`, `s3://...`."""
    return epath.Path(workdir)


def is_reproduce_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is one that `reproduce` wrote (its REPORT.md or recorded times)."""
    return any((path(folder) / name).exists() for name in REPRODUCE_FILES)


def is_local(target: str | os.PathLike) -> bool:
    """Whether `target` is on a local (POSIX) file system, i.e. not an object-storage URL."""
    return not _URL.match(os.fspath(target))


def describe_os_error(error: BaseException) -> str:
    """'No space left on device' (the strerror), or the first line of the error's text."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.strerror or os.strerror(error.errno)
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


@contextlib.contextmanager
def writing(what: str, *, remote: bool = False):
    """Turns an OSError raised while writing `what` into a one-line WorkdirWriteError; with
    `remote`, any Exception (object-storage clients raise their own HTTP and auth errors)."""
    try:
        yield
    except Exception as error:
        if not (remote or isinstance(error, OSError)):
            raise
        raise WorkdirWriteError(f"cannot write {what} ({describe_os_error(error)})") from None


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_object(target: epath.Path, data: bytes) -> None:
    """`data` as the whole content of the object `target` (object storage: one atomic write)."""
    with writing(target, remote=True), target.open("wb") as f:
        f.write(data)


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike, mode: str = "w", **kwargs):
    """A file object whose content replaces `target` only once the block ends without error.

    Local: writes `target.tmp-<pid>`, fsyncs it, renames it over `target` and fsyncs the
    folder; on an exception the temporary file is removed and `target` is untouched. Object
    storage: a memory buffer (text modes take `newline`), written as the object at the end, in
    one write. OSError (remote: any failure to write) -> WorkdirWriteError.
    """
    if not is_local(target):
        binary = "b" in mode
        buffer = io.BytesIO() if binary else io.StringIO(newline=kwargs.get("newline"))
        yield buffer
        data = buffer.getvalue()
        write_object(path(target), data if binary else data.encode("utf-8"))
        return
    target = os.fspath(target)
    tmp = f"{target}.tmp-{os.getpid()}"
    with writing(target):
        try:
            with open(tmp, mode, **kwargs) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        _fsync_directory(os.path.dirname(os.path.abspath(target)))


def make_folder(folder: str | os.PathLike, what: str | None = None) -> None:
    """Creates `folder` and its parents if missing (object storage: nothing to create, a
    folder is a name prefix). A failure -> WorkdirWriteError naming `what` (else the folder)."""
    folder = path(folder)
    with writing(what or folder, remote=not is_local(folder)):
        folder.mkdir(parents=True, exist_ok=True)


def write_png(figure, target: str | os.PathLike, dpi: int) -> None:
    """A matplotlib figure rendered to PNG in memory, then written with `atomic_open`."""
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=dpi)
    with atomic_open(target, "wb") as f:
        f.write(png.getvalue())


def json_safe(value):
    """`value` with every non-finite float replaced by None, so that it serializes as JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(target: str | os.PathLike, value) -> None:
    """`value` as indented, strictly valid JSON (non-finite floats -> null), atomically."""
    text = json.dumps(json_safe(value), indent=2, allow_nan=False) + "\n"
    with atomic_open(target) as f:
        f.write(text)


def write_csv(target: str | os.PathLike, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys, the first's order) as a CSV with a header, atomically."""
    with atomic_open(target, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_saved_config(workdir: str | os.PathLike) -> dict | None:
    """The config a run in `workdir` started with (config.json), or None when there is none.

    Raises ConfigError (one line naming the file and what to do) when the file is unreadable.
    """
    config_path = path(workdir) / CONFIG_FILE
    try:
        saved = json.loads(config_path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = describe_os_error(error) if isinstance(error, OSError) else str(error)
        raise ConfigError(
            f"{config_path} is unreadable ({reason}); it records the run's config: restore it "
            "from a copy, or delete it (the resume is then checked against the latest "
            "checkpoint's copy of the config), or use a new --workdir"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{config_path} does not hold a config (a JSON object); use a new --workdir"
        )
    return saved


def _holder_fields(lock_path: epath.Path) -> list[str] | None:
    """The lock's words (PID, host, start time), [] if unreadable, None if there is none."""
    try:
        return lock_path.read_text().split()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return []


def _holder(fields: list[str] | None) -> str:
    if fields and len(fields) >= 2:
        since = f" since {fields[2]}" if len(fields) > 2 else ""
        return f"PID {fields[0]} on host {fields[1]}{since}"
    return "another process"


def _gone(fields: list[str] | None) -> bool:
    """Whether the lock's holder is provably no longer running: a process of this host that
    has ended (or this very PID, from a process before this one: this process holds no lock
    on that workdir)."""
    if not fields or len(fields) < 2 or fields[1] != socket.gethostname():
        return False
    try:
        pid = int(fields[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


_HELD: set[str] = set()  # the remote locks this process holds


class WorkdirLock:
    """The workdir's lock, `workdir/.lock`, held until `release` (or the process's death).

    Local: an exclusive `flock`, which the kernel drops when the process dies (SIGKILL
    included), so a lock is never stale; the file's content (PID, host, start time) only names
    the holder in the refusal.

    Object storage has no flock: the lock is the object `.lock` itself, holding the same
    words, written by `acquire` when it is absent and deleted by `release`. A start that finds
    it refuses (WorkdirBusy, exit status 3), naming the holder, unless the holder was a process
    of this host that has ended: then it says so in one line and takes the lock over. What this
    does not guarantee: the check and the write are two requests, so two starts within the same
    moment can both pass; and a run killed without `release` (SIGKILL, a lost VM) leaves the
    object behind, which a start on another host cannot tell from a live run: the refusal says
    to delete it once that run is known to be gone.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.path = path(workdir) / LOCK_FILE
        self._workdir = os.fspath(workdir)
        self._file = None
        self._owned = False

    def acquire(self) -> None:
        """Takes the lock or raises WorkdirBusy naming the holder. The workdir must exist."""
        if is_local(self.path):
            self._acquire_flock()
        else:
            self._acquire_object()

    def _acquire_flock(self) -> None:
        lock_path = os.fspath(self.path)
        with writing(lock_path):
            f = open(lock_path, "a+")  # noqa: SIM115 - held open while the lock is held
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            f.close()
            if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise WorkdirBusy(
                    f"--workdir={os.path.dirname(lock_path)} is in use by "
                    f"{_holder(_holder_fields(self.path))}; wait for that run to end, or use "
                    "another --workdir"
                ) from None
            raise WorkdirWriteError(
                f"cannot lock {lock_path} ({describe_os_error(error)})"
            ) from None
        with writing(lock_path):
            f.seek(0)
            f.truncate()
            f.write(_stamp())
            f.flush()
        self._file = f

    def refuse_if_held(self) -> None:
        """WorkdirBusy, naming the holder, if another process holds the lock now; takes nothing.
        Local: the flock taken and dropped at once. Object storage: the lock object only read
        (a reader without write access to the bucket may still reuse a finished run)."""
        if is_local(self.path):
            self._acquire_flock()
            self.release()
        else:
            self._object_holder()

    def _object_holder(self) -> dict | None:
        """The lock object's holder fields when it names a process that has ended (for
        `_acquire_object` to take over), None when there is none; WorkdirBusy when it names one
        that may still run."""
        key = os.fspath(self.path)
        try:
            fields = _holder_fields(self.path)
        except Exception as error:  # noqa: BLE001 - the store's own errors, in one line
            raise WorkdirWriteError(f"cannot read {key} ({describe_os_error(error)})") from None
        if fields is not None and (key in _HELD or not _gone(fields)):
            how = f" (gcloud storage rm {key})" if key.startswith("gs://") else ""
            raise WorkdirBusy(
                f"--workdir={self._workdir} is in use by {_holder(fields)} (per the lock "
                f"object {key}); wait for that run to end, or, if it is no longer running, "
                f"delete that object{how} and rerun; or use another --workdir"
            )
        return fields

    def _acquire_object(self) -> None:
        key = os.fspath(self.path)
        if (fields := self._object_holder()) is not None:
            print(
                f"{key}: taking over the lock of {_holder(fields)}, which is no longer running",
                flush=True,
            )
        write_object(self.path, _stamp().encode())
        self._owned = True
        _HELD.add(key)

    def release(self) -> None:
        """Drops the lock. Local: the file stays (removing it would race with a waiting
        process). Object storage: the lock object is deleted (a failure to: one line)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._owned:
            self._owned = False
            _HELD.discard(os.fspath(self.path))
            try:
                self.path.unlink(missing_ok=True)
            except Exception as error:  # noqa: BLE001 - reported, the run's outcome stands
                print(
                    f"warning: could not delete the lock object {self.path} "
                    f"({describe_os_error(error)}); delete it before the next run",
                    file=sys.stderr,
                    flush=True,
                )


def _stamp() -> str:
    return f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"


# train.microbatch_size: the same GD step in other microbatches (float rounding aside), e.g. on a
# device with less memory.
RESUMABLE_CHANGES = ("train.num_steps", "train.print_every", "train.microbatch_size")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_changes(saved: dict, current: dict, defaults: dict) -> list[tuple[str, object, object]]:
    """(field, saved value, current value) for each dotted field in which the config JSON
    `current` makes another run than `saved`: every difference but RESUMABLE_CHANGES. A field
    that `saved` lacks (added since the run started) took its `defaults` value (the base
    config's JSON) there, if `current` has it."""
    defaults = _flatten(defaults)
    saved, current = _flatten(saved), _flatten(current)
    saved = {k: v for k, v in defaults.items() if k in current} | saved
    return [
        (k, saved.get(k), current.get(k))
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k) and k not in RESUMABLE_CHANGES
    ]


def check_same_run(workdir: str, saved: dict, current: dict, where: str, defaults: dict) -> None:
    """Raises ConfigError unless `current` may resume the run that `saved` (config JSON) started
    (`run_changes` finds none). `where` names the saved copy."""
    changed = run_changes(saved, current, defaults)
    if changed:
        named = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changed[:6])
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise ConfigError(
            f"--workdir={workdir} holds a run with another config ({named}{more}; per {where}); "
            "use a new --workdir, or remove this one to start it over"
        )
