"""GPT-2 against an independent NumPy implementation of Hugging Face's equations; the loader of
a local checkpoint folder (its errors, one line each). The hub and `random`:
test_gpt2_sources.py."""

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx
from gpt2_checkpoints import HF_CONFIG, TINY, save_checkpoint, tiny_tensors
from safetensors.numpy import load_file, save_file

from resconv_jax.models.gpt2 import modeling as gpt2
from resconv_jax.models.gpt2 import weights

NUM_CLASSES = 3
LENGTHS = (7, 4, 1)  # real tokens per sequence of the test batch, padded on the right to 7


@pytest.fixture(scope="module")
def tensors():
    return tiny_tensors()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tensors):
    """{prefix: checkpoint folder} with and without the `transformer.` prefix."""
    root = tmp_path_factory.mktemp("gpt2")
    prefixes = ("transformer.", "")
    return {p: save_checkpoint(root / (p or "bare"), tensors, prefix=p) for p in prefixes}


def batch(lengths=LENGTHS, seed: int = 1) -> dict[str, np.ndarray]:
    """{"ids": (P, T) int32, "mask": (P, T) float32}; padding ids are random tokens too."""
    rng = np.random.default_rng(seed)
    length = max(lengths)
    ids = rng.integers(0, TINY["vocab_size"], (len(lengths), length)).astype(np.int32)
    mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    return {"ids": ids, "mask": mask}


def layernorm(x, weight, bias, eps=1e-5):
    """torch.nn.LayerNorm over the last axis (biased variance)."""
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(-1, keepdims=True) + eps) * weight + bias


