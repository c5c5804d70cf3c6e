"""Rank collapse at initialization: σ_min/σ_max of Attn(X) and of Attn(X) + X against d_QK.

The paper's claim 3: with d fixed and W_Q, W_K entries of variance 1/d_QK, the logits
X W_Q W_Kᵀ Xᵀ/√d_QK have a spread of order 1/d_QK, S(X) tends to the uniform matrix 11ᵀ/M and
Attn(X_p) = S X_p W_V to the rank-one 1 x̄_pᵀ W_V (x̄_p the mean token), so σ_min(Attn(X_p)) → 0.
The residual keeps Z_p = Attn(X_p) + X_p as well conditioned as X_p. With variance 1/d
(qk_init="1/d") the logits keep an O(1) spread and nothing collapses. At small d_QK < d another
effect shows under either init: the logits (X W_Q)(X W_K)ᵀ have rank d_QK, and at d_QK = 1 the
kernel exp(a_m b_n) is numerically low rank (its singular values fall like 1/k!), so Attn(X_p) is
ill-conditioned there too (σ_min/σ_max at float32 rounding level, below FLOAT32_FLOOR, for d = 16).

For each qk_init, d_QK and seed, the model's own `Block` (seeded as layer 0 of a `Transformer`
with that seed) computes A = Block.attention(X) and Z = A + X on one Gaussian X (P, M, d) drawn
from ``config.data.seed`` (the same X for every setting and seed: the seeds vary the weights
only). Recorded per seed: for A and Z, per-sample σ_min/σ_max (mean and min over p), min over p of
σ_min, the stacked (P·M, d) σ_min, σ_max and their ratio, and the mean over p of the numerical
rank (NumPy's matrix_rank tolerance) and of the stable rank ‖·‖_F²/σ_max². Written to the workdir:
rank_collapse.csv (seed mean/min/max per qk_init × d_QK), rank_collapse_seeds.csv, the plot
rank_collapse.png, and config.json.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from resconv_jax.analysis import probe
from resconv_jax.analysis.linalg import eps_relative_to_float32, small_batches
from resconv_jax.errors import ConfigError
from resconv_jax.experiments import claims, rank_collapse_plot
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants
from resconv_jax.finished import why_config_differs
from resconv_jax.models import transformer
from resconv_jax.runtime import memory
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import WorkdirLock, make_folder, write_csv, write_json
from resconv_jax.validation import SEED_LIMIT, check_workdir, validate_config

CSV_FILE = "rank_collapse.csv"
SEEDS_CSV_FILE = "rank_collapse_seeds.csv"
PLOT_FILE = "rank_collapse.png"
CONFIG_FILE = "config.json"
QK_INITS = transformer.QK_INITS
# σ_min/σ_max below this is rounding, not spectrum: float32 attention of M ≤ 10³ tokens (a float64
# recomputation agrees to 1e-3 relative at 3e-6, and gives 1e-9 to 1e-15 where float32 says 1e-8).
FLOAT32_FLOOR = 1e-7


def rounding_floor(dtype: str) -> float:
    """FLOAT32_FLOOR scaled by the machine epsilon of `dtype` (~1.9e-16 for float64)."""
    return FLOAT32_FLOOR * eps_relative_to_float32(dtype)


# Per-seed metrics of each matrix ("attn": Attn(X), "z": Attn(X) + X), in CSV column order.
METRICS = (
    "ratio_p_mean",  # mean over p of σ_min(A_p)/σ_max(A_p)
    "ratio_p_min",  # min over p of σ_min(A_p)/σ_max(A_p)
    "ratio_p_max",  # max over p of σ_min(A_p)/σ_max(A_p): the least collapsed sample
    "sigma_min_p_min",  # min over p of σ_min(A_p)
    "ratio_stacked",  # σ_min/σ_max of the stacked (P·M, d) matrix
    "sigma_min_stacked",
    "sigma_max_stacked",
    "rank_p_mean",  # mean over p of the numerical rank of A_p
    "stable_rank_p_mean",  # mean over p of ‖A_p‖_F²/σ_max(A_p)²
)
COLUMNS = tuple(f"{name}_{metric}" for name in ("attn", "z") for metric in METRICS)


def _check_int_list(field: str, values, *, minimum: int) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ConfigError(f"config.{field}={values!r}: expected a list of integers")
    if not values:
        raise ConfigError(f"config.{field}: empty; give at least one value")
    for value in values:
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise ConfigError(f"config.{field}: {value!r} is not an integer")
        if value < minimum:
            bound = "positive" if minimum == 1 else f">= {minimum}"
            raise ConfigError(f"config.{field}: {value} must be {bound}")
    if len(set(values)) != len(values):
        raise ConfigError(f"config.{field}={tuple(values)}: repeated values")
    return tuple(int(v) for v in values)


def validate(config) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Checks the config for this task; returns (qk_inits, d_qk_values, seeds).

    Raises ConfigError (one line naming the field) for the first value that cannot be run.
    """
    validate_config(config)
    if "rank_collapse" not in config:
        raise ConfigError(
            "config.rank_collapse: missing section; use configs/rank_collapse.py for this task"
        )
    if config.data.name != "synthetic":
        raise ConfigError(
            f"config.data.name={config.data.name!r}: rank_collapse uses Gaussian data (synthetic)"
        )
    section = config.rank_collapse
    for key in ("d_qk_values", "qk_inits", "seeds"):
        if key not in section:
            raise ConfigError(f"config.rank_collapse.{key}: missing")
    unknown = sorted(set(section.keys()) - {"d_qk_values", "qk_inits", "seeds"})
    if unknown:
        raise ConfigError(f"config.rank_collapse.{unknown[0]}: unknown field")
    qk_inits = section.qk_inits
    if isinstance(qk_inits, str) or not isinstance(qk_inits, Sequence):
        raise ConfigError(f"config.rank_collapse.qk_inits={qk_inits!r}: expected a list")
    if not qk_inits:
        raise ConfigError("config.rank_collapse.qk_inits: empty; give at least one value")
    for value in qk_inits:
        if value not in QK_INITS:
            raise ConfigError(
                f"config.rank_collapse.qk_inits: {value!r}: expected one of {', '.join(QK_INITS)}"
            )
    if len(set(qk_inits)) != len(qk_inits):
        raise ConfigError(f"config.rank_collapse.qk_inits={tuple(qk_inits)}: repeated values")
    d_qk_values = _check_int_list("rank_collapse.d_qk_values", section.d_qk_values, minimum=1)
    seeds = _check_int_list("rank_collapse.seeds", section.seeds, minimum=0)
    if beyond := [s for s in seeds if s >= SEED_LIMIT]:  # jax.random.key would wrap it round
        raise ConfigError(f"config.rank_collapse.seeds: {beyond[0]} is not in [0, 2**32)")
    _check_fits(max(d_qk_values), len(seeds), config.data.dim)
    return tuple(qk_inits), tuple(sorted(d_qk_values)), seeds


