"""GPUs without a GPU: the peak table, the refusals before launch (too few GPUs, an architecture the
torch build lacks), each agent's GPUs, the hardware in a run's identity and counting per GPU, all
through fake device names, capabilities and inventories."""
from __future__ import annotations

import json

import pytest
import torch

from contract import ConfigError, RunConfig
from contract.config import planned_key
from contract.rank import Context
from runners import devices
from runners.devices import Gpus, agent_devices, build_runs_on, code_runs_on, judge_gpus, visible_entries
from runners.record import build_record, host_environment
from contract.registry import get_system
from runners.request import Placement, resolve_devices
from workload.configs import get_model_config
from workload.flops import GPU_MODELS, GPU_PEAK_TFLOPS, flops_per_token, gpu_model, gpu_peak_tflops

H100 = Gpus(names=("NVIDIA H100 80GB HBM3",), capabilities=((9, 0),), torch="2.11.0+cu130",
            arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"), visible=("0",))


def _gpus(n: int, name: str = "NVIDIA A100-SXM4-80GB", cap=(8, 0), arch=("sm_80", "sm_90")) -> Gpus:
    return Gpus((name,) * n, (cap,) * n, arch, "2.13.0+cu126", tuple(str(i) for i in range(n)))


@pytest.mark.parametrize("name, model, bf16, fp16, fp32", [
    ("Tesla V100-SXM2-16GB", "V100 SXM2", None, 125.0, 15.7),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", None, 125.0, 15.7),
    ("Tesla V100-PCIE-16GB", "V100 PCIe", None, 112.0, 14.0),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312.0, 312.0, 19.5),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0, 312.0, 19.5),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0, 312.0, 19.5),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0, 989.0, 67.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 756.0, 51.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0, 835.0, 60.0),
    ("NVIDIA H200", "H200 SXM", 989.0, 989.0, 67.0),
    ("NVIDIA H200 NVL", "H200 NVL", 835.0, 835.0, 60.0),
    ("NVIDIA L4", "L4", 121.0, 121.0, 30.3),
    ("NVIDIA L40S", "L40S", 362.0, 362.0, 91.6),
    ("NVIDIA A10G", "A10G", 70.0, 70.0, 35.0),
    ("Tesla T4", "T4", None, 65.0, 8.1),
])
def test_the_peak_table_is_keyed_by_exact_model(name, model, bf16, fp16, fp32):
    assert gpu_model(name) == model
    peaks = (gpu_peak_tflops(name, "bf16"), gpu_peak_tflops(name, "fp16"), gpu_peak_tflops(name, "fp32"))
    assert peaks == (bf16, fp16, fp32)


