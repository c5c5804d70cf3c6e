"""Checkpoints with Orbax's CheckpointManager: periodic, keep-last-K, async, verified on restore.

Every checkpoint's metadata holds a content hash of each array of the state (computed on device,
so a sharded state is never gathered) and a copy of the run's config. A restore recomputes the
hashes; a checkpoint that fails to read, fails its hashes or is refused by the caller (a
non-finite loss) is reported in one line and the one before it is tried.
"""

from __future__ import annotations

import errno
import itertools
import logging as std_logging
import os
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from resconv_jax.errors import WorkdirWriteError
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.multihost import to_host
from resconv_jax.runtime.workdir import describe_os_error


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 words (a JAX or a NumPy array, wrapping alike):
    every input bit flips each output bit with p ≈ ½."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash_words(words, xp):
    """The uint32 hash of a flat uint32 word array and the words' positions (`xp`: jnp or np)."""
    index = xp.arange(words.size, dtype=np.uint32)
    return xp.sum(_fmix32(words ^ _fmix32(index + np.uint32(0x9E3779B9))), dtype=np.uint32)


def _array_hash(x: jax.Array) -> jax.Array:
    """A uint32 hash of an array's bits and their positions (any shape, any 1-8 byte dtype)."""
    if x.dtype.itemsize in (4, 8):
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: (..., 2), low word first
    else:
        unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    return _hash_words(words.ravel(), jnp)


def _host_array_hash(x: np.ndarray) -> int:
    """`_array_hash` of a NumPy array, computed by NumPy (nothing to compile): the same value."""
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize in (4, 8):
        words = x.reshape(-1).view(np.uint32)  # little-endian: the low word first, as XLA's
    else:
        words = x.reshape(-1).view(f"uint{8 * x.dtype.itemsize}").astype(np.uint32)
    return int(_hash_words(words, np))


@jax.jit
def _tree_hashes(tree):
    return jax.tree.map(_array_hash, tree)


def state_digest(state) -> dict[str, int]:
    """{leaf path: uint32 content hash} of a pytree of (possibly sharded) arrays."""
    hashes = to_host(_tree_hashes(state))
    flat, _ = jax.tree_util.tree_flatten_with_path(hashes)
    return {jax.tree_util.keystr(path): int(value) for path, value in flat}


def host_state_digest(state) -> dict[str, int]:
    """`state_digest` of a pytree of NumPy arrays (a checkpoint read back as saved), by NumPy."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(path): _host_array_hash(np.asarray(x)) for path, x in flat}


def _from_abandoned_io(unraisable) -> bool:
    """Whether an unraisable exception is the debris of a failed Orbax save or restore: its
    tensorstore I/O finishes after the event loop closed, or its coroutines are never awaited."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    value = unraisable.exc_value
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


# TensorStore's errors are ValueErrors whose text starts with an absl status code.
_TENSORSTORE_ERROR = re.compile(
    r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): "
)


def _is_tensorstore_error(exc_info) -> bool:
    error = exc_info[1] if exc_info else None
    return isinstance(error, ValueError) and bool(_TENSORSTORE_ERROR.match(str(error)))


def orbax_io_debris(record) -> bool:
    """A logging filter (True: keep) that drops, from stderr, the ERROR records a failed Orbax
    save or restore leaves: its writer threads' own tracebacks, and asyncio's "Task exception was
    never retrieved" for Orbax's coroutines and for the TensorStore futures it gathers (when one
    read fails, the others' failures are never retrieved). The failure reaches the user as one
    line (a WorkdirWriteError, or "checkpoint at step N is unreadable")."""
    if record.levelno < std_logging.ERROR:
        return True
    orbax = f"{os.sep}orbax{os.sep}"
    if orbax in record.pathname or orbax in record.getMessage():
        return False
    return not (record.name == "asyncio" and _is_tensorstore_error(record.exc_info))


