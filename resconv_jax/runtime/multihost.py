"""Several processes, one program: when to start `jax.distributed`, and how results reach hosts.

A run is multi-process when main's --coordinator_address, --num_processes and --process_id are
given (all three), or when JAX itself detects a cluster it can join: a Cloud TPU pod, an `srun`
step of SLURM, Open MPI's `mpirun` (the clusters `jax.distributed.initialize()` finds without
arguments). Nothing else is guessed: a plain `python` inside an `sbatch` allocation, or with
`JAX_COORDINATOR_ADDRESS` alone, is one process.

In a multi-process run every process runs the same program on its own devices: it reads the data
files and places only its own shards (`sharding.put`), takes part in every compiled step and in
every Orbax save, and fetches the small per-run results (losses, probe values, hashes) with
`to_host`. Process 0 alone takes the workdir lock and writes metrics, summaries and figures.
Preemption goes through JAX's preemption sync point (SIGTERM to any process makes all of them
save at the same step); the Python SIGTERM handler is for single-process runs only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from resconv_jax.errors import ConfigError

LOOPBACK_NAMES = ("localhost",)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a run: explicit flags, a detected cluster, or alone."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cluster: str | None = None  # the name of the cluster JAX detected, if any
    heartbeat_timeout_seconds: int = 100

    @property
    def multi_process(self) -> bool:
        return self.coordinator_address is not None or self.cluster is not None


def detected_cluster() -> str | None:
    """The name of the cluster `jax.distributed.initialize()` would join on its own, or None.

    The same search JAX makes (its non-opt-in ClusterEnv types, in its order); it reads
    environment variables only, except on a Cloud TPU VM, where it asks the metadata server.
    """
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - JAX moved its cluster detection
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.__name__
    return None


def resolve_launch(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    heartbeat_timeout_seconds: int = 100,
) -> Launch:
    """The Launch the flags (or the detected cluster) ask for; ConfigError on an incomplete set."""
    given = {
        "--coordinator_address": coordinator_address,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    missing = [name for name, value in given.items() if value is None]
    if len(missing) not in (0, 3):
        raise ConfigError(
            f"multi-process flags: {', '.join(missing)} missing; give all of --coordinator_address,"
            " --num_processes and --process_id, or none (a cluster JAX detects: TPU, srun, mpirun)"
        )
    if heartbeat_timeout_seconds < 1:
        raise ConfigError(f"--heartbeat_timeout={heartbeat_timeout_seconds}: must be >= 1 s")
    if not missing:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(
                f"--process_id={process_id} --num_processes={num_processes}: need "
                "0 <= process_id < num_processes"
            )
        host, _, port = coordinator_address.rpartition(":")
        if not (host.strip("[]") and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(
                f"--coordinator_address={coordinator_address}: expected HOST:PORT (a port 1-65535)"
            )
        return Launch(
            coordinator_address, num_processes, process_id, None, heartbeat_timeout_seconds
        )
    return Launch(cluster=detected_cluster(), heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def initialize(launch: Launch, stop: Callable[[], bool] = lambda: False) -> bool:
    """Starts `jax.distributed` for a multi-process launch (before anything touches a device);
    False when `stop()` (a SIGTERM) came first, True once started (or for one process).

    It waits for every process to join (up to JAX's timeout), in a thread of its own: this one
    keeps running Python's signal handlers meanwhile. Once started, SIGTERM is JAX's preemption
    notifier's (installed in there). A loopback coordinator binds to its own address, not to
    every interface. On CPU the cross-process collectives are gloo's.
    """
    if not launch.multi_process:
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    kwargs = {"heartbeat_timeout_seconds": launch.heartbeat_timeout_seconds}
    if launch.coordinator_address is not None:
        host = launch.coordinator_address.rsplit(":", 1)[0]
        kwargs |= {
            "coordinator_address": launch.coordinator_address,
            "num_processes": launch.num_processes,
            "process_id": launch.process_id,
        }
        if _is_loopback(host):
            kwargs["coordinator_bind_address"] = launch.coordinator_address
    failed: list[BaseException] = []

    def start() -> None:
        try:
            jax.distributed.initialize(**kwargs)
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(error)

    joining = threading.Thread(target=start, name="jax.distributed.initialize", daemon=True)
    joining.start()
    while joining.is_alive():
        if stop():
            return False
        joining.join(0.1)
    if failed:
        raise failed[0]
    return True


def to_host(tree):
    """Every leaf of a pytree of (possibly sharded, non-addressable) arrays as a NumPy array
    holding its global value, on every process. For small results only (losses, spectra)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(
        lambda a: (
            np.asarray(multihost_utils.process_allgather(a, tiled=True))
            if isinstance(a, jax.Array)
            else np.asarray(a)
        ),
        tree,
    )


class PeerWatchdog:
    """Stops this process with one line when another process of the run stops responding.

    Every process counts beats into the coordination service's key-value store each `interval`
    seconds; a daemon thread reads the others'. A process whose count has not changed for
    `lost_after` seconds on this process's clock, and that has not said it ended, is lost; one
    that ended with a non-zero status stops the others too. Either way `on_lost(message,
    last_words)` is called once, on the watchdog thread; `last_words` (None, or for a process
    that ended: a callable) is to be called after the message is out and before this process
    exits. `lost_after` is below JAX's own heartbeat timeout, which would otherwise abort the
    process with a C++ stack trace.
    """

    PREFIX = "resconv_jax/peers"

    def __init__(self, on_lost, lost_after: float, interval: float = 1.0):
        from jax._src import distributed

        self._client = distributed.global_state.client
        self._index, self._count = jax.process_index(), jax.process_count()
        self._on_lost, self._lost_after, self._interval = on_lost, lost_after, interval
        self._beats, self._seen = 0, {}  # peer -> (last beat count seen, when)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)

    def start(self) -> PeerWatchdog:
        self._beat()
        self._thread.start()
        return self

    def finish(self, status: int) -> None:
        """Says this process ended with exit `status` and stops watching: after 0 its silence is
        not a loss; any other status stops the other processes at once."""
        self._stop.set()
        try:
            self._client.key_value_set(f"{self.PREFIX}/done/{self._index}", str(status), True)
            if self._index == 0 and status:  # its coordinator serves the others' last words
                deadline = time.monotonic() + self._lost_after
                others = [p for p in range(1, self._count)]
                while others and time.monotonic() < deadline:
                    others = [p for p in others if not self._ended(p)]
                    time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the service may be gone already at exit
            pass

    def wait_for_loss(self) -> None:
        """After an error that a lost process could explain (a collective that failed), keeps
        watching long enough for `on_lost` to be called if a process is indeed gone: a peer's
        last beat is seen up to a tick after it was written, and its silence counted from then;
        two ticks more of slack for a loaded machine."""
        self._thread.join(self._lost_after + 4 * self._interval)

    def _beat(self) -> None:
        self._beats += 1
        self._client.key_value_set(f"{self.PREFIX}/beat/{self._index}", str(self._beats), True)

    def _say_stopping(self) -> None:
        """Tells process 0, which keeps the coordinator up until every other process has read
        its status, that this one has: else it waits its whole `lost_after` before it exits.
        The last thing this process does: once the coordinator is gone, JAX ends it."""
        with contextlib.suppress(Exception):  # the coordinator may be gone meanwhile
            self._client.key_value_set(f"{self.PREFIX}/stops/{self._index}", "1", True)

    def _ended(self, peer: int) -> bool:
        """Whether `peer` said it ended, or that it stops because another process failed."""
        return any(
            self._try_get(f"{self.PREFIX}/{what}/{peer}") is not None for what in ("done", "stops")
        )

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as error:  # noqa: BLE001 - jaxlib raises for a key not yet set
            if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
                return None
            raise

    def _status(self, peer: int) -> tuple[str | None, float]:
        """(its exit status if it ended, seconds since its beat count last changed here)."""
        if (status := self._try_get(f"{self.PREFIX}/done/{peer}")) is not None:
            return status, 0.0
        beat, now = self._try_get(f"{self.PREFIX}/beat/{peer}"), time.monotonic()
        if peer not in self._seen or beat != self._seen[peer][0]:  # a first look counts as a beat
            self._seen[peer] = (beat, now)
        return None, now - self._seen[peer][1]

    def _watch(self) -> None:
        # Ticks on a fixed grid: a tick's own time (key-value calls, a loaded machine) does not
        # push the next ones later; a tick late by more than an interval skips those it missed.
        tick = time.monotonic()
        while True:
            tick = max(tick + self._interval, time.monotonic())
            if self._stop.wait(max(0.0, tick - time.monotonic())):
                return
            try:
                self._beat()
                for peer in range(self._count):
                    if peer == self._index:
                        continue
                    status, silent = self._status(peer)
                    if status not in (None, "0"):
                        self._on_lost(
                            f"process {peer} of {self._count} exited with status {status}: "
                            f"stopping process {self._index} (see process {peer}'s error line)",
                            self._say_stopping,
                        )
                        return
                    if status is None and silent > self._lost_after:
                        self._on_lost(
                            f"process {peer} of {self._count} stopped responding "
                            f"({silent:.0f} s without a heartbeat): stopping process "
                            f"{self._index}; rerun the same command on every process to resume "
                            "from the last checkpoint"
                        )
                        return
            except Exception as error:  # noqa: BLE001 - the coordinator (process 0) is gone
                if self._stop.is_set():
                    return
                self._on_lost(
                    f"lost the coordinator (process 0 of {self._count}: "
                    f"{type(error).__name__}): stopping process {self._index}; rerun the same "
                    "command on every process to resume from the last checkpoint"
                )
                return
