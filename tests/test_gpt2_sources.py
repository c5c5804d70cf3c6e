"""Where GPT-2's weights come from, other than a local folder: a Hugging Face hub id (its cache
offline, an unreachable or silent hub: one line within seconds) and `random` (GPT-2 small's
shape and init)."""

import os
import time

import huggingface_hub
import huggingface_hub.constants
import jax
import numpy as np
import pytest
from gpt2_checkpoints import save_checkpoint, tiny_tensors

from resconv_jax.models.gpt2 import modeling as gpt2
from resconv_jax.models.gpt2 import weights


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache; huggingface_hub reads its settings at import, so the module
    constants are patched as well as the environment."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def offline(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if on else "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", on)


def hub_error_in_seconds(repo_id: str) -> str:
    """The one-line WeightsError message of loading `repo_id`, which must come within 20 s (a
    hub that never answers held it 30 s and more before; the hub's own imports and 3 s waits
    take 7-10 s on a loaded machine)."""
    start = time.monotonic()
    with pytest.raises(weights.WeightsError) as error:
        weights.load_gpt2(repo_id, num_layers=1, num_classes=2, seed=0)
    assert time.monotonic() - start < 20
    message = str(error.value)
    assert "\n" not in message and weights.FOLDER_OPTION in message
    return message


def test_hub_id_offline_with_empty_cache_fails_at_once(empty_hub_cache, monkeypatch):
    offline(monkeypatch, True)
    message = hub_error_in_seconds("openai-community/gpt2")
    assert "could not be found offline" in message and str(empty_hub_cache) in message


def test_hub_id_without_network_fails_at_once(empty_hub_cache, monkeypatch):
    offline(monkeypatch, False)
    unreachable = "http://127.0.0.1:9"  # nothing listens on the discard port: refused at once
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", unreachable)
    template = unreachable + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    message = hub_error_in_seconds("openai-community/gpt2")
    assert "could not be found offline" in message and "unreachable" in message


@pytest.mark.slow
def test_a_hub_that_never_answers_fails_within_seconds(empty_hub_cache, monkeypatch):
    """A resolver or connection that hangs (no network, a firewall that drops packets): a
    connect with a timeout ends a little after it, as a real one does (Hugging Face's own
    requests set 3 s), one without a timeout after 30 s. Alone in a process, the first lookup
    also meets huggingface_hub's agent-registry request, which other tests had made before."""
    offline(monkeypatch, False)

    def hang(address, timeout=None, *args, **kwargs):
        time.sleep(30 if timeout is None else timeout + 0.5)
        raise TimeoutError("timed out")

    monkeypatch.setattr(weights.socket, "create_connection", hang)
    message = hub_error_in_seconds("openai-community/gpt2")
    assert "unreachable (no answer from huggingface.co within 3 s)" in message


def test_missing_weights_stop_a_run_in_one_line_before_it_prints(
    empty_hub_cache, monkeypatch, tmp_path, capsys
):
    from resconv_jax import train
    from resconv_jax.config_defaults import load_config_file

    offline(monkeypatch, True)
    config = load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "sst2.py"))
    with pytest.raises(weights.WeightsNotFound):
        train.run(config, str(tmp_path / "w"))
    assert capsys.readouterr().out == "" and not (tmp_path / "w").exists()


def test_a_random_depth_sweep_deeper_than_its_shape_is_refused_before_it_trains(tmp_path, capsys):
    """The deepest L was checked against the shape only when its program was built: L = 1 trained
    and left its folder, then L = 2 stopped with exit status 2 ("nothing written")."""
    from resconv_jax import train
    from resconv_jax.config_defaults import load_config_file

    config = load_config_file(
        os.path.join(os.path.dirname(__file__), "..", "configs", "sst2.py"),
        "tiny",
        **{
            "model.gpt2.weights": "random",
            "model.gpt2.shape.n_embd": 16,
            "model.gpt2.shape.n_head": 2,
            "model.gpt2.shape.n_layer": 1,
            "train.num_steps": 2,
        },  # fmt: skip
    )
    assert tuple(config.sweep.num_layers) == (1, 2)
    with pytest.raises(ValueError, match="num_layers=2 must be between 1 and n_layer=1"):
        train.run(config, str(tmp_path / "w"))
    assert capsys.readouterr().out == "" and not (tmp_path / "w").exists()


def test_hub_id_is_read_from_the_cache_offline(empty_hub_cache, monkeypatch, tmp_path):
    offline(monkeypatch, True)
    repo = empty_hub_cache / "models--test-org--tiny-gpt2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    save_checkpoint(repo / "snapshots" / commit, tiny_tensors(), prefix="")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _, _, from_hub = weights.load_gpt2("test-org/tiny-gpt2", num_layers=2, num_classes=3, seed=0)
    folder = save_checkpoint(tmp_path / "bare", tiny_tensors(), prefix="")
    _, _, from_folder = weights.load_gpt2(str(folder), num_layers=2, num_classes=3, seed=0)
    jax.tree.map(np.testing.assert_array_equal, from_hub["h"], from_folder["h"])


def test_random_is_gpt2_small_by_default(monkeypatch):
    init = gpt2.init_params

    def shapes_only(cfg, seed):  # drawing GPT-2 small's 40M numbers took 5 s of the test
        built = {}

        def drawn():
            built["graphdef"], params = init(cfg, seed)
            return params

        shapes = jax.eval_shape(drawn)
        return built["graphdef"], shapes

    monkeypatch.setattr(gpt2, "init_params", shapes_only)
    cfg, _, params = weights.load_gpt2("random", num_layers=1, num_classes=2, seed=0)
    sizes = {name: getattr(cfg, name) for name in weights.GPT2_SMALL}
    assert sizes == {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
    }
    assert params["wte"]["weight"].shape == (50257, 768)
    assert params["wpe"]["weight"].shape == (1024, 768)
    assert params["h"][0]["attn"]["c_attn"]["weight"].shape == (768, 2304)
    assert params["h"][0]["mlp"]["c_proj"]["weight"].shape == (3072, 768)
    assert params["head"]["weight"].shape == (768, 2)
    assert list(params["h"]) == [0]


def test_random_init_statistics():
    shape = {"vocab_size": 500, "n_positions": 64, "n_embd": 64, "n_head": 4, "n_layer": 8}
    _, _, params = weights.load_gpt2("random", num_layers=2, num_classes=3, seed=0, shape=shape)
    block = params["h"][1]
    for weight, std in [
        (params["wte"]["weight"], 0.02),
        (params["wpe"]["weight"], 0.02),
        (block["attn"]["c_attn"]["weight"], 0.02),
        (block["mlp"]["c_fc"]["weight"], 0.02),
        (block["attn"]["c_proj"]["weight"], 0.02 / 4),  # 0.02 / sqrt(2 n_layer)
        (block["mlp"]["c_proj"]["weight"], 0.02 / 4),
    ]:
        assert np.std(weight) == pytest.approx(std, rel=0.05)
        assert abs(np.mean(weight)) < 0.1 * std
    np.testing.assert_array_equal(block["attn"]["c_attn"]["bias"], 0)
    np.testing.assert_array_equal(block["ln_1"]["weight"], 1)
    np.testing.assert_array_equal(params["ln_f"]["bias"], 0)
    _, _, again = weights.load_gpt2("random", num_layers=2, num_classes=3, seed=0, shape=shape)
    np.testing.assert_array_equal(again["wte"]["weight"], params["wte"]["weight"])
