"""Rank collapse at initialization: outputs, the collapse itself, uniform attention, bad input."""

import csv
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from resconv_jax.analysis import probe
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError, WorkdirWriteError
from resconv_jax.experiments import rank_collapse, rank_collapse_plot
from resconv_jax.models import transformer

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "configs", "rank_collapse.py")
# P = 4 samples of M = 8 tokens, d = 4: X_p has full rank 4. d_QK = 1024 is cheap at d = 4.
TINY = {
    "data.num_samples": 4,
    "data.seq_len": 8,
    "data.dim": 4,
    "rank_collapse.d_qk_values": (1, 1024),
    "rank_collapse.seeds": (0, 1),
}


def tiny(**overrides):
    return load_config_file(CONFIG, **(TINY | overrides))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rank_collapse")
    return workdir, rank_collapse.spectra(tiny(), str(workdir))


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def row(rows, qk_init, d_qk) -> dict:
    (found,) = [r for r in rows if r["qk_init"] == qk_init and r["d_qk"] == d_qk]
    return found


def test_config_file_is_the_protocol():
    config = load_config_file(CONFIG)
    assert config.task == "rank_collapse"
    assert tuple(config.rank_collapse.d_qk_values) == (1, 4, 16, 64, 256, 1024, 4096)
    assert set(config.rank_collapse.qk_inits) == {"1/d_qk", "1/d"}
    assert len(config.rank_collapse.seeds) >= 3
    assert config.data.seq_len >= config.data.dim  # X_p full rank d
    rank_collapse.validate(config)


