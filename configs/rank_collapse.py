"""Rank collapse at initialization (the paper's claim 3; the sizes and seeds are our protocol).

With the embedding width d fixed and W_Q, W_K entries of variance 1/d_QK, the attention logits
X W_Q W_Kᵀ Xᵀ/√d_QK shrink like 1/d_QK, so S(X) tends to the uniform matrix 11ᵀ/M and Attn(X) to
rank one per sample: σ_min/σ_max of Attn(X_p) falls towards 0 as d_QK grows, while that of
Z = Attn(X) + X stays bounded away from 0. With variance 1/d (qk_init="1/d") the logits keep an
O(1) spread for every d_QK and nothing collapses: the contrast. No training; no GD step is taken.

    python -m resconv_jax.main --config=configs/rank_collapse.py --workdir=/tmp/rank_collapse

Expected (15-20 s on 2 CPU cores): a table with one row per qk_init × d_QK. With "1/d_qk" the
per-sample σ_min/σ_max of Attn(X) falls from ~1e-3 at d_QK = 4-16 to ~3e-6 at 4096 (stable rank
→ 1), while that of Attn(X) + X rises to that of X itself (~0.2); with "1/d" both stay flat
(~2e-3 and ~0.18). Under either init Attn(X) is also degenerate at d_QK = 1 (rank-one logits; the
ratio is at float32 rounding level, ~1e-8), so the collapse curve is not monotone from d_QK = 1.
Written to the workdir: rank_collapse.csv (seed mean/min/max per qk_init × d_QK),
rank_collapse_seeds.csv (one row per seed), rank_collapse.png, config.json.

Data: one Gaussian X (P, M, d) drawn from data.seed, the same for every setting and seed (the
seeds vary W_Q, W_K, W_V only). Of the model section only qk_scale, v_scale and d_h (which sets the
shape of the unused MLP weights, so that a seed gives the weights of layer 0 of a Transformer
with that seed) are used; model.transformer.d_qk, model.transformer.qk_init and the β fields
are replaced by the section below (Z = Attn(X) + X, β_a = 1). The seed, sweep, optim and train
sections are unused.
"""

import ml_collections

from resconv_jax.config_defaults import base_config, variants


def get_config(arg=None):
    tiny = "tiny" in variants(arg, "configs/rank_collapse.py", ("tiny",))
    config = base_config()
    config.task = "rank_collapse"
    config.data.name = "synthetic"  # Gaussian X_p ~ N(0, 1)^{M×d}; targets are not used
    config.data.num_samples = 16  # P samples
    config.data.seq_len = 32  # M tokens per sample: M ≥ d, so each X_p has full rank d
    config.data.dim = 16  # d, the embedding width, fixed while d_QK grows
    config.data.seed = 0  # the one data set X shared by every qk_init, d_QK and seed

    config.rank_collapse = ml_collections.ConfigDict()
    # Query/key widths d_QK (x axis); W_Q, W_K are d × d_QK. Positive integers, no repeats.
    config.rank_collapse.d_qk_values = (1, 4, 16, 64, 256, 1024, 4096)
    # W_Q, W_K entry variance: "1/d_qk" (logits concentrate: collapse) and "1/d" (the contrast).
    config.rank_collapse.qk_inits = ("1/d_qk", "1/d")
    # Parameter-initialization seeds (W_Q, W_K, W_V); results give their mean, min and max.
    config.rank_collapse.seeds = (0, 1, 2, 3, 4)
    if tiny:  # a smoke test: the two ends of the d_QK axis, two seeds
        config.rank_collapse.d_qk_values = (1, 4096)
        config.rank_collapse.seeds = (0, 1)
    config.lock()
    return config
