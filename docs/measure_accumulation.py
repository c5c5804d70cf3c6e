"""Float32 error of the full-batch gradient taken whole and in microbatches, against float64.

    python docs/measure_accumulation.py            # configs/jena.py:full, seed 0, β = 0 and 1

The same float32 weight draws and data; the reference is the float64 model's gradient. Prints,
per microbatch size n (0: the whole batch at once), ‖g − g64‖ / ‖g64‖ and |L − L64| / L64.
docs/protocol.md quotes its output.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

from resconv_jax.config_defaults import load_config_file  # noqa: E402
from resconv_jax.data import load_dataset  # noqa: E402
from resconv_jax.models import build_model  # noqa: E402
from resconv_jax.step import make_optimizer, make_step_functions  # noqa: E402
from resconv_jax.sweep import expand_runs, run_settings  # noqa: E402

SIZES = (0, 256, 64, 8, 1)


def gradient(config, dtype: str, size: int, runs, dataset):
    with config.unlocked():
        config.model.dtype = dtype
    model = build_model(config.model, dataset)
    fns = make_step_functions(
        model, make_optimizer(config.optim), config.optim.reduction, 1, microbatch_size=size
    )
    params = model.init_runs([run.seed for run in runs])
    floats = jnp.dtype(dtype)
    x, y = jnp.asarray(dataset.x_train, floats), jnp.asarray(dataset.y_train, floats)
    loss, grads = jax.jit(fns.gradient)(params, run_settings(runs), x, y)
    return np.asarray(loss, np.float64), np.asarray(jax.vmap(lambda g: ravel_pytree(g)[0])(grads))


def main() -> None:
    config = load_config_file("configs/jena.py", "full")
    runs = [run for run in expand_runs(config) if run.seed == 0 and run.beta_attn in (0.0, 1.0)]
    dataset = load_dataset(config)
    ref_loss, ref_grad = gradient(config, "float64", 0, runs, dataset)
    print(f"configs/jena.py:full, P = {dataset.num_train}, seed 0, β = 0 and 1; float32 vs float64")
    for size in SIZES:
        loss, grad = gradient(config, "float32", size, runs, dataset)
        g_err = np.linalg.norm(grad - ref_grad, axis=1) / np.linalg.norm(ref_grad, axis=1)
        l_err = np.abs(loss - ref_loss) / ref_loss
        what = "whole batch" if not size else f"n = {size} ({-(-dataset.num_train // size)} parts)"
        print(
            f"{what:>22}: gradient {', '.join(f'{e:.2e}' for e in g_err)}; "
            f"loss {', '.join(f'{e:.2e}' for e in l_err)}"
        )


if __name__ == "__main__":
    main()