def _check_fits(d_qk: int, num_seeds: int, d: int) -> None:
    """ConfigError when the blocks of the widest d_QK alone (W_Q and W_K, d × d_QK float32, for
    every seed) cannot fit the host's memory."""
    need = 2 * 4 * num_seeds * d * d_qk
    have = memory.host_available_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"config.rank_collapse.d_qk_values: {d_qk} needs {memory.format_bytes(need)} for W_Q "
            f"and W_K of {num_seeds} seeds alone, more than the {memory.format_bytes(have)} of "
            "memory available"
        )


def make_data(data_cfg) -> np.ndarray:
    """One Gaussian data set X_p ~ N(0, 1)^{M×d}: (P, M, d) float32, seeded by data_cfg.seed."""
    rng = np.random.default_rng(data_cfg.seed)
    shape = (data_cfg.num_samples, data_cfg.seq_len, data_cfg.dim)
    return rng.standard_normal(shape).astype(np.float32)


def make_blocks(cfg: transformer.ModelConfig, seeds: Sequence[int]) -> tuple[nnx.GraphDef, dict]:
    """The model's Block for each seed, as one graphdef and parameters stacked over seeds.

    Block(seed) has the weights of layer 0 of ``Transformer(cfg, seed)``. Returns the parameter
    dict with leaves (S, ...): w_q, w_k (S, d, d_QK), w_v (S, d, d), w_1, w_2.
    """
    graphdef, states = None, []
    for seed in seeds:
        graphdef, state = nnx.split(transformer.Block(cfg, rngs=nnx.Rngs(params=seed)))
        states.append(nnx.to_pure_dict(state))
    return graphdef, jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def matrix_stats(m: jax.Array) -> dict[str, jax.Array]:
    """The per-seed METRICS of matrices m: (S, P, M, d) -> dict of (S,) arrays."""
    _, n_samples, n_tokens, d = m.shape
    sv = small_batches(probe.singular_values, m)  # (S, P, min(M, d)), descending
    sample = probe.spectral_stats(sv, n_tokens, d)
    ratio = sample["sigma_min"] / sample["sigma_max"]  # (S, P)
    stacked = probe.spectral_stats(
        probe.stacked_singular_values(m, dtype=m.dtype), n_samples * n_tokens, d
    )  # (S,) each, in the model's dtype
    return {
        "ratio_p_mean": ratio.mean(axis=-1),
        "ratio_p_min": ratio.min(axis=-1),
        "ratio_p_max": ratio.max(axis=-1),
        "sigma_min_p_min": sample["sigma_min"].min(axis=-1),
        "ratio_stacked": stacked["sigma_min"] / stacked["sigma_max"],
        "sigma_min_stacked": stacked["sigma_min"],
        "sigma_max_stacked": stacked["sigma_max"],
        "rank_p_mean": sample["rank"].mean(axis=-1),
        "stable_rank_p_mean": (jnp.sum(sv**2, axis=-1) / sample["sigma_max"] ** 2).mean(axis=-1),
    }


