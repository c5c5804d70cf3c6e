"""Taking a run's workdir at the start of `train.run`, and giving back one it created when the
start is refused: process 0 creates and locks it for every process; a refused start deletes it
while still holding the lock, unless something was trained there."""

from __future__ import annotations

import contextlib
import shutil

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from resconv_jax.errors import WorkdirBusy, WorkdirWriteError
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.metrics import METRICS_FILE
from resconv_jax.runtime.workdir import LOCK_FILE, WorkdirLock, make_folder


def lock_on_process_0(workdir: str, lock: WorkdirLock) -> None:
    """Process 0 creates the workdir and takes its lock; every process learns whether that
    worked, so that a busy or unwritable workdir stops all of them (with process 0's line)."""
    failure = None
    if jax.process_index() == 0:
        try:
            make_folder(workdir, f"--workdir={workdir}")
            lock.acquire()
        except (WorkdirBusy, WorkdirWriteError) as error:
            failure = error
    if jax.process_count() > 1:
        code = {None: 0, WorkdirBusy: 1, WorkdirWriteError: 2}[type(failure) if failure else None]
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        if code and failure is None:
            kind = WorkdirBusy if code == 1 else WorkdirWriteError
            failure = kind(f"--workdir={workdir}: process 0 could not take the workdir")
    if failure is not None:
        raise failure


def remove_untrained_workdir(workdir: epath.Path) -> None:
    """Deletes a workdir this process created if nothing was trained in it: no metrics line and
    no checkpoint anywhere (a depth sweep's layers_<L>/ included), so a refused start leaves no
    trace. Called with the lock held, so no other start can begin in the folder meanwhile.
    Object storage: the lock object stays, for `WorkdirLock.release` to delete last."""
    for folder, subfolders, files in workdir.walk():
        if METRICS_FILE in files or (folder.name == "checkpoints" and subfolders):
            return
    if wd.is_local(workdir):  # the flock outlives the lock file's name
        shutil.rmtree(workdir, ignore_errors=True)
        return
    with contextlib.suppress(Exception):  # best effort, as shutil's ignore_errors
        for entry in workdir.iterdir():
            if entry.name != LOCK_FILE:
                entry.rmtree() if entry.is_dir() else entry.unlink()
