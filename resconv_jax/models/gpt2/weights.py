"""GPT-2 weights for `gpt2.GPT2Classifier`: a Hugging Face folder, a hub id, or a random init.

`source` is one of

- a folder with Hugging Face's `config.json` and `model.safetensors` (keys with or without the
  `transformer.` prefix; the `attn.bias` / `attn.masked_bias` buffers and `lm_head.*` are skipped,
  but for a tied file that kept only `lm_head.weight`, which is then the embedding `wte.weight`);
- a hub id such as `openai-community/gpt2`, taken from the local Hugging Face cache first and
  downloaded only when it is not there and the hub can be reached;
- `random`: GPT-2's random init for the shape `shape` (Hugging Face config names; GPT-2 small
  when None).

Only the first L blocks of a checkpoint are read. The classification head is not in any GPT-2
checkpoint: it is always drawn fresh from `seed`, the same head as `gpt2.init_params(cfg, seed)`.
The loader follows the NNX model zoo (bonsai): an abstract model from `nnx.eval_shape`, one table
that maps checkpoint keys to model paths, every shape checked, and every missing, unexpected or
mis-shaped key named in one error before anything is read.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import urllib.parse
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from absl import logging
from flax import nnx, traverse_util

from resconv_jax.errors import WeightsError, WeightsNotFound, one_line
from resconv_jax.models.gpt2 import modeling as gpt2

FOLDER_OPTION = "--config.model.gpt2.weights=FOLDER"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SHAPE_NAMES = ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer", "layer_norm_epsilon")
GPT2_SMALL = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12}
_MAX_LISTED = 20  # keys named per kind in an error; the rest are counted

# Checkpoint key (without "transformer.") -> model path. The model's paths are Hugging Face's
# names, so each rule keeps the name; no rule transposes (Conv1D weights are (in, out) in both).
_KEY_RULES = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (r"(wte|wpe)\.weight", r"\1.weight"),
        (r"h\.(\d+)\.(ln_1|ln_2)\.(weight|bias)", r"h.\1.\2.\3"),
        (r"h\.(\d+)\.attn\.(c_attn|c_proj)\.(weight|bias)", r"h.\1.attn.\2.\3"),
        (r"h\.(\d+)\.mlp\.(c_fc|c_proj)\.(weight|bias)", r"h.\1.mlp.\2.\3"),
        (r"ln_f\.(weight|bias)", r"ln_f.\1"),
    )
)
_SKIPPED_KEYS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)|lm_head\..*")
_BLOCK_PATH = re.compile(r"h\.(\d+)\.")
_TIED = "lm_head.weight"  # GPT-2's output projection, tied to wte.weight


def load_gpt2(
    source: str,
    *,
    num_layers: int,
    num_classes: int,
    seed: int,
    shape: dict | None = None,
    dtype: str = "float32",
    cache_dir: str | None = None,
) -> tuple[gpt2.GPT2Config, nnx.GraphDef, dict]:
    """(config, graphdef, params) of GPT-2 truncated to `num_layers` blocks with a fresh head.

    `shape` (Hugging Face config names) sets the model for `random`; for a checkpoint, any entry
    it has must agree with the checkpoint's `config.json`. `cache_dir` is the Hugging Face hub
    cache (default: huggingface_hub's, from HF_HUB_CACHE / HF_HOME). Raises `WeightsError`.
    """
    shape = _checked_shape(shape)
    if source == "random":
        cfg = gpt2.GPT2Config.from_hf_config(
            {**GPT2_SMALL, **shape}, num_layers, num_classes, dtype
        )
        graphdef, params = gpt2.init_params(cfg, seed)
        logging.info("GPT-2 %s: random init from seed %d", _describe(cfg), seed)
        return cfg, graphdef, params
    return _load_folder(
        find_weights(source, cache_dir), num_layers, num_classes, seed, shape, dtype
    )


def find_weights(source: str, cache_dir: str | None = None) -> Path:
    """The folder of GPT-2 weights `source` (a folder, or a hub id: its cache snapshot, else
    downloaded when the hub answers within HUB_TIMEOUT_S). WeightsNotFound when it is in neither
    place, WeightsError for a bad name."""
    return _local_folder(source) or _hub_folder(source, cache_dir)


HUB_TIMEOUT_S = 3.0


def _hub_unreachable(timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (a name that does not resolve, a refused or unanswered
    connection within `timeout` seconds, DNS included), or None when a connection opens."""
    host = urllib.parse.urlparse(huggingface_hub.constants.ENDPOINT).hostname or ""
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{type(error).__name__}: {one_line(error)}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer from {host} within {timeout:g} s"


def check_random_shape(shape: dict, num_layers: int) -> None:
    """The random model's `shape` (refused as in `load_gpt2`) holds `num_layers` blocks."""
    gpt2.GPT2Config.from_hf_config({**GPT2_SMALL, **_checked_shape(shape)}, num_layers, 1)


def _checked_shape(shape: dict | None) -> dict:
    """`shape` as a dict, refusing names that are not GPT-2 sizes (a typo would be ignored)."""
    shape = dict(shape or {})
    unknown = sorted(set(shape) - set(SHAPE_NAMES))
    if unknown:
        raise WeightsError(f"unknown GPT-2 shape entries {unknown}; known: {list(SHAPE_NAMES)}")
    return shape


def _describe(cfg: gpt2.GPT2Config) -> str:
    return (
        f"blocks 0..{cfg.num_layers - 1} of {cfg.n_layer} (d={cfg.n_embd}, {cfg.n_head} heads, "
        f"vocab {cfg.vocab_size}, {cfg.n_positions} positions)"
    )


def _local_folder(source: str) -> Path | None:
    """`source` as a folder, None when it names a hub repository instead."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.startswith(("/", ".", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        raise WeightsError(
            f"GPT-2 weights {source!r}: no such folder (expected 'random', a folder with "
            f"{CONFIG_FILE} and {WEIGHTS_FILE}, or a hub id such as openai-community/gpt2)"
        )
    return None


def _hub_folder(repo_id: str, cache_dir: str | None) -> Path:
    """The snapshot folder of hub repository `repo_id`: from the cache, else downloaded."""
    try:
        return _download(repo_id, cache_dir, local_files_only=True)
    except huggingface_hub.errors.LocalEntryNotFoundError:
        pass
    cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
    not_found = (
        f"GPT-2 weights {repo_id!r} are not a local folder and could not be found offline "
        f"(not in the Hugging Face cache {cache})"
    )
    use_folder = f"pass a folder with {CONFIG_FILE} and {WEIGHTS_FILE}: {FOLDER_OPTION}"
    if huggingface_hub.is_offline_mode():
        raise WeightsNotFound(f"{not_found} and HF_HUB_OFFLINE is set; {use_folder}")
    unreachable = _hub_unreachable()
    if unreachable:
        raise WeightsNotFound(
            f"{not_found} and the hub is unreachable ({unreachable}); {use_folder}"
        )
    try:
        # One HEAD request without retries: without network this fails at once, where
        # hf_hub_download would retry for a minute.
        url = huggingface_hub.hf_hub_url(repo_id, CONFIG_FILE)
        huggingface_hub.get_hf_file_metadata(url, timeout=10)
        return _download(repo_id, cache_dir, local_files_only=False)
    except huggingface_hub.errors.HfHubHTTPError as error:
        raise WeightsError(f"GPT-2 weights {repo_id!r}: {one_line(error)}; {use_folder}") from None
    except Exception as error:  # no network, no DNS, a timeout: all mean "offline" here
        raise WeightsNotFound(
            f"{not_found} and the hub is unreachable ({type(error).__name__}: "
            f"{one_line(error)}); {use_folder}"
        ) from None


def _download(repo_id: str, cache_dir: str | None, *, local_files_only: bool) -> Path:
    paths = [
        huggingface_hub.hf_hub_download(
            repo_id, name, cache_dir=cache_dir, local_files_only=local_files_only
        )
        for name in (CONFIG_FILE, WEIGHTS_FILE)
    ]
    return Path(paths[0]).parent


def check_fits(source: str, num_layers: int, cache_dir: str | None = None) -> None:
    """WeightsError unless `source` (a folder or hub id, not `random`) holds every tensor, in
    its shape, of GPT-2's first `num_layers` blocks: reads config.json and the safetensors
    header only, so a depth sweep checks its deepest L before training its first."""
    folder = find_weights(source, cache_dir)
    cfg, _, model_shapes = _folder_model(folder, num_layers, num_classes=1, seed=0, shape={})
    with _opened(folder / WEIGHTS_FILE) as file:
        _match_keys(_file_shapes(file), model_shapes, cfg, folder / WEIGHTS_FILE)


def _folder_model(
    folder: Path, num_layers: int, num_classes: int, seed: int, shape: dict, dtype="float32"
) -> tuple[gpt2.GPT2Config, nnx.GraphDef, dict[str, tuple]]:
    """(config, graphdef, {model path: shape}) of the model of `folder`'s config.json."""
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise WeightsError(f"GPT-2 weights folder {folder} has no {name}")
    try:
        hf_config = json.loads((folder / CONFIG_FILE).read_text())
        cfg = gpt2.GPT2Config.from_hf_config(hf_config, num_layers, num_classes, dtype)
    except (OSError, ValueError) as error:  # json's errors are ValueErrors
        raise WeightsError(f"{folder / CONFIG_FILE}: {one_line(error)}") from None
    _check_shape_agrees(shape, hf_config, folder)
    abstract = nnx.eval_shape(lambda: gpt2.GPT2Classifier(cfg, rngs=gpt2.make_rngs(seed)))
    graphdef, state = nnx.split(abstract)
    shapes = {path: leaf.shape for path, leaf in _flatten(nnx.to_pure_dict(state)).items()}
    return cfg, graphdef, shapes


def _load_folder(
    folder: Path, num_layers: int, num_classes: int, seed: int, shape: dict, dtype: str
) -> tuple[gpt2.GPT2Config, nnx.GraphDef, dict]:
    """(config, graphdef, params) from a Hugging Face folder: body from the file, head fresh."""
    cfg, graphdef, model_shapes = _folder_model(folder, num_layers, num_classes, seed, shape, dtype)
    body = _read_body(folder / WEIGHTS_FILE, model_shapes, cfg)
    flat = {**body, **_flatten({"head": gpt2.init_head(cfg, seed)})}
    logging.info(
        "GPT-2 %s from %s; classification head (%d, %d) freshly initialized from seed %d",
        *(_describe(cfg), folder, cfg.n_embd, cfg.num_classes, seed),
    )
    return cfg, graphdef, _unflatten({path: flat[path] for path in model_shapes})


def _check_shape_agrees(shape: dict, hf_config: dict, folder: Path) -> None:
    """WeightsError when an entry of `shape` differs from the checkpoint's config.json."""
    # an entry absent from config.json is Hugging Face's default, GPT-2 small's
    defaults = {name: getattr(gpt2.GPT2Config, name) for name in SHAPE_NAMES}
    differ = [
        f"{name}={value} (checkpoint {hf_config.get(name, defaults[name])})"
        for name, value in shape.items()
        if hf_config.get(name, defaults[name]) != value
    ]
    if differ:
        raise WeightsError(
            f"GPT-2 shape disagrees with {folder / CONFIG_FILE}: {', '.join(differ)}"
        )


def _read_body(path: Path, model_shapes: dict, cfg: gpt2.GPT2Config) -> dict[str, jax.Array]:
    """{model path: array in cfg.dtype} for every non-head path, after checking every key."""
    with _opened(path) as file:
        plan = _match_keys(_file_shapes(file), model_shapes, cfg, path)
        return {
            dest: jnp.asarray(_finite(file, key, path), cfg.dtype) for dest, key in plan.items()
        }


def _finite(file, key: str, path: Path) -> np.ndarray:
    """Tensor `key` of an open safetensors file; WeightsError unless it is finite floats."""
    tensor = file.get_tensor(key)
    if not jnp.issubdtype(tensor.dtype, jnp.floating):  # bfloat16 too, which numpy's is not
        raise WeightsError(f"{path}: {key} is {tensor.dtype}, not a floating-point tensor")
    if not np.isfinite(tensor).all():
        raise WeightsError(f"{path}: {key} holds non-finite values")
    return tensor


@contextlib.contextmanager
def _opened(path: Path):
    """The safetensors file `path`, open for reading; a read that fails within is one line."""
    try:
        with safetensors.safe_open(path, framework="numpy") as file:
            yield file
    except (OSError, safetensors.SafetensorError) as error:
        raise WeightsError(f"cannot read GPT-2 weights {path}: {one_line(error)}") from None


def _file_shapes(file) -> dict[str, tuple]:
    """{checkpoint key: shape} of an open safetensors file, from its header."""
    return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}


