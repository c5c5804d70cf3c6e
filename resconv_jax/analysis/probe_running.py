"""The step's spectral probe and collapse residuals over microbatches (train.microbatch_size):
the values `probe.probe_attention` and `probe.collapse_residual` give for the whole batch, in one
microbatch's memory.

Stacked σ: the R factor of the rows seen so far (d × d per run and layer) is carried, and each
microbatch's rows join it by one more QR, [R; X_k] = Q' R': the final R has the singular values of
the whole stacked (P·M, d) matrix (TSQR, sequential over microbatches and a tree over 'data'
within one; only d × d blocks move). Rows of samples a microbatch takes a second time
(`microbatch.Microbatches.weights` 0) are zeroed, which leaves the singular values unchanged.
Per-sample σ_min: a running minimum (a sample seen twice gives its own value twice). Collapse
residuals: a running sum of the per-sample ratios.

Arrays: attn, z (R, L, n, M, d) of one microbatch, sharded P('sweep', None, 'data'); the carry
holds, per name, "r" (R, L, d, d) in the probe's dtype, "sample_min" and "collapse" (R, L).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from resconv_jax.analysis import probe
from resconv_jax.analysis.linalg import small_batches

NAMES = ("attn", "z")


def start(settings: probe.SpectralProbe, inter) -> dict:
    """The carry before the first microbatch; `inter` the shapes of one microbatch's
    intermediates ({"attn", "z"}: (R, L, n, M, d), optional "row_mask")."""
    runs, layers, *_, d = inter["z"].shape
    dtype = jnp.dtype(settings.dtype)
    floats = inter["z"].dtype
    return {
        name: {
            "r": jnp.zeros((runs, layers, d, d), dtype),
            "sample_min": jnp.full((runs, layers), jnp.inf, dtype),
            "collapse": jnp.zeros((runs, layers), floats),
        }
        for name in NAMES
    }


def _join_rows(r: jax.Array, rows: jax.Array, axis_name: str | None) -> jax.Array:
    """R factor (..., d, d) of [r; all rows over `axis_name`], rows (..., N_local, d) local."""
    local = small_batches(probe.qr_r, rows)  # (..., min(N_local, d), d)
    if axis_name is not None and jax.lax.axis_size(axis_name) > 1:
        local = jax.lax.all_gather(
            local, axis_name, axis=local.ndim - 2, tiled=True, to="invarying"
        )
    elif axis_name is not None:  # pmax moves nothing here; it marks `local` the same on 'data'
        local = jax.lax.pmax(local, axis_name)
    return small_batches(probe.qr_r, jnp.concatenate([r, local], axis=-2))


def _joined(settings: probe.SpectralProbe, r: jax.Array, x: jax.Array) -> jax.Array:
    runs, layers, n, m, d = x.shape
    dtype = jnp.dtype(settings.dtype)

    def local(r, x):
        rows = x.astype(dtype).reshape(x.shape[0], layers, x.shape[2] * m, d)
        return _join_rows(r, rows, None if settings.mesh is None else probe.DATA)

    if settings.mesh is None:
        return local(r, x)
    return jax.shard_map(
        local,
        mesh=settings.mesh,
        in_specs=(P(probe.SWEEP), P(probe.SWEEP, None, probe.DATA)),
        out_specs=P(probe.SWEEP),
    )(r, x)


def update(settings: probe.SpectralProbe, carry: dict, inter: dict, weights: jax.Array) -> dict:
    """The carry after one microbatch's intermediates `inter` and sample weights (n,)."""
    row_mask = inter.get("row_mask")
    out = {}
    for name in NAMES:
        x = inter[name]
        real = x if row_mask is None else x * row_mask[:, None, :, :, None]
        counted = real * weights[None, None, :, None, None].astype(x.dtype)
        part = {"r": _joined(settings, carry[name]["r"], counted)}
        if settings.per_sample:
            (sample,) = probe.spectra(real, settings.mesh, settings.dtype, ("sample",))
            part["sample_min"] = jnp.minimum(carry[name]["sample_min"], sample)
        else:
            part["sample_min"] = carry[name]["sample_min"]
        ratios = probe.collapse_ratios(x, row_mask)  # (R, L, n)
        part["collapse"] = carry[name]["collapse"] + jnp.sum(ratios * weights, axis=-1)
        out[name] = part
    return out


def finish(
    settings: probe.SpectralProbe, carry: dict, num_samples: int, seq_len: int
) -> dict[str, jax.Array]:
    """The probe's (R, L) values of the whole batch of `num_samples` samples of `seq_len` rows:
    the keys of `probe.probe_attention` and '{attn,z}/collapse_residual'."""
    values = {}
    for name in NAMES:
        r = carry[name]["r"]
        d = r.shape[-1]
        rows = num_samples * seq_len
        sv = small_batches(probe.singular_values, r)[..., : min(rows, d)]
        stats = probe.spectral_stats(sv, rows, d)
        if settings.per_sample:
            stats["sample_sigma_min"] = carry[name]["sample_min"]
        stats["collapse_residual"] = carry[name]["collapse"] / num_samples
        values |= {f"{name}/{key}": value for key, value in stats.items()}
    return values
