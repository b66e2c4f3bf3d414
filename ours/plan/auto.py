"""``--n-slices auto`` (ours' default): the token slicing of a run, chosen before it starts, by one rule:
TeraPipe's pipeline latency with ours' cost of a slice and ours' fill, T = M sum_i t_i + (P - 1) max_i f_i
less what the deferred weight gradients hide at the step's end (``ours.plan.latency``), solved exactly
(``ours.plan.planner``) over the run's compute model (``workload.compute``), with the run's stages,
layers, batch, micro-batch (the batch slice: the run's layout, which auto keeps), tensor-parallel degree
and recompute; one slice where slicing cannot pay.

The compute model of the run's device:
- a GPU: its device file (``workload/devices``), found by the name the driver reports;
- a CPU: this host's profile at the model's layer shape (``python -m ours.plan profile`` writes it into
  ``ours/plan/profiles/<device>-h..-a..-s..-v...json``, llama's ``<device>-llama-h..-a..-kv..-f..-s..-v...json``;
  a profile at a longer sequence covers shorter ones), its gloo loopback as the link between stages;
  without one, the host's measured matmul rate as a device of its own (``host_device``).

With one stage there is nothing to fill: the formula's (P - 1) term is zero and every slice only adds
its own costs, so the rule keeps one slice. The warm-up search of earlier versions (time a few K and
keep the fastest) is the option ``--n-slices search`` (``ours.plan.tune``), recorded as such.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from contract.links import Link
from ours.plan.planner import plan_for
from workload.compute import ComputeModel, CpuCompute, Device, DeviceError, GpuCompute, default_attention, find_device
from workload.configs import ModelConfig

PROFILES = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class AutoSlicing:
    slices: tuple[int, ...]
    source: str  # how they were chosen: "planner (<compute model>)"


def profile_dir() -> Path:
    return Path(os.environ.get("OURS_PLAN_DIR") or PROFILES)


def _shape(model: ModelConfig) -> str:
    """The layer shape a profile is of, in its file name: gpt's hidden size and heads; llama's with the
    family, its key/value heads and its MLP's width (a gpt profile is never read for llama)."""
    if model.llama:
        return f"llama-h{model.n_embd}-a{model.n_head}-kv{model.n_kv_head}-f{model.ffn_dim}"
    return f"h{model.n_embd}-a{model.n_head}"


def cache_key(model: ModelConfig, device) -> str:
    kind = str(device).split(":")[0]  # a torch.device or "cpu" / "cuda"
    return f"{kind}-{_shape(model)}-s{model.seq_len}-v{model.vocab_size}"


def profile_path(model: ModelConfig, device) -> Path | None:
    """The profile that covers ``model``'s layer shape on this device kind, if any: the exact sequence
    length first, else the shortest longer one."""
    kind = str(device).split(":")[0]
    pattern = re.compile(rf"^{kind}-{_shape(model)}-s(\d+)-v{model.vocab_size}\.json$")
    found = sorted((int(m.group(1)), p) for p in profile_dir().glob("*.json") if (m := pattern.match(p.name)))
    longer = [(s, p) for s, p in found if s >= model.seq_len]
    return longer[0][1] if longer else None


def host_device(peak_tflops: float) -> Device:
    """A CPU host as a device: its measured matmul rate (one thread per rank), a stream's bandwidth of a
    core, and eager PyTorch's cost per operation on a CPU."""
    return Device(name="cpu host (measured peak)", part="cpu", memory_gb=1e6, bandwidth_gbs=10.0, sms=1,
                  gemm={"fp32": {"efficiency": 1.0, "half": 16}}, memory_efficiency=1.0, kernel_us=2.0,
                  host_op_us=15.0, reserved_gb=0.0, peak_tflops={"fp32": peak_tflops})


def compute_model(config, device) -> tuple[ComputeModel, Link | None, str]:
    """(compute model, link between stages, its name) of ``config``'s run on ``device`` (a torch.device,
    or "cpu" / "cuda")."""
    m = config.model
    kind = str(device).split(":")[0]
    if kind == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
        try:
            dev = find_device(name)
        except DeviceError:
            from workload.matmul_peak import measure_matmul_tflops

            dev = host_device(measure_matmul_tflops(torch.device(device)))
        return GpuCompute(dev, m, config.precision, default_attention(dev)), None, dev.name
    path = profile_path(m, kind)
    if path is not None:
        prof = json.loads(path.read_text())
        fit = prof.get("p2p_fit") or {}
        link = Link(max(0.0, fit.get("latency", 0.0)), fit.get("bandwidth", float("inf"))) if fit else None
        return CpuCompute(prof), link, f"profile {path.name}"
    from workload.cpu_peak import cpu_peak_tflops

    peak, _ = cpu_peak_tflops(m, config.micro_batch_size)
    return GpuCompute(host_device(peak), m, "fp32", "flash"), None, f"this host's measured peak ({peak:.3f} TFLOP/s)"


def auto_slicing(config, device, cm: ComputeModel | None = None, link=None) -> AutoSlicing:
    """The slicing for ``config`` (P = config.pp stages, batch slice = config.micro_batch_size); ``cm``
    and ``link``: a compute model and stage link to use instead of the device's."""
    name = "given compute model"
    if cm is None:
        cm, link, name = compute_model(config, device)
    p = plan_for(cm, config.model, tp=config.tp, pp=config.pp, batch=config.batch_size,
                 micro_batch=config.micro_batch_size, recompute=config.recompute, link=link)
    if sum(p.slices) != config.model.seq_len:
        raise RuntimeError(f"the planner's slices {p.slices} do not cover the sequence ({config.model.seq_len})")
    return AutoSlicing(tuple(int(x) for x in p.slices), f"planner ({name})")
