"""A device's matmul peak, measured (where ``workload.flops``' datasheet table has no entry: a CPU, an
unlisted GPU). The record's arithmetic (``workload.flops``) needs no torch; this does, so the run
command, which only builds records, never imports it."""
from __future__ import annotations

import time

import torch


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, trials: int = 8,
                          budget_s: float = 1.0) -> float:
    """A matmul peak measured on this device (used where no table entry exists: CPU, an unlisted GPU).

    On a GPU: ``gpu_matmul_tflops``. On CPU: the best of several short trials, so that a moment of
    contention on a shared machine does not lower it; at least two trials, then no more once
    ``budget_s`` is spent. Where one matmul of n takes more than a quarter of the budget, judged from
    one at n = 256 (bf16 on a CPU without bf16 units: 2.4 s at n = 1024 here, so nine of them cost
    every mixed-precision rank 20 s), it measures at n = 256."""
    if device.type == "cuda":
        return gpu_matmul_tflops(device, dtype)
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
        start = time.perf_counter()
        a @ b
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def gpu_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 2048, max_n: int = 16384,
                      min_product_s: float = 2e-3, reps: int = 10, trials: int = 3) -> float:
    """A GPU's matmul peak: n doubles (from ``n``, at most ``max_n``) until one product takes at least
    ``min_product_s``, so that the kernel, not its launch, is timed (at 1024^3 a modern GPU computes
    for microseconds: launch-bound; an H100 needs n = 8192 in bf16 for a millisecond); then the best of
    ``trials`` batches of ``reps`` back-to-back products timed by CUDA events. Where a size does not
    fit the free memory, the last size that did is measured. The memory is given back to the device
    (the caller resets the peak memory statistics)."""
    def per_product(a: torch.Tensor, b: torch.Tensor, count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count

    with torch.cuda.device(device):
        a = b = None
        size = n
        while True:
            try:
                x = torch.randn(size, size, device=device, dtype=dtype)
                y = torch.randn(size, size, device=device, dtype=dtype)
                x @ y  # warm-up (and the workspace)
            except torch.OutOfMemoryError:
                if a is None:
                    raise
                break
            a, b, n = x, y, size  # the last size that fitted (the one before is freed)
            del x, y
            if size >= max_n or per_product(a, b, 2) >= min_product_s:
                break
            size *= 2
        best = max(2.0 * n**3 / per_product(a, b, reps) / 1e12 for _ in range(trials))
        del a, b
        torch.cuda.empty_cache()
    return best
