"""Up-front memory checks: refuse a size that cannot fit before anything is written.

Two checks: the synthetic data set from the config's shapes alone (before it is drawn), and the
compiled training chunk from XLA's memory analysis (its temporaries and outputs, per device)
against what the devices have free. On a CPU every device shares the host's memory.
"""

from __future__ import annotations

import os

import jax

from resconv_jax.errors import ConfigError


def format_bytes(num: float) -> str:
    """'1.5 GiB', '12.0 MiB', '900 B'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num >= size:
            return f"{num / size:.1f} {unit}"
    return f"{int(num)} B"


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else physical memory; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def device_available_bytes(device) -> int | None:
    """Free bytes of an accelerator (its allocator's limit minus what is in use), or the host's
    available memory for a CPU device."""
    if device.platform == "cpu":
        return host_available_bytes()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def check_synthetic_data(data_cfg, dim: int | None = None) -> None:
    """Refuses synthetic data (P, M, d + d_y float32, a host and a device copy) that cannot fit;
    d is `dim` (the widest of a width sweep) or data.dim."""
    dim = dim or data_cfg.dim
    entries = data_cfg.num_samples * data_cfg.seq_len * (dim + data_cfg.out_dim)
    need = 2 * 4 * entries
    have = host_available_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"config.data.num_samples={data_cfg.num_samples}, d={dim}: the data set alone needs "
            f"{format_bytes(need)} (P·M·(d + d_y) float32, on the host and on the devices), "
            f"more than the {format_bytes(have)} of memory available; use fewer samples"
        )


def check_fits(what: str, weights: int, activations: int) -> None:
    """Refuses, before anything is built or drawn, a model (`what`, named in the message) whose
    `weights` bytes (every run's parameters) and their gradients with one run's `activations`
    bytes cannot fit the memory available: on a CPU the host's; on accelerators each device's,
    weights replicated and activations spread over all devices."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        need, have, where = 2 * weights + activations, host_available_bytes(), "this host"
    else:
        need = 2 * weights + activations // jax.device_count()
        have, where = device_available_bytes(device), f"each {device.platform} device"
    if have is not None and need > have:
        raise ConfigError(
            f"{what} needs at least {format_bytes(need)} (weights and gradients "
            f"{format_bytes(2 * weights)}, one run's activations {format_bytes(activations)}), "
            f"more than the {format_bytes(have)} free on {where}; reduce the widths, the depth, "
            "the samples or the runs"
        )


def compiled_need(compiled, mesh: jax.sharding.Mesh) -> tuple[int, int, int | None]:
    """(per device, this process, free) bytes of a compiled chunk: its new allocations per
    device (temporaries + outputs − outputs aliased to donated inputs, which are already
    allocated), those of this process's devices (on a CPU they share the host's memory: the sum),
    and what the devices have free (None: unknown). (0, 0, None) without XLA's analysis."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0, 0, None
    per_device = (
        analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    )
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    sharing = len(local) if local[0].platform == "cpu" else 1
    return per_device, per_device * sharing, device_available_bytes(local[0])


def fits(compiled, mesh: jax.sharding.Mesh) -> bool:
    """Whether `compiled_need` is within what the devices have free (True when unknown)."""
    _, need, have = compiled_need(compiled, mesh)
    return have is None or need <= have


def refusal(
    compiled,
    mesh: jax.sharding.Mesh,
    advice: str = "reduce the samples, the model's widths or the number of runs",
) -> ConfigError | None:
    """The one-line ConfigError (ending with `advice`) for a compiled chunk whose new allocations
    (`compiled_need`) exceed what its devices have free; None when it fits."""
    per_device, need, have = compiled_need(compiled, mesh)
    if have is None or need <= have:
        return None
    device = mesh.devices.flat[0]
    sharing = need // max(per_device, 1)
    across = f" × {sharing} devices" if sharing > 1 else ""
    return ConfigError(
        f"the training step needs {format_bytes(need)} of memory ("
        f"{format_bytes(per_device)} per device{across}, from XLA's memory analysis of the "
        f"compiled step), more than the {format_bytes(have)} free on {device.platform}; {advice}"
    )
