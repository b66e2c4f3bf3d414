"""How close ``--verify`` wants a run to the single-process reference, per precision policy.

The reference runs under the same policy as the run (``--precision``: its autocast, and fp16's loss
scaling). A system that autocasts as the reference does (torch_pipe, fairscale_fsdp, ours, diloco) is
judged by the policy's autocast tolerance; one that keeps half-precision weights and activations with
fp32 main parameters (``SystemSpec.half_weights``: megatron) is compared with the reference run the
same way (``reference --half-weights``) and judged by that policy's tolerance. Half precision rounds
in proportion to magnitude, so its tolerances bound each gradient element's difference as a fraction
of the largest |gradient| of its parameter in the reference.

Each tolerance is derived (``derive``) from the reference alone, never from the systems it judges:
the spread between reference runs that differ only in micro-batching (the same global batch of 4 at
micro-batch 2 and 4 against 1: other accumulation orders and GEMM shapes, the same math), over many
seeds at that policy (``python -m tools.verify_spread``; ``results/measured-here/verify-spread.jsonl``),
by one rule: twice the largest difference, rounded up to 1, 2 or 5 x 10^k. ``TOLERANCES`` holds the
result and ``tests/runners/test_verify.py`` checks that it still follows from the kept measurements.
The rule and its numbers: docs/verification.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from contract import RunConfig

DERIVED_AT_STEPS = 12  # the optimizer steps of the runs the tolerances are derived from (a run's default: 2 + 10)
DERIVED_TOKENS = 32  # their tokens per micro-batch (the tests' model: sequence 32, micro-batch 1)
MARGIN = 2.0  # over the largest difference measured


@dataclass(frozen=True)
class Tolerance:
    """How close --verify wants a run to the reference under one precision policy: every step's
    loss within ``loss``; every gradient element within ``grad``, absolute, or, with ``relative``,
    as a fraction of the largest |gradient| of the same parameter in the reference (half precision
    rounds in proportion to magnitude)."""

    policy: str
    loss: float
    grad: float
    relative: bool = False

    def describe(self) -> str:
        """E.g. 'fp32, tol 1e-5' or 'bf16 autocast, tol 5e-2 rel, loss 5e-4'."""
        if not self.relative and self.loss == self.grad:
            return f"{self.policy}, tol {_short(self.grad)}"
        return f"{self.policy}, tol {_short(self.grad)}{' rel' if self.relative else ''}, loss {_short(self.loss)}"


def _short(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def policy_class(precision: str, half_weights: bool) -> str:
    """The name of what a run under ``precision`` is judged as: 'fp32', 'bf16 autocast', 'fp16
    autocast', or, for a system that keeps half weights, 'bf16 weights + fp32 main params' (fp16 alike)."""
    if precision == "fp32":
        return "fp32"
    return f"{precision} weights + fp32 main params" if half_weights else f"{precision} autocast"


FP32_TOLERANCE = Tolerance("fp32", loss=1e-5, grad=1e-5)
TOLERANCES = {t.policy: t for t in (
    FP32_TOLERANCE,
    Tolerance("bf16 autocast", loss=5e-4, grad=5e-2, relative=True),
    Tolerance("fp16 autocast", loss=5e-5, grad=1e-2, relative=True),
    Tolerance("bf16 weights + fp32 main params", loss=5e-4, grad=2e-1, relative=True),
    Tolerance("fp16 weights + fp32 main params", loss=1e-4, grad=2e-2, relative=True),
)}


def tolerance_table() -> dict[str, Tolerance]:
    return dict(TOLERANCES)


def round_up(x: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above ``x`` (> 0)."""
    k = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * 10**k >= x * (1 - 1e-12):
            return float(f"{m * 10**k:.0e}")
    raise AssertionError("unreachable")


def derivation_runs(policy: str, rows: list[dict]) -> list[dict]:
    """Of ``tools.verify_spread``'s rows, those a policy's tolerance is derived from: the policy's
    reference cases (the reference against itself at another micro-batch size, no system) at
    ``DERIVED_AT_STEPS`` steps and ``DERIVED_TOKENS`` tokens per micro-batch."""
    return [r for r in rows if r["class"] == policy and r["case"].startswith("reference") and r["status"] == "ok"
            and r["steps"] == DERIVED_AT_STEPS and r["tokens"] == DERIVED_TOKENS
            and r.get("max_rel_grad_diff") is not None]


def derive(policy: str, runs: list[dict]) -> Tolerance:
    """The tolerance of ``policy`` by the rule, from its runs' verifications (each a dict with
    ``max_abs_loss_diff``, ``max_abs_grad_diff``, ``max_rel_grad_diff``): ``MARGIN`` times the largest
    difference, rounded up (``round_up``); relative gradients for the half policies. fp32 keeps its
    absolute 1e-5 wherever the rule gives less (see FP32_TOLERANCE)."""
    loss = round_up(MARGIN * max(max(r["max_abs_loss_diff"] for r in runs), 1e-12))
    if policy == "fp32":
        grad = round_up(MARGIN * max(max(r["max_abs_grad_diff"] for r in runs), 1e-12))
        return Tolerance(policy, loss=max(loss, FP32_TOLERANCE.loss), grad=max(grad, FP32_TOLERANCE.grad))
    grad = round_up(MARGIN * max(r["max_rel_grad_diff"] for r in runs))
    return Tolerance(policy, loss=loss, grad=grad, relative=True)


# A lossy wire (a system's option, e.g. ours' --wire-dtype bf16): activations, their gradients and the
# DP push and pull rounded to 8 (bf16) or 11 (fp16) significant bits, each off by at most 2^-9
# relative. Measured (tests/ours/test_wire_dtype.py, tiny, P-2 D-2, bf16): loss 4.5e-5, gradients
# 3.1e-3 of each tensor's largest; errors add over steps, so the bound is that of bf16 autocast.
LOSSY_TOLERANCE = (1e-3, 5e-2)  # (loss, relative grad)


def verify_tolerance(cfg: RunConfig, half_weights: bool) -> Tolerance:
    """The tolerance of ``cfg``'s precision policy (``half_weights``: the system's spec keeps half
    weights). Options that round on purpose (``lossy()``) widen it to the larger of the two and name
    both. The tolerances were measured on CPU; a GPU's kernels round alike (the same dtypes), but
    sum in other orders: not measured here."""
    base = TOLERANCES[policy_class(cfg.precision, half_weights)]
    lossy = cfg.options.lossy()
    if not lossy:
        return base
    loss, grad = LOSSY_TOLERANCE
    if base.relative:
        loss, grad = max(loss, base.loss), max(grad, base.grad)
    return Tolerance(f"{base.policy} + {lossy}", loss=loss, grad=grad, relative=True)


def relative(diff: float, scale: float) -> float:
    """``diff`` as a fraction of ``scale`` (a difference where the reference is exactly 0: infinite)."""
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else float("inf")
