"""How close ``--verify`` wants a run to the single-process reference, per precision policy.

fp32: losses and gradients within 1e-5 (absolute). Under ``--mixed-precision`` the reference
autocasts (bf16 on CPU, fp16 with loss scaling on CUDA), as do torch_pipe, fairscale_fsdp and ours;
megatron keeps half-precision weights with fp32 main params (``SystemSpec.half_weights``) and is
compared with the same autocast reference under a tolerance of its own. Half precision rounds in
proportion to magnitude, so the mixed tolerances bound each gradient element's difference as a
fraction of the largest |gradient| of its parameter in the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import RunConfig


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
        """E.g. 'fp32, tol 1e-5' or 'bf16 autocast, tol 5e-2 rel, loss 1e-3'."""
        if not self.relative and self.loss == self.grad:
            return f"{self.policy}, tol {_short(self.grad)}"
        return f"{self.policy}, tol {_short(self.grad)}{' rel' if self.relative else ''}, loss {_short(self.loss)}"


def _short(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


FP32_TOLERANCE = Tolerance("fp32", loss=1e-5, grad=1e-5)
# Measured on the tiny model (4 layers, hidden 64, seq 32; P = 2, TP 2 or DP 2; 4 micro-batches; 3
# steps) against the bf16 autocast reference, as a fraction of a parameter's largest gradient:
# torch_pipe and fairscale_fsdp autocast the same ops in the same order and match within 2e-7; ours
# slices the sequence, so its roundings differ: 1.3e-2 (loss 6e-5), the size of bf16 against fp32
# itself (0.8e-2 to 1.1e-2). Megatron (bf16 weights, fp32 main params): 1.7e-2 to 2.1e-2 (PP 2, TP 2,
# DP 2), 2.5e-2 after 10 steps (loss up to 2.2e-4). A bug that loses a micro-batch's or a slice's
# share of a gradient changes it by 1/8 or more (tests/runners/test_verify.py).
MIXED_TOLERANCE = {False: (1e-3, 5e-2), True: (2e-3, 8e-2)}  # half_weights -> (loss, relative grad)


# A lossy wire (a system's option, e.g. ours' --wire-dtype bf16): activations, their gradients and the
# DP push and pull rounded to 8 (bf16) or 11 (fp16) significant bits, each off by at most 2^-9
# relative. Measured (tests/ours/test_wire_dtype.py, tiny, P-2 D-2, bf16): loss 4.5e-5, gradients
# 3.1e-3 of each tensor's largest; errors add over steps, so the bound is that of bf16 autocast.
LOSSY_TOLERANCE = (1e-3, 5e-2)  # (loss, relative grad)


def verify_tolerance(cfg: RunConfig, half_weights: bool, cuda: bool) -> Tolerance:
    """The tolerance of ``cfg``'s precision policy. fp16 on CUDA is judged as bf16 (it rounds finer;
    not measured here, the machine has no GPU). Options that round on purpose (``lossy()``) widen it
    to the larger of the two and name both."""
    base = _policy_tolerance(cfg.mixed_precision, half_weights, cuda)
    lossy = cfg.options.lossy()
    if not lossy:
        return base
    loss, grad = LOSSY_TOLERANCE
    if base.relative:
        loss, grad = max(loss, base.loss), max(grad, base.grad)
    return Tolerance(f"{base.policy} + {lossy}", loss=loss, grad=grad, relative=True)


def _policy_tolerance(mixed_precision: bool, half_weights: bool, cuda: bool) -> Tolerance:
    if not mixed_precision:
        return FP32_TOLERANCE
    half = "fp16" if cuda else "bf16"
    policy = f"{half} weights + fp32 main params" if half_weights else f"{half} autocast"
    loss, grad = MIXED_TOLERANCE[half_weights]
    return Tolerance(policy, loss=loss, grad=grad, relative=True)


def relative(diff: float, scale: float) -> float:
    """``diff`` as a fraction of ``scale`` (a difference where the reference is exactly 0: infinite)."""
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else float("inf")
