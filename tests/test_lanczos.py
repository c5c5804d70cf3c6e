"""Lanczos on the tangent kernel against the dense eigenvalues; breakdown, batching, memory."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resconv_jax.analysis import theory
from resconv_jax.analysis.lanczos import _lanczos, tangent_kernel_lanczos
from resconv_jax.models import RunSettings, transformer
from resconv_jax.models.gpt2 import modeling as gpt2
from resconv_jax.models.gpt2 import weights


def lanczos(f, params, iterations):
    return jax.jit(lambda p: tangent_kernel_lanczos(f, p, iterations=iterations))(params)


def dense(f, params):
    return [
        float(v) for v in jax.jit(theory.tangent_kernel_eigenvalues, static_argnums=0)(f, params)
    ]


def assert_matches_dense(f, params, iterations):
    """Lanczos with k = m against `theory.tangent_kernel_eigenvalues`; returns the spectrum."""
    spec = lanczos(f, params, iterations)
    lam_min, lam_max = dense(f, params)
    np.testing.assert_allclose(spec.lam_max, lam_max, rtol=1e-6)
    np.testing.assert_allclose(spec.lam_min, lam_min, rtol=1e-6, atol=1e-12 * lam_max)
    assert spec.res_max < 1e-8 * lam_max and spec.res_min < 1e-8 * lam_max
    return spec


def paper_model(x_shape=(4, 5, 6), num_layers=2):
    cfg = transformer.ModelConfig(
        d=6, d_qk=3, d_h=10, d_y=2, num_layers=num_layers, dtype="float64"
    )
    model = transformer.make_model(cfg)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(x_shape))
    return model, x


def paper_outputs(hp, seed):
    """(f, params): params -> the paper model's outputs on `paper_model`'s x, at residuals hp."""
    model, x = paper_model()
    return (lambda p: model.apply(p, x, hp)), model.init(seed)


@pytest.mark.slow
def test_paper_model_matches_dense_in_float64():
    with jax.enable_x64(True):
        f, params = paper_outputs(RunSettings(0.5, 1.0), seed=3)

        n, p = theory.jacobian_shape(f, params)
        assert n <= p
        spec = assert_matches_dense(f, params, iterations=n + 5)
        assert spec.lam_min > 0 and spec.products == n + 2


def test_more_outputs_than_parameters_gives_zero_lam_min():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((30, 3)))
        params = {
            "w1": jnp.asarray(rng.standard_normal((3, 2))),
            "w2": jnp.asarray(rng.standard_normal((2, 2))),
        }

        def f(q):
            return jnp.tanh(x @ q["w1"]) @ q["w2"]

        n, p = theory.jacobian_shape(f, params)
        assert n > p
        spec = assert_matches_dense(f, params, iterations=p)
        assert spec.lam_min == 0.0 and spec.res_min == 0.0 and spec.products == p + 1


@pytest.mark.slow
def test_gpt2_matches_dense_in_float64():
    with jax.enable_x64(True):
        shape = {"vocab_size": 30, "n_positions": 8, "n_embd": 8, "n_head": 2, "n_layer": 2}
        _, graphdef, params = weights.load_gpt2(
            "random", num_layers=1, num_classes=3, seed=0, shape=shape, dtype="float64"
        )
        rng = np.random.default_rng(2)
        lengths = np.array([6, 3, 1, 5])
        inputs = {
            "ids": jnp.asarray(rng.integers(0, 30, (4, 6)), jnp.int32),
            "mask": jnp.asarray(np.arange(6)[None] < lengths[:, None], jnp.float32),
        }

        def f(p):
            return gpt2.apply(graphdef, p, inputs, 0.5, 1.0)

        n, _ = theory.jacobian_shape(f, params)
        assert n == 12
        assert_matches_dense(f, params, iterations=n)


def test_rank_deficient_kernel_gives_zero_without_nan():
    rng = np.random.default_rng(3)
    n, p, rank = 12, 30, 3
    with jax.enable_x64(True):
        a = jnp.asarray(rng.standard_normal((n, rank)) @ rng.standard_normal((rank, p)))
        lam_max = float(np.linalg.eigvalsh(np.asarray(a @ a.T))[-1])
        for iterations in (rank + 2, n):  # breaks down after rank + 1 steps; restarts to n
            spec = lanczos(lambda t: a @ t, jnp.zeros(p), iterations)
            assert all(np.isfinite(v) for v in spec[:4])
            assert spec.lam_min <= spec.res_min < 1e-12 * lam_max
            np.testing.assert_allclose(spec.lam_max, lam_max, rtol=1e-10)
        basis, _, betas = jax.jit(_lanczos, static_argnums=(0, 1, 2, 3))(
            lambda v: a @ (a.T @ v), n, n, jnp.float64
        )
        assert betas[rank] < 1e-12 * lam_max  # the breakdown, to rounding
        np.testing.assert_allclose(basis @ basis.T, np.eye(n), atol=1e-12)
        # A zero kernel: everything breaks down, all zeros.
        spec = lanczos(lambda t: 0.0 * t[:5], jnp.zeros(p), 4)
        assert list(spec[:4]) == [0.0] * 4


def test_breakdown_with_full_rank_restarts_instead_of_inventing_zeros():
    # K = diag(1, 1, 4, 4, 9, 9, ...): the start vector's Krylov space has dimension 3 only.
    with jax.enable_x64(True):
        d = jnp.repeat(jnp.arange(1.0, 4.0), 3)
        spec = lanczos(lambda t: d * t, jnp.zeros(d.size), d.size)
        np.testing.assert_allclose([spec.lam_min, spec.lam_max], [1.0, 9.0], rtol=1e-12)
        basis, _, betas = jax.jit(_lanczos, static_argnums=(0, 1, 2, 3))(
            lambda v: d * d * v, d.size, d.size, jnp.float64
        )
        assert np.all(betas[2:] == 0.0)  # exact breakdown, then restarts in the eigenspaces
        np.testing.assert_allclose(basis @ basis.T, np.eye(d.size), atol=1e-14)


@pytest.mark.slow
def test_fewer_steps_bound_the_extremes_from_inside():
    with jax.enable_x64(True):
        f, params = paper_outputs(RunSettings(1.0, 1.0), seed=5)

        lam_min, lam_max = dense(f, params)
        spec = lanczos(f, params, 10)  # m = n = 40
        assert spec.products == 12
        assert lam_max * 0.97 < spec.lam_max <= lam_max * (1 + 1e-9)
        assert spec.lam_min >= lam_min * (1 - 1e-9)
        assert spec.res_max > 0 and spec.res_min > 0
        # Kahan–Parlett: an eigenvalue of K lies within the residual of each Ritz value.
        assert lam_max - spec.lam_max <= spec.res_max * (1 + 1e-9)


@pytest.mark.slow
def test_under_lax_map_and_vmap_over_runs():
    with jax.enable_x64(True):
        model, x = paper_model(num_layers=1)
        params = model.init_runs([0, 1])
        hp = RunSettings(jnp.array([0.0, 1.0]), jnp.array([1.0, 0.5]))

        def one(run):
            return tangent_kernel_lanczos(
                lambda p: model.apply(p, x, run[1]), run[0], iterations=40
            )

        mapped = jax.jit(lambda ps, h: jax.lax.map(one, (ps, h)))(params, hp)
        vmapped = jax.jit(jax.vmap(lambda ps, h: one((ps, h))))(params, hp)
        want = jax.jit(
            lambda ps, h: jax.lax.map(
                lambda run: theory.tangent_kernel_eigenvalues(
                    lambda p: model.apply(p, x, run[1]), run[0]
                ),
                (ps, h),
            )
        )(params, hp)
        for got in (mapped, vmapped):
            assert got.lam_min.shape == (2,)
            np.testing.assert_allclose(got.lam_min, want[0], rtol=1e-6)
            np.testing.assert_allclose(got.lam_max, want[1], rtol=1e-6)


SHAPE = re.compile(r"\b(?:pred|[a-z]+[0-9]+)\[([0-9,]*)\]")


def largest_buffer(fn, params) -> int:
    """Elements of the largest array shape anywhere in the compiled HLO of fn(params)."""
    text = jax.jit(fn).lower(params).compile().as_text()
    sizes = [math.prod(int(s) for s in dims.split(",") if s) for dims in SHAPE.findall(text)]
    return max(sizes)


@pytest.mark.parametrize("samples,width,hidden,out", [(32, 20, 200, 2), (500, 3, 4, 2)])
def test_no_jacobian_sized_buffer(samples, width, hidden, out):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((samples, width)), jnp.float32)
    params = {
        "w1": jnp.asarray(rng.standard_normal((width, hidden)), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((hidden, out)), jnp.float32),
    }

    def f(q):
        return jnp.tanh(x @ q["w1"]) @ q["w2"]

    n, p = theory.jacobian_shape(f, params)
    k = 20
    assert n * p > 5 * (k * min(n, p) + n + p + samples * max(width, hidden))
    assert largest_buffer(lambda q: tangent_kernel_lanczos(f, q, iterations=k), params) < n * p
    # The check can fail: the dense reference holds J.
    assert largest_buffer(lambda q: theory.tangent_kernel_eigenvalues(f, q), params) >= n * p


@pytest.mark.slow
def test_training_certificate_by_lanczos_equals_the_dense_one(tmp_path, capsys):
    """J over certificate.max_jacobian_entries: the trainer's certificate runs by Lanczos, says so
    in one line, logs residuals, and (k ≥ n, float64) matches the dense certificate to 1e-6."""
    import os

    from resconv_jax import train
    from resconv_jax.config_defaults import load_config_file
    from resconv_jax.runtime.metrics import read_metrics

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
    common = {
        "train.num_steps": 10,
        "certificate.every": 5,
        "model.dtype": "float64",
        "probe.enabled": False,
        "train.async_checkpoints": False,
    }
    lanczos = common | {"certificate.max_jacobian_entries": 1, "certificate.lanczos_iterations": 40}
    with jax.enable_x64(True):
        train.run(load_config_file(tiny, **common), str(tmp_path / "dense"))
        assert "Lanczos" not in capsys.readouterr().out
        train.run(load_config_file(tiny, **lanczos), str(tmp_path / "lanczos"))
    out = capsys.readouterr().out
    assert "by Lanczos (34 products J(Jᵀv) per run per check" in out  # n = 32 outputs: k = 32
    dense, by_lanczos = (read_metrics(str(tmp_path / name)) for name in ("dense", "lanczos"))
    checked = [(a, b) for a, b in zip(dense, by_lanczos, strict=True) if "ntk/lambda_min" in a]
    assert len(checked) == 6  # steps 0 and 5, 3 runs
    for a, b in checked:
        for key in ("ntk/lambda_min", "ntk/lambda_max", "ntk/bound"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
        assert 0 <= b["ntk/residual_min"] < 1e-8 * b["ntk/lambda_max"]
        assert "ntk/residual_min" not in a