def test_other_gpus_are_not_taken_for_a_listed_one():
    """A substring is not a model: these get a measured peak (None from the table)."""
    for name in ("NVIDIA L40", "NVIDIA A10", "NVIDIA GeForce RTX 4090", "NVIDIA H100 PCIe 2", "Tesla V100-FHHL-16GB",
                 "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "cpu"):
        assert gpu_model(name) is None and gpu_peak_tflops(name, "bf16") is None, name
    assert {model for _, model in GPU_MODELS} == set(GPU_PEAK_TFLOPS)  # every model named, every name a model
    assert all(v > 0 for peaks in GPU_PEAK_TFLOPS.values() for v in peaks.values())


@pytest.mark.parametrize("code, capability, runs", [
    ("sm_70", (7, 0), True), ("sm_75", (7, 0), False),  # a cu128+ build on a V100: no sm_70 code
    ("sm_80", (8, 6), True), ("sm_86", (8, 0), False), ("sm_80", (9, 0), False),
    ("sm_90a", (9, 0), True), ("sm_90a", (9, 1), False), ("sm_100f", (10, 3), True),
    ("compute_90", (10, 0), True), ("compute_90", (8, 9), False),  # PTX: compiled on load for later GPUs
    ("sm_80", (8, 7), False), ("sm_87", (8, 7), True),  # Jetson Orin's code and sm_80's do not mix
    ("bogus", (9, 0), False),
])
def test_which_code_runs_on_which_gpu(code, capability, runs):
    assert code_runs_on(code, capability) is runs


def test_a_build_runs_where_any_of_its_code_does():
    cu126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
    cu130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
    assert build_runs_on(cu126, (7, 0)) and not build_runs_on(cu130, (7, 0))
    assert build_runs_on(cu130, (12, 0)) and not build_runs_on(cu126, (12, 0))
    assert build_runs_on((), (7, 0))  # a build that lists nothing (ROCm) is not judged


def test_the_hardware_of_a_request():
    assert judge_gpus("cpu", H100, 4) == "cpu"
    assert judge_gpus("auto", Gpus(), 4) == "cpu"
    assert judge_gpus("auto", H100, 1) == judge_gpus("cuda", H100, 1) == "cuda:NVIDIA H100 80GB HBM3"
    mixed = Gpus(("NVIDIA L4", "NVIDIA A10G"), ((8, 9), (8, 6)), ("sm_80", "sm_86", "sm_89"), "2.13", ("0", "1"))
    assert judge_gpus("auto", mixed, 2) == "cuda:NVIDIA A10G + NVIDIA L4"
    assert judge_gpus("auto", mixed, 1) == "cuda:NVIDIA L4"


def test_too_few_gpus_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="--device cuda: CUDA is not available"):
        judge_gpus("cuda", Gpus(), 1)
    with pytest.raises(ConfigError) as e:
        judge_gpus("auto", H100, 2)
    assert ("2 process(es) need 2 GPUs, one of their own each; this machine has 1 (NVIDIA H100 80GB HBM3)"
            in str(e.value))
    assert "\n" not in str(e.value)
    judge_gpus("auto", _gpus(4), 2, devices_per_process=2)  # fairscale: 2 processes x a pipe of 2 GPUs
    with pytest.raises(ConfigError, match=r"2 process\(es\) x 2 GPUs each need 4 GPUs"):
        judge_gpus("auto", _gpus(3), 2, devices_per_process=2)  # fairscale put them all on one GPU before