@partial(jax.jit, static_argnums=0)
def attention_spectra(graphdef: nnx.GraphDef, params: dict, x: jax.Array) -> dict[str, jax.Array]:
    """A = Block.attention(X) and Z = A + X for each seed's Block, and their METRICS.

    Args:
      graphdef, params: from ``make_blocks``; leaves stacked over S seeds.
      x: (P, M, d), the same for every seed.
    Returns:
      dict of (S,) arrays keyed '{attn,z}_{metric}' (COLUMNS).
    """
    attn = jax.vmap(lambda p: nnx.merge(graphdef, p).attention(x))(params)  # (S, P, M, d)
    out = {}
    for name, m in (("attn", attn), ("z", attn + x)):
        out.update({f"{name}_{k}": v for k, v in matrix_stats(m).items()})
    return out


def _aggregate(per_seed: list[dict]) -> dict:
    row = {"qk_init": per_seed[0]["qk_init"], "d_qk": per_seed[0]["d_qk"]}
    row["num_seeds"] = len(per_seed)
    for column in COLUMNS:
        values = np.array([r[column] for r in per_seed], dtype=np.float64)
        row[f"{column}/mean"] = float(values.mean())
        row[f"{column}/min"] = float(values.min())
        row[f"{column}/max"] = float(values.max())
    return row


def _fmt_range(row: dict, column: str) -> str:
    return f"{row[column + '/mean']:.2e} [{row[column + '/min']:.1e}, {row[column + '/max']:.1e}]"


def format_table(rows: list[dict]) -> str:
    """One line per qk_init × d_QK: σ_min/σ_max of Attn(X) and Attn(X)+X, and ranks of Attn(X_p).

    Per-sample columns are the mean over p, shown as seed mean [seed min, seed max].
    """
    head = (
        f"{'qk_init':>7} {'d_QK':>5} | {'Attn(X) per-sample σmin/σmax':^29} | "
        f"{'Attn(X)+X per-sample':^29} | {'stacked A':>9} {'stacked Z':>9} | "
        f"{'rank A_p':>8} {'srank A_p':>9}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{row['qk_init']:>7} {row['d_qk']:>5} | {_fmt_range(row, 'attn_ratio_p_mean'):^29} | "
            f"{_fmt_range(row, 'z_ratio_p_mean'):^29} | "
            f"{row['attn_ratio_stacked/mean']:>9.2e} {row['z_ratio_stacked/mean']:>9.2e} | "
            f"{row['attn_rank_p_mean/mean']:>8.2f} {row['attn_stable_rank_p_mean/mean']:>9.3f}"
        )
    return "\n".join(lines)


