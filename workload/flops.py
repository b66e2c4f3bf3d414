"""FLOP counts and hardware peaks for tokens/s, TFLOP/s and MFU."""
from __future__ import annotations

import re
import time

import torch

from workload.configs import ModelConfig
from workload.model import count_params

# Dense peaks in TFLOP/s of each GPU model, per precision (never the sparse figures, which are twice
# these; fp32 is the plain fp32 rate, not TF32: torch leaves TF32 matmuls off by default). From
# NVIDIA's datasheets, each cited beside its entry; a model without a precision (V100 and T4 have no
# bf16 units) gets a measured peak for it.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Tesla V100 datasheet (2020): SXM2 125 tensor / 15.7 fp32; PCIe 112 / 14; V100S PCIe 130 / 16.4
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    # A100 datasheet (2021): SXM and PCIe, 40 and 80 GB alike: bf16/fp16 tensor 312 (624 sparse), fp32 19.5
    "A100 SXM": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A100 PCIe": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    # H100 datasheet (2023): SXM 1,979 sparse -> 989 dense, fp32 67; PCIe 1,513 -> 756, fp32 51;
    # NVL 1,671 -> 835, fp32 60
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    # H200 datasheet (2024): SXM 1,979 sparse -> 989 dense, fp32 67; NVL 1,671 -> 835, fp32 60
    "H200 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    # L4 datasheet (2023): bf16/fp16 tensor 242 sparse -> 121 dense, fp32 30.3
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    # L40S datasheet (2023): bf16/fp16 tensor 362.05 dense (733 sparse), fp32 91.6
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    # A10G (AWS g5): NVIDIA publishes no datasheet; AWS's figures: bf16/fp16 tensor 70 dense, fp32 35
    # (the A10's datasheet, 125 / 31.2, is another part)
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},
    # T4 datasheet (2019): fp16 tensor (mixed precision) 65, fp32 8.1
    "T4": {"fp16": 65.0, "fp32": 8.1},
}

# torch.cuda.get_device_name's answer -> the model it names, matched whole (a PCIe or NVL part never
# takes an SXM part's peak). Names as the drivers report them, e.g. "Tesla V100-SXM2-16GB", "NVIDIA
# A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (the SXM5 part), "NVIDIA H200".
GPU_MODELS: tuple[tuple[str, str], ...] = (
    (r"(Tesla )?V100-SXM2-\d+GB(-LS)?", "V100 SXM2"),
    (r"(Tesla )?V100-PCIE-\d+GB", "V100 PCIe"),
    (r"(Tesla )?V100S-PCIE-\d+GB", "V100S PCIe"),
    (r"(NVIDIA )?A100-SXM\d?-\d+GB", "A100 SXM"),
    (r"(NVIDIA )?A100(-PCIE-\d+GB| \d+GB PCIe)", "A100 PCIe"),
    (r"(NVIDIA )?H100( \d+GB)? HBM3|(NVIDIA )?H100 SXM5( \d+GB)?", "H100 SXM"),
    (r"(NVIDIA )?H100 PCIe", "H100 PCIe"),
    (r"(NVIDIA )?H100 NVL", "H100 NVL"),
    (r"(NVIDIA )?H200( SXM)?( \d+GB( HBM3e)?)?", "H200 SXM"),
    (r"(NVIDIA )?H200 NVL", "H200 NVL"),
    (r"(NVIDIA )?L4", "L4"),
    (r"(NVIDIA )?L40S", "L40S"),
    (r"(NVIDIA )?A10G", "A10G"),
    (r"(Tesla )?T4", "T4"),
)


def flops_per_token(cfg: ModelConfig) -> float:
    """6N + 12·L·h·s: N parameters without embeddings, forward and backward, attention included."""
    return 6.0 * count_params(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def gpu_model(device_name: str) -> str | None:
    """The model of GPU_PEAK_TFLOPS that ``device_name`` (torch.cuda.get_device_name) is, or None."""
    name = " ".join(device_name.split())
    for pattern, model in GPU_MODELS:
        if re.fullmatch(pattern, name):
            return model
    return None


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet's dense peak of this GPU at ``precision`` (fp32, bf16, fp16), or None where the
    table has no such model or the model no such precision."""
    model = gpu_model(device_name)
    return GPU_PEAK_TFLOPS[model].get(precision) if model else None


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
