"""One full-batch GD step of the L-block GPT-2 classifier: resconv_jax (JAX) against Hugging Face's
PyTorch GPT2Model, same weights, data and loss.

    pip install -r requirements-bench.txt         # torch (CPU build) and transformers
    python -m benchmarks.vs_hf_gpt2 --lr 2e-5      # L = 2, 10 at 32 x 64 tokens (~4 min, 2 cores)
    python -m benchmarks.vs_hf_gpt2 --lr 2e-5 --repeats 5 --steps-per-call 10  # as sst2 trains
    python -m benchmarks.vs_hf_gpt2 --layers 2 --batch 8 --tokens 32 --repeats 7

Model: GPT-2 small's shape (n_embd 768, 12 heads, vocab 50257, n_positions 1024) with random
weights (`model.gpt2.weights="random"`; nothing is downloaded), truncated to its first L blocks,
and a (768, 2) head on ln_f's output at each sentence's last real token. Data: `--batch`
sentences of `--tokens` random token ids, right-padded with an attention mask on every fourth
row, random labels in {0, 1}. Loss: ½·mean ‖F − onehot(y)‖² (configs/sst2.py: optim.loss="squared",
optim.reduction="mean"), β = 1 (GPT-2's residuals), step size optim.lr of configs/sst2.py.

JAX: configs/sst2.py (the settings above; sweep.num_layers=(), sweep.beta=(β,)), the model of
`resconv_jax.models.build_model` and the trainer's step functions (`make_step_functions` with
its reduction and loss, one run, R=1, without the probe), jitted with the state donated as in
resconv_jax.train: `run_steps`, K = `--steps-per-call` GD steps in one on-device loop per call,
as train.run steps between two log steps (train.log_every: 10 in configs/sst2.py). The step
needs one block of temporaries (2.0 GiB at L = 10) that XLA:CPU allocates at every call and
the kernel maps in page by page (531k page faults per call at L = 10, 0.6–0.8 s on this
project's machine): a loop of K steps pays that once. `--steps-per-call 1` times one jitted
`step` per call instead (benchmarks/RESULTS.md §4's figures up to 2026-12-05 at 3621652).
PyTorch: `transformers.GPT2Model` with n_layer=L, dropout off (pdrop 0 and eval mode), the
default attention implementation (`--attn-implementation`), `last_hidden_state` (ln_f applied)
at the last real token times the head, `loss.backward()` and `p -= lr * p.grad` under
`torch.no_grad()`, eager, float32, `torch.set_num_threads(<cores>)`, K steps per timing sample.
The JAX initial weights are copied into torch (Hugging Face's names: wte, wpe, h.i.ln_1,
attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f; Conv1D weights are (in, out) in
both). Before timing, the script asserts that the losses at the start and after `--check-steps`
steps agree to `--rtol`, and that the parameter updates of those steps agree to `--update-rtol`
(largest difference over the largest update); those steps are also the warm-up of both.

Timing: per L, both round-robin (`benchmarks.common.interleave`), `--repeats` samples of K steps
each; medians per step, IQR and the ratio torch / JAX of medians, and in the same round-robin
one jitted (2048, 768) @ (768, 3072) float32 product (the MLP's, `MATMUL_SHAPE`): the machine's
matmul FLOP/s, against which the JAX step's FLOP/s (XLA's count of one compiled step) is set,
and the same product in torch (its BLAS, the ceiling of the Hugging Face step's projections).
Targets (issue 20): torch / JAX >= 1.0 and the step at >= 85 % of the matmul's FLOP/s.
See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from resconv_jax.data import Dataset  # noqa: E402
from resconv_jax.data.sst2 import PAD_ID  # noqa: E402
from resconv_jax.models import build_model  # noqa: E402
from resconv_jax.step import init_opt_state, make_optimizer, make_step_functions  # noqa: E402
from resconv_jax.sweep import expand_runs, run_settings  # noqa: E402

try:
    import torch  # noqa: E402
    import transformers  # noqa: E402
except ImportError:  # pragma: no cover - benchmark-only dependencies
    sys.exit("vs_hf_gpt2 needs torch and transformers: pip install -r requirements-bench.txt")

TARGET = 1.0  # JAX at least as fast as PyTorch (issue 20)
MATMUL_SHARE = 0.85  # and the step's FLOP/s >= 85 % of one large matmul's, measured alongside
MATMUL_SHAPE = (2048, 768, 3072)  # (m, k, n): GPT-2 small's MLP product at 32 x 64 tokens
NUM_CLASSES = 2


def gpt2_config(layers: int, beta: float, lr: float | None):
    """configs/sst2.py for one run of depth L: random GPT-2-small-shaped weights, β, lr."""
    overrides = {
        "model.gpt2.weights": "random",
        "model.num_layers": layers,
        "sweep.num_layers": (),
        "sweep.beta": (beta,),
    }
    if lr is not None:
        overrides["optim.lr"] = lr
    config = common.load_config_file(str(common.REPO / "configs" / "sst2.py"), **overrides)
    if config.model.name != "gpt2" or config.model.dtype != "float32":
        raise SystemExit(f"configs/sst2.py: expected a float32 gpt2 model, got {config.model}")
    return config


def make_batch(batch: int, tokens: int, vocab: int, seed: int = 0) -> Dataset:
    """Random ids (P, T) int32, right-padded (every fourth row shorter, with PAD_ID), the mask
    (P, T) int32 and labels (P,) int32, as resconv_jax.data.sst2 makes them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, tokens), dtype=np.int32)
    lengths = np.full(batch, tokens)
    padded = np.arange(batch) % 4 == 3
    lengths[padded] = rng.integers(max(1, tokens // 4), tokens, padded.sum())
    mask = (np.arange(tokens)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask == 1, ids, PAD_ID).astype(np.int32)
    labels = rng.integers(0, NUM_CLASSES, batch, dtype=np.int32)
    return Dataset({"ids": ids, "mask": mask}, labels, None, None, "random ids")


def build_jax(config, dataset: Dataset) -> common.Runs:
    """The trainer's model, one-run state and step functions (train.py's set-up, no probe)."""
    runs = expand_runs(config)
    assert len(runs) == 1, runs
    model = build_model(config.model, dataset)
    optimizer = make_optimizer(config.optim)
    fns = make_step_functions(
        model,
        optimizer,
        config.optim.reduction,
        config.train.log_every,
        loss_kind=config.optim.loss,
    )
    params = model.init_runs([run.seed for run in runs])
    lrs = jnp.asarray([run.lr for run in runs], jnp.float32)
    state = {"params": params, "opt_state": init_opt_state(optimizer, params, lrs)}
    hp = jax.tree.map(jnp.asarray, run_settings(runs))
    x = {k: jnp.asarray(v) for k, v in dataset.x_train.items()}
    params0 = jax.tree.map(lambda a: np.array(a[0]), params)
    return common.Runs(fns, state, hp, x, jnp.asarray(dataset.y_train), model.graphdef, params0)


def flat(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"h.0.attn.c_attn.weight": array, ...}: a nested parameter dict under Hugging Face's
    dotted names (list indices and dict keys alike)."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat(value, name + ".")
        else:
            out[name] = np.asarray(value)
    return out


class TorchGPT2:
    """Hugging Face's GPT2Model (n_layer = L) and a linear head, weights from resconv_jax."""

    def __init__(self, gpt2_cfg: dict, layers: int, params0: dict, attn_implementation: str):
        hf_config = transformers.GPT2Config(
            **gpt2_cfg,
            n_layer=layers,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
        )
        if attn_implementation:
            hf_config._attn_implementation = attn_implementation
        self.model = transformers.GPT2Model(hf_config).eval()  # eval(): no dropout either way
        self.attn_implementation = self.model.config._attn_implementation
        weights = flat(params0)
        head = weights.pop("head.weight")
        names = dict(self.model.named_parameters())
        if set(names) != set(weights):
            only_torch, only_jax = set(names) - set(weights), set(weights) - set(names)
            raise SystemExit(
                f"Hugging Face GPT2Model parameters differ from resconv_jax's: only in torch "
                f"{sorted(only_torch)}, only in JAX {sorted(only_jax)}"
            )
        with torch.no_grad():
            for name, p in names.items():
                if tuple(p.shape) != weights[name].shape:
                    raise SystemExit(f"{name}: torch {tuple(p.shape)} vs JAX {weights[name].shape}")
                p.copy_(torch.from_numpy(weights[name]))
        self.head = torch.tensor(head, dtype=torch.float32, requires_grad=True)
        self.names = list(names) + ["head.weight"]
        self.params = list(names.values()) + [self.head]

    def loss(self, ids: torch.Tensor, mask: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # ln_f applied
        last = mask.sum(-1) - 1
        logits = hidden[torch.arange(ids.shape[0]), last] @ self.head
        return 0.5 * torch.mean(torch.square(logits - onehot))  # optim.reduction = "mean"

    def step(self, ids, mask, onehot, lr: float) -> torch.Tensor:
        """One full-batch GD step; returns the loss of the parameters it started from."""
        loss = self.loss(ids, mask, onehot)
        loss.backward()
        with torch.no_grad():
            for p in self.params:
                p -= lr * p.grad
                p.grad = None
        return loss.detach()

    def weights(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in zip(self.names, self.params, strict=True)}


def torch_batch(dataset: Dataset):
    ids = torch.from_numpy(dataset.x_train["ids"].astype(np.int64))
    mask = torch.from_numpy(dataset.x_train["mask"].astype(np.int64))
    onehot = torch.nn.functional.one_hot(torch.from_numpy(dataset.y_train.astype(np.int64)))
    return ids, mask, onehot.to(torch.float32)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(a)


def check_agreement(case, runs, model, batch, lr: float, args, label: str) -> str:
    """Losses at the start and after `args.check_steps` steps of the timed JAX case and the torch
    model, and their parameter updates; SystemExit past the tolerances; returns a report line."""
    with torch.no_grad():
        torch0 = float(model.loss(*batch))
    jax0 = float(case.final_losses()[0])
    for _ in range(args.check_steps):
        jax.block_until_ready(case(1 if case.loop_steps else None))
        model.step(*batch, lr)
    jax1 = float(case.final_losses()[0])
    with torch.no_grad():
        torch1 = float(model.loss(*batch))
    before = flat(runs.params0)
    after_jax = {k: v[0] for k, v in flat(jax.device_get(case.states[0]["params"])).items()}
    after_torch = model.weights()
    worst_update, worst_diff, worst_name = 0.0, 0.0, ""
    for name, w0 in before.items():
        dj, dt = after_jax[name] - w0, after_torch[name] - w0
        worst_update = max(worst_update, float(np.max(np.abs(dj))))
        diff = float(np.max(np.abs(dj - dt)))
        if diff > worst_diff:
            worst_diff, worst_name = diff, name
    update_rel = worst_diff / worst_update
    line = (
        f"{label}: loss at start JAX {jax0:.8g}, torch {torch0:.8g} (relative difference "
        f"{rel(jax0, torch0):.1e}); after {args.check_steps} step(s) JAX {jax1:.8g}, torch "
        f"{torch1:.8g} ({rel(jax1, torch1):.1e}); required <= {args.rtol:g}. Updates: largest "
        f"difference {worst_diff:.2e} ({worst_name}) over largest update {worst_update:.2e} = "
        f"{update_rel:.1e}, required <= {args.update_rtol:g}"
    )
    bad = max(rel(jax0, torch0), rel(jax1, torch1)) > args.rtol or update_rel > args.update_rtol
    if bad or not np.isfinite([jax0, jax1, torch0, torch1]).all():
        raise SystemExit(f"JAX and torch disagree, not timing two different computations:\n{line}")
    return line


def xla_flops(runs: common.Runs) -> float:
    """XLA's FLOP count of one compiled step (NaN when it has none). A loop's count is not K
    times its step's (XLA counts a while loop's body once), so the step is compiled for it."""
    try:
        step = jax.jit(common.step_fn(runs.fns)).lower(runs.state, runs.hp, runs.x, runs.y)
        cost = step.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float(cost["flops"])
    except Exception:  # noqa: BLE001 - diagnostics only
        return float("nan")


def matmul_case() -> tuple[Callable[[], object], float]:
    """One jitted float32 (m, k) @ (k, n) product (`MATMUL_SHAPE`) and its FLOP count: the
    machine's matmul ceiling in JAX, timed alongside the steps."""
    m, k, n = MATMUL_SHAPE
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    product = jax.jit(jnp.matmul)
    jax.block_until_ready(product(a, b))
    return lambda: jax.block_until_ready(product(a, b)), 2.0 * m * k * n


def torch_matmul_case() -> Callable[[], object]:
    """The same product in torch (its BLAS): the ceiling of the Hugging Face step's kernels."""
    m, k, n = MATMUL_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(k, n, generator=generator)
    a @ b
    return lambda: a @ b


def repeated(product: Callable[[], object], seconds: float = 0.5) -> tuple[Callable[[], None], int]:
    """(`product` called n times in a row, n): n calls take about `seconds` (one timing sample)."""
    times = max(1, round(seconds / max(common.timed(product), 1e-6)))

    def products():
        for _ in range(times):
            product()

    return products, times


def bench_depth(layers: int, args, dataset: Dataset) -> tuple[list, str, str]:
    """The table row, the agreement line and the timing line of depth L."""
    config = gpt2_config(layers, args.beta, args.lr)
    lr = config.optim.lr
    if args.steps_per_call > config.train.log_every:
        raise SystemExit(
            f"--steps-per-call {args.steps_per_call} is more than run_steps does per call "
            f"(train.log_every = {config.train.log_every} in configs/sst2.py)"
        )
    t0 = time.perf_counter()
    runs = build_jax(config, dataset)
    if args.steps_per_call == 1:
        case = common.Case(common.step_fn(runs.fns), [runs], None)
    else:
        case = common.Case(runs.fns.run_steps, [runs], args.steps_per_call)
    compile_s = time.perf_counter() - t0
    flops = xla_flops(runs)
    shape = dict(config.model.gpt2.shape)
    model = TorchGPT2(
        {k: v for k, v in shape.items() if k != "n_layer"},
        layers,
        runs.params0,
        args.attn_implementation,
    )
    batch = torch_batch(dataset)
    label = f"L={layers}"
    check = check_agreement(case, runs, model, batch, lr, args, label)
    print(check, flush=True)
    torch_label = f"torch ({model.attn_implementation})"
    matmul, matmul_flops = matmul_case()
    matmuls, matmul_calls = repeated(matmul)
    torch_matmuls, torch_calls = repeated(torch_matmul_case())
    k = case.steps_per_call()

    def torch_steps():
        for _ in range(k):
            model.step(*batch, lr)

    cases = {
        "jax": lambda: jax.block_until_ready(case()),
        torch_label: torch_steps,
        "matmul": matmuls,
        "torch matmul": torch_matmuls,
    }
    load_before = common.load_average()
    times = common.interleave(cases, args.repeats, warmup=0)  # the check steps warmed both up
    for name in ("jax", torch_label):
        times[name] = [t / k for t in times[name]]
    t_jax, t_torch = common.median(times["jax"]), common.median(times[torch_label])
    speed = t_torch / t_jax
    ceiling = matmul_calls * matmul_flops / common.median(times["matmul"])
    torch_ceiling = torch_calls * matmul_flops / common.median(times["torch matmul"])
    share = flops / t_jax / ceiling
    row = [
        layers,
        k,
        common.fmt_time(t_jax),
        common.spread(times["jax"]),
        common.fmt_time(t_torch),
        common.spread(times[torch_label]),
        f"{speed:.2f}x",
        "yes" if speed >= TARGET else "no",
        f"{flops / 1e12:.3f}" if np.isfinite(flops) else "?",
        f"{flops / t_jax / 1e9:.0f}" if np.isfinite(flops) else "?",
        f"{ceiling / 1e9:.0f}",
        f"{100 * share:.0f} %" if np.isfinite(share) else "?",
        "yes" if share >= MATMUL_SHARE else "no",
        f"{flops / t_torch / 1e9:.0f}" if np.isfinite(flops) else "?",
        f"{torch_ceiling / 1e9:.0f}",
    ]
    detail = (
        f"{label}: lr={lr:g}, {k} step(s) per call and per torch sample, JAX build + compile "
        f"{compile_s:.1f} s, load average "
        f"{load_before} -> {common.load_average()}; seconds per step JAX "
        f"{', '.join(f'{t:.2f}' for t in times['jax'])}; torch "
        f"{', '.join(f'{t:.2f}' for t in times[torch_label])}"
    )
    print(detail, flush=True)
    return row, check, detail


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,10", help="comma list of depths L (first L blocks)")
    p.add_argument("--batch", type=int, default=32, help="sentences P")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sentence T")
    p.add_argument("--repeats", type=int, default=4, help="interleaved repeats (>= 4 for IQR)")
    p.add_argument("--beta", type=float, default=1.0, help="β for both residuals")
    p.add_argument("--lr", type=float, default=None, help="step size (default: configs/sst2.py)")
    p.add_argument(
        "--steps-per-call",
        type=int,
        default=3,
        help="K: JAX steps per call of run_steps (<= train.log_every) and torch steps per sample;"
        " 1: one jitted step per call",
    )
    p.add_argument("--check-steps", type=int, default=2, help="steps before the agreement check")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance on the losses")
    p.add_argument(
        "--update-rtol",
        type=float,
        default=1e-3,
        help="largest difference of the two parameter updates over the largest update",
    )
    p.add_argument(
        "--attn-implementation",
        default="",
        help="transformers attention ('sdpa', 'eager'; default: transformers' default)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--output", default="", help="also write the table (Markdown) here")
    args = p.parse_args(argv)
    if args.steps_per_call < 1:
        p.error(f"--steps-per-call must be >= 1, got {args.steps_per_call}")
    torch.set_num_threads(args.threads)
    layers = [int(v) for v in args.layers.split(",") if v.strip()]
    t_start = time.perf_counter()
    header = f"Machine: {common.machine()}; transformers {transformers.__version__}"
    print(header + "\n", flush=True)
    vocab = int(gpt2_config(layers[0], args.beta, args.lr).model.gpt2.shape.vocab_size)
    dataset = make_batch(args.batch, args.tokens, vocab)
    padded = int((dataset.x_train["mask"].sum(-1) < args.tokens).sum())
    rows, checks, details = [], [], []
    for depth in layers:
        row, check, detail = bench_depth(depth, args, dataset)
        rows.append(row)
        checks.append(check)
        details.append(detail)
    headers = [
        "L",
        "steps / call",
        "JAX step",
        "IQR",
        "torch step",
        "IQR",
        "torch / JAX",
        f">= {TARGET:g}x",
        "TFLOP / step (XLA)",
        "JAX GFLOP/s",
        "matmul GFLOP/s",
        "of matmul",
        f">= {100 * MATMUL_SHARE:.0f} %",
        "torch GFLOP/s",
        "torch matmul GFLOP/s",
    ]
    text = (
        f"One GD step, {args.batch} sentences x {args.tokens} tokens ({padded} right-padded), "
        f"GPT-2-small-shaped (random init), beta={args.beta:g}, float32; medians of "
        f"{args.repeats} interleaved repeats of {args.steps_per_call} step(s) (JAX: per call); "
        f"load average at the end {common.load_average()}.\n\n"
        "Agreement before timing (asserted):\n"
        + "".join(f"- {line}\n" for line in checks)
        + "\nTimes:\n"
        + "".join(f"- {line}\n" for line in details)
        + "\n"
        + common.table(headers, rows)
        + f"\n\nWall time {time.perf_counter() - t_start:.0f} s."
    )
    print("\n" + text, flush=True)
    if args.output:
        Path(args.output).write_text(header + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
