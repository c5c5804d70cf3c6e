"""The compiled on-device loops that train.run calls between log steps.

One chunk is train.log_every GD steps of every run (`step.make_step_functions(...).run_steps`),
compiled once for the shapes and shardings of the train state and data. A chunk that starts at a
multiple of probe.every also probes its first step: the same program, told so by its last
argument.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from resconv_jax import sharding
from resconv_jax.errors import ConfigError
from resconv_jax.microbatch import Microbatches
from resconv_jax.runtime import memory

# runs_per_chunk=-1: step the runs in chunks when the compiled chunk of all runs needs more
# temporaries than this. It was 8 MiB while a chunk held two copies of the step (its first step
# outside the loop); one copy needs ~20 % less for the same runs (11.1 against 14.2 MiB for
# `reproduce`'s depth sweep at L = 8), and 7 MiB keeps every sweep of `reproduce` stepping the
# same runs together as before, so its numbers do not move with the program's size.
CPU_CHUNK_BYTES = 7 << 20


def check_runs_per_chunk(requested: int, mesh_shape: dict[str, int]) -> int:
    """train.runs_per_chunk checked against the mesh's {"sweep": n, "data": m}; -1 (automatic)
    resolves to 0 here."""
    if requested > 0 and math.prod(mesh_shape.values()) > 1:
        raise ConfigError(
            f"config.train.runs_per_chunk={requested} needs a 1-device mesh (this one is "
            f"{mesh_shape}); use 0 to step all runs together"
        )
    return max(requested, 0)


def automatic_runs_per_chunk(num_runs: int, mesh: jax.sharding.Mesh, compiled) -> int:
    """train.runs_per_chunk=-1: runs per chunk for a `compiled` chunk of all `num_runs` runs.

    On a 1-device CPU mesh with more than one run whose compiled chunk needs more than
    CPU_CHUNK_BYTES of temporaries: max(1, R · CPU_CHUNK_BYTES // temp). Otherwise 0 (all runs
    together).
    """
    if mesh.devices.flat[0].platform != "cpu" or mesh.size != 1 or num_runs < 2:
        return 0
    temp = compiled.memory_analysis().temp_size_in_bytes
    return max(1, num_runs * CPU_CHUNK_BYTES // temp) if temp > CPU_CHUNK_BYTES else 0


class ChunkRunners:
    """The compiled chunk program, `compiled(state, hp, x, y, num_steps, probe_now) -> (state,
    buffers)`, one for every chunk of a run, and which chunks probe (`probe_now`).

    Args:
      make_fns: `make_step_functions` with everything but `probe` and `runs_per_chunk` bound.
      probe_fn: the probe of a step's (R, L, P, M, d) intermediates, or None.
      mesh: the ('sweep', 'data') mesh.
      args: (state, hp, x, y) as the chunks will be called with (shapes and shardings).
      log_every: steps per chunk (train.log_every); runs_per_chunk: train.runs_per_chunk (0 all
        together, n > 0 that many at a time, -1 automatic); probe_every: probe.every (0: every
        chunk probes its first step).
    """

    def __init__(
        self,
        make_fns,
        probe_fn,
        mesh: jax.sharding.Mesh,
        args,
        *,
        log_every: int,
        runs_per_chunk: int = 0,
        probe_every: int = 0,
        microbatch_size: int = 0,
    ):
        self.microbatch_size = microbatch_size
        self._batches = Microbatches(
            jax.tree.leaves(args[3])[0].shape[0], mesh.shape["data"], microbatch_size
        )
        self.probe_every = probe_every if probe_fn is not None else 0
        num_runs = jax.tree.leaves(args[1])[0].shape[0]
        chunk = check_runs_per_chunk(runs_per_chunk, dict(mesh.shape))
        self.runs_per_chunk = chunk if chunk < num_runs else 0  # 0: all runs together
        compile_chunk = functools.partial(self._compile, make_fns, probe_fn, log_every, mesh, args)
        self.compiled = compile_chunk()
        if runs_per_chunk == -1:
            self.runs_per_chunk = automatic_runs_per_chunk(num_runs, mesh, self.compiled)
            if self.runs_per_chunk:
                self.compiled = compile_chunk()

    def _compile(self, make_fns, probe_fn, log_every: int, mesh, args):
        state, hp, x, y = args
        fns = make_fns(
            probe=probe_fn,
            runs_per_chunk=self.runs_per_chunk,
            microbatch_size=self.microbatch_size,
        )
        on_runs = jax.tree.map(lambda _: sharding.run_sharding(mesh), state)
        return (
            jax.jit(fns.run_steps, donate_argnums=0, out_shardings=(on_runs, None))
            .lower(state, hp, x, y, jnp.int32(log_every), jnp.bool_(True))
            .compile()
        )

    @property
    def description(self) -> str:
        """', n runs at a time' when the runs are stepped in chunks, else ''."""
        if not self.runs_per_chunk:
            return ""
        return f", {self.runs_per_chunk} run{'s' if self.runs_per_chunk > 1 else ''} at a time"

    def memory_description(self, mesh) -> str:
        """How the batch is taken and what the step needs: 'the whole batch at once' or
        'microbatches of n samples per device (k per step)', and the step's memory per device."""
        batches = "the whole batch at once"
        if self.microbatch_size:
            batches = self._batches.describe()
        per_device, _, _ = memory.compiled_need(self.compiled, mesh)
        return f"{batches}, step memory {memory.format_bytes(per_device)} per device"

    def probe_now(self, step: int) -> jax.Array:
        """Whether the chunk starting at `step` probes its first step (a multiple of probe.every),
        the last argument of `compiled`."""
        return jnp.bool_(not self.probe_every or step % self.probe_every == 0)

    def run(self, step: int, state, hp, x, y, num_steps: int):
        """The chunk starting at `step`: `num_steps` steps of `compiled`, probed when
        `probe_now(step)`; (state, buffers)."""
        return self.compiled(state, hp, x, y, jnp.int32(num_steps), self.probe_now(step))


