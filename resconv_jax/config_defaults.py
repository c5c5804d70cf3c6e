"""The full set of config fields with their defaults; every config in configs/ starts here.

Fields are documented where they are defined. Configs override values, never add keys, so an
unknown key on the command line (`--config.optim.lrr=...`) is an error.
"""

from __future__ import annotations

import functools
import importlib.util
import json

import ml_collections

from resconv_jax.data import synthetic
from resconv_jax.models import model_module, model_names


def base_config() -> ml_collections.ConfigDict:
    """Default config: a small synthetic theory problem, one run."""
    c = ml_collections.ConfigDict()
    # The task: the module resconv_jax.experiments.NAME (`experiments.task_names()`): "training",
    # or "rank_collapse" (spectra at initialization only).
    c.task = "training"
    c.seed = 0  # parameter-initialization seed (per run: see sweep.seed)

    c.model = ml_collections.ConfigDict()
    # The model: the module resconv_jax.models.NAME (`models.model_names()`: transformer, the
    # paper's; gpt2, Hugging Face's GPT-2). Each model's own fields are config.model.NAME.*.
    c.model.name = "transformer"
    c.model.num_layers = 1  # number of blocks L under the one head (gpt2: the first L blocks)
    c.model.dtype = "float32"  # of weights and activations; "float64" turns on jax_enable_x64
    c.model.beta_attn = 1.0  # β_a: Z = Attn(X) + β_a X (the paper: 1; "no residual": 0)
    c.model.beta_ffn = 1.0  # β_f: H = σ(Z W_1) W_2 + β_f Z
    for name in model_names():
        c.model[name] = model_module(name).default_config()

    # The data set: the module resconv_jax.data.NAME (`data.data_names()`: synthetic, jena, sst2)
    # gives the whole section (config.data = jena.default_config() in configs/jena.py).
    c.data = synthetic.default_config()

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "sgd"  # "sgd" (plain GD, the paper), or ablations "momentum", "adam"
    c.optim.lr = 1e-3  # step size η (per run: see sweep.lr)
    c.optim.momentum = 0.9  # for name="momentum"
    c.optim.reduction = "sum"  # "sum": ½Σ_p‖F(X_p)−Y_p‖² (the paper); "mean": ½·mean of squares
    # Classification (integer labels): "squared" on one-hot labels (the paper's analysis) or
    # "cross_entropy"; regression targets always take the squared loss.
    c.optim.loss = "squared"
    # "fixed": η = optim.lr (or sweep.lr); "lambda_max": per run, η = lr_factor / λ_max(K) of the
    # tangent kernel at initialization (dense or Lanczos, as for the certificate).
    c.optim.lr_rule = "fixed"
    c.optim.lr_factor = 1.0  # c in η = c / λ_max(K) for lr_rule="lambda_max" (2 is the edge)

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 200  # GD steps
    c.train.log_every = 10  # steps between metrics lines (steps run on device in between)
    c.train.print_every = 50  # steps between progress lines (a multiple of log_every)
    # Steps [0, step_losses_until) also log every step's loss: each metrics line before it holds
    # "step_losses", the losses of its log_every steps (early descent at single-step resolution).
    c.train.step_losses_until = 0
    c.train.checkpoint_every = 100  # steps between checkpoints (a multiple of log_every)
    c.train.keep_checkpoints = 3  # how many recent checkpoints to keep
    c.train.async_checkpoints = True  # write checkpoints in the background
    # Runs stepped together: 0: all (one vmapped step); n > 0: n at a time (lax.map over chunks of
    # runs, the same results up to float rounding, one chunk's working set; 1-device meshes only);
    # -1: auto, chunks on a 1-device CPU mesh when the compiled chunk of all runs needs more than
    # 8 MiB of temporaries (cache-sized).
    c.train.runs_per_chunk = -1
    # Full-batch GD in bounded memory: 0: the whole batch at once; n > 0: each device's shard of
    # the batch in microbatches of n samples inside the compiled step (the same full-batch step,
    # loss, probe and certificate, summed over microbatches); "auto": the whole batch if the
    # compiled step fits the devices' free memory, else the largest n that does.
    c.train.microbatch_size = ml_collections.FieldReference(0, field_type=object)

    c.sweep = ml_collections.ConfigDict()
    # Runs are the product of the non-empty lists below; an empty list uses the single value above.
    c.sweep.beta = ()  # values of β applied to both residuals (excludes beta_attn/beta_ffn)
    c.sweep.beta_attn = ()  # values of β_a
    c.sweep.beta_ffn = ()  # values of β_f
    c.sweep.seed = ()  # initialization seeds
    c.sweep.lr = ()  # step sizes
    # depths L (model.num_layers): one compiled program per depth, run one after another, each in
    # WORKDIR/layers_<L>/ (its own checkpoints and metrics; WORKDIR holds the merged results)
    c.sweep.num_layers = ()
    # widths d (data.dim) of synthetic data: one program per width, in WORKDIR/dim_<d>/ (with a
    # depth sweep too, WORKDIR/layers_<L>_dim_<d>/); each width draws its own data (data.seed)
    c.sweep.dim = ()

    c.probe = ml_collections.ConfigDict()
    # Spectral probe of Attn(X) and Z, from a forward pass at the probed step's parameters; its
    # values go to metrics.jsonl and TensorBoard.
    c.probe.enabled = True
    c.probe.every = 0  # steps between probes, a multiple of train.log_every; 0: every log step
    c.probe.per_sample = True  # also min_p σ_min(Z_p), min_p σ_min(Attn(X_p)) (one SVD per sample)
    c.probe.dtype = "float32"  # of the probe's QR/SVD; "float64" turns on jax_enable_x64

    c.certificate = ml_collections.ConfigDict()
    c.certificate.every = (
        0  # steps between tangent-kernel certificates (0: off); multiple of log_every
    )
    # J (n × p) up to this many entries is formed and K diagonalized exactly; a larger J is never
    # formed: Lanczos on K v = J (Jᵀ v) gives λ_min, λ_max with their residuals instead
    c.certificate.max_jacobian_entries = 20_000_000
    c.certificate.lanczos_iterations = 100  # Lanczos steps k (capped at the operator's size)

    c.report = ml_collections.ConfigDict()
    # Loss level for "steps to threshold" in beta_table.csv; 0: 1.5 × the largest final loss.
    c.report.loss_threshold = 0.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.sweep = 0  # devices on the 'sweep' (runs) axis; 0: the largest that divides the runs
    c.mesh.data = 0  # devices on the 'data' (samples) axis; 0: the largest that divides P
    return c


