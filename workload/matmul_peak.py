"""A GPU's matmul peak, measured where ``workload.flops``' datasheet table has no entry (an unlisted GPU).
A CPU's speed is the model's own operations on one thread (``workload.cpu_peak``), never a square
matmul. The record's arithmetic (``workload.flops``) needs no torch; this does, so the run command,
which only builds records, never imports it."""
from __future__ import annotations

import torch


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048,
                          max_n: int = 16384, min_product_s: float = 2e-3, reps: int = 10, trials: int = 3) -> float:
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
