"""The spectral probe and the tangent-kernel certificate inside training (train.run).

The probe must be a pure observer (same losses and parameters with and without it), report the
singular values of the stacked Z = Attn(X) + βX of the step's own forward pass, agree across
meshes, and never move Z between devices; the certificate must hold where the theory says it does
and the divergence message must name the stable step size.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_collectives import largest_collective_elements
from jax.flatten_util import ravel_pytree

from resconv_jax import sharding, train
from resconv_jax.analysis import probe, theory
from resconv_jax.config_defaults import load_config_file
from resconv_jax.data import load_dataset
from resconv_jax.errors import ConfigError
from resconv_jax.models import RunSettings, transformer
from resconv_jax.runtime.checkpoint import Checkpointer
from resconv_jax.runtime.metrics import read_metrics
from resconv_jax.step import make_optimizer, make_step_functions
from resconv_jax.sweep import expand_runs, run_settings

TINY = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
PROBE_KEYS = [
    f"layer0/{m}/{k}"
    for m in ("attn", "z")
    for k in ("sigma_max", "sigma_min", "kappa", "sigma_min_over_fro", "rank", "sample_sigma_min")
]
# A tiny theory-regime problem (d = 16 ≥ P·M = 16) whose Jacobian (16 × 912) is cheap.
TINY_THEORY = {"data.num_samples": 4, "data.seq_len": 4, "data.dim": 16}


def tiny(**overrides):
    defaults = {"train.checkpoint_every": 1000, "train.async_checkpoints": False}
    return load_config_file(TINY, **(defaults | overrides))


def records_at(workdir, step: int) -> list[dict]:
    """The metrics lines of `step`, in run order."""
    return sorted(
        (r for r in read_metrics(str(workdir)) if r["step"] == step), key=lambda r: r["run"]
    )


def loss_column(workdir) -> list[tuple[int, int, float]]:
    return [(r["step"], r["run"], r["loss"]) for r in read_metrics(str(workdir))]


def final_params(config, workdir) -> dict:
    """The parameters of the last checkpoint in `workdir`, as NumPy arrays."""
    runs = expand_runs(config)
    data = load_dataset(config)
    model_cfg = transformer.model_config(
        config.model, d=data.x_train.shape[-1], d_y=data.y_train.shape[-1]
    )
    model = transformer.make_model(model_cfg)
    abstract = train.initial_state(model, runs, make_optimizer(config.optim))
    checkpointer = Checkpointer(str(workdir), every=1, keep=1, use_async=False)
    try:
        step, state, _ = checkpointer.restore_latest(abstract)
    finally:
        checkpointer.close()
    assert step == config.train.num_steps
    return jax.tree.map(np.asarray, state["params"])


# Three runs (β = 0, 0.5, 1) of tiny for 20 steps (4 chunks of log_every = 5), so that three of
# the probed steps are chunk starts after training has moved the parameters.
STEPS = {"train.num_steps": 20, "train.checkpoint_every": 20}


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    """tiny with the probe on, default mesh: 3 runs -> sweep 1 × data 8."""
    workdir = tmp_path_factory.mktemp("probed")
    config = tiny(**STEPS)
    assert config.probe.enabled
    train.run(config, str(workdir))
    return config, workdir


@pytest.mark.parametrize("factor, warned", [(0.5, False), (2.5, True)])
def test_a_step_size_above_two_over_lambda_max_at_init_is_said(tmp_path, capsys, factor, warned):
    """η = factor/λ_max(K) at initialization: above 2/λ_max the protocol's premise fails, which
    the run now says in one line (configs/sst2.py's η was 3.3x above it at L = 6, β = 0)."""
    config = tiny(**TINY_THEORY, **{
        "train.num_steps": 2, "train.log_every": 2, "certificate.every": 2,
        "optim.lr_rule": "lambda_max", "optim.lr_factor": factor})  # fmt: skip
    train.run(config, str(tmp_path))
    said = [line for line in capsys.readouterr().out.splitlines() if "warning: η" in line]
    assert len(said) == warned, said
    if warned:
        assert "for 3 of 3 runs: r0 (η·λ_max/2 = 1.25), r1 (η·λ_max/2 = 1.25)" in said[0]


@pytest.mark.slow
def test_probe_leaves_losses_and_parameters_unchanged(probed_run, tmp_path):
    config, probed = probed_run
    plain = tmp_path / "plain"
    train.run(tiny(**STEPS, **{"probe.enabled": False}), str(plain))
    assert not any("/" in k for r in read_metrics(str(plain)) for k in r)
    assert all(k in r for r in records_at(probed, 0) for k in PROBE_KEYS)
    # Exact: the probe only reads intermediates that the loss computes anyway, so the loss, its
    # gradient and the update are the same XLA computation with or without it.
    assert loss_column(probed) == loss_column(plain)
    with_probe, without = final_params(config, probed), final_params(config, plain)
    for a, b in zip(jax.tree.leaves(with_probe), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)


def test_probe_every_two_log_steps_without_per_sample_values(probed_run, tmp_path):
    _, probed = probed_run
    sparse = tmp_path / "sparse"
    train.run(tiny(**STEPS, **{"probe.every": 10, "probe.per_sample": False}), str(sparse))
    records = read_metrics(str(sparse))
    assert sorted({r["step"] for r in records if PROBE_KEYS[0] in r}) == [0, 10]
    assert not any("sample_sigma_min" in k for r in records for k in r)
    assert loss_column(sparse) == loss_column(probed)
    for a, b in zip(records_at(sparse, 10), records_at(probed, 10), strict=True):
        assert a["layer0/z/sigma_max"] == b["layer0/z/sigma_max"]


def reference_z_singular_values(config, beta: float, seed: int) -> np.ndarray:
    """float64 singular values of the stacked (P·M, d) Z of layer 0 at initialization."""
    data = load_dataset(config)
    model_cfg = transformer.model_config(
        config.model, d=data.x_train.shape[-1], d_y=data.y_train.shape[-1]
    )
    graphdef, params = transformer.init_params(model_cfg, seed)
    _, inter = transformer.apply(
        graphdef, params, jnp.asarray(data.x_train), beta, beta, return_intermediates=True
    )
    z = np.asarray(inter["z"][0], np.float64)
    p, m, d = z.shape
    return np.linalg.svd(z.reshape(p * m, d), compute_uv=False)


def test_probe_values_match_an_svd_of_the_models_z(probed_run):
    config, workdir = probed_run
    records = records_at(workdir, 0)
    assert [r["beta_attn"] for r in records] == [0.0, 0.5, 1.0]
    for record in records:
        assert record["beta_ffn"] == record["beta_attn"]
        sv = reference_z_singular_values(config, record["beta_attn"], record["seed"])
        np.testing.assert_allclose(record["layer0/z/sigma_max"], sv[0], rtol=1e-4)
        np.testing.assert_allclose(record["layer0/z/sigma_min"], sv[-1], rtol=1e-3)


SHORT = {"train.num_steps": 10, "train.checkpoint_every": 10}


@pytest.mark.slow
def test_float64_probe_of_a_float32_model(probed_run, tmp_path):
    """x64 on for the probe only: the same float32 training, the probe's values in float64."""
    _, probed = probed_run
    with jax.enable_x64(True):
        config = tiny(**SHORT, **{"probe.dtype": "float64"})
        train.run(config, str(tmp_path))
        for record in records_at(tmp_path, 0):
            sv = reference_z_singular_values(config, record["beta_attn"], record["seed"])
            np.testing.assert_allclose(record["layer0/z/sigma_max"], sv[0], rtol=1e-4)
            np.testing.assert_allclose(record["layer0/z/sigma_min"], sv[-1], rtol=1e-3)
    float32_losses = [row for row in loss_column(probed) if row[0] <= 10]
    assert loss_column(tmp_path) == float32_losses


@pytest.mark.slow
def test_float64_model_trains_in_float64_from_the_float32_draws(tmp_path):
    with jax.enable_x64(True):
        config = tiny(**SHORT, **{"model.dtype": "float64"})
        train.run(config, str(tmp_path))
        params64 = final_params(config, tmp_path)
        model_cfg = transformer.model_config(config.model, d=32, d_y=1)
        _, init64 = transformer.init_params(model_cfg, 0)
    _, init32 = transformer.init_params(dataclasses.replace(model_cfg, dtype="float32"), 0)
    assert {a.dtype for a in jax.tree.leaves(params64)} == {np.dtype(np.float64)}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.float64(b)), init64, init32)
    losses = [loss for step, run, loss in loss_column(tmp_path) if run == 0]
    assert losses[-1] < losses[0]


