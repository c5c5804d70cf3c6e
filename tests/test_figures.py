"""The report figures (`experiments.figures`) and the progress lines (`metrics.progress_line`),
on small synthetic metrics histories."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_hex

from resconv_jax.experiments import figures
from resconv_jax.runtime.metrics import progress_line


def history(betas=(0.0, 0.5, 1.0), seeds=(0, 1), steps=range(0, 201, 10), layers=None):
    """Metrics lines of a β × seed sweep whose loss falls faster for larger β."""
    lines, run = [], 0
    settings = []
    for seed in seeds:
        for beta in betas:
            s = {"run": run, "seed": seed, "lr": 1e-3, "beta_attn": beta, "beta_ffn": beta}
            if layers is not None:
                s["num_layers"] = layers
            settings.append(s)
            run += 1
    for step in steps:
        for s in settings:
            rate = 0.02 * (1 + s["beta_attn"])
            loss = (1 + s["beta_attn"]) * np.exp(-rate * step) + 0.1 + 0.01 * s["seed"]
            lines.append(
                s
                | {
                    "step": step,
                    "loss": float(loss),
                    "layer0/z/sigma_min": 1.0 + s["beta_attn"],
                    "layer0/attn/sigma_min": 1.0,
                    "layer0/z/sigma_min_over_fro": 0.01 * (1 + s["beta_attn"]),
                }
            )
    return lines


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _colors(ax) -> set[str]:
    return {to_hex(line.get_color()) for line in ax.get_lines()}


def test_training_colours_by_beta_and_marks_seeds():
    fig = figures.training_figure(history(betas=(0.0, 0.5, 1.0), seeds=(0, 1)))
    ax_loss, ax_sigma = fig.axes
    assert len(ax_loss.get_lines()) == 6 and len(_colors(ax_loss)) == 3
    assert {line.get_marker() for line in ax_loss.get_lines()} == {"o", "s"}
    assert _colors(ax_sigma) == _colors(ax_loss)
    texts = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    assert texts == ["seed 0", "seed 1"]  # the seed legend; the β one is an extra artist
    beta_legend = [a for a in ax_loss.artists if a is not ax_loss.get_legend()]
    assert [t.get_text() for t in beta_legend[0].get_texts()] == ["β=0", "β=0.5", "β=1"]
    sigma_texts = " | ".join(t.get_text() for t in ax_sigma.get_legend().get_texts())
    assert "σ_min(Z), Z = Attn(X)" in sigma_texts and "σ_min(Attn(X))" in sigma_texts
    assert "loss" in ax_loss.get_ylabel() and "σ_min" in ax_sigma.get_ylabel()


def test_training_with_many_seeds_draws_thin_lines_and_says_so():
    fig = figures.training_figure(history(betas=(0.0, 1.0), seeds=range(7), layers=2))
    ax_loss = fig.axes[0]
    assert len(ax_loss.get_lines()) == 14 and len(_colors(ax_loss)) == 2
    assert {line.get_marker() for line in ax_loss.get_lines()} == {"None"}
    assert "thin lines" in ax_loss.get_title()
    assert [t.get_text() for t in ax_loss.get_legend().get_texts()] == ["L=2, β=0", "L=2, β=1"]


def test_loss_by_beta_draws_the_threshold_and_an_early_window():
    lines = history(steps=range(0, 2001, 10))
    rows, threshold = figures.beta_table(lines)
    fig = figures.loss_by_beta_figure(lines, threshold)
    assert len(fig.axes) == 2  # every run reaches the threshold early: a zoomed second panel
    for ax in fig.axes:
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert len(dashed) == 1 and set(dashed[0].get_ydata()) == {threshold}
        assert len(_colors(ax) - {to_hex(dashed[0].get_color())}) == 3
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert texts[-1] == f"threshold {threshold:.4g} (steps<thr in beta_table.csv)"
    assert "mean" in fig.axes[0].get_title() and "min–max" in fig.axes[0].get_title()
    last_reach = max(row["steps_to_threshold_max"] for row in rows)
    assert fig.axes[1].get_xlim()[1] < 0.4 * 2000 and fig.axes[1].get_xlim()[1] > last_reach


def test_loss_by_beta_without_an_early_descent_has_one_panel():
    lines = history(steps=range(0, 201, 10))
    _, threshold = figures.beta_table(lines)
    assert len(figures.loss_by_beta_figure(lines, threshold).axes) == 1


def test_write_reports_passes_the_table_threshold_to_loss_by_beta(tmp_path, monkeypatch):
    seen = []
    original = figures.plot_loss_by_beta
    monkeypatch.setattr(
        figures,
        "plot_loss_by_beta",
        lambda h, path, threshold=0.0: seen.append(threshold) or original(h, path, threshold),
    )
    rows = figures.write_reports(tmp_path, history())
    assert seen == [rows[0]["threshold"]] and seen[0] > 0
    for name in ("training.png", "loss_by_beta.png", "sigma_by_beta.png", "beta_table.csv"):
        assert (tmp_path / name).stat().st_size > 0, name


SETTINGS = [
    {"run": r, "seed": r // 5, "lr": 4e-4, "beta_attn": b, "beta_ffn": b}
    for r, b in enumerate([0.0, 0.25, 0.5, 0.75, 1.0] * 3)
]


def test_progress_line_names_the_step_of_the_losses_and_each_of_a_few_runs():
    line = progress_line(2000, 2000, 1999, np.array([0.5, 0.25, 0.125]), 500.0, SETTINGS[:3])
    assert line == (
        "step 2000/2000  loss@1999: r0 β=0 5.000e-01, r1 β=0.25 2.500e-01, r2 β=0.5 1.250e-01"
        "  500.0 steps/s  ETA 0s"
    )
    assert progress_line(10, 20, 9, [1.0], 2.0).startswith("step 10/20  loss@9: r0 1.000e+00 ")


def test_progress_line_summarises_a_sweep():
    losses = np.linspace(1.0, 2.0, 15)
    losses[7], losses[3] = 0.1, 9.0
    line = progress_line(200, 2000, 199, losses, 100.0, SETTINGS)
    assert line.startswith("step 200/2000  loss@199: min 1.000e-01 (r7 β=0.5 seed 1), median ")
    assert "max 9.000e+00 (r3 β=0.75 seed 0) over 15 runs  100.0 steps/s  ETA 18s" in line
    losses[0] = np.nan
    assert "(1 non-finite)" in progress_line(200, 2000, 199, losses, 100.0, SETTINGS)


def lr_sweep() -> list[dict]:
    """Metrics lines of a β × lr sweep (one seed): lr 1e-3 and 4e-3 descend at different rates."""
    fast = history(seeds=(0,), betas=(0.0, 1.0))
    for line in fast:
        line["run"] += 2
        line["lr"] = 4e-3
        line["loss"] = 0.5 * line["loss"]
    return history(seeds=(0,), betas=(0.0, 1.0)) + fast


def test_an_lr_sweep_keeps_one_row_and_one_label_per_lr():
    """Runs that differ only in lr are not one group: averaging them would report a loss and a
    rate that no run had (and call the lrs 'seeds')."""
    lines = lr_sweep()
    rows, _ = figures.beta_table(lines)
    assert [(row["lr"], row["beta_attn"], row["runs"]) for row in rows] == [
        (1e-3, 0.0, 1), (1e-3, 1.0, 1), (4e-3, 0.0, 1), (4e-3, 1.0, 1)
    ]  # fmt: skip
    assert rows[2]["final_loss"] == pytest.approx(0.5 * rows[0]["final_loss"])
    printed = figures.format_beta_table([row | {"threshold": 1.0} for row in rows])
    assert "lr" in printed.splitlines()[1] and "0.004" in printed
    ax = figures.loss_by_beta_figure(lines, 0.0).axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["lr=0.001, β=0", "lr=0.001, β=1", "lr=0.004, β=0", "lr=0.004, β=1"]
    assert "seeds" not in ax.get_title()


def test_per_run_step_sizes_are_not_an_lr_sweep():
    """optim.lr_rule="lambda_max" gives every run its own lr: one lr per (seed, β) is not a
    sweep, so the seeds of a β stay one row and no lr column appears."""
    lines = history()
    for line in lines:
        line["lr"] = 1e-3 / (1 + line["run"])
    rows, _ = figures.beta_table(lines)
    assert "lr" not in rows[0] and [row["runs"] for row in rows] == [2, 2, 2]


def test_a_depth_tables_sigma_columns_say_they_are_layer_0s():
    """σmin/‖Z‖F start and end are layer 0's: in a depth sweep they read as the stack's (every
    β = 0 row of L = 1, 2, 4, 8 the same), so the table says whose they are."""
    rows = [row | {"threshold": 1.0} for row in figures.beta_table(history())[0]]
    note = "σmin/‖Z‖F: layer 0's; the depth table and depth_sigma.png give every layer"
    assert note not in figures.format_beta_table(rows)
    deep = [row | {"num_layers": 2} for row in rows]
    assert note in figures.format_beta_table(deep)


def test_a_summed_loss_table_says_train_and_validation_sums_are_not_comparable():
    """With optim.reduction=sum the two loss columns are sums over sets of different sizes
    (Jena: 256 train against 145 validation windows): the table says so under them."""
    lines = history()
    for line in lines:
        line["val_loss"] = 0.5 * line["loss"]
    rows = [row | {"threshold": 1.0} for row in figures.beta_table(lines)[0]]
    note = "final loss and final val are sums over the training and the validation samples"
    assert note in figures.format_beta_table(rows, summed=True)
    assert note not in figures.format_beta_table(rows, summed=False)
    no_val = [row | {"threshold": 1.0} for row in figures.beta_table(history())[0]]
    assert note not in figures.format_beta_table(no_val, summed=True)


def test_the_beta_table_gives_each_rows_worst_fit_so_a_plateau_is_not_read_as_a_rate():
    """rate/step is the slope of a line fitted to log L_t. On a plateau (Jena: R² 0.07-0.43) it
    printed as a linear rate of 0.9998 with nothing in the table to say the fit was no line."""
    early = range(0, 31, 5)  # before history()'s losses bend onto their floor
    straight = [row | {"threshold": 1.0} for row in figures.beta_table(history(steps=early))[0]]
    assert "not a linear rate" not in figures.format_beta_table(straight)
    lines = history(steps=early)
    for line in lines:
        if line["run"] == 3:  # seed 1, β = 0: a wobbling plateau, no linear descent
            line["loss"] = 1.0 + 0.05 * np.sin(line["step"])
    rows = [row | {"threshold": 1.0} for row in figures.beta_table(lines)[0]]
    table = figures.format_beta_table(rows).splitlines()
    assert "min R²" in table[1]
    # beta_a beta_f runs final-loss final-val steps<thr rate/step min-R² ...
    worst = {float(line.split()[0]): float(line.split()[7]) for line in table[2:5]}
    assert worst[0.0] < 0.5 and worst[0.5] > 0.99 and worst[1.0] > 0.99
    assert worst[0.0] == pytest.approx(rows[0]["rate_r2_min"], abs=1e-4)
    assert any("min R² below 0.99" in line and "not a linear rate" in line for line in table[5:])


def test_a_run_too_short_to_fit_is_said_unfit_not_said_to_be_no_line():
    """Fewer than 3 logged losses above the fit floor: no R² (NaN). The row's min R² was NaN
    (hiding its other runs' fits) and the table said its loss "is no line"."""
    lines = history(steps=range(0, 31, 5))
    lines = [line for line in lines if line["run"] != 3 or line["step"] <= 5]  # 2 losses
    rows = [row | {"threshold": 1.0} for row in figures.beta_table(lines)[0]]
    assert rows[0]["rate_r2_min"] > 0.99  # its other run's fit, not NaN
    table = figures.format_beta_table(rows)
    assert "not a linear rate" not in table
    assert "no rate fit" in table and "fewer than 3 logged losses above the fit floor" in table
