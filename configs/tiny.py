"""A tiny synthetic problem for tests: 3 runs (β = 0, 0.5, 1), a second or two on a CPU.

python -m resconv_jax.main --config=configs/tiny.py --workdir=/tmp/tiny
"""

from resconv_jax.config_defaults import base_config, variants


def get_config(arg=None):
    variants(arg, "configs/tiny.py")  # none: refuses any
    config = base_config()
    config.model.transformer.d_qk = 4
    config.model.transformer.d_h = 16
    config.data.num_samples = 8  # P
    config.data.seq_len = 4  # M
    config.data.dim = 32  # d = P*M: the theory regime
    config.optim.lr = 0.004  # stable for every β (0.01 diverges at β = 1)
    config.train.num_steps = 200
    config.train.log_every = 5
    config.train.print_every = 100
    config.train.checkpoint_every = 20
    config.sweep.beta = (0.0, 0.5, 1.0)
    config.lock()
    return config
