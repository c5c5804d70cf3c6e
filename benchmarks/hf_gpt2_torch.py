"""The PyTorch side of benchmarks/vs_hf_gpt2.py: Hugging Face's GPT2Model with resconv_jax's
weights, run in a child process (the default) or in the benchmark's own process.

In one process the JAX step ran 5-12 % slower next to torch's steps than alone (L = 10, 3 steps
per call: 5.54-5.98 s against 5.22-5.30 s; torch's own time did not change, 5.51-5.82 s against
5.65-6.23 s; benchmarks/RESULTS.md §4): the two libraries share one heap, and glibc keeps what
torch frees. `TorchProcess` runs torch in a spawned child that waits on a pipe while JAX runs,
so neither library's memory or threads are the other's; `TorchInProcess` is the same interface
in this process (`--same-process`).
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import torch
import transformers


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


def torch_batch(ids: np.ndarray, mask: np.ndarray, labels: np.ndarray):
    """(ids, mask) (P, T) int64 and one-hot labels (P, 2) float32 tensors."""
    onehot = torch.nn.functional.one_hot(torch.from_numpy(labels.astype(np.int64)))
    return (
        torch.from_numpy(ids.astype(np.int64)),
        torch.from_numpy(mask.astype(np.int64)),
        onehot.to(torch.float32),
    )


class TorchInProcess:
    """The torch model, its batch and step size, and one (m, k) @ (k, n) float32 product (the
    ceiling of its projections, repeated to ~`matmul_seconds` per call), in this process."""

    def __init__(
        self,
        *,
        gpt2_cfg: dict,
        layers: int,
        params0: dict,
        attn_implementation: str,
        threads: int,
        batch: tuple[np.ndarray, np.ndarray, np.ndarray],
        lr: float,
        matmul_shape: tuple[int, int, int],
        matmul_seconds: float = 0.5,
    ):
        torch.set_num_threads(threads)
        self.model = TorchGPT2(gpt2_cfg, layers, params0, attn_implementation)
        self.attn_implementation = self.model.attn_implementation
        self.batch, self.lr = torch_batch(*batch), lr
        m, k, n = matmul_shape
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(m, k, generator=generator)
        self.b = torch.randn(k, n, generator=generator)
        t0 = time.perf_counter()
        self.a @ self.b
        self.matmul_calls = max(1, round(matmul_seconds / max(time.perf_counter() - t0, 1e-6)))

    def loss(self) -> float:
        with torch.no_grad():
            return float(self.model.loss(*self.batch))

    def steps(self, k: int) -> None:
        for _ in range(k):
            self.model.step(*self.batch, self.lr)

    def matmuls(self) -> None:
        for _ in range(self.matmul_calls):
            self.a @ self.b

    def weights(self) -> dict[str, np.ndarray]:
        return self.model.weights()

    def close(self) -> None:
        pass


def _serve(conn, kwargs: dict) -> None:
    """The child: a TorchInProcess, then its methods as the parent asks, until 'close'."""
    try:
        side = TorchInProcess(**kwargs)
        conn.send((side.attn_implementation, side.matmul_calls))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(error)
        return
    while True:
        name, args = conn.recv()
        if name == "close":
            return
        try:
            conn.send(getattr(side, name)(*args))
        except BaseException as error:  # noqa: BLE001
            conn.send(error)


class TorchProcess:
    """`TorchInProcess` in a spawned child; the same methods, each a round trip on a pipe (the
    parent blocks in `recv` while the child computes)."""

    def __init__(self, **kwargs):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, kwargs), daemon=True)
        self._process.start()
        child.close()
        self.attn_implementation, self.matmul_calls = self._reply()

    def _reply(self):
        out = self._conn.recv()
        if isinstance(out, BaseException):
            raise out
        return out

    def _call(self, name: str, *args):
        self._conn.send((name, args))
        return self._reply()

    def loss(self) -> float:
        return self._call("loss")

    def steps(self, k: int) -> None:
        self._call("steps", k)

    def matmuls(self) -> None:
        self._call("matmuls")

    def weights(self) -> dict[str, np.ndarray]:
        return self._call("weights")

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close", ()))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