# Fields and sections that moved: old dotted name (or its prefix) -> new. An old name on the
# command line is refused in one line naming the new one (`validation.renamed_flag`), never aliased.
RENAMED = {
    "theory": "certificate",
    **{
        f"model.{field}": f"model.transformer.{field}"
        for field in (
            "d_qk",
            "d_h",
            "qk_init",
            "qk_scale",
            "v_scale",
            "mlp_scale",
            "head_scale",
            "activation",
        )
    },  # fmt: skip
    "model.weights": "model.gpt2.weights",
    "model.gpt2_shape": "model.gpt2.shape",
}


@functools.cache
def base_config_json() -> dict:
    """`base_config()` as JSON: what a field that a saved config lacks took when it was saved
    (computed once; read only)."""
    return json.loads(base_config().to_json_best_effort())


def theory_regime_config(dim: int) -> ml_collections.ConfigDict:
    """The theory regime's shared sizes (our protocol; configs/theory.py, conditioning.py,
    depth.py): P = M = 8 Gaussian samples of width d = `dim`, d_QK = 16, d_h = 64, one output; a
    metrics line every 10 steps, progress lines and checkpoints every 500."""
    c = base_config()
    c.model.transformer.d_qk = 16
    c.model.transformer.d_h = 64
    c.data.num_samples = 8  # P
    c.data.seq_len = 8  # M
    c.data.dim = dim
    c.data.out_dim = 1
    c.train.log_every = 10
    c.train.print_every = 500
    c.train.checkpoint_every = 500
    return c


def shorten(config: ml_collections.ConfigDict, num_steps: int) -> None:
    """A smoke-test length (the `tiny` variants): `num_steps` steps, a checkpoint and a progress
    line every `num_steps // 2`."""
    config.train.num_steps = num_steps
    config.train.checkpoint_every = num_steps // 2
    config.train.print_every = num_steps // 2


def variants(arg: str | None, config_file: str, allowed: tuple[str, ...] = ()) -> set[str]:
    """The comma-separated variants of `configs/FILE.py:arg`, each one of `allowed`; ValueError
    (one line naming the file and what it offers) for any other, so a misspelt variant never
    trains the default."""
    chosen = set(arg.split(",")) if arg else set()
    unknown = sorted(chosen - set(allowed))
    if unknown:
        offered = f"its variants: {', '.join(allowed)}" if allowed else "it has no variants"
        raise ValueError(f"{config_file}: unknown variant {unknown[0]!r} ({offered})")
    return chosen


def load_config_file(path: str, arg: str | None = None, **overrides) -> ml_collections.ConfigDict:
    """`get_config(arg)` of the config file at `path` (`configs/x.py:arg` on the command line),
    with dotted-key `overrides`.

    `load_config_file("configs/tiny.py", **{"train.num_steps": 20})`.
    """
    spec = importlib.util.spec_from_file_location("resconv_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg is not None else module.get_config()
    with config.unlocked():
        for dotted, value in overrides.items():
            *parents, leaf = dotted.split(".")
            node = config
            for parent in parents:
                node = node[parent]
            if leaf not in node:
                raise KeyError(f"unknown config key {dotted}")
            node[leaf] = value
    return config