def test_float64_without_x64_is_one_line_config_error(tmp_path):
    for field in ("model.dtype", "probe.dtype"):
        with pytest.raises(ConfigError, match=f"config.{field}=float64 needs jax_enable_x64"):
            train.run(tiny(**{field: "float64"}), str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()


def test_probe_values_same_on_eight_devices_and_one(probed_run, tmp_path):
    config, eight = probed_run
    one = tmp_path / "one"
    train.run(tiny(**STEPS, **{"mesh.sweep": 1, "mesh.data": 1}), str(one))
    probed_steps = sorted({r["step"] for r in read_metrics(str(eight)) if PROBE_KEYS[0] in r})
    assert probed_steps == [0, 5, 10, 15]
    # Step 0: the same parameters on both meshes, only the probe's SVD is computed differently
    # (8-way TSQR against one SVD): σ_min is backward stable, determined to ~eps·σ_max, and so
    # are κ and σ_min/‖·‖_F relatively to κ·eps.
    for a, b in zip(records_at(eight, 0), records_at(one, 0), strict=True):
        for key in PROBE_KEYS:
            matrix = key.rsplit("/", 1)[0]
            kappa = b[f"{matrix}/kappa"]
            sigma_min_based = key.endswith(("/sigma_min", "/kappa", "/sigma_min_over_fro"))
            rtol = 1e-5 + (1e-6 * kappa if sigma_min_based else 0.0)
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, err_msg=key)
    # Later steps: the gradient all-reduce over 8 devices sums in another order, so parameters
    # differ by float32 rounding (losses agree to ~1e-7); Attn(X) becomes nearly singular while
    # training (κ up to ~5e5), where σ_min is determined only to ~eps·σ_max (backward stability):
    # compare σ_min absolutely on the scale of σ_max, the well-conditioned values relatively.
    for step in probed_steps[1:]:
        for a, b in zip(records_at(eight, step), records_at(one, step), strict=True):
            for m in ("attn", "z"):
                key = f"layer0/{m}/"
                sigma_max = b[key + "sigma_max"]
                np.testing.assert_allclose(a[key + "sigma_max"], sigma_max, rtol=1e-5)
                np.testing.assert_allclose(
                    a[key + "sigma_min"], b[key + "sigma_min"], rtol=0, atol=1e-6 * sigma_max
                )
                np.testing.assert_allclose(
                    a[key + "sample_sigma_min"], b[key + "sample_sigma_min"], rtol=1e-4
                )


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, num_runs", [((1, 8), 1), ((2, 4), 2)])
def test_compiled_training_step_moves_no_z_sized_array(mesh_shape, num_runs):
    """run_steps as train.run compiles it: the only collectives are the probe's d×d R factors and
    scalars, and the gradient all-reduce. The sizes make each run's stacked Z (P·M, d) =
    (4096, 16) far larger than the gathered R factors (n_data·d, d) = (≤ 128, 16) and than the
    parameters (912 per run: d = 16, d_qk = 4, d_h = 16, d_y = 1), so that a parameter-sized
    all-reduce can neither be mistaken for, nor hide, a gathered Z."""
    config = tiny(
        **{
            "data.num_samples": 64,
            "data.seq_len": 64,
            "data.dim": 16,
            "sweep.beta": (0.0, 1.0)[:num_runs],
            "mesh.sweep": mesh_shape[0],
            "mesh.data": mesh_shape[1],
        }
    )
    runs = expand_runs(config)
    data = load_dataset(config)
    model_cfg = transformer.model_config(
        config.model, d=data.x_train.shape[-1], d_y=data.y_train.shape[-1]
    )
    mesh = sharding.make_mesh(len(runs), data.x_train.shape[0], config.mesh)
    assert dict(mesh.shape) == {"sweep": mesh_shape[0], "data": mesh_shape[1]}
    put_data = functools.partial(sharding.put, sharding=sharding.data_sharding(mesh))
    x, y = put_data(data.x_train), put_data(data.y_train)
    on_runs = sharding.run_sharding(mesh)
    hp = sharding.put_tree(run_settings(runs), on_runs)
    optimizer = make_optimizer(config.optim)
    initial = train.initial_state(transformer.make_model(model_cfg), runs, optimizer)
    state = sharding.put_tree(initial, on_runs)
    num_params = sum(leaf[0].size for leaf in jax.tree.leaves(state["params"]))

    def compiled_hlo(probe_fn):
        fns = make_step_functions(
            transformer.make_model(model_cfg),
            optimizer,
            config.optim.reduction,
            config.train.log_every,
            probe=probe_fn,
        )
        state_sharding = jax.tree.map(lambda _: on_runs, state)
        jitted = jax.jit(fns.run_steps, donate_argnums=0, out_shardings=(state_sharding, None))
        steps, probe_now = jnp.int32(config.train.log_every), jnp.bool_(True)
        return jitted.lower(state, hp, x, y, steps, probe_now).compile().as_text()

    probed = compiled_hlo(functools.partial(probe.probe_attention, mesh=mesh))
    plain = compiled_hlo(None)
    assert "all-gather" in probed and "all-gather" not in plain  # the probe's TSQR is compiled in
    n_data, d = mesh_shape[1], config.data.dim
    runs_per_device = num_runs // mesh_shape[0]
    gathered_r = runs_per_device * n_data * d * d  # (R_local, L = 1, n_data·d, d)
    z_elements = num_runs * config.data.num_samples * config.data.seq_len * d
    assert z_elements >= 32 * max(num_params, gathered_r)  # so that the check means something
    largest = largest_collective_elements(probed)
    assert 0 < largest <= max(gathered_r, num_params), (largest, gathered_r, num_params)
    assert largest <= z_elements // 32