def test_an_architecture_the_build_lacks_is_refused_in_one_line():
    v100 = _gpus(1, "Tesla V100-SXM2-16GB", (7, 0), arch=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"))
    with pytest.raises(ConfigError) as e:
        judge_gpus("auto", v100, 1)
    assert "none of which runs on the Tesla V100-SXM2-16GB (sm_70)" in str(e.value) and "\n" not in str(e.value)
    assert judge_gpus("cpu", v100, 1) == "cpu"  # on CPU the build's GPU code does not matter
    assert judge_gpus("auto", _gpus(1, "Tesla V100-SXM2-16GB", (7, 0), ("sm_70", "sm_80")), 1) == \
        "cuda:Tesla V100-SXM2-16GB"


def test_resolve_devices_counts_this_nodes_processes(monkeypatch):
    """The run command's judgement: processes on this node (a multi-node run's share) x each one's GPUs."""
    monkeypatch.setattr(devices, "local_gpus", lambda: _gpus(2))
    model = get_model_config("tiny")
    ours = RunConfig(system="ours", model=model, batch_size=2, micro_batch_size=1, pp=4,
                     options=get_system("ours").options())
    with pytest.raises(ConfigError, match="4 process"):
        resolve_devices(ours, get_system('ours'), Placement())
    assert resolve_devices(ours, get_system('ours'),
                           Placement(nnodes=2, node_rank=1, rdzv_endpoint="n0:1")).hardware == \
        "cuda:NVIDIA A100-SXM4-80GB"
    fairscale = RunConfig(system="fairscale_fsdp", model=model, batch_size=2, micro_batch_size=1, pp=2, dp=2,
                          options=get_system("fairscale_fsdp").options())
    with pytest.raises(ConfigError, match="x 2 GPUs each need 4"):
        resolve_devices(fairscale, get_system('fairscale_fsdp'), Placement())
    assert resolve_devices(fairscale.replace(device="cpu"), get_system('fairscale_fsdp'), Placement()).hardware == "cpu"


def test_each_emulated_agent_gets_gpus_of_its_own():
    assert agent_devices(("0", "1", "2", "3"), 4, 1) == ["0", "1", "2", "3"]
    assert agent_devices(("2", "3", "5", "7"), 2, 2) == ["2,3", "5,7"]
    with pytest.raises(ValueError):
        agent_devices(("0",), 2, 1)
    assert visible_entries(2, {}) == ("0", "1")
    assert visible_entries(2, {"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2,GPU-c3"}) == ("GPU-a1", "GPU-b2")


def test_the_hardware_is_part_of_a_runs_identity():
    cfg = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    cpu, gpu = cfg.replace(hardware="cpu"), cfg.replace(hardware="cuda:NVIDIA H100 80GB HBM3")
    assert cpu.key() != gpu.key() != cfg.key()
    assert cpu.key() == cpu.replace(device="cpu", timeout=5.0).key()  # the request itself stays volatile
    assert planned_key(gpu.key()) == (cfg.key(), "cuda:NVIDIA H100 80GB HBM3")
    old = json.loads(cfg.key())
    del old["hardware"]  # a record from before the hardware was part of the identity
    assert planned_key(json.dumps(old)) == (cfg.key(), None)
    assert host_environment("cuda:NVIDIA L4")["device_name"] == "NVIDIA L4"
    assert host_environment("cpu")["device_kind"] == "cpu"


def _gpu_rank(rank: int, gpus: list[int], step: float = 2.0) -> dict:
    return {"rank": rank, "step_times": [step] * 3, "losses": [1.0] * 3, "dp_sync_times": [0.0] * 3, "busy_times": [],
            "extra": {}, "hostname": "h", "device": f"cuda:{gpus[0]}", "devices": [f"cuda:{g}" for g in gpus],
            "device_name": "NVIDIA A100-SXM4-80GB", "backend": "nccl", "peak_tflops": 312.0,
            "peak_source": "table:fp16", "cpu_rss_bytes": 3000 + rank,
            "gpu_memory": [{"device": f"cuda:{g}", "allocated_bytes": 100 * g + 1, "reserved_bytes": 100 * g + 50}
                           for g in gpus]}


def test_tokens_and_mfu_are_counted_per_gpu():
    """fairscale at P-2 D-2: 2 processes of 2 GPUs each are 4 devices, not 2 (its MFU was twice too high)."""
    spec = get_system("fairscale_fsdp")
    cfg = RunConfig(system="fairscale_fsdp", model=get_model_config("tiny"), batch_size=4, micro_batch_size=1,
                    pp=2, dp=2, precision="fp16", options=spec.options())
    rec = build_record(cfg, spec, "ok", None, [_gpu_rank(0, [0, 1]), _gpu_rank(1, [2, 3])], {})
    assert rec.environment["device_count"] == 4
    assert rec.tokens_per_s == 8 * 128 / 2.0 and rec.tokens_per_s_per_device == rec.tokens_per_s / 4
    assert rec.tflops_per_device == pytest.approx(rec.tokens_per_s / 4 * flops_per_token(cfg.model) / 1e12)
    assert rec.mfu == pytest.approx(rec.tflops_per_device / 312.0)
    # memory per GPU, allocated and reserved; the host's RSS per rank, apart
    assert rec.peak_memory_bytes == [1, 101, 201, 301] and rec.peak_reserved_bytes == [50, 150, 250, 350]
    assert rec.cpu_rss_bytes == [3000, 3001]


def test_a_context_synchronizes_every_device_it_uses():
    cfg = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    one = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo", config=cfg)
    assert one.devices == (torch.device("cpu"),)
    one.synchronize()  # nothing queued on a CPU
    two = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 2), backend="nccl", config=cfg,
                  devices=(torch.device("cuda", 2), torch.device("cuda", 3)))
    assert two.devices[0] == two.device and len(two.devices) == 2
