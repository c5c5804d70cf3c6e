"""The theory regime of the paper (our protocol): wide embedding d >= P*M, Gaussian data.

Zero loss is reachable, so plain full-batch GD should drive log L down a straight line, at a rate
set by the conditioning of the attention output matrix Z = Attn(X) + β X. One program runs
β ∈ {0, 0.5, 1} (both residuals) from the same initialization (seed 0).

    python -m resconv_jax.main --config=configs/theory.py --workdir=/tmp/theory

Expected: per-run summary lines (final loss, fitted per-step rate and R² of the log-linear fit), in
under a minute on 2 CPU cores. The step size is one value for all runs, chosen below the stable step
size of the most curved run (β = 1) at initialization: with the sum loss it scales like 1/(P·M).
"""

from resconv_jax.config_defaults import base_config


def get_config(arg=None):
    config = base_config()
    config.model.d_qk = 16
    config.model.d_h = 64
    config.data.num_samples = 8  # P
    config.data.seq_len = 8  # M
    config.data.dim = 64  # d = P*M
    config.data.out_dim = 1
    config.optim.lr = 2e-3
    config.train.num_steps = 2000
    config.train.log_every = 20
    config.train.print_every = 200
    config.train.checkpoint_every = 500
    config.sweep.beta = (0.0, 0.5, 1.0)
    config.lock()
    return config
