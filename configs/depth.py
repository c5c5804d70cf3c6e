"""Linear convergence per depth (claim 4): the theory regime with L ∈ {1, 2, 4, 8} blocks.

Claim 4 of docs/protocol.md: the analysis extends to multi-layer stacks. One compiled program per
depth (`sweep.num_layers`, each in WORKDIR/layers_<L>/), β ∈ {0, 1} on both residuals × 3 seeds;
every β of a seed starts from the same weights.

    python -m resconv_jax.main --config=configs/depth.py --workdir=workdirs/depth

Reports (depth_runs.csv, the printed table): the fitted linear rate and R² per run, the per-layer
σ_min(Z) trajectories (depth_sigma.png), and Spearman's ρ between 1 − rate and the slowest layer's
σ_min²/σ_max²(Z) at initialization.

Our protocol (the paper gives no sizes): P = 8, M = 8, d = 2·P·M = 128, d_QK = 16, d_h = 64, the sum
loss, 3000 steps. One η cannot serve every depth (the β = 1 stacks' λ_max(K) grows with L: at
L = 4, η = 1e-4 diverges in 2 steps), so each run takes η = 0.5/λ_max(K) at its own initialization
(`optim.lr_rule = "lambda_max"`).

`:branches` (claim 4 "under suitable initialization"; added after the default init above failed
it): small residual branches, W_V and W_1, W_2 at 0.3 of their default scale, in float64, β = 1
only (without residuals these branches shrink the signal, and λ_max(K) grows so fast that
0.5/λ_max at init diverges within 5 steps). `:small` (for `reproduce --scale=small`): 1500
steps, seeds {0, 1}; `:small,branches` combines both. `:tiny` (a smoke test, on top of `small`):
L ∈ {1, 2}, seed 0, 40 steps.
"""

from resconv_jax.config_defaults import shorten, theory_regime_config, variants


def get_config(arg=None):
    chosen = variants(arg, "configs/depth.py", ("small", "branches", "tiny"))
    small = "small" in chosen or "tiny" in chosen
    config = theory_regime_config(128)  # d = 2·P·M
    config.optim.lr_rule = "lambda_max"  # η = lr_factor / λ_max(K) per run, at initialization
    config.optim.lr_factor = 0.5  # 1.0 diverged at L = 8, β = 0 (λ_max grows during training)
    config.train.num_steps = 1500 if small else 3000
    config.probe.every = 50
    config.probe.per_sample = False
    config.sweep.num_layers = (1, 2, 4, 8)
    config.sweep.beta = (0.0, 1.0)
    config.sweep.seed = (0, 1) if small else (0, 1, 2)
    if "branches" in chosen:
        config.model.transformer.v_scale = 0.3
        config.model.transformer.mlp_scale = 0.3
        config.model.dtype = "float64"
        config.probe.dtype = "float64"
        config.sweep.beta = (1.0,)
    if "tiny" in chosen:
        shorten(config, 40)
        config.sweep.num_layers = (1, 2)
        config.sweep.seed = (0,)
        config.probe.every = 0  # every log step: one compiled chunk, not two
    config.lock()
    return config