def test_writes_csv_png_and_config(tiny_run, capsys):
    workdir, rows = tiny_run
    assert [(r["qk_init"], r["d_qk"]) for r in rows] == [
        ("1/d_qk", 1),
        ("1/d_qk", 1024),
        ("1/d", 1),
        ("1/d", 1024),
    ]
    table = read_csv(workdir / rank_collapse.CSV_FILE)
    assert [(r["qk_init"], int(r["d_qk"])) for r in table] == [
        (r["qk_init"], r["d_qk"]) for r in rows
    ]
    for column in rank_collapse.COLUMNS:
        for stat in ("mean", "min", "max"):
            got = [float(r[f"{column}/{stat}"]) for r in table]
            np.testing.assert_allclose(got, [r[f"{column}/{stat}"] for r in rows], rtol=1e-12)
    seeds = read_csv(workdir / rank_collapse.SEEDS_CSV_FILE)
    assert len(seeds) == 4 * 2 and {int(r["seed"]) for r in seeds} == {0, 1}
    for r in rows:  # the aggregate is over the per-seed rows
        values = [
            float(s["attn_ratio_p_mean"])
            for s in seeds
            if s["qk_init"] == r["qk_init"] and int(s["d_qk"]) == r["d_qk"]
        ]
        assert r["attn_ratio_p_mean/mean"] == pytest.approx(np.mean(values), rel=1e-6)
        assert r["attn_ratio_p_mean/min"] == pytest.approx(min(values), rel=1e-6)
    with open(workdir / rank_collapse.PLOT_FILE, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(workdir / rank_collapse.PLOT_FILE) > 10_000
    with open(workdir / rank_collapse.CONFIG_FILE) as f:
        assert json.load(f)["rank_collapse"]["seeds"] == [0, 1]


def test_final_line_quotes_the_largest_d_qk():
    rows = [
        {"qk_init": q, "d_qk": d, "num_seeds": 2}
        | {f"{c}/{s}": 0.5 for c in rank_collapse.COLUMNS for s in ("mean", "min", "max")}
        for q in ("1/d", "1/d_qk")
        for d in (4, 64)
    ]
    assert rank_collapse.final_line(rows).startswith("d_QK=64, qk_init=1/d_qk:")


def test_attn_collapses_with_d_qk_and_the_residual_does_not(tiny_run):
    """At d = 4, M = 8: measured per-sample σ_min/σ_max (mean over p), seeds 0 and 1.

    "1/d_qk": Attn(X) 3.7e-3 … 1.2e-2 at d_QK = 1, 4.9e-5 … 7.2e-5 at 1024 (50× below);
    Attn(X)+X 0.24 … 0.29, X itself 0.32. Stable rank of A_p: ≥ 1.045 at 1, ≤ 1.00003 at
    1024. "1/d" at 1024: Attn(X) 7.1e-3 … 1.5e-2, no collapse.
    """
    _, rows = tiny_run
    small, large = row(rows, "1/d_qk", 1), row(rows, "1/d_qk", 1024)
    assert large["attn_ratio_p_mean/max"] < small["attn_ratio_p_mean/min"] / 20
    assert large["attn_stable_rank_p_mean/max"] < 1.001  # ‖A_p‖_F ≈ σ_max: rank one
    assert small["attn_stable_rank_p_mean/min"] > 1.01  # measured 1.045
    fixed = row(rows, "1/d", 1024)  # variance 1/d: the logits do not concentrate
    assert fixed["attn_ratio_p_mean/min"] > 20 * large["attn_ratio_p_mean/max"]
    for r in rows:  # the residual keeps every Z_p well conditioned
        assert r["z_ratio_p_mean/min"] > 0.2
        assert r["z_ratio_p_min/min"] > 0.1
        assert r["z_rank_p_mean/min"] == 4
        assert r["z_ratio_stacked/min"] > 0.2


@pytest.mark.slow
def test_float64_agrees_with_float32_above_the_float32_floor(tiny_run, tmp_path):
    """The same weights (drawn in float32) in float64: the ratios float32 resolves agree."""
    _, rows32 = tiny_run
    with jax.enable_x64(True):
        rows64 = rank_collapse.spectra(tiny(**{"model.dtype": "float64"}), str(tmp_path))
    for r32, r64 in zip(rows32, rows64, strict=True):
        for column in ("attn_ratio_p_mean/mean", "z_ratio_p_mean/mean", "attn_ratio_stacked/mean"):
            assert r32[column] > rank_collapse.FLOAT32_FLOOR
            np.testing.assert_allclose(r64[column], r32[column], rtol=1e-3, err_msg=column)
    assert rank_collapse.rounding_floor("float64") < 1e-15


def test_block_is_layer_zero_of_the_transformer():
    cfg = transformer.ModelConfig(d=4, d_qk=8, d_h=6, d_y=1, qk_init="1/d_qk")
    _, stacked = rank_collapse.make_blocks(cfg, (3, 5))
    for i, seed in enumerate((3, 5)):
        _, params = transformer.init_params(cfg, seed)
        for name, value in params["blocks"][0].items():
            np.testing.assert_array_equal(stacked[name][i], value)


def uniform_attention_block(d: int, w_v=None) -> transformer.Block:
    cfg = transformer.ModelConfig(d=d, d_qk=3, d_h=5, d_y=1)
    block = transformer.Block(cfg, rngs=nnx.Rngs(params=0))
    block.w_q[...] = jnp.zeros_like(block.w_q[...])  # logits 0: S = 11ᵀ/M
    if w_v is not None:
        block.w_v[...] = jnp.asarray(w_v, jnp.float32)
    return block


def per_sample_stats(m: np.ndarray) -> dict:
    """(P, M, d) -> spectral_stats of each sample (numerical rank as NumPy's matrix_rank)."""
    sv = jnp.linalg.svd(jnp.asarray(m), compute_uv=False)
    stats = jax.device_get(probe.spectral_stats(sv, m.shape[1], m.shape[2]))
    np.testing.assert_array_equal(stats["rank"], [np.linalg.matrix_rank(m_p) for m_p in m])
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 6, 4), (3, 4, 4), (2, 3, 5)])  # M > d, M = d, M < d
def test_uniform_attention_is_rank_one_and_the_residual_keeps_the_rank(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    block = uniform_attention_block(shape[2])
    attn = np.asarray(block.attention(jnp.asarray(x)))
    expected = x.mean(axis=1, keepdims=True) @ np.asarray(block.w_v[...])  # every row: x̄ W_V
    np.testing.assert_allclose(attn, np.broadcast_to(expected, attn.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(per_sample_stats(attn)["rank"], 1)
    z_rank = per_sample_stats(attn + x)["rank"]
    np.testing.assert_array_equal(z_rank, per_sample_stats(x)["rank"])
    np.testing.assert_array_equal(z_rank, min(shape[1:]))


def test_uniform_attention_with_rank_deficient_x():
    """X_p = U_p V_p of rank 2 (M = 6, d = 4). Z_p = X_p + 1 (x̄_pᵀ W_V) adds one direction.

    With a generic W_V, x̄_pᵀ W_V leaves the row space of X_p, so rank Z_p = rank X_p + 1; with
    W_V = I, Z_p = (I + 11ᵀ/M) X_p, an invertible map of X_p, so rank Z_p = rank X_p exactly.
    """
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 6, 2)) @ rng.standard_normal((3, 2, 4))).astype(np.float32)
    np.testing.assert_array_equal(per_sample_stats(x)["rank"], 2)
    for w_v, z_rank in ((None, 3), (np.eye(4), 2)):
        block = uniform_attention_block(4, w_v)
        attn = np.asarray(block.attention(jnp.asarray(x)))
        np.testing.assert_array_equal(per_sample_stats(attn)["rank"], 1)
        np.testing.assert_array_equal(per_sample_stats(attn + x)["rank"], z_rank)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"rank_collapse.d_qk_values": (0, 4)}, "d_qk_values: 0 must be positive"),
        ({"rank_collapse.d_qk_values": (4, -2)}, "d_qk_values: -2 must be positive"),
        ({"rank_collapse.d_qk_values": ()}, "d_qk_values: empty"),
        ({"rank_collapse.d_qk_values": (4, 4)}, "repeated values"),
        ({"rank_collapse.d_qk_values": (4.5,)}, "4.5 is not an integer"),
        ({"rank_collapse.qk_inits": ("1/d", "xavier")}, "qk_inits: 'xavier': expected one of"),
        ({"rank_collapse.qk_inits": ()}, "qk_inits: empty"),
        ({"rank_collapse.seeds": ()}, "seeds: empty"),
        ({"rank_collapse.seeds": (0, -1)}, "seeds: -1 must be >= 0"),
        # 2**32 was seed 0 again (a spread over seeds that was no spread); 10**20 and a
        # d_QK of 10**12 were tracebacks (exit 1)
        ({"rank_collapse.seeds": (0, 2**32)}, r"seeds: 4294967296 is not in \[0, 2\*\*32\)"),
        ({"rank_collapse.seeds": (10**20,)}, r"seeds: 100000000000000000000 is not in \[0, 2"),
        ({"rank_collapse.d_qk_values": (1, 10**12)}, "d_qk_values: 1000000000000 needs"),
        ({"data.dim": 0}, "config.data.dim=0: must be positive"),
        ({"data.name": "jena"}, "config.data.dim: not a field of data set 'jena'"),
    ],
)
def test_bad_config_raises_one_line_and_writes_nothing(tmp_path, overrides, expected):
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=expected) as error:
        rank_collapse.spectra(tiny(**overrides), str(workdir))
    assert "\n" not in str(error.value)
    assert not workdir.exists()


