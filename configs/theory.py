"""The theory regime of the paper (our protocol): wide embedding d >= P*M, Gaussian data.

Zero loss is reachable, so plain full-batch GD should drive log L down a straight line, at a rate
set by the conditioning of the attention output matrix Z = Attn(X) + β X. One program runs
β ∈ {0, 0.5, 1} (both residuals) from the same initialization (seed 0).

    python -m resconv_jax.main --config=configs/theory.py --workdir=/tmp/theory

Expected, in well under a minute on 2 CPU cores: per-run summary lines (final loss, fitted per-step
rate and R² of the log-linear fit, σ_min²/σ_max² of Z at the start and end, and the fraction of
tangent-kernel checks where the measured L_{t+1}/L_t stayed below the linearized bound
max((1 − η λ_min(K))², (1 − η λ_max(K))²)); the per-β table; training.png (log-loss and σ_min of Z
and Attn(X) against step), loss_by_beta.png and sigma_by_beta.png in the workdir.

Step size (our protocol): one η for all runs, below 1/λ_max(K) of the most curved run at
initialization. Measured with this config: λ_max(K) at step 0 is 571 (β = 0), 1034 (β = 0.5) and
2480 (β = 1), so η = 4e-4 ≤ 1/2480. (η = 1e-3 still converges but is past 2/λ_max for β = 1 at
initialization.) With the sum loss, λ_max grows like P·M. `--config.optim.lr_rule=lambda_max`
instead gives each run η = lr_factor / λ_max(K) at its own initialization.

`configs/theory.py:float64` (weights and probe in float64) follows the runs below float32's loss
floor (β = 1 down to ~1e-28; the same initial weights; 18–22 s instead of 15 s). `:softplus` is
the certificate's premise (a smooth activation, Assumption 1, and η = 0.9/λ_max(K) of each run
at its initialization); `:tiny` (for `reproduce --scale=tiny`) stops at 40 steps. Variants
combine: `reproduce` runs `:float64` and `:float64,softplus`.
"""

from resconv_jax.config_defaults import shorten, theory_regime_config, variants


def get_config(arg=None):
    chosen = variants(arg, "configs/theory.py", ("float64", "softplus", "tiny"))
    config = theory_regime_config(64)  # d = P·M
    config.optim.lr = 4e-4  # <= 1/λ_max(K) at init for every β (see docstring)
    config.train.num_steps = 2000
    config.certificate.every = 20  # tangent-kernel certificate every 20 steps (J is 64 × 13k)
    config.sweep.beta = (0.0, 0.5, 1.0)
    if "float64" in chosen:
        config.model.dtype = "float64"
        config.probe.dtype = "float64"
    if "softplus" in chosen:  # the certificate's premise, η ≤ 1/λ_max(K), for every run
        config.model.transformer.activation = "softplus"
        config.optim.lr_rule = "lambda_max"
        config.optim.lr_factor = 0.9
    if "tiny" in chosen:
        shorten(config, 40)
    config.lock()
    return config