def final_line(rows: list[dict]) -> str:
    """The headline figures at the largest d_QK, for qk_init "1/d_qk" if it was run."""
    qk_init = "1/d_qk" if any(r["qk_init"] == "1/d_qk" for r in rows) else rows[0]["qk_init"]
    row = max((r for r in rows if r["qk_init"] == qk_init), key=lambda r: r["d_qk"])
    return (
        f"d_QK={row['d_qk']}, qk_init={qk_init}: per-sample σ_min/σ_max (mean over samples; "
        f"mean [min, max] over {row['num_seeds']} seeds) of Attn(X) = "
        f"{_fmt_range(row, 'attn_ratio_p_mean')}, of Attn(X)+X = "
        f"{_fmt_range(row, 'z_ratio_p_mean')}"
    )


def spectra(config, workdir: str) -> list[dict]:
    """Runs the rank-collapse experiment; returns one dict per qk_init × d_QK (the CSV rows).

    Each row has qk_init, d_qk, num_seeds and, for every column of COLUMNS, its mean, min and max
    over seeds ('{column}/mean', ...). Nothing is written before the config is validated.
    """
    qk_inits, d_qk_values, seeds = validate(config)
    check_workdir(workdir, checkpoints=False)
    start = time.perf_counter()
    dtype = config.model.dtype  # of the weights, so of the attention and its SVDs
    x = make_data(config.data).astype(dtype)  # (P, M, d)
    n_samples, n_tokens, d = x.shape
    x_sv = np.linalg.svd(x.astype(np.float64), compute_uv=False)  # (P, min(M, d))
    x_ratio = float(np.mean(x_sv[:, -1] / x_sv[:, 0]))
    per_seed, rows = [], []
    for qk_init in qk_inits:
        for d_qk in d_qk_values:
            cfg = transformer.ModelConfig(
                d=d,
                d_qk=d_qk,
                d_h=config.model.transformer.d_h,
                d_y=1,
                qk_init=qk_init,
                qk_scale=config.model.transformer.qk_scale,
                v_scale=config.model.transformer.v_scale,
                dtype=dtype,
            )
            graphdef, params = make_blocks(cfg, seeds)
            stats = jax.device_get(attention_spectra(graphdef, params, jnp.asarray(x)))
            seed_rows = [
                {"qk_init": qk_init, "d_qk": d_qk, "seed": seed}
                | {column: float(stats[column][i]) for column in COLUMNS}
                for i, seed in enumerate(seeds)
            ]
            per_seed.extend(seed_rows)
            rows.append(_aggregate(seed_rows))
    elapsed = time.perf_counter() - start

    title = (
        f"Rank collapse at initialization: d = {d}, M = {n_tokens}, P = {n_samples}, "
        f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} (band: seed min–max)"
    )
    if jax.process_index() != 0:  # several processes: each computed the same rows
        return rows
    make_folder(workdir, f"--workdir={workdir}")
    lock = WorkdirLock(workdir)
    lock.acquire()
    folder = wd.path(workdir)
    try:  # config.json goes first and comes back last: it marks the outputs as this config's
        (folder / CONFIG_FILE).unlink(missing_ok=True)
        write_csv(folder / CSV_FILE, rows)
        write_csv(folder / SEEDS_CSV_FILE, per_seed)
        rank_collapse_plot.plot(
            folder / PLOT_FILE, rows, x_ratio, title, rounding_floor(dtype), dtype
        )
        write_json(folder / CONFIG_FILE, json.loads(config.to_json_best_effort()))
    finally:
        lock.release()

    print(
        f"rank collapse at initialization: X (P={n_samples}, M={n_tokens}, d={d}), "
        f"data seed {config.data.seed}, {len(seeds)} init seeds, {dtype}; {elapsed:.1f} s",
        flush=True,
    )
    print(f"X itself: per-sample σ_min/σ_max mean over p = {x_ratio:.3f}", flush=True)
    print(format_table(rows), flush=True)
    print(
        f"wrote {CSV_FILE}, {SEEDS_CSV_FILE}, {PLOT_FILE}, {CONFIG_FILE} to {workdir}", flush=True
    )
    floor = rounding_floor(dtype)
    if any(r["attn_ratio_p_mean/min"] < floor for r in rows):
        note = f"note: ratios below {floor:.0e} are at {dtype} rounding level; "
        note += "the true values are smaller"
        if dtype == "float32":
            note += "; --config.model.dtype=float64 computes them in float64"
        print(note, flush=True)
    print(final_line(rows), flush=True)
    if not all(math.isfinite(r["attn_ratio_p_mean/mean"]) for r in rows):
        print("warning: non-finite singular-value ratios (see the CSV)", flush=True)
    return rows