def quiet_failed_io() -> None:
    """Installs, once, the filters that send a failed save's or restore's debris (reported in one
    line) to the log rather than to stderr as tracebacks: `orbax_io_debris` on the absl and
    asyncio loggers, and an unraisable hook; every other record and unraisable is as before."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_failed_io", False):
        return
    for name in ("absl", "asyncio"):
        std_logging.getLogger(name).addFilter(orbax_io_debris)

    def hook(unraisable):
        if _from_abandoned_io(unraisable):
            logging.info("after a failed checkpoint save or restore: %s", unraisable.exc_value)
        else:
            previous(unraisable)

    hook.quiets_failed_io = True
    sys.unraisablehook = hook


_IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOENT, errno.EACCES)


def _first_line(error: BaseException) -> str:
    """The reason for an I/O failure in a few words: the strerror of the OSError, or one found in
    a library's message (tensorstore's name the OS error in the middle of a long line)."""
    if isinstance(error, OSError):
        return describe_os_error(error)
    text = str(error).strip()
    for number in _IO_ERRNOS:
        if os.strerror(number) in text:
            return os.strerror(number)
    return text.splitlines()[0][:160] if text else type(error).__name__


def is_saved_meta(meta, step: int) -> bool:
    """Whether a checkpoint's metadata is what `Checkpointer.save` writes for `step`: a dict with
    that step and a dict of content hashes."""
    return (
        isinstance(meta, dict) and meta.get("step") == step and isinstance(meta.get("digest"), dict)
    )


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, but for its own calls to JAX's preemption sync point: it asks there with
    step numbers (in should_save and save), while `Checkpointer.reached_preemption` asks with the
    loop's ids, and JAX's protocol needs every call of a process on one sequence (the sync point
    is the largest latest id of any process plus one, and is met only by a call with that id)."""

    def reached_preemption(self, step: int) -> bool:
        return False


_sync_ids = itertools.count()  # this process's ids at JAX's preemption sync point


