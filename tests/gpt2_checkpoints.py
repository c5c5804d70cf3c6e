"""Test helper: small GPT-2 checkpoints in Hugging Face's layout (safetensors and config.json),
written by the tests that load them."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

from resconv_jax.models.gpt2 import weights

TINY = {"vocab_size": 50, "n_positions": 16, "n_embd": 16, "n_head": 2, "n_layer": 3}
HF_CONFIG = {
    **TINY,
    "layer_norm_epsilon": 1e-5,
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "n_inner": None,
    "n_ctx": 16,
}


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A random GPT-2 body in Hugging Face's layout (keys without prefix), float32.

    Scales are larger than GPT-2's init (and LayerNorm scales and biases are not 1 and 0), so
    that every term of the equations moves the outputs.
    """
    rng = np.random.default_rng(seed)
    d = TINY["n_embd"]
    shapes = {"wte.weight": (TINY["vocab_size"], d), "wpe.weight": (TINY["n_positions"], d)}
    for i in range(TINY["n_layer"]):
        shapes |= {
            f"h.{i}.attn.c_attn.weight": (d, 3 * d),
            f"h.{i}.attn.c_attn.bias": (3 * d,),
            f"h.{i}.attn.c_proj.weight": (d, d),
            f"h.{i}.attn.c_proj.bias": (d,),
            f"h.{i}.mlp.c_fc.weight": (d, 4 * d),
            f"h.{i}.mlp.c_fc.bias": (4 * d,),
            f"h.{i}.mlp.c_proj.weight": (4 * d, d),
            f"h.{i}.mlp.c_proj.bias": (d,),
        }
        shapes |= {f"h.{i}.{ln}.{p}": (d,) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")}
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
    tensors = {key: 0.3 * rng.standard_normal(shape) for key, shape in shapes.items()}
    for key in tensors:
        if key.split(".")[-2].startswith("ln_") and key.endswith(".weight"):
            tensors[key] = 1.0 + tensors[key]
    return {key: value.astype(np.float32) for key, value in tensors.items()}


def save_checkpoint(folder, tensors: dict, *, prefix: str = "transformer.", config=None):
    """Writes `config.json` and `model.safetensors` in Hugging Face's layout, with the causal
    mask buffers `h.{i}.attn.bias` (1, 1, n_positions, n_positions) and an `lm_head.weight`
    (vocab, d) that the loader must skip. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    n = TINY["n_positions"]
    mask = np.tril(np.ones((n, n), np.float32))[None, None]
    file = {prefix + key: value for key, value in tensors.items()}
    file |= {f"{prefix}h.{i}.attn.bias": mask for i in range(TINY["n_layer"])}
    file["lm_head.weight"] = tensors["wte.weight"].copy()
    save_file(file, str(folder / weights.WEIGHTS_FILE))
    (folder / weights.CONFIG_FILE).write_text(json.dumps(config or HF_CONFIG))
    return folder
