"""The tangent-kernel certificate during training: λ_min, λ_max of K = J Jᵀ at checked steps,
the linearized bound next to the measured contraction, and the lr_rule="lambda_max" step sizes.

K is diagonalized exactly when J fits certificate.max_jacobian_entries, else estimated by Lanczos
(`analysis.lanczos`, J never formed), whose residuals are logged next to the eigenvalues."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from resconv_jax.analysis import jacobian, theory
from resconv_jax.analysis.lanczos import kernel_lanczos, num_products
from resconv_jax.runtime.multihost import to_host


def loss_scale(reduction: str, num_outputs: int) -> float:
    """d loss / d(½‖F − Y‖²): 1 for the "sum" reduction, 1/N for the "mean" over the N outputs."""
    return 1.0 if reduction == "sum" else 1.0 / num_outputs


def _per_run(of_ops, linearize):
    """(params, hp, x) -> `of_ops(J)` per run (lax.map over the run axis), J from
    `linearize(params, hp, x)` -> `jacobian.JacobianOps` of one run's outputs."""

    def one_run(run, x):
        params, hp = run
        return of_ops(linearize(params, hp, x))

    return lambda params, hp, x: jax.lax.map(lambda run: one_run(run, x), (params, hp))


def dense_eigenvalues(linearize):
    """(params, hp, x) -> (λ_min, λ_max), each (R,): K = J Jᵀ formed and diagonalized per run."""
    return _per_run(jacobian.dense_eigenvalues, linearize)


def power_lambda_max(linearize):
    """(params, hp, x) -> (R,) λ_max(K) per run by matrix-free power iteration."""
    return _per_run(jacobian.power_lambda_max, linearize)


def lanczos_eigenvalues(linearize, iterations: int):
    """(params, hp, x) -> (λ_min, λ_max, res_min, res_max), each (R,): Lanczos per run."""

    def of_ops(ops):
        spectrum = kernel_lanczos(ops, iterations=iterations)
        return spectrum.lam_min, spectrum.lam_max, spectrum.res_min, spectrum.res_max

    return _per_run(of_ops, linearize)


@dataclasses.dataclass
class Kernel:
    """The tangent-kernel certificate: jitted eigenvalues and the latest λ_max per run."""

    # jitted (params, hp, x) -> (λ_min, λ_max), each (R,); Lanczos adds (res_min, res_max)
    eigenvalues: object
    loss_scale: float
    lam_max: np.ndarray | None = None

    def records(self, params, hp, x, lrs: np.ndarray, contraction: np.ndarray) -> list[dict]:
        lam_min, lam_max, *residuals = (to_host(v) for v in self.eigenvalues(params, hp, x))
        self.lam_max = lam_max
        bound = theory.certificate_bound(lrs, lam_min, loss_scale=self.loss_scale, lam_max=lam_max)
        holds = theory.bound_holds(contraction, bound)
        stable = theory.stable_lr(lam_max, loss_scale=self.loss_scale)
        records = [
            {
                "ntk/lambda_min": lam_min[r],
                "ntk/lambda_max": lam_max[r],
                "ntk/bound": bound[r],
                "ntk/holds": float(holds[r]),
                "ntk/stable_lr": stable[r],
            }
            for r in range(len(lrs))
        ]
        if residuals:
            for record, res_min, res_max in zip(records, *residuals, strict=True):
                record |= {"ntk/residual_min": res_min, "ntk/residual_max": res_max}
        return records


def above_stable_lr(records: list[dict]) -> str | None:
    """A warning line when a run's η is at or above its stable step size 2/λ_max(K) in `records`
    (the metrics lines of step 0, with the certificate's "ntk/stable_lr"), else None: the paper's
    protocol picks one η below the smallest 2/λ_max at initialization over the sweep."""
    above = [r for r in records if r.get("ntk/stable_lr", np.inf) <= r["lr"]]
    if not above:
        return None
    smallest = min(r["ntk/stable_lr"] for r in records)
    runs = ", ".join(f"r{r['run']} (η·λ_max/2 = {r['lr'] / r['ntk/stable_lr']:.2f})" for r in above)
    return (
        f"warning: η is at or above 2/λ_max(K) at initialization for {len(above)} of "
        f"{len(records)} runs: {runs}; the protocol's premise (η below the smallest 2/λ_max over "
        f"the sweep, here {smallest:.3g}) does not hold for them"
    )


def make_kernel(
    linearize, scale: float, num_outputs: int, num_params: int, *, max_entries: int, iterations: int
) -> Kernel:
    """The certificate's eigenvalues of the tangent kernel of `linearize(params, hp, x)` (one
    run's `jacobian.JacobianOps`): K formed from J when J
    (outputs × the parameters of one run) has at most `max_entries` entries, else Lanczos with
    `iterations` steps (J never formed; its cost and accuracy are said in one line)."""
    if num_outputs * num_params <= max_entries:
        return Kernel(jax.jit(dense_eigenvalues(linearize)), scale)
    products = num_products(iterations, num_outputs, num_params)
    print(
        f"certificate: J ({num_outputs} outputs x {num_params} params) exceeds "
        f"certificate.max_jacobian_entries={max_entries}: λ_min, λ_max of K by "
        f"Lanczos ({products} products J(Jᵀv) per run per check, "
        f"certificate.lanczos_iterations={iterations}), accuracy in ntk/residual_min, "
        "ntk/residual_max",
        flush=True,
    )
    return Kernel(jax.jit(lanczos_eigenvalues(linearize, iterations)), scale)


def with_kernel_lrs(lr_factor: float, runs, kernel: Kernel, params, hp, x):
    """lr_rule="lambda_max": each run's η = lr_factor / (λ_max(K)·loss_scale) at initialization."""
    _, lam_max, *_ = (to_host(v) for v in kernel.eigenvalues(params, hp, x))
    lrs = lr_factor / (lam_max * kernel.loss_scale)
    return [dataclasses.replace(run, lr=float(lr)) for run, lr in zip(runs, lrs, strict=True)]