def _row_at(workdir, d_qk: int) -> dict | None:
    """The aggregated CSV row at `d_qk` with qk_init 1/d_qk (None when there is none)."""
    rows = claims.read_csv(wd.path(workdir) / CSV_FILE)
    return next((r for r in rows if r["qk_init"] == "1/d_qk" and r["d_qk"] == d_qk), None)


def residual_conditioning(workdir, d_qk: int = 4096, attn_max=1e-4, z_min=0.1) -> Claim:
    """Claim 3: at d_QK = 4096 (variance 1/d_QK) σ_min/σ_max of Attn(X) stays < attn_max and
    that of Attn(X) + X > z_min for every seed (per-sample ratios, mean over samples)."""
    claim = Claim(
        "3. residual fixes conditioning at init",
        f"σ_min/σ_max of Attn(X) vs Attn(X) + X at d_QK = {d_qk} (every seed)",
        f"< {attn_max:g} vs > {z_min:g}",
    )
    if missing := claims.missing(claim, workdir, CSV_FILE):
        return missing
    if (row := _row_at(workdir, d_qk)) is None:
        return dataclasses.replace(claim, note=f"no d_QK = {d_qk} row with qk_init 1/d_qk")
    attn_worst, z_worst = row["attn_ratio_p_mean/max"], row["z_ratio_p_mean/min"]
    value = f"Attn(X) ≤ {attn_worst:.3g}, Attn(X) + X ≥ {z_worst:.3g}"
    if not (math.isfinite(attn_worst) and math.isfinite(z_worst)):
        note = f"a non-finite singular-value ratio at d_QK = {d_qk} (see {CSV_FILE})"
        return dataclasses.replace(claim, value=value, note=note)
    note = ""
    if "attn_ratio_p_max/max" in row:  # tables before 2026-12-07 lack it
        note = (  # the claim is per sample: the least collapsed sample beside the means
            f"worst single sample of any seed: Attn(X) {row['attn_ratio_p_max/max']:.2g}, "
            f"Attn(X) + X {row['z_ratio_p_min/min']:.2g}"
        )
    return dataclasses.replace(
        claim,
        value=value,
        verdict=claims.verdict(attn_worst < attn_max and z_worst > z_min),
        note=note,
    )


