"""The jitted JAX training step of resconv_jax against plain PyTorch eager, same model and data.

    pip install -r requirements-bench.txt        # torch (CPU build)
    python -m benchmarks.vs_pytorch              # both sizes, small defaults (~1 min on 2 cores)
    python -m benchmarks.vs_pytorch --sizes jena --repeats 9

JAX: the library's GD step (resconv_jax.step.make_step_functions, one run, R=1, defaults: the
fast_backward model), jitted with the state donated as in resconv_jax.train, timed two ways:
`run_steps` (K steps in one on-device loop per call) and one `step` per call (dispatch-bound); and
`run_steps` with `fast_backward=False` ("plain", the formulation before the fast_ops patch).
PyTorch: the paper's model written out below from its equations (single-head softmax attention
with W_Q, W_K (d×d_qk), W_V (d×d); Z = Attn(X) + βX; H = relu(Z W_1) W_2 + βZ; F = H W_U; no
biases, LayerNorm or mask; loss ½Σ‖F − Y‖²), `loss.backward()` and `p -= lr * p.grad` under
`torch.no_grad()`, in eager mode, with `torch.set_num_threads(<cores>)`. Both start from the JAX
initialization (copied into torch) on the same data; before timing, the script asserts that their
losses after `--check-steps` steps agree to `--rtol` (float32).

Sizes: the configs/theory.py size and a Jena-like size (P=512, M=24, d=6, d_qk=6, d_h=32, d_y=1;
Gaussian data of that shape). Target: JAX >= 2x faster. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.step_cases import STEP_KWARGS  # noqa: E402

try:
    import torch  # noqa: E402
except ImportError:  # pragma: no cover - torch is a benchmark-only dependency
    sys.exit("vs_pytorch needs torch: pip install -r requirements-bench.txt")


class TorchTransformer:
    """The paper's model in PyTorch eager, with weights copied from a resconv_jax parameter dict."""

    def __init__(self, params: dict, beta_attn: float, beta_ffn: float):
        def tensor(a):
            return torch.tensor(np.asarray(a), dtype=torch.float32, requires_grad=True)

        blocks = params["blocks"]
        self.blocks = [
            {name: tensor(blocks[i][name]) for name in ("w_q", "w_k", "w_v", "w_1", "w_2")}
            for i in sorted(blocks)
        ]
        self.w_u = tensor(params["w_u"])
        self.beta_attn, self.beta_ffn = beta_attn, beta_ffn

    def parameters(self) -> list[torch.Tensor]:
        return [w for block in self.blocks for w in block.values()] + [self.w_u]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for b in self.blocks:
            q, k, v = h @ b["w_q"], h @ b["w_k"], h @ b["w_v"]
            logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            attn = torch.softmax(logits, dim=-1) @ v
            z = attn + self.beta_attn * h
            h = torch.relu(z @ b["w_1"]) @ b["w_2"] + self.beta_ffn * z
        return h @ self.w_u

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.sum(torch.square(self.forward(x) - y))

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One full-batch GD step; returns the loss of the parameters it started from."""
        loss = self.loss(x, y)
        loss.backward()
        with torch.no_grad():
            for p in self.parameters():
                p -= lr * p.grad
                p.grad = None
        return loss.detach()


def torch_data(runs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(np.array(runs.x)), torch.from_numpy(np.array(runs.y))


def check_agreement(size, beta: float, steps: int, rtol: float, step_kwargs: dict) -> str:
    """Runs `steps` GD steps in JAX (the library step with `step_kwargs`) and in torch from the same
    start; asserts that the losses agree to `rtol`; returns a report line."""
    runs = common.build_runs(size, (beta,), steps, step_kwargs=step_kwargs)
    case = common.Case(runs.fns.run_steps, [runs], steps)
    case()
    jax_loss = float(case.final_losses()[0])
    model = TorchTransformer(runs.params0, beta, beta)
    x, y = torch_data(runs)
    for _ in range(steps):
        model.step(x, y, size.lr)
    with torch.no_grad():
        torch_loss = float(model.loss(x, y))
    params = case.states[0]["params"]
    worst = max(
        float(np.max(np.abs(np.asarray(params["blocks"][i][name])[0] - w.detach().numpy())))
        for i, block in enumerate(model.blocks)
        for name, w in block.items()
    )
    rel = abs(jax_loss - torch_loss) / abs(jax_loss)
    if not rel <= rtol:
        raise SystemExit(
            f"{size.name}: JAX and torch disagree after {steps} steps: loss {jax_loss!r} vs "
            f"{torch_loss!r} (relative difference {rel:.1e} > {rtol:g})"
        )
    return (
        f"loss after {steps} steps JAX {jax_loss:.7g}, torch {torch_loss:.7g} (relative "
        f"difference {rel:.1e}, required <= {rtol:g}; largest weight difference {worst:.1e})"
    )


def bench_size(size, args) -> str:
    n = args.steps or (50 if size.name == "theory" else 5)  # steps per timing sample, every case
    checks = [
        f"{variant}: {check_agreement(size, args.beta, args.check_steps, args.rtol, kwargs)}"
        for variant, kwargs in STEP_KWARGS.items()
    ]
    runs = {
        v: common.build_runs(size, (args.beta,), n, step_kwargs=kw) for v, kw in STEP_KWARGS.items()
    }
    call = common.Case(common.step_fn(runs["library"].fns), [runs["library"]], None)
    model = TorchTransformer(runs["library"].params0, args.beta, args.beta)
    x, y = torch_data(runs["library"])

    def torch_steps():
        for _ in range(n):
            model.step(x, y, size.lr)

    def jax_calls():
        out = None
        for _ in range(n):
            out = call()
        return out

    cases = {
        f"JAX jit, run_steps ({n} steps on device per call)": common.Case(
            runs["library"].fns.run_steps, [runs["library"]], n
        ),
        "JAX jit, one step per call": jax_calls,
        "JAX jit, run_steps, plain (fast_backward=False)": common.Case(
            runs["plain"].fns.run_steps, [runs["plain"]], n
        ),
        f"PyTorch eager ({torch.get_num_threads()} threads)": torch_steps,
    }
    times = common.interleave(cases, args.repeats)
    per_step = {k: common.median(v) / n for k, v in times.items()}
    t_torch = per_step[list(cases)[-1]]
    rows = []
    for i, (label, t) in enumerate(per_step.items()):
        speed = t_torch / t
        target = "" if i == len(per_step) - 1 else ("yes" if speed >= 2 else "no")
        rows.append(
            [label, common.fmt_time(t), common.spread(times[label]), f"{speed:.2f}x", target]
        )
    text = (
        f"### {size.name} size ({size.describe()}), beta={args.beta:g}, lr={size.lr:g}\n\n"
        "Agreement before timing (asserted):\n"
        + "".join(f"- {line}\n" for line in checks)
        + f"\n{args.repeats} interleaved repeats of {n} steps each; load average "
        f"{common.load_average()}. 'speedup' = torch time / this time.\n\n"
        + common.table(["implementation", "time / step", "IQR", "speedup vs torch", ">= 2x"], rows)
    )
    print(text + "\n", flush=True)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="theory,jena", help="comma list of: theory, jena")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    p.add_argument("--steps", type=int, default=0, help="steps per sample (0: 50 / 5)")
    p.add_argument("--beta", type=float, default=1.0, help="β for both residuals")
    p.add_argument("--check-steps", type=int, default=10)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--output", default="", help="also write the tables (Markdown) here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    header = f"Machine: {common.machine()}"
    print(header + "\n", flush=True)
    sections = [header] + [bench_size(size, args) for size in common.sizes_from_flag(args.sizes)]
    if args.output:
        Path(args.output).write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
