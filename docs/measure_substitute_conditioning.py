"""Where the random-init GPT-2 substitute's σ_min/‖Z‖_F at β = 0 comes from, per seed.

    python docs/measure_substitute_conditioning.py     # configs/sst2.py:random_small,small, float64

Layer 0 at init, Z stacked over the real tokens of the P training sentences ((tokens, d), as the
probe reports it in the SST-2 tables). With β = 0, Z = Attn(LN(h)) ends in the attention's output
projection c_proj, a square (d, d) Gaussian draw; with β = 1, Z = h + Attn(LN(h)). Prints per seed
σ_min/σ_max of c_proj, σ_min/‖Z‖_F at β = 0 and β = 1, and at β = 0 again with c_proj replaced by
an orthogonal matrix of the same Frobenius norm. docs/protocol.md quotes its output (claim 5c).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from resconv_jax.config_defaults import load_config_file  # noqa: E402
from resconv_jax.data import load_dataset  # noqa: E402
from resconv_jax.models import RunSettings, build_model  # noqa: E402

SEEDS = range(8)


def z_ratio(model, params, inputs, beta: float) -> float:
    """σ_min/‖Z‖_F of layer 0's Z over real tokens, (tokens, d)."""
    _, middle = model.apply(params, inputs, RunSettings(beta, beta), return_intermediates=True)
    z = np.asarray(middle["z"][0])[np.asarray(middle["row_mask"]).astype(bool)]
    singular = np.linalg.svd(z, compute_uv=False)
    return singular[-1] / np.linalg.norm(singular)


def with_orthogonal_c_proj(params, seed: int):
    """`params` with layer 0's c_proj weight (d, d) replaced by an orthogonal matrix of its norm."""
    weight = np.asarray(params["h"][0]["attn"]["c_proj"]["weight"])
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal(weight.shape))
    q *= np.linalg.norm(weight) / np.linalg.norm(q)
    replaced = jax.tree.map(np.asarray, params)  # new containers: `params` stays as it was
    replaced["h"][0]["attn"]["c_proj"]["weight"] = q
    return replaced


def main() -> None:
    config = load_config_file("configs/sst2.py", "random_small,small", **{"model.dtype": "float64"})
    dataset = load_dataset(config)
    model = build_model(config.model, dataset)
    print(
        f"configs/sst2.py:random_small,small, P = {dataset.num_train}, layer 0 at init, float64\n"
        "seed  c_proj σmin/σmax  σmin/‖Z‖F β=0  β=1       β=0, orthogonal c_proj"
    )
    rows = []
    for seed in SEEDS:
        params = model.init(seed)
        c_proj = np.linalg.svd(params["h"][0]["attn"]["c_proj"]["weight"], compute_uv=False)
        ratios = [z_ratio(model, params, dataset.x_train, beta) for beta in (0.0, 1.0)]
        fixed = z_ratio(model, with_orthogonal_c_proj(params, seed), dataset.x_train, 0.0)
        rows.append((c_proj[-1] / c_proj[0], *ratios, fixed))
        print(f"{seed:4d}  {rows[-1][0]:16.2e}  {ratios[0]:13.2e}  {ratios[1]:8.2e}  {fixed:10.2e}")
    logs = np.log(np.array(rows))
    correlation = np.corrcoef(logs[:, 0], logs[:, 1])[0, 1]
    print(f"correlation of the logs, c_proj against β = 0: {correlation:.3f}")


if __name__ == "__main__":
    main()