def test_missing_section_and_bad_workdir(tmp_path):
    config = load_config_file(os.path.join(ROOT, "configs", "tiny.py"), task="rank_collapse")
    with pytest.raises(ConfigError, match="missing section"):
        rank_collapse.spectra(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        rank_collapse.spectra(tiny(), str(blocker))


@pytest.mark.slow
def test_command_line_bad_value_exits_2_with_one_line(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "resconv_jax.main",
            "--config=configs/rank_collapse.py",
            f"--workdir={workdir}",
            "--config.rank_collapse.d_qk_values=(0,4)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: config.rank_collapse.d_qk_values: 0 must be positive"
    ]
    assert not workdir.exists()


def test_a_rerun_that_fails_mid_write_leaves_a_folder_no_config_calls_finished(
    tmp_path, monkeypatch
):
    """A finished folder rerun with other seeds whose plot cannot be written (a full disk): the
    folder holds a mix, so neither config may reuse it (config.json is written last)."""
    first, second = tiny(), tiny(**{"rank_collapse.seeds": (7, 8, 9)})
    rank_collapse.spectra(first, str(tmp_path))
    assert rank_collapse.why_unfinished(first, str(tmp_path)) is None

    def full_disk(target, *args):
        raise WorkdirWriteError(f"cannot write {target} (No space left on device)")

    monkeypatch.setattr(rank_collapse_plot, "plot", full_disk)
    with pytest.raises(WorkdirWriteError):
        rank_collapse.spectra(second, str(tmp_path))
    assert rank_collapse.why_unfinished(second, str(tmp_path)) is not None
    assert rank_collapse.why_unfinished(first, str(tmp_path)) is not None


def test_a_folder_without_every_output_is_unfinished(tiny_run, tmp_path):
    workdir, _ = tiny_run
    for name in (rank_collapse.CSV_FILE, rank_collapse.SEEDS_CSV_FILE, rank_collapse.PLOT_FILE):
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(workdir, copy)
        os.remove(copy / name)
        assert name in rank_collapse.why_unfinished(tiny(), str(copy))


def test_a_table_of_an_earlier_version_is_unfinished(tiny_run, tmp_path):
    """A rank_collapse.csv without a column this version writes (attn_ratio_p_max/max, the
    worst sample, was added on 2026-12-07) is rerun, not reused with the column missing."""
    workdir, _ = tiny_run
    copy = tmp_path / "older"
    shutil.copytree(workdir, copy)
    table = copy / rank_collapse.CSV_FILE
    lines = table.read_text().splitlines()
    header = lines[0].split(",")
    keep = [i for i, name in enumerate(header) if not name.startswith("attn_ratio_p_max")]
    table.write_text("\n".join(",".join(line.split(",")[i] for i in keep) for line in lines))
    assert "columns" in rank_collapse.why_unfinished(tiny(), str(copy))
    assert rank_collapse.why_unfinished(tiny(), str(workdir)) is None


@pytest.mark.parametrize("name", ["CSV_FILE", "SEEDS_CSV_FILE"])
def test_a_torn_table_is_unfinished(tiny_run, tmp_path, name):
    """A table cut mid-row passed as finished: reproduce reused it, its claims could not be
    evaluated, and --readme wrote those rows over the measured ones."""
    workdir, _ = tiny_run
    copy = tmp_path / "torn"
    shutil.copytree(workdir, copy)
    table = copy / getattr(rank_collapse, name)
    table.write_bytes(table.read_bytes()[: len(table.read_bytes()) // 2])
    assert "complete rows" in rank_collapse.why_unfinished(tiny(), str(copy))


def test_a_float64_run_takes_its_stacked_singular_values_in_float64():
    """The stacked matrix's SVD ran in float32 whatever the model's dtype: a ratio of 1e-10 came
    out at float32's resolution instead."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        u, _ = np.linalg.qr(rng.normal(size=(2 * 8, 4)))
        v, _ = np.linalg.qr(rng.normal(size=(4, 4)))
        stacked = (u * np.array([1.0, 0.5, 0.1, 1e-10])) @ v.T  # (P·M, d) with σ_min/σ_max 1e-10
        m = jnp.asarray(stacked.reshape(1, 2, 8, 4), jnp.float64)
        ratio = float(rank_collapse.matrix_stats(m)["ratio_stacked"][0])
    assert ratio == pytest.approx(1e-10, rel=1e-4)