@pytest.mark.slow
def test_certificate_holds_while_step_size_below_one_over_lambda_max(tmp_path):
    """η = 0.5/λ_max(K) at initialization (lr_rule="lambda_max"). λ_max(K) grows while training
    (with lr_factor=1, η·λ_max(K_t) reaches 1.8 by step 45, outside the certificate's premise), so
    the factor 0.5 keeps η ≤ 1/λ_max(K_t) at every check; that premise is asserted from the
    metrics, then the bound at every check."""
    config = tiny(
        **TINY_THEORY,
        **{
            "train.num_steps": 30,
            "certificate.every": 5,
            "optim.lr_rule": "lambda_max",
            "optim.lr_factor": 0.5,
        },
    )
    train.run(config, str(tmp_path))
    checked = [r for r in read_metrics(str(tmp_path)) if "ntk/holds" in r]
    assert sorted({r["step"] for r in checked}) == list(range(0, 30, 5))
    assert len(checked) == 6 * 3
    for r in records_at(tmp_path, 0):  # η = 0.5/λ_max(K) at initialization, per run
        np.testing.assert_allclose(r["lr"] * r["ntk/lambda_max"], 0.5, rtol=1e-5)
    for r in checked:
        assert r["lr"] * r["ntk/lambda_max"] <= 1.0, r  # the certificate's premise
        assert r["ntk/lambda_min"] > 0  # n = 16 outputs < p = 912 parameters: K is full rank
        np.testing.assert_allclose(
            r["ntk/bound"], (1 - r["lr"] * r["ntk/lambda_min"]) ** 2, rtol=1e-5
        )
        assert r["contraction"] <= r["ntk/bound"] * (1 + 1e-6), r
        assert r["ntk/holds"] == 1.0, r


