"""Rate against conditioning (claim 2): the theory regime swept over β × seeds × width d.

Claim 2 of docs/protocol.md: the linear rate is set by the extreme singular values of the
attention output matrix Z = Attn(X) + βX. At d = P·M (square Z of one sample stack) σ_min(Z) is
erratic between seeds, so the sweep adds wider embeddings, d ∈ {P·M, 2·P·M, 4·P·M}, one compiled
program per width (`sweep.dim`), each on its own Gaussian data (data.seed 0) and every β of a seed
from the same initial weights.

    python -m resconv_jax.main --config=configs/conditioning.py --workdir=workdirs/conditioning

Per run (summary.json, conditioning_runs.csv): the fitted linear rate and R² over the logged steps
above the fit floor, σ_min²/σ_max²(Z) at initialization and averaged over that window,
λ_min(K)/λ_max(K) of the tangent kernel at initialization, and η. Per width: Spearman's ρ of
1 − rate against σ_min²/σ_max²(Z) and against η·λ_min(K), and the log-log slope (rate_scatter.png,
step_size.png: the stable step 2/λ_max(K) against σ_max²(Z) at initialization).

Our protocol (the paper gives no sizes): P = 8, M = 8, d_QK = 16, d_h = 64, the sum loss, one
η = 1.6e-4 for every run, below 1/λ_max(K) at initialization of the most curved run (β = 1 at
d = 4·P·M: λ_max(K) 5328–6040 over seeds 0–4, so η·λ_max ≤ 0.97; the η = 2e-4 used before
2026-12-06 gave 1.07–1.21 there, stable but outside the premise of η·λ_min(K) as a rate), 3000
steps; 11 β × 5 seeds × 3 widths = 165 runs. `:small` (for
`python -m resconv_jax.reproduce --scale=small`): 5 β × 3 seeds × d ∈ {P·M, 2·P·M}, 1500 steps,
η = 2e-4 (η·λ_max(K) ≤ 0.84 at initialization of its 30 runs).
`:tiny` (a smoke test): β ∈ {0, 1} × seeds {0, 1} × d ∈ {P·M, 2·P·M}, 40 steps.
"""

from resconv_jax.config_defaults import shorten, theory_regime_config, variants


def get_config(arg=None):
    chosen = variants(arg, "configs/conditioning.py", ("small", "tiny"))
    small = bool(chosen)  # tiny starts from small
    config = theory_regime_config(64)  # d = P·M; each width of sweep.dim replaces it
    config.optim.lr = 2e-4 if small else 1.6e-4  # η·λ_max(K) < 1 at init (see above)
    config.train.num_steps = 1500 if small else 3000
    config.probe.every = 50
    config.probe.per_sample = False
    config.certificate.every = config.train.num_steps  # the tangent kernel at initialization only
    if small:
        config.sweep.beta = (0.0, 0.25, 0.5, 0.75, 1.0)
        config.sweep.seed = (0, 1, 2)
        config.sweep.dim = (64, 128)
    else:
        config.sweep.beta = tuple(round(0.1 * i, 1) for i in range(11))
        config.sweep.seed = (0, 1, 2, 3, 4)
        config.sweep.dim = (64, 128, 256)
    if "tiny" in chosen:
        shorten(config, 40)
        config.sweep.beta = (0.0, 1.0)
        config.sweep.seed = (0, 1)
        config.certificate.every = 40
        config.probe.every = 0  # every log step: one compiled chunk, not two
    config.lock()
    return config
