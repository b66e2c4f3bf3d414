"""FLOP counts and hardware peaks for tokens/s, TFLOP/s and MFU."""
from __future__ import annotations

import time

import torch

from workload.configs import ModelConfig
from workload.model import count_params

# Dense peaks in TFLOP/s (never the sparse figures), by a substring of the device name.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
}


def flops_per_token(cfg: ModelConfig) -> float:
    """6N + 12·L·h·s: N parameters without embeddings, forward and backward, attention included."""
    return 6.0 * count_params(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(precision)
    return None


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, trials: int = 8,
                          budget_s: float = 1.0) -> float:
    """A matmul peak measured on this device (used where no table entry exists, e.g. CPU): the best
    of several short trials, so that a moment of contention on a shared machine does not lower it;
    at least two trials, then no more once ``budget_s`` is spent. Where one matmul of n takes more
    than a quarter of the budget, judged from one at n = 256 (bf16 on a CPU without bf16 units: 2.4 s
    at n = 1024 here, so nine of them cost every mixed-precision rank 20 s), it measures at n = 256."""
    small = 256  # first a small matmul, to see whether n is affordable (n^3 / small^3 times its time)
    a = torch.randn(small, small, device=device, dtype=dtype)
    a @ a
    start = time.perf_counter()
    a @ a
    if (time.perf_counter() - start) * (n / small) ** 3 > budget_s / 4:
        n = small
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = 0.0
    began = time.perf_counter()
    for k in range(trials):
        if k >= 2 and time.perf_counter() - began > budget_s:
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start) / 1e12)
    return best