@pytest.mark.slow
def test_kernel_from_j_jt_and_jt_j_share_nonzero_eigenvalues():
    """K = J Jᵀ (n × n) and G = Jᵀ J (p × p) of the actual model, float64, for one run (β = 1)."""
    config = tiny(**TINY_THEORY)
    data = load_dataset(config)
    model_cfg = transformer.model_config(
        config.model, d=data.x_train.shape[-1], d_y=data.y_train.shape[-1]
    )
    # Initialized in float32 as in training (and without recompiling the initializers for x64),
    # then evaluated in float64.
    graphdef, params = transformer.init_params(model_cfg, 0)
    params = jax.tree.map(np.asarray, params)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        model = transformer.make_model(model_cfg)
        fns = make_step_functions(model, make_optimizer(config.optim), "sum", 1)
        hp = RunSettings(jnp.float64(1.0), jnp.float64(1.0))
        x = jnp.asarray(data.x_train, jnp.float64)
        theta, unravel = ravel_pytree(params)

        def flat_predict(t):
            return jnp.ravel(fns.predict(unravel(t), hp, x))

        jac_rev = np.asarray(jax.jit(jax.jacrev(flat_predict))(theta))
        jac_fwd = np.asarray(jax.jit(jax.jacfwd(flat_predict))(theta))
        assert jac_rev.dtype == np.float64
        n, p = jac_rev.shape
        assert (n, p) == (16, 912)
        np.testing.assert_allclose(jac_fwd, jac_rev, rtol=1e-9, atol=1e-12 * np.abs(jac_rev).max())
        k_eig = np.linalg.eigvalsh(jac_rev @ jac_rev.T)
        g_eig = np.linalg.eigvalsh(jac_fwd.T @ jac_fwd)
        np.testing.assert_allclose(g_eig[-n:], k_eig, rtol=1e-9, atol=1e-12 * k_eig[-1])
        assert np.all(np.abs(g_eig[:-n]) <= 1e-10 * k_eig[-1])  # the other p − n are zero
        lam_min, lam_max = jax.jit(theory.tangent_kernel_eigenvalues, static_argnums=0)(
            lambda q: fns.predict(q, hp, x), params
        )
        np.testing.assert_allclose([lam_min, lam_max], k_eig[[0, -1]], rtol=1e-9)


@pytest.mark.parametrize("lr", [0.01, 1.0], ids=["diverges-after-first-check", "diverges-at-once"])
def test_divergence_message_names_stable_step_size(tmp_path, lr):
    config = tiny(**{"optim.lr": lr, "train.num_steps": 100, "certificate.every": 5})
    with pytest.raises(train.TrainingDiverged) as error:
        train.run(config, str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "diverged" in message
    assert "2/lambda_max" in message, message


@pytest.mark.slow
def test_the_jena_sweep_on_8_devices_does_not_deadlock_in_the_per_sample_probe(tmp_path):
    """15 runs x 256 windows of 24 x 6, probed per sample on 8 CPU devices sharing 2 cores: with
    LAPACK batches of ~50 kFLOP the first chunk hung forever (every pool thread blocked)."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    command = [
        sys.executable, "-m", "resconv_jax.main", "--config=configs/jena.py",
        f"--workdir={tmp_path}", "--config.train.num_steps=10",
    ]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    try:
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("the Jena sweep hung in its first chunk on 8 devices")
    assert result.returncode == 0, result.stderr[-2000:]
