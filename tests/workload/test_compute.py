"""The one compute model (``workload.compute``): device files, a GPU's operations by their shapes, and
the same answer wherever the suite asks (the simulator, ours' latency model and planner, auto)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ours.plan.latency import slice_time
from ours.plan.layout import Cluster, evaluate, parse_link
from workload.compute import (DEVICES, DeviceError, GpuCompute, find_device, gpu_compute, read_device,
                              tile_efficiency)
from workload.configs import get_model_config

REPO = Path(__file__).resolve().parents[2]
XL = get_model_config("gpt3-xl")


def test_every_device_file_reads_with_its_sources():
    names = {read_device(p).name for p in DEVICES.glob("*.json")}
    assert {"V100 SXM2 16GB", "V100 SXM2 32GB", "A100 SXM4 40GB", "A100 SXM4 80GB", "H100 SXM", "H200 SXM"} <= names
    for path in DEVICES.glob("*.json"):
        d = read_device(path)
        assert d.sources and d.memory_gb > 0 and d.bandwidth_gbs > 0 and d.sms > 0
        for p in ("fp32", "bf16", "fp16"):
            e, half = d.gemm_curve(p)
            assert 0 < e <= 1 and half > 0 and d.peak_flops(p) > 0
        assert len(d.calibrated_on) <= 3  # at most one cell per precision, named
    v100 = find_device("V100 SXM2 16GB")
    assert not v100.calibrated_on and v100.kernels  # its GEMMs from published kernel benchmarks, no whole step
    assert v100.peak_flops("bf16") == v100.peak_flops("fp32")  # no bf16 units: the fp32 rate
    assert find_device("Tesla V100-SXM2-16GB").name == "V100 SXM2 16GB"  # as the driver names it
    assert find_device("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert find_device("v100-sxm2-32gb").memory_gb == 32


def test_a_bad_device_file_is_one_line(tmp_path):
    cases = {"missing.json": None, "text.json": "not json", "list.json": "[]",
             "lacks.json": json.dumps({"name": "x"}), "part.json": json.dumps(
                 {"name": "x", "part": "Z9000", "memory_gb": 1, "bandwidth_gbs": 1, "sms": 1, "gemm": {}})}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(DeviceError) as exc:
            read_device(tmp_path / name)
        assert "\n" not in str(exc.value)
    with pytest.raises(DeviceError, match="no device file for 'B200'"):
        find_device("B200")


def test_a_thin_slice_under_fills_the_gpu():
    """V100 fp16, a GPT-3 XL layer: per token, 16-token slices cost at least twice 2048-token ones."""
    g = gpu_compute("V100 SXM2 16GB", XL, "fp16")
    per_token = {l: g.layer_step(1, l, 0) / l for l in (16, 2048)}
    assert per_token[16] >= 2 * per_token[2048], per_token
    # a large output fills the SMs; a thin one does not, and its weights are read for few tokens
    assert tile_efficiency(2048, 6144, 2048, 1, 80, 32) > 0.9 > 0.2 > tile_efficiency(16, 6144, 2048, 1, 80, 32)


def test_terapipes_latency_curve_flat_then_linear_and_context_adds():
    """TeraPipe's latency model (the seed's README: the best slice is set by the point where a device
    becomes compute bound): a slice's time is nearly flat while the device is under-filled, then grows
    linearly with its tokens; attending to more context costs more, linearly in it."""
    g = gpu_compute("V100 SXM2 16GB", XL, "fp16")
    t = {l: g.layer_step(1, l, 0) for l in (16, 32, 64, 512, 1024)}
    assert t[32] / t[16] < 1.25 and t[64] / t[16] < 1.6  # under-filled: 4x the tokens, < 1.6x the time
    assert 1.7 < t[1024] / t[512] < 2.3  # compute bound: twice the tokens, about twice the time
    c = [g.layer_step(1, 128, ctx) for ctx in (0, 512, 1024, 1536)]
    steps = [b - a for a, b in zip(c, c[1:])]
    assert all(s > 0 for s in steps) and max(steps) / min(steps) < 1.6


def test_one_compute_model_for_the_simulator_the_latency_model_the_layout_and_auto():
    """The same layer, slice and device: ours.plan's latency model, the layout planner, auto and the
    simulator's programs all take their compute time from workload.compute."""
    from contract import RunConfig
    from ours import OursOptions
    from ours.plan.auto import auto_slicing
    from contract.links import Link
    from predict.run_spec import Cluster as SimCluster, RunSpec
    from predict.step_time import predict

    model = XL.with_overrides(n_layer=4)
    g = gpu_compute("A100 SXM4 80GB", model, "bf16")
    b, l, layers = 1, 512, 4
    per_slice = layers * g.layer_step(b, l, 0)
    assert slice_time(g, model.n_embd, b, l, 0, layers=layers, n_stages=1) == pytest.approx(per_slice)
    cand = evaluate(model, Cluster(1, intra=parse_link("5us,300GB/s")), g, 1, 1, batch_size=1, batch_slice=1,
                    granularity=512)
    assert cand.compute == pytest.approx(sum(layers * g.layer_step(1, s, sum(cand.slices[:i]))
                                             for i, s in enumerate(cand.slices)))
    cfg = RunConfig(system="ours", model=model, batch_size=1, micro_batch_size=1, pp=1, precision="bf16",
                    options=OursOptions(n_slices="auto"))
    assert auto_slicing(cfg, "cuda", cm=g).slices == (model.seq_len,)  # one stage: one slice
    link = Link.from_ms_gbps(0.005, 1000)
    spec = RunSpec("ours", model.with_overrides(seq_len=l), batch_size=1, micro_batch_size=1, link=link,
                   slices=(l,), precision="bf16", transport="nccl", cluster=SimCluster(1, 1, link))
    g2 = GpuCompute(g.device, spec.model, "bf16", g.attention)
    p = predict(spec, g2)
    layer_math = sum(p.detail.get(k, 0.0) for k in ("forward", "backward", "wgrad"))
    head_wgrad = g2.head_wgrad(b * l)  # deferred with the layers' weight gradients
    assert layer_math == pytest.approx(layers * g2.layer_step(b, l, 0) + head_wgrad)


def test_nothing_else_computes_an_operations_time():
    """Only workload/compute.py turns FLOPs or bytes into seconds of a device: no other module of the
    suite reads a device's efficiency or divides by a peak."""
    found = []
    for pkg in ("workload", "ours", "predict", "baselines", "contract", "runners", "bench", "tools"):
        for path in (REPO / pkg).rglob("*.py"):
            if path.name == "compute.py" and path.parent.name == "workload":
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("peak_flops", "gemm_curve", "tile_efficiency"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.attr}")
                if isinstance(node, ast.Name) and node.id in ("tile_efficiency",):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.id}")
    allowed = ("tools/gpu_profile.py", "predict/fitting.py")  # fit the curves the model reads
    assert [f for f in found if not f.startswith(allowed)] == []