def _model_path(name: str) -> str | None:
    """The model path of checkpoint key `name` (prefix removed), None when no rule accepts it."""
    for pattern, target in _KEY_RULES:
        if pattern.fullmatch(name):
            return pattern.sub(target, name)
    return None


def _match_keys(
    file_shapes: dict[str, tuple], model_shapes: dict[str, tuple], cfg: gpt2.GPT2Config, path
) -> dict[str, str]:
    """{model path: checkpoint key}; one WeightsError naming every missing, unexpected and
    mis-shaped key. Blocks L..n_layer-1 of the checkpoint are neither loaded nor unexpected."""
    plan, unexpected, wrong = {}, [], []
    for key, shape in file_shapes.items():
        name = key.removeprefix("transformer.")
        if _SKIPPED_KEYS.fullmatch(name):
            continue
        dest = _model_path(name)
        if dest is None or dest in plan:
            unexpected.append(key if dest is None else f"{key} (duplicate)")
        elif dest not in model_shapes:
            block = _BLOCK_PATH.match(dest)
            if block is None or int(block.group(1)) >= cfg.n_layer:
                unexpected.append(key)
        else:
            if shape != model_shapes[dest]:
                wrong.append(f"{key} {shape} (model {model_shapes[dest]})")
            plan[dest] = key
    if "wte.weight" not in plan and _TIED in file_shapes:  # a tied file that kept lm_head's name
        if file_shapes[_TIED] != model_shapes["wte.weight"]:
            wrong.append(f"{_TIED} {file_shapes[_TIED]} (model {model_shapes['wte.weight']})")
        plan["wte.weight"] = _TIED
    missing = [dest for dest in model_shapes if dest not in plan and not dest.startswith("head.")]
    problems = [
        f"{kind}: {_listing(keys)}"
        for kind, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if keys
    ]
    blocks = {
        int(match.group(1))
        for key in file_shapes
        if (match := _BLOCK_PATH.match(key.removeprefix("transformer.")))
    }
    if blocks != set(range(cfg.n_layer)):
        held = f"blocks {_listing([str(i) for i in sorted(blocks)])}" if blocks else "no block"
        problems.append(f"{CONFIG_FILE} has n_layer={cfg.n_layer}, the file holds {held}")
    if problems:
        raise WeightsError(
            f"GPT-2 weights {path} do not fit the model ({_describe(cfg)}): {'; '.join(problems)}"
        )
    return plan


def _listing(keys: list[str]) -> str:
    listed = ", ".join(keys[:_MAX_LISTED])
    return listed if len(keys) <= _MAX_LISTED else f"{listed} and {len(keys) - _MAX_LISTED} more"


def _flatten(tree: dict) -> dict[str, object]:
    """{"h.0.attn.c_attn.weight": leaf} of a nested parameter dict."""
    return {".".join(map(str, k)): v for k, v in traverse_util.flatten_dict(tree).items()}


def _unflatten(flat: dict[str, object]) -> dict:
    """The nested parameter dict of `_flatten`'s keys (block indices back to ints)."""
    split = (tuple(int(p) if p.isdigit() else p for p in k.split(".")) for k in flat)
    return traverse_util.unflatten_dict(dict(zip(split, flat.values(), strict=True)))
