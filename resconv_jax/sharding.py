"""The ('sweep', 'data') device mesh and the placement of runs and data on it.

Runs of a sweep are independent, so their leading axis is split over 'sweep'; the full-batch data
set is split by samples over 'data' and the parameters are replicated over 'data' (XLA inserts the
gradient all-reduce). Arrays are built with `make_array_from_callback`, which places each
process's own shards, so the same code runs on one host and on a multi-host pod.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resconv_jax.errors import ConfigError


def make_mesh(num_runs: int, num_samples: int, mesh_cfg) -> Mesh:
    """A (sweep, data) mesh; a size of 0 in `mesh_cfg` picks the largest size that divides."""
    sweep, data = mesh_shape(num_runs, num_samples, mesh_cfg)
    devices = np.asarray(jax.devices()[: sweep * data])
    return jax.make_mesh(
        (sweep, data), ("sweep", "data"), (AxisType.Auto, AxisType.Auto), devices=devices
    )


def mesh_shape(num_runs: int, num_samples: int, mesh_cfg) -> tuple[int, int]:
    """(sweep, data) of `make_mesh`'s mesh, from the config and the device count alone; raises
    ConfigError (one line) for a mesh that cannot be built."""
    num_devices = jax.device_count()
    sweep = mesh_cfg.sweep or math.gcd(num_runs, num_devices)
    data = mesh_cfg.data or math.gcd(num_samples, num_devices // sweep)
    if num_runs % sweep:
        raise ConfigError(f"config.mesh.sweep={sweep} does not divide the {num_runs} runs")
    if num_samples % data:
        raise ConfigError(f"config.mesh.data={data} does not divide the {num_samples} samples")
    if sweep * data > num_devices:
        raise ConfigError(f"mesh {sweep}x{data} needs more than the {num_devices} devices")
    if jax.process_count() > 1 and sweep * data != num_devices:
        raise ConfigError(
            f"mesh {sweep}x{data} uses {sweep * data} of the {num_devices} devices of "
            f"{jax.process_count()} processes: a multi-process run needs every device in its mesh; "
            f"set config.mesh.sweep and config.mesh.data so that sweep x data = {num_devices}"
        )
    return sweep, data


def run_sharding(mesh: Mesh) -> NamedSharding:
    """Leading run axis over 'sweep', the rest replicated."""
    return NamedSharding(mesh, P("sweep"))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading sample axis over 'data', replicated over 'sweep'."""
    return NamedSharding(mesh, P("data"))


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array that every process holds in full."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def put_tree(tree, sharding: NamedSharding):
    """`put` for every leaf of a pytree."""
    return jax.tree.map(lambda leaf: put(leaf, sharding), tree)
