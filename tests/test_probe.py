"""Spectral probe: TSQR singular values against NumPy, sharding, and no large collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_collectives import largest_collective_elements
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from resconv_jax.analysis import linalg, probe


def make_mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, ("sweep", "data"), axis_types=(axis_type, axis_type))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def conditioned(rng, n, d, kappa):
    """(n, d) float32 matrix U diag(s) Vᵀ, s log-spaced from 1 to 1/kappa."""
    u, _ = np.linalg.qr(rng.standard_normal((n, d)))
    v, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return ((u * np.logspace(0, -np.log10(kappa), d)) @ v.T).astype(np.float32)


def numpy_sv(x):
    """(R, P, M, d) -> (R, min(P·M, d)) float64 singular values of the stacked matrices."""
    r, p, m, d = x.shape
    return np.linalg.svd(x.reshape(r, p * m, d).astype(np.float64), compute_uv=False)


def stacked_sv(x, mesh):
    if mesh is None:
        return np.asarray(jax.jit(probe.stacked_singular_values)(x))
    x = put(x, mesh, P("sweep", "data"))
    return np.asarray(jax.jit(lambda a: probe.stacked_singular_values(a, mesh))(x))


def test_random_matrices_single_device():
    x = np.random.default_rng(0).standard_normal((2, 12, 7, 10)).astype(np.float32)  # 84 rows
    np.testing.assert_allclose(stacked_sv(x, None), numpy_sv(x), rtol=1e-5)


@pytest.mark.parametrize("kappa", [1e2, 1e3, 1e4])
@pytest.mark.parametrize("shape", [(1, 1), (1, 8), (2, 4)])
def test_ill_conditioned(kappa, shape):
    rng = np.random.default_rng(int(np.log10(kappa)))
    x = np.stack([conditioned(rng, 8 * 100, 24, kappa) for _ in range(2)]).reshape(2, 8, 100, 24)
    sv, ref = stacked_sv(x, make_mesh(shape)), numpy_sv(x)
    np.testing.assert_allclose(sv[:, 0], ref[:, 0], rtol=1e-5)
    np.testing.assert_allclose(sv[:, -1], ref[:, -1], rtol=1e-3)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_meshes_agree(axis_type):
    x = np.random.default_rng(1).standard_normal((8, 16, 9, 20)).astype(np.float32)  # 144 rows
    one = stacked_sv(x, make_mesh((1, 1), axis_type))
    for shape in [(1, 8), (2, 4), (8, 1)]:
        np.testing.assert_allclose(stacked_sv(x, make_mesh(shape, axis_type)), one, rtol=1e-5)


def test_fewer_local_rows_than_columns():
    x = np.random.default_rng(2).standard_normal((2, 8, 3, 40)).astype(np.float32)  # 3 rows/device
    sv = stacked_sv(x, make_mesh((1, 8)))
    assert sv.shape == (2, 24)
    np.testing.assert_allclose(sv, numpy_sv(x), rtol=1e-5)


def test_float64():
    x = conditioned(np.random.default_rng(3), 512, 16, 1e4).reshape(1, 8, 64, 16)
    with jax.enable_x64(True):
        mesh = make_mesh((1, 8))
        xs = put(x, mesh, P("sweep", "data"))
        f = jax.jit(lambda a: probe.stacked_singular_values(a, mesh, dtype=jnp.float64))
        sv = f(xs)
        assert sv.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(sv), numpy_sv(x), rtol=1e-10)
    with pytest.raises(ValueError, match="x64"):
        probe.stacked_singular_values(x, dtype=jnp.float64)


@pytest.mark.parametrize("m,d", [(12, 5), (4, 9)])
def test_per_sample_min_singular_value(m, d):
    x = np.random.default_rng(4).standard_normal((2, 8, m, d)).astype(np.float32)
    ref = np.linalg.svd(x.astype(np.float64), compute_uv=False)[..., -1].min(axis=1)
    np.testing.assert_allclose(probe.per_sample_min_singular_value(x), ref, rtol=1e-5)
    mesh = make_mesh((2, 4))
    f = jax.jit(lambda a: probe.per_sample_min_singular_value(a, mesh))
    np.testing.assert_allclose(f(put(x, mesh, P("sweep", "data"))), ref, rtol=1e-5)


def test_spectral_stats():
    rng = np.random.default_rng(5)
    low_rank = (rng.standard_normal((60, 6)) @ rng.standard_normal((6, 10))).astype(np.float32)
    full = rng.standard_normal((60, 10)).astype(np.float32)
    x = np.stack([low_rank, full]).reshape(2, 6, 10, 10)
    stats = probe.spectral_stats(probe.stacked_singular_values(x), 60, 10)
    ref = numpy_sv(x)
    np.testing.assert_array_equal(stats["rank"], [6, 10])
    np.testing.assert_array_equal(
        stats["rank"], [np.linalg.matrix_rank(a) for a in x.reshape(2, 60, 10)]
    )
    fro = np.linalg.norm(x.reshape(2, 60, 10).astype(np.float64), axis=(1, 2))
    np.testing.assert_allclose(stats["sigma_min_over_fro"][1], ref[1, -1] / fro[1], rtol=1e-5)
    np.testing.assert_allclose(stats["kappa"][1], ref[1, 0] / ref[1, -1], rtol=1e-5)


def test_probe_attention_values():
    rng = np.random.default_rng(6)
    attn = rng.standard_normal((2, 3, 8, 6, 4)).astype(np.float32)
    z = attn + rng.standard_normal(attn.shape).astype(np.float32)
    mesh = make_mesh((2, 4))
    spec = P("sweep", None, "data")
    out = jax.jit(lambda a, b: probe.probe_attention(a, b, mesh))(
        put(attn, mesh, spec), put(z, mesh, spec)
    )
    keys = ["sigma_max", "sigma_min", "kappa", "sigma_min_over_fro", "rank", "sample_sigma_min"]
    assert set(out) == {f"{p}/{k}" for p in ("attn", "z") for k in keys}
    assert all(v.shape == (2, 3) for v in out.values())
    ref = numpy_sv(z[:, 1])
    np.testing.assert_allclose(out["z/sigma_max"][:, 1], ref[:, 0], rtol=1e-5)
    np.testing.assert_allclose(out["z/sigma_min"][:, 1], ref[:, -1], rtol=1e-4)
    sample = np.linalg.svd(attn.astype(np.float64), compute_uv=False)[..., -1].min(axis=2)
    np.testing.assert_allclose(out["attn/sample_sigma_min"], sample, rtol=1e-5)


def compiled_hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_no_collective_as_large_as_stacked_z():
    """The compiled probe moves only d×d R factors and scalars, never the rows of Z."""
    rng = np.random.default_rng(7)
    mesh, spec = make_mesh((2, 4)), P("sweep", None, "data")
    shape = (2, 2, 64, 32, 16)  # (R, L, P, M, d): per run and layer, a (2048, 16) stacked Z
    attn, z = (put(rng.standard_normal(shape).astype(np.float32), mesh, spec) for _ in range(2))
    hlo = compiled_hlo(lambda a, b: probe.probe_attention(a, b, mesh), attn, z)
    largest = largest_collective_elements(hlo)
    assert 0 < largest <= z.size // 64, (largest, z.size)


def test_collective_check_flags_a_gathering_implementation():
    mesh = make_mesh((1, 8), AxisType.Auto)
    x = put(np.ones((2, 64, 32, 16), np.float32), mesh, P("sweep", "data"))

    def gathering(a):
        stacked = a.reshape(2, 64 * 32, 16)
        return jnp.linalg.svd(stacked, full_matrices=False, compute_uv=False)

    assert largest_collective_elements(compiled_hlo(gathering, x)) >= x.size // 2


def test_largest_collective_elements_parses_hlo():
    hlo = "\n".join(
        [
            "  %p = f32[4,1024]{1,0} parameter(0)",
            "  %rs = f32[4,128]{1,0} reduce-scatter(%p), dimensions={1}, to_apply=%add",
            "  %ar = (f32[2,3]{1,0}, f32[7]{0}) all-reduce(%x, %y), to_apply=%min",
            "  ROOT %t = f32[4,128]{1,0} add(%rs, %rs)",
        ]
    )
    assert largest_collective_elements(hlo) == 4096
    assert largest_collective_elements("  %a = f32[8]{0} add(%b, %c)") == 0


def test_small_batches_loops_on_cpu_and_batches_elsewhere(monkeypatch):
    x = jax.random.normal(jax.random.key(0), (3, 5, 8, 6))
    looped = jax.jit(lambda a: linalg.small_batches(probe.singular_values, a))
    assert "while" in looped.lower(x).as_text()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    batched = jax.jit(lambda a: linalg.small_batches(probe.singular_values, a))
    assert "while" not in batched.lower(x).as_text()
    np.testing.assert_allclose(batched(x), looped(x), rtol=1e-6)
    assert batched(x).shape == (3, 5, 6)


def test_one_device_mesh_probe_needs_no_qr_for_a_wide_stacked_matrix():
    """P·M ≤ d on a 1 × 1 mesh (the theory regime): one SVD per matrix, no QR, same values."""
    mesh = make_mesh((1, 1), AxisType.Auto)
    rng = np.random.default_rng(0)
    attn, z = (jnp.asarray(rng.standard_normal((2, 1, 4, 4, 16)), jnp.float32) for _ in range(2))
    on_mesh = jax.jit(lambda a, b: probe.probe_attention(a, b, mesh))
    assert "geqrf" not in on_mesh.lower(attn, z).compile().as_text()
    without_mesh = jax.jit(lambda a, b: probe.probe_attention(a, b))(attn, z)
    for key, value in on_mesh(attn, z).items():
        np.testing.assert_allclose(value, without_mesh[key], rtol=1e-6, err_msg=key)
    tall = jnp.asarray(rng.standard_normal((2, 1, 8, 8, 16)), jnp.float32)
    assert "geqrf" in on_mesh.lower(tall, tall).compile().as_text()


def test_collapse_residual_is_zero_for_identical_rows_and_ignores_padding():
    from resconv_jax.analysis.probe import collapse_residual

    rng = np.random.default_rng(0)
    row = rng.standard_normal((1, 1, 3, 1, 5))
    collapsed = np.broadcast_to(row, (1, 1, 3, 4, 5)).copy()  # (R, L, P, M, d), rows all equal
    noisy = rng.standard_normal((1, 1, 3, 4, 5))
    x = np.concatenate([collapsed, noisy], axis=1)  # layer 0 collapsed, layer 1 not
    res = np.asarray(collapse_residual(jnp.asarray(x)))
    assert res.shape == (1, 2) and res[0, 0] < 1e-6 and 0.5 < res[0, 1] <= 1.0
    padded = x.copy()
    padded[:, :, :, 3] = 1e3  # garbage in the padding row
    mask = np.ones((1, 3, 4), np.float32)
    mask[:, :, 3] = 0
    expected = np.asarray(collapse_residual(jnp.asarray(x[:, :, :, :3])))
    got = np.asarray(collapse_residual(jnp.asarray(padded), jnp.asarray(mask)))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
