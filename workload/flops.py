"""FLOP counts and hardware peaks for tokens/s, TFLOP/s and MFU."""
from __future__ import annotations

import platform
import re
from pathlib import Path

from workload.configs import ModelConfig, count_params

# Dense peaks in TFLOP/s of each GPU model, per precision (never the sparse figures, which are twice
# these; fp32 is the plain fp32 rate, not TF32: torch leaves TF32 matmuls off by default). From
# NVIDIA's datasheets, each cited beside its entry; a model without a precision (V100 and T4 have no
# bf16 units) gets a measured peak for it. ``fp8`` is a GEMM precision only (Hopper's tensor cores,
# TransformerEngine's fp8 GEMMs), never a run's: a prediction may run a run's GEMMs at it.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Tesla V100 datasheet (2020): SXM2 125 tensor / 15.7 fp32; PCIe 112 / 14; V100S PCIe 130 / 16.4
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    # A100 datasheet (2021): SXM and PCIe, 40 and 80 GB alike: bf16/fp16 tensor 312 (624 sparse), fp32 19.5
    "A100 SXM": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A100 PCIe": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    # H100 datasheet (2023): SXM 1,979 sparse -> 989 dense, fp32 67, fp8 3,958 sparse -> 1,979 dense;
    # PCIe 1,513 -> 756, fp32 51, fp8 3,026 -> 1,513; NVL 1,671 -> 835, fp32 60, fp8 3,341 -> 1,671
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1671.0},
    # H200 datasheet (2024): SXM 1,979 sparse -> 989 dense, fp32 67, fp8 3,958 -> 1,979; NVL 1,671 -> 835,
    # fp32 60, fp8 3,341 -> 1,671
    "H200 SXM": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1671.0},
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
    """6N + 12·L·h·s: N parameters without embeddings (``count_params``: llama's k and v by its
    key/value heads, its MLP's three matrices), forward and backward, attention included (its scores
    and their product with the values go by the query heads, n_head x head_dim = h wide, whatever the
    key/value heads)."""
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


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it ('Intel(R) Xeon(R) Processor'), else what the
    platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
