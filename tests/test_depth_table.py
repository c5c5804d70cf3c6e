"""The depth sweep's table, figure and claim-4 note from synthetic metrics lines."""

import numpy as np

from resconv_jax.experiments import claims, depth
from resconv_jax.runtime.workdir import write_csv


def depth_history(cells) -> list[dict]:
    """Metrics lines of one run per (L, β_a, β_f) in `cells`, each descending at its own rate
    (β_f = 1 three times faster), with layer 0's σ(Z) logged (its own per run)."""
    lines = []
    for run, (layers, beta_attn, beta_ffn) in enumerate(cells):
        rate = 0.01 * (1 + beta_attn) * (3 if beta_ffn else 1)
        for step in range(0, 101, 10):
            lines.append({"run": run, "seed": 0, "lr": 1e-3, "num_layers": layers,
                          "beta_attn": beta_attn, "beta_ffn": beta_ffn, "step": step,
                          "loss": float(np.exp(-rate * step)) + 1e-3,
                          "layer0/z/sigma_min": 1.0 + 0.1 * run,
                          "layer0/z/sigma_max": 2.0})  # fmt: skip
    return lines


def test_the_depth_table_keeps_runs_that_differ_in_beta_ffn_apart():
    """β_a and β_f swept apart: one row per (L, β_a, β_f); merging the β_f of one β_a averaged
    two different descents into one rate."""

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    rows = depth.depth_rows(depth_history(cells))
    table = depth.format_depth_table(rows).splitlines()
    assert "beta_a" in table[1] and "beta_f" in table[1]
    body = [line.split() for line in table[2:-1]]
    assert [(int(b[0]), float(b[1]), float(b[2]), int(b[3])) for b in body] == [
        (L, a, f, 1) for L, a, f in cells
    ]
    rates = {(L, a, f): float(b[4]) for (L, a, f), b in zip(cells, body, strict=True)}
    assert rates[1, 0.0, 1.0] < rates[1, 0.0, 0.0]


def test_the_depth_table_counts_a_ratio_below_the_probes_precision_as_zero(tmp_path):
    """A float32 probe's σ_min/σ_max below its epsilon is zero to its precision: the table
    printed 1.6e-16 and 4.5e-65 as measurements and ranked them in its Spearman ρ."""

    cells = [(1, 0.0, 0.0), (2, 0.0, 0.0), (1, 1.0, 1.0), (2, 1.0, 1.0)]
    lines = depth_history(cells)
    tiny = {0: 1e-30, 1: 1e-20}  # σ_min of runs 0 and 1: ratios² 2.5e-61 and 2.5e-41
    for line in lines:
        if line["run"] in tiny:
            line["layer0/z/sigma_min"] = tiny[line["run"]]
    text = depth.write_depth_report(tmp_path, lines, 0.0, probe_dtype="float32")
    rows = claims.read_csv(tmp_path / depth.RUNS_FILE)
    assert [r["slowest_ratio_sq_init"] for r in rows[:2]] == [0.0, 0.0]
    assert rows[2]["slowest_ratio_sq_init"] > 0
    assert "0: at or below float32's epsilon², zero to the probe's precision" in text


def test_claim_4_names_beta_ffn_in_its_note_when_it_is_swept(tmp_path):

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    write_csv(tmp_path / depth.RUNS_FILE, depth.depth_rows(depth_history(cells)))
    note = depth.multilayer(str(tmp_path)).note
    assert "1/β_a=0,β_f=1: " in note and note.count("/β_a=") == 8


def test_the_depth_figure_draws_beta_ffn_apart(tmp_path, monkeypatch):

    cells = [(L, a, f) for L in (1, 2) for a in (0.0, 1.0) for f in (0.0, 1.0)]
    lines = depth_history(cells)
    saved = []
    monkeypatch.setattr(depth, "save_figure", lambda fig, path: saved.append(fig))
    depth.plot_depth_sigma(lines, depth.depth_rows(lines), tmp_path / "depth_sigma.png", 1e-6)
    labels = [text.get_text() for text in saved[0].legends[0].get_texts()]
    assert labels[-4:] == ["β_a=0, β_f=0", "β_a=0, β_f=1", "β_a=1, β_f=0", "β_a=1, β_f=1"]
    styles = {line.get_linestyle() for line in saved[0].axes[0].get_lines()}
    assert len(styles) == 4
