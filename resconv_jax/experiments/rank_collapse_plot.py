"""The rank-collapse figure: σ_min/σ_max of Attn(X) and Attn(X) + X against d_QK, from the rows
of `rank_collapse.spectra` (one per qk_init × d_QK, seed mean/min/max per column)."""

from __future__ import annotations

from resconv_jax.runtime.workdir import write_png


def plot(path: str, rows: list[dict], x_ratio: float, title: str, floor: float, dtype: str) -> None:
    """σ_min/σ_max against d_QK (both log scale), one panel per qk_init; bands span the seeds.
    Ratios below `floor`, the rounding level of `dtype` (the attention's precision), are shaded.

    Solid: per-sample ratio (mean over p); dashed: stacked (P·M, d) matrix; dotted: X itself.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    qk_inits = list(dict.fromkeys(r["qk_init"] for r in rows))
    fig = Figure(figsize=(5.2 * len(qk_inits), 4.8), layout="constrained", dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(qk_inits), sharey=True, squeeze=False)[0]
    curves = (
        ("attn", "C3", "Attn(X)"),
        ("z", "C0", "Attn(X) + X"),
    )
    for ax, qk_init in zip(axes, qk_inits, strict=True):
        sub = sorted((r for r in rows if r["qk_init"] == qk_init), key=lambda r: r["d_qk"])
        d_qk = [r["d_qk"] for r in sub]
        for name, color, label in curves:
            for kind, style, suffix in (
                ("p_mean", "-o", "per sample"),
                ("stacked", "--", "stacked"),
            ):
                col = f"{name}_ratio_{kind}"
                mean = [r[f"{col}/mean"] for r in sub]
                ax.plot(d_qk, mean, style, color=color, label=f"{label}, {suffix}", ms=4)
                ax.fill_between(
                    d_qk,
                    [r[f"{col}/min"] for r in sub],
                    [r[f"{col}/max"] for r in sub],
                    color=color,
                    alpha=0.2 if kind == "p_mean" else 0.1,
                    lw=0,
                )
        ax.axhline(x_ratio, color="gray", ls=":", label="X, per sample")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(d_qk, [str(v) for v in d_qk])
        ax.minorticks_off()
        ax.set_xlabel("query/key width $d_{QK}$")
        variance = "1/d_{QK}" if qk_init == "1/d_qk" else "1/d"
        ax.set_title(f"$W_Q, W_K$ entries of variance ${variance}$")
        ax.grid(True, which="major", alpha=0.3)
    low, _ = axes[0].get_ylim()
    if low < floor:
        for ax in axes:
            ax.axhspan(low, floor, color="k", alpha=0.06, lw=0)
        axes[-1].text(
            0.98,
            0.02,
            f"{dtype} rounding level",
            transform=axes[-1].transAxes,
            ha="right",
            va="bottom",
            fontsize=8,
            color="0.4",
        )
        axes[0].set_ylim(bottom=low)
    axes[0].set_ylabel(r"$\sigma_{\min} / \sigma_{\max}$")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=5, fontsize=8)
    fig.suptitle(title)
    write_png(fig, path, dpi=fig.dpi)
