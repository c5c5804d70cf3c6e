"""Checkpoints with Orbax's CheckpointManager: periodic, keep-last-K, async, corruption-tolerant."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    """Saves the train state (pytree with sharded leaves) under `workdir/checkpoints/<step>`."""

    def __init__(self, workdir: str, *, every: int, keep: int, use_async: bool):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every,
            max_to_keep=keep,
            enable_async_checkpointing=use_async,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def steps(self) -> list[int]:
        """Steps of the finished checkpoints on disk, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The latest finished checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Saves if `step` is on the interval (or `force`); returns whether a save started."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=force)

    def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
        """(step, state, meta) of the newest readable checkpoint, or None when there is none.

        `abstract_state` gives the shapes, dtypes and shardings to restore into. A checkpoint that
        fails to read is skipped with a warning and the one before it is tried.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        for step in reversed(self.steps()):
            args = ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            )
            try:
                restored = self._manager.restore(step, args=args)
            except Exception as error:  # noqa: BLE001 - any failure to read means unusable
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                logging.warning(
                    "checkpoint at step %d is unreadable (%s: %s); trying the previous one",
                    step,
                    type(error).__name__,
                    first_line[:200],
                )
                continue
            return step, restored.state, restored.meta
        return None

    def reached_preemption(self, step: int) -> bool:
        """Whether the cluster signalled preemption (multi-host pods), agreed on all hosts."""
        return self._manager.reached_preemption(step)

    def wait(self) -> None:
        """Blocks until background saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for saves and releases the manager."""
        self._manager.close()