def residual_conditioning_stacked(workdir, d_qk: int = 4096, attn_max=1e-4, z_min=0.1) -> Claim:
    """Row 3″: row 3's thresholds on the stacked matrices, which set the rate (docs/protocol.md,
    the second reading); the interval of each ratio is its range over the seeds."""
    claim = Claim(
        "3″. residual fixes conditioning, stacked matrices (second reading of 3)",
        f"σ_min/σ_max of the stacked Attn(X) vs Attn(X) + X at d_QK = {d_qk} [range over seeds]",
        f"< {attn_max:g} vs > {z_min:g}; undecided if a range spans its threshold",
    )
    if missing := claims.missing(claim, workdir, CSV_FILE):
        return missing
    if (row := _row_at(workdir, d_qk)) is None:
        return dataclasses.replace(claim, note=f"no d_QK = {d_qk} row with qk_init 1/d_qk")
    attn = (row["attn_ratio_stacked/min"], row["attn_ratio_stacked/max"])
    z = (row["z_ratio_stacked/min"], row["z_ratio_stacked/max"])
    value = (
        f"Attn(X) {row['attn_ratio_stacked/mean']:.3g} [{attn[0]:.2g}, {attn[1]:.2g}], "
        f"Attn(X) + X {row['z_ratio_stacked/mean']:.3g} [{z[0]:.2g}, {z[1]:.2g}] "
        f"({row['num_seeds']} seeds)"
    )
    attn_verdict = claims.decided(attn[1] < attn_max, attn, attn_max, claimed="below")
    z_verdict = claims.decided(z[0] > z_min, z, z_min, claimed="above")
    verdict = claims.combined((attn_verdict, z_verdict))
    note = f"Attn(X) alone: {attn_verdict}; Attn(X) + X: {z_verdict}; row 3 is per sample"
    return dataclasses.replace(claim, value=value, verdict=verdict, note=note)


def run(config, workdir: str) -> list[dict]:
    """The task: `spectra` written to `workdir` and printed; nothing trains, so no summaries."""
    spectra(config, workdir)
    return []


def report(workdir: str) -> list[str]:
    """Its files are written by `run`: nothing more to report."""
    return []


def why_unfinished(config, workdir: str) -> str | None:
    """None when `workdir` holds this config's result: its config.json (written after the
    outputs) and every output file (the task trains nothing)."""
    folder = wd.path(workdir)
    if problem := why_config_differs(config, folder):
        return problem
    missing = [
        name for name in (CSV_FILE, SEEDS_CSV_FILE, PLOT_FILE) if not (folder / name).exists()
    ]
    if missing:
        return f"no {', '.join(missing)}"
    header = (folder / CSV_FILE).read_text().split("\n", 1)[0].split(",")
    if lacking := [c for c in COLUMNS if f"{c}/max" not in header]:
        return f"{CSV_FILE} lacks the columns of {', '.join(lacking)} (an earlier version)"
    qk_inits, d_qk_values, seeds = validate(config)
    cells = len(qk_inits) * len(d_qk_values)
    for name, expected in ((CSV_FILE, cells), (SEEDS_CSV_FILE, cells * len(seeds))):
        complete = _complete_rows(folder / name)
        if complete != expected:
            return f"{name} holds {complete} complete rows, not {expected} (damaged?)"
    return None


def _complete_rows(path) -> int:
    """How many rows of a CSV have a number in every column but qk_init (-1: unreadable)."""

    def number(text: str | None) -> bool:
        try:
            return text is not None and isinstance(float(text), float)
        except ValueError:
            return False

    try:
        with wd.path(path).open() as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return -1
    return sum(
        None not in r and all(number(v) for k, v in r.items() if k != "qk_init") for r in rows
    )


def describe_sizes(config) -> str:
    """One line: the data's sizes, the d_QK values and the seeds."""
    r, data = config.rank_collapse, config.data
    values = "{" + ", ".join(f"{v:g}" for v in r.d_qk_values) + "}"
    return (
        f"P={data.num_samples} Gaussian samples of M={data.seq_len}, d={data.dim}; "
        f"d_QK ∈ {values}, {len(r.seeds)} seeds"
    )


EXPERIMENTS = (
    Experiment(
        "rank_collapse",
        "Rank collapse at initialization",
        "rank_collapse.py",
        scale_variants(small=""),
        typical_seconds={"small": 6},
        claims=(
            ClaimCheck(3, residual_conditioning),
            ClaimCheck(3.1, residual_conditioning_stacked),
        ),
        files=(CSV_FILE, SEEDS_CSV_FILE, PLOT_FILE),
    ),
)