class Checkpointer:
    """Saves the train state (pytree with sharded leaves) under `workdir/checkpoints/<step>`.

    `workdir` is a local folder or a `gs://` URL (Orbax writes there itself, through epath and
    TensorStore). `on_save(step)`, when set, runs before each save starts: the metrics writer's
    sync, so that a checkpoint never exists before the metrics lines that precede it.
    """

    def __init__(self, workdir, *, every: int, keep: int, use_async: bool):
        root = wd.path(workdir)
        directory = (root.resolve() if wd.is_local(root) else root) / "checkpoints"
        self.directory = os.fspath(directory)
        self.on_save: Callable[[int], None] | None = None
        quiet_failed_io()  # installed up front: a failed save's debris precedes its exception
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every,
            max_to_keep=keep,
            enable_async_checkpointing=use_async,
            create=True,
        )
        try:
            self._manager = _Manager(directory, options=options, item_names=("state", "meta"))
        except OSError as error:
            raise WorkdirWriteError(
                f"cannot create {self.directory} ({describe_os_error(error)})"
            ) from None

    def steps(self) -> list[int]:
        """Steps of the finished checkpoints on disk, ascending (Orbax also lists the newest
        while a background save still writes it: left out then)."""
        steps = sorted(self._manager.all_steps())
        return steps[:-1] if self._writing() is not None else steps

    def _writing(self) -> int | None:
        """The step a background save is still writing, or None."""
        if not self._manager.is_saving_in_progress():
            return None
        steps = self._manager.all_steps()
        return max(steps) if steps else None

    def latest_step(self) -> int | None:
        """The latest finished checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Saves if `step` is on the interval (or `force`); returns whether a save started.

        `meta` (JSON) gets the state's content hashes; `on_save` runs first. A failed write ->
        WorkdirWriteError.
        """
        if not (force or self._manager.should_save(step)):
            return False
        if self.on_save is not None:
            self.on_save(step)
        meta = meta | {"digest": state_digest(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if (writing := self._writing()) is not None:  # Orbax waits for it first: its failure
            try:  # is that step's, not this one's
                self._manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - Orbax wraps I/O failures in several types
                raise WorkdirWriteError(
                    f"cannot save the checkpoint of step {writing} in {self.directory} "
                    f"({_first_line(error)})"
                ) from None
        try:
            return self._manager.save(step, args=args, force=force)
        except Exception as error:  # noqa: BLE001 - Orbax wraps I/O failures in several types
            raise WorkdirWriteError(
                f"cannot save the checkpoint of step {step} in {self.directory} "
                f"({_first_line(error)})"
            ) from None

    def read_meta(self, step: int) -> dict | None:
        """The metadata saved with the checkpoint at `step` (None if it cannot be read)."""
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception:  # noqa: BLE001 - unreadable metadata: the caller says so
            return None
        return restored.meta if isinstance(restored.meta, dict) else None

    def restore_latest(
        self,
        abstract_state,
        *,
        max_step: int | None = None,
        accept: Callable[[object, dict], str | None] = lambda state, meta: None,
        report: Callable[[str], None] = print,
    ) -> tuple[int, object, dict] | None:
        """(step, state, meta) of the newest good checkpoint at or before `max_step`, or None.

        `abstract_state` gives the shapes, dtypes and shardings to restore into. A checkpoint is
        good if it reads, its arrays match the hashes saved with them, and `accept(state, meta)`
        returns None (else the reason it is refused). Every checkpoint after the one returned
        (refused, or past `max_step`) is deleted, so that the resumed run can save those steps
        again; each skip is `report`-ed in one line.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        found, skipped = None, []
        for step in reversed(self.steps()):
            if max_step is not None and step > max_step:
                skipped.append(step)
                continue
            problem, state, meta = self._verified(step, abstract)
            if problem is None:
                problem = accept(state, meta)
            if problem is None:
                found = step, state, meta
                break
            report(f"checkpoint at step {step} {problem}; trying the previous one")
            skipped.append(step)
        for step in skipped:
            self._manager.delete(step)
        if found is None and skipped:
            report(f"no usable checkpoint in {self.directory}: the run restarts from step 0")
        return found

    def _verified(self, step: int, abstract) -> tuple[str | None, object, dict]:
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as error:  # noqa: BLE001 - any failure to read means unusable
            logging.info("checkpoint %d: %s", step, error)
            reason = _first_line(error) if isinstance(error, OSError) else type(error).__name__
            return f"is unreadable ({reason})", None, {}
        meta = restored.meta if isinstance(restored.meta, dict) else {}
        if not is_saved_meta(meta, step):
            return "has damaged metadata (no content hashes or another step)", None, {}
        saved = meta["digest"]
        if (actual := state_digest(restored.state)) != saved:
            bad = sorted(k for k in saved.keys() | actual.keys() if saved.get(k) != actual.get(k))
            return f"does not match its content hashes (at {', '.join(bad[:3])})", None, {}
        return None, restored.state, meta

    def reached_preemption(self) -> bool:
        """Whether the cluster signalled preemption (multi-process runs), agreed on all processes.

        Each call takes the next id of one sequence for the whole process (every start, every
        group of a sweep), the same on every process since they make the same calls; JAX's sync
        point is the id after the largest any process had reached when the notice came."""
        return ocp.utils.reached_preemption(next(_sync_ids))

    def wait(self) -> None:
        """Blocks until background saves are on disk; a failed one -> WorkdirWriteError."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - Orbax wraps I/O failures in several types
            raise WorkdirWriteError(
                f"cannot finish saving a checkpoint in {self.directory} ({_first_line(error)})"
            ) from None

    def close(self) -> None:
        """Waits for saves and releases the manager (errors were reported by `wait`)."""
        try:
            self._manager.close()
        except Exception as error:  # noqa: BLE001
            logging.info("closing the checkpoint manager: %s", error)


def checkpoint_losses_finite(losses: np.ndarray) -> str | None:
    """`accept` helper: None if every loss (R,) is finite, else the reason for refusing."""
    bad = np.flatnonzero(~np.isfinite(losses))
    if not bad.size:
        return None
    return f"holds a non-finite loss (run {int(bad[0])}: {losses[bad[0]]})"