def gelu_new(x):
    """Hugging Face's `gelu_new`, written out."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def attention(w: dict, prefix: str, x, allowed, n_head: int):
    """HF GPT2Attention on one sequence: x (T, d), allowed (T, T) -> (T, d), head by head."""
    d = x.shape[1]
    head_dim = d // n_head
    qkv = x @ w[prefix + "c_attn.weight"] + w[prefix + "c_attn.bias"]
    q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
    out = np.empty_like(x)
    for head in range(n_head):
        cols = slice(head * head_dim, (head + 1) * head_dim)
        scores = np.where(allowed, q[:, cols] @ k[:, cols].T / np.sqrt(head_dim), -np.inf)
        probs = np.exp(scores - scores.max(1, keepdims=True))
        out[:, cols] = probs / probs.sum(1, keepdims=True) @ v[:, cols]
    return out @ w[prefix + "c_proj.weight"] + w[prefix + "c_proj.bias"]


def numpy_block(w: dict, i: int, h, allowed, beta_a: float, beta_f: float):
    """Block i of HF GPT-2 with scaled residuals on one sequence: h (T, d) -> (h, attn, z)."""

    def ln(x, name):
        return layernorm(x, w[f"h.{i}.{name}.weight"], w[f"h.{i}.{name}.bias"])

    def conv1d(x, name):
        return x @ w[f"h.{i}.{name}.weight"] + w[f"h.{i}.{name}.bias"]

    attn = attention(w, f"h.{i}.attn.", ln(h, "ln_1"), allowed, TINY["n_head"])
    z = beta_a * h + attn
    h = beta_f * z + conv1d(gelu_new(conv1d(ln(z, "ln_2"), "mlp.c_fc")), "mlp.c_proj")
    return h, attn, z


def numpy_gpt2(tensors, head, inputs, num_layers, beta_a, beta_f):
    """Logits (P, C) and per-layer attn, z (L, P, T, d) in float64, one sequence at a time,
    with the causal mask ∧ the key mask of real tokens, pooled at the last real token."""
    w = {key: np.asarray(value, np.float64) for key, value in tensors.items()}
    logits, attns, zs = [], [], []
    for ids, mask in zip(inputs["ids"], inputs["mask"], strict=True):
        length = len(ids)
        h = w["wte.weight"][ids] + w["wpe.weight"][:length]
        allowed = np.tril(np.ones((length, length), bool)) & mask.astype(bool)[None, :]
        layers = []
        for i in range(num_layers):
            h, attn, z = numpy_block(w, i, h, allowed, beta_a, beta_f)
            layers.append((attn, z))
        attns.append([attn for attn, _ in layers])
        zs.append([z for _, z in layers])
        last = int(mask.sum()) - 1
        logits.append(layernorm(h, w["ln_f.weight"], w["ln_f.bias"])[last] @ head)
    return np.stack(logits), np.swapaxes(attns, 0, 1), np.swapaxes(zs, 0, 1)


def load(folder, num_layers=3, seed=0):
    return weights.load_gpt2(str(folder), num_layers=num_layers, num_classes=NUM_CLASSES, seed=seed)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("betas", [(0.0, 0.0), (1.0, 1.0), (0.5, 0.25)])
def test_forward_matches_numpy(folders, tensors, prefix, num_layers, betas):
    _, graphdef, params = load(folders[prefix], num_layers)
    inputs = batch()
    logits, inter = gpt2.apply(graphdef, params, inputs, *betas, return_intermediates=True)
    head = np.asarray(params["head"]["weight"])
    expected = numpy_gpt2(tensors, head, inputs, num_layers, *betas)
    for got, want in zip((logits, inter["attn"], inter["z"]), expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_float64_matches_numpy_to_float64_precision(folders, tensors):
    with jax.enable_x64(True):
        source = str(folders[""])
        _, graphdef, params = weights.load_gpt2(
            source, num_layers=3, num_classes=NUM_CLASSES, seed=0, dtype="float64"
        )
        assert params["h"][2]["mlp"]["c_fc"]["weight"].dtype == np.float64
        logits = gpt2.apply(graphdef, params, batch(), 0.5, 0.25)
        head = np.asarray(params["head"]["weight"])
        expected = numpy_gpt2(tensors, head, batch(), 3, 0.5, 0.25)[0]
        np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-11)


def test_betas_as_arrays_under_jit_and_vmap(folders):
    _, graphdef, params = load(folders[""])
    inputs = batch()
    betas = np.array([0.0, 0.5, 1.0], np.float32)
    run = jax.jit(jax.vmap(lambda b_a, b_f: gpt2.apply(graphdef, params, inputs, b_a, b_f)))
    swept = run(betas, betas[::-1])
    for i, (b_a, b_f) in enumerate(zip(betas, betas[::-1], strict=True)):
        alone = np.asarray(gpt2.apply(graphdef, params, inputs, float(b_a), float(b_f)))
        # float32 rounding on the logits' scale, as test_forward_matches_numpy: at XLA's -O0
        # on an AMD EPYC, the vmapped and the single program differ up to 1e-7 (5.5e-7 of the
        # largest |logit|), 1.4e-5 relative on a logit near 0.
        np.testing.assert_allclose(swept[i], alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())


def test_body_is_copied_and_head_is_fresh_from_seed(folders, tensors):
    cfg, _, params = load(folders[""], num_layers=2, seed=4)
    np.testing.assert_array_equal(
        params["h"][1]["attn"]["c_attn"]["weight"], tensors["h.1.attn.c_attn.weight"]
    )
    assert sorted(params["h"]) == [0, 1]
    _, random_params = gpt2.init_params(cfg, seed=4)
    np.testing.assert_array_equal(params["head"]["weight"], random_params["head"]["weight"])
    other = load(folders[""], num_layers=2, seed=5)[2]
    assert not np.allclose(other["head"]["weight"], params["head"]["weight"])


@pytest.mark.slow
def test_right_padding_leaves_real_tokens_unchanged(folders):
    _, graphdef, params = load(folders["transformer."])
    padded = batch(lengths=(8, 5), seed=2)
    alone = {key: value[1:, :5] for key, value in padded.items()}
    logits_p, inter_p = gpt2.apply(graphdef, params, padded, 0.5, 1.0, return_intermediates=True)
    logits_a, inter_a = gpt2.apply(graphdef, params, alone, 0.5, 1.0, return_intermediates=True)
    np.testing.assert_allclose(logits_p[1], logits_a[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inter_p["z"][:, 1, :5], inter_a["z"][:, 0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits_p[0], logits_p[1])  # the pooled token is the last real one


def test_intermediates_are_attn_and_z_of_each_block(folders):
    _, graphdef, params = load(folders[""])
    inputs = batch()
    beta_a, beta_f = 0.5, 0.75
    logits, inter = gpt2.apply(graphdef, params, inputs, beta_a, beta_f, return_intermediates=True)
    assert inter["attn"].shape == inter["z"].shape == (3, 3, 7, TINY["n_embd"])
    np.testing.assert_array_equal(inter["row_mask"], inputs["mask"])
    np.testing.assert_array_equal(logits, gpt2.apply(graphdef, params, inputs, beta_a, beta_f))
    model = nnx.merge(graphdef, params)
    h = model.wte.weight[...][inputs["ids"]] + model.wpe.weight[...][:7]
    for i, block in enumerate(model.h):
        np.testing.assert_allclose(inter["z"][i] - inter["attn"][i], beta_a * h, atol=2e-6)
        h = beta_f * inter["z"][i] + block.mlp(block.ln_2(inter["z"][i]))


def test_checkpoint_errors_name_every_bad_key(tmp_path, tensors):
    bad = dict(tensors)
    bad["h.1.attn.c_attn.weight"] = bad["h.1.attn.c_attn.weight"].T.copy()  # the transpose bug
    del bad["h.2.ln_2.bias"]
    bad["h.0.attn.c_q.weight"] = np.zeros((16, 16), np.float32)
    bad["h.7.ln_1.weight"] = np.ones(16, np.float32)  # a block beyond n_layer
    with pytest.raises(weights.WeightsError) as error:
        load(save_checkpoint(tmp_path, bad))
    message = str(error.value)
    assert "\n" not in message
    assert "missing: h.2.ln_2.bias" in message
    assert "transformer.h.0.attn.c_q.weight" in message
    assert "transformer.h.7.ln_1.weight" in message
    assert "transformer.h.1.attn.c_attn.weight (48, 16) (model (16, 48))" in message


@pytest.mark.parametrize(
    "tensor, match",
    [
        (np.ones((16,), np.int32), "h.0.ln_1.weight is int32, not a floating-point tensor"),
        (np.full((16,), np.nan, np.float32), "h.0.ln_1.weight holds non-finite values"),
    ],
)
def test_a_tensor_that_is_not_finite_floats_is_refused(tmp_path, tensors, tensor, match):
    """An int32 tensor was cast and trained (final loss 2.5e12), a NaN one 'diverged'."""
    bad = dict(tensors) | {"h.0.ln_1.weight": tensor}
    with pytest.raises(weights.WeightsError, match=re.escape(match)):
        load(save_checkpoint(tmp_path, bad))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_checkpoint_loads_as_its_float32_values(tmp_path, tensors, dtype):
    """A bfloat16 checkpoint (Hugging Face saves one with `.to(torch.bfloat16)`) was refused as
    "bfloat16, not a floating-point tensor": numpy does not count bfloat16 as floating."""
    import ml_dtypes

    half = {k: v.astype(getattr(ml_dtypes, dtype, None) or dtype) for k, v in tensors.items()}
    _, _, params = load(save_checkpoint(tmp_path, half))
    expected = half["h.1.attn.c_attn.weight"].astype(np.float32)
    np.testing.assert_array_equal(params["h"][1]["attn"]["c_attn"]["weight"], expected)


def test_a_tied_checkpoint_that_kept_only_lm_head_loads_it_as_the_embedding(tmp_path, tensors):
    """safetensors' `save_model` keeps one name of tied tensors, `lm_head.weight` (it sorts
    first): the loader skipped lm_head and refused the file as missing wte.weight."""
    folder = save_checkpoint(tmp_path, tensors)
    file = load_file(str(folder / weights.WEIGHTS_FILE))
    del file["transformer.wte.weight"]
    save_file(file, str(folder / weights.WEIGHTS_FILE))
    _, _, params = load(folder)
    np.testing.assert_array_equal(params["wte"]["weight"], tensors["wte.weight"])


def test_n_layer_is_checked_against_the_blocks_in_the_file(tmp_path, tensors):
    """Even blocks that the truncation does not read: the config must describe the file."""
    config = HF_CONFIG | {"n_layer": TINY["n_layer"] + 1}
    with pytest.raises(weights.WeightsError, match=r"has n_layer=4, the file holds blocks 0, 1, 2"):
        load(save_checkpoint(tmp_path, tensors, config=config), num_layers=2)


def test_n_head_that_does_not_divide_n_embd_is_refused(tmp_path, tensors):
    config = HF_CONFIG | {"n_head": 5}
    with pytest.raises(weights.WeightsError, match="n_embd=16 is not a multiple of n_head=5"):
        load(save_checkpoint(tmp_path, tensors, config=config), num_layers=2)


@pytest.mark.parametrize(
    "config, match",
    [
        ([1, 2], "expected a JSON object, got a list"),
        (HF_CONFIG | {"n_embd": "16"}, "n_embd='16': expected a positive integer"),
        (HF_CONFIG | {"n_head": 0}, "n_head=0: expected a positive integer"),
        (HF_CONFIG | {"layer_norm_epsilon": "x"}, "layer_norm_epsilon='x': expected a positive"),
        (HF_CONFIG | {"layer_norm_epsilon": -1}, "layer_norm_epsilon=-1: expected a positive"),
    ],
)
def test_a_malformed_config_json_is_one_line(tmp_path, tensors, config, match):
    """Each of these was a traceback (AttributeError, TypeError, ZeroDivisionError) or, for a
    negative ε, a NaN loss reported as a divergence."""
    folder = save_checkpoint(tmp_path, tensors)
    (folder / weights.CONFIG_FILE).write_text(json.dumps(config))
    one_line_error(weights.WeightsError, match, load, folder, num_layers=2)


def test_blocks_beyond_the_truncation_are_not_read(tmp_path, tensors):
    bad = dict(tensors)
    bad["h.2.mlp.c_fc.weight"] = np.zeros((3, 3), np.float32)
    load(save_checkpoint(tmp_path, bad), num_layers=2)
    with pytest.raises(weights.WeightsError, match=r"wrong shape: transformer\.h\.2\.mlp\.c_fc"):
        load(tmp_path, num_layers=3)


def one_line_error(error_type, match: str, function, *args, **kwargs) -> None:
    """Asserts that function(*args, **kwargs) raises `error_type` with a one-line message."""
    with pytest.raises(error_type, match=match) as error:
        function(*args, **kwargs)
    assert "\n" not in str(error.value)


def test_depth_and_length_errors_are_one_line(folders):
    folder = folders[""]
    one_line_error(ValueError, "num_layers=4 .* n_layer=3", load, folder, num_layers=4)
    one_line_error(ValueError, "num_layers=0", load, folder, num_layers=0)
    _, graphdef, params = load(folder)
    too_long = batch(lengths=(17,))
    match = "length 17 exceeds GPT-2's n_positions=16"
    one_line_error(ValueError, match, gpt2.apply, graphdef, params, too_long, 1.0, 1.0)


def test_shape_errors_are_one_line(folders):
    def load_with(source, shape):
        return weights.load_gpt2(source, num_layers=1, num_classes=2, seed=0, shape=shape)

    match = r"n_embd=32 \(checkpoint 16\)"
    one_line_error(weights.WeightsError, match, load_with, str(folders[""]), {"n_embd": 32})
    typo = "unknown GPT-2 shape entries"
    one_line_error(weights.WeightsError, typo, load_with, "random", {"n_embed": 32})


def test_unsupported_config_and_unreadable_file_are_one_line_errors(tmp_path, tensors):
    relu = save_checkpoint(
        tmp_path / "relu", tensors, config={**HF_CONFIG, "activation_function": "relu"}
    )
    one_line_error(weights.WeightsError, "activation_function='relu'", load, relu)
    broken = save_checkpoint(tmp_path / "broken", tensors)
    (broken / weights.WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    one_line_error(weights.WeightsError, "cannot read GPT-2 weights", load, broken)
    one_line_error(weights.WeightsError, "no such folder", load, tmp_path / "absent")


def test_a_training_set_with_fewer_distinct_prefixes_than_d_is_named_in_the_description():
    """Two sentences sharing their first two tokens, padding after: 3 + 4 - 2 = 5 distinct
    prefixes, so at d = 8 the stacked Z has σ_min = 0 by construction and the model says so."""
    from types import SimpleNamespace

    from resconv_jax.models import gpt2

    ids = np.array([[5, 6, 7, 0, 0], [5, 6, 8, 9, 0]], np.int32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.int32)
    assert gpt2.distinct_prefixes(ids, mask, enough=100) == 5
    assert gpt2.distinct_prefixes(ids, mask, enough=4) == 4
    data = SimpleNamespace(x_train={"ids": ids, "mask": mask})
    assert "5 distinct token prefixes < d=8" in gpt2._rank_note(data, 8)
    assert gpt2._rank_note(data, 5) == ""
