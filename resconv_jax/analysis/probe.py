"""Spectral probe of the stacked attention output matrices, on device and never gathered.

For run r and layer l the training step holds Z = Attn(X) + β X and A = Attn(X) as (P, M, d) arrays
(P samples of M tokens, width d). The paper's rate is set by the singular values of the *stacked*
(P·M, d) matrix of all tokens. The sample axis P is sharded over the mesh axis ``'data'`` and the
run axis R over ``'sweep'``, so the stacked matrix is split by rows across devices.

A tall-skinny QR (TSQR) gives its singular values exactly (they are those of the R factor) while
moving only d×d blocks: each device QRs its own rows, the small R factors are all-gathered over
``'data'``, one more QR combines them, and the SVD runs on the final d×d R only.

Accuracy (float32): Householder QR is backward stable, so σ_i of R equal those of X + δX with
‖δX‖ ≈ eps·‖X‖; the rounding errors are not aligned with the smallest singular direction and the
measured error on σ_min at κ = 1e4 is ~1e-5 relative (σ_max ~1e-7), well inside 1e-3, so no second
pass is needed. The Gram matrix XᵀX squares κ and loses σ_min beyond κ ≈ 1e3: it is never formed.

Call everything inside ``jax.jit`` with inputs sharded as ``NamedSharding(mesh, P('sweep', ...,
'data'))``; meshes from ``jax.make_mesh((n_sweep, n_data), ('sweep', 'data'), axis_types=...)``
work with ``AxisType.Explicit`` and ``AxisType.Auto`` alike (both are tested). R must be divisible
by n_sweep and P by n_data. On CPU with several (virtual) devices, set OPENBLAS_NUM_THREADS=1: the
devices' concurrent LAPACK QRs otherwise fight over OpenBLAS threads (100× slower).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from resconv_jax.analysis.linalg import small_batches

SWEEP, DATA = "sweep", "data"


def _check_dtype(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype=float64 needs x64 enabled (jax.enable_x64(True) or JAX_ENABLE_X64)")
    return dtype


qr_r = functools.partial(jnp.linalg.qr, mode="r")  # (m, n) -> the (min(m, n), n) R factor


def _local_singular_values(x: jax.Array) -> jax.Array:
    """(..., N, d) -> (..., min(N, d)) singular values, QR first when the matrices are tall."""
    if x.shape[-2] > x.shape[-1]:
        x = small_batches(qr_r, x)  # (..., d, d)
    return small_batches(singular_values, x)


def _tsqr_singular_values(x: jax.Array, axis_name: str | None) -> jax.Array:
    """(..., N_local, d) rows of one stacked matrix per batch entry -> (..., k) singular values.

    k = min(n_shards·min(N_local, d), d) ≥ min(N, d); the caller keeps the first min(N, d).
    """
    if axis_name is None or jax.lax.axis_size(axis_name) == 1:  # all rows are local
        sv = _local_singular_values(x)
        # On a size-1 axis pmax moves nothing; it marks sv as the same on every 'data' shard.
        return sv if axis_name is None else jax.lax.pmax(sv, axis_name)
    r = small_batches(qr_r, x)  # (..., min(N_local, d), d): a short R when N_local < d
    r = jax.lax.all_gather(r, axis_name, axis=r.ndim - 2, tiled=True, to="invarying")
    return _local_singular_values(r)  # the gathered (n_shards·min(N_local, d), d) R factors


def singular_values(x: jax.Array) -> jax.Array:
    """Singular values of one (m, n) matrix, descending."""
    return jnp.linalg.svd(x, full_matrices=False, compute_uv=False)


def _probe_local(x: jax.Array, axis_name: str | None, dtype, parts: tuple[str, ...]) -> tuple:
    """x: (R, L, P, M, d) local block -> stacked σ (R, L, k) and/or min_p σ_min(X_p) (R, L)."""
    r, n_layers, n_samples, m, d = x.shape
    x = x.astype(dtype)
    out = []
    if "stacked" in parts:
        out.append(_tsqr_singular_values(x.reshape(r, n_layers, n_samples * m, d), axis_name))
    if "sample" in parts:
        # σ_min(X_p) is the min(M, d)-th singular value; small SVDs of local samples only.
        s = small_batches(singular_values, x)[..., -1].min(axis=-1)
        out.append(s if axis_name is None else jax.lax.pmin(s, axis_name))
    return tuple(out)


def spectra(x: jax.Array, mesh: jax.sharding.Mesh | None, dtype, parts: tuple[str, ...]) -> tuple:
    """x: (R, L, P, M, d) -> per ``parts``: stacked σ (R, L, min(P·M, d)), sample σ_min (R, L)."""
    dtype = _check_dtype(dtype)
    _, _, n_samples, m, d = x.shape
    if mesh is None:
        out = _probe_local(x, None, dtype, parts)
    else:
        out = jax.shard_map(
            lambda b: _probe_local(b, DATA, dtype, parts),
            mesh=mesh,
            in_specs=P(SWEEP, None, DATA),
            out_specs=(P(SWEEP),) * len(parts),
        )(x)
    k = min(n_samples * m, d)
    return tuple(o[..., :k] if part == "stacked" else o for part, o in zip(parts, out, strict=True))


def stacked_singular_values(
    x: jax.Array, mesh: jax.sharding.Mesh | None = None, *, dtype=jnp.float32
) -> jax.Array:
    """Singular values of each run's stacked (P·M, d) matrix, by TSQR over the 'data' axis.

    Args:
      x: (R, P, M, d), sharded P('sweep', 'data') when ``mesh`` is given.
      mesh: a ('sweep', 'data') mesh, or None for a single device (no shard_map).
      dtype: compute dtype; float64 requires x64.
    Returns:
      (R, min(P·M, d)) singular values in descending order (d of them when P·M ≥ d).
    """
    return spectra(x[:, None], mesh, dtype, ("stacked",))[0][:, 0]


def per_sample_min_singular_value(
    x: jax.Array, mesh: jax.sharding.Mesh | None = None, *, dtype=jnp.float32
) -> jax.Array:
    """min over p of σ_min(X_p), σ_min being the min(M, d)-th singular value of X_p (M, d).

    Args:
      x: (R, P, M, d), sharded P('sweep', 'data') when ``mesh`` is given; only a scalar per run is
        communicated (a pmin over 'data').
    Returns:
      (R,)
    """
    return spectra(x[:, None], mesh, dtype, ("sample",))[0][:, 0]


def spectral_stats(sv: jax.Array, n_rows: int, n_cols: int) -> dict[str, jax.Array]:
    """Summary of descending singular values of (n_rows, n_cols) matrices.

    Args:
      sv: (..., k) descending, k = min(n_rows, n_cols).
    Returns:
      dict of (...) arrays: sigma_max, sigma_min (the k-th), kappa = σ_max/σ_min,
      sigma_min_over_fro = σ_min/‖·‖_F, rank = #{σ > σ_max·max(n_rows, n_cols)·eps} (as NumPy's
      matrix_rank).
    """
    s_max, s_min = sv[..., 0], sv[..., -1]
    tol = s_max * max(n_rows, n_cols) * jnp.finfo(sv.dtype).eps
    return {
        "sigma_max": s_max,
        "sigma_min": s_min,
        "kappa": s_max / s_min,
        "sigma_min_over_fro": s_min / jnp.sqrt(jnp.sum(sv**2, axis=-1)),
        "rank": jnp.sum(sv > tol[..., None], axis=-1),
    }


def probe_attention(
    attn: jax.Array,
    z: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
    *,
    dtype=jnp.float32,
    per_sample: bool = True,
) -> dict[str, jax.Array]:
    """Per-step spectral metrics of the stacked Attn(X) and Z = Attn(X) + β X, per run and layer.

    Args:
      attn, z: (R, L, P, M, d), sharded P('sweep', None, 'data') when ``mesh`` is given. Call inside
        jit; the run axis is explicit (not under vmap).
      per_sample: also min_p σ_min of each sample's (M, d) matrix: one small SVD per sample, by far
        the larger part of the probe's cost when P is large.
    Returns:
      dict of (R, L) arrays keyed '{attn,z}/{sigma_max, sigma_min, kappa, sigma_min_over_fro, rank,
      sample_sigma_min}' (the last only with per_sample). The stacked matrices are (P·M, d); σ_min
      is their min(P·M, d)-th value.
    """
    _, _, n_samples, m, d = z.shape
    parts = ("stacked", "sample") if per_sample else ("stacked",)
    out = {}
    for name, x in (("attn", attn), ("z", z)):
        sv, *sample_min = spectra(x, mesh, dtype, parts)
        stats = spectral_stats(sv, n_samples * m, d)
        if per_sample:
            stats["sample_sigma_min"] = sample_min[0]
        out.update({f"{name}/{key}": value for key, value in stats.items()})
    return out


@dataclasses.dataclass(frozen=True)
class SpectralProbe:
    """`probe_attention` with its settings bound: (attn, z) -> dict of (R, L) arrays; the
    microbatched step takes the same settings to `probe_running`."""

    mesh: jax.sharding.Mesh | None = None
    dtype: object = jnp.float32
    per_sample: bool = True

    def __call__(self, attn: jax.Array, z: jax.Array) -> dict[str, jax.Array]:
        return probe_attention(attn, z, self.mesh, dtype=self.dtype, per_sample=self.per_sample)


def collapse_ratios(x: jax.Array, row_mask: jax.Array | None = None) -> jax.Array:
    """Dong et al. (2021)'s rank-collapse residual of each sample, per run and layer.

    res(X_p) = ‖X_p − 1 x̄_pᵀ‖_F / ‖X_p‖_F, x̄_p the mean row (the best constant row in Frobenius
    norm) of sample p's real rows: 0 when every token's row is the same (rank collapse), near 1
    for unstructured rows.

    Args:
      x: (R, L, P, M, d). row_mask: (R, P, M), 1 on real rows (None: all real).
    Returns:
      (R, L, P).
    """
    mask = jnp.ones(x.shape[:1] + x.shape[2:4], x.dtype) if row_mask is None else row_mask
    mask = mask.astype(x.dtype)[:, None, :, :, None]  # (R, 1, P, M, 1)
    count = jnp.maximum(jnp.sum(mask, axis=-2, keepdims=True), 1)
    mean_row = jnp.sum(x * mask, axis=-2, keepdims=True) / count
    centred = jnp.sum(jnp.square((x - mean_row) * mask), axis=(-2, -1))
    total = jnp.sum(jnp.square(x * mask), axis=(-2, -1))
    return jnp.sqrt(centred / jnp.maximum(total, jnp.finfo(x.dtype).tiny))


def collapse_residual(x: jax.Array, row_mask: jax.Array | None = None) -> jax.Array:
    """`collapse_ratios` (x (R, L, P, M, d), row_mask (R, P, M)) averaged over samples: (R, L)."""
    return jnp.mean(collapse_ratios(x, row_mask), axis=-1)