def _fitting_size(need_at, shard: int, have: int, known: tuple[int, int]) -> int:
    """The largest microbatch size n ≤ `shard` whose chunk is estimated to fit `have` bytes:
    a line through need_at(1) and `known` = (n, need) measured (activations grow linearly in n).
    0 when even n = 1 does not fit."""
    one = need_at(1)
    if one > have:
        return 0
    size, need = known
    if size <= 1 or need <= one:
        return shard
    slope = (need - one) / (size - 1)
    return max(1, min(shard, 1 + int((have - one) / slope)))


def compile_chunks(make_runners, requested, shard: int, mesh) -> tuple[ChunkRunners, int]:
    """The compiled chunks and the microbatch size they use, for train.microbatch_size
    `requested` (0: the whole batch, n > 0, or "auto": the whole batch if it fits, else the
    largest n that does, from XLA's memory analysis). `make_runners(microbatch_size=n)` compiles
    `ChunkRunners` at size n; `shard` is the samples of one 'data' shard. Raises ConfigError (one
    line, naming the largest size that would fit) when the chunks do not fit the devices' free
    memory."""

    def need_at(size: int) -> int:
        return memory.compiled_need(make_runners(microbatch_size=size).compiled, mesh)[1]

    size = 0 if requested == "auto" else requested
    runners = make_runners(microbatch_size=size)
    if memory.fits(runners.compiled, mesh):
        return runners, size
    _, need, have = memory.compiled_need(runners.compiled, mesh)
    fitting = _fitting_size(need_at, shard, have, (size or shard, need))
    if requested == "auto":
        for _ in range(4):  # the line is an estimate: verified, and shrunk if it was optimistic
            if not fitting:
                break
            runners = make_runners(microbatch_size=fitting)
            if memory.fits(runners.compiled, mesh):
                return runners, fitting
            fitting = int(fitting * 0.8)
    advice = (
        "even train.microbatch_size=1 does not fit: reduce the model's widths or the number of runs"
        if not fitting
        else f"train.microbatch_size={fitting} (samples per device per microbatch) would fit, "
        "estimated from XLA's memory analysis; or reduce the model's widths or the runs"
    )
    raise memory.refusal(runners.compiled, mesh, advice)
