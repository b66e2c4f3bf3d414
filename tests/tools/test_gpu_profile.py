"""scripts/gpu_profile.sh without a GPU (one line, exit 0), and its fit and page on synthetic measurements:
a GEMM grid made by a known curve gives that curve back."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.gpu_profile import WIDTHS, fit_gemm_curve, gemm_shapes, page, predicted_layers, predicted_systems
from workload.compute import GpuCompute, find_device
from workload.configs import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    p = subprocess.run(["bash", "scripts/gpu_profile.sh", "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().count("\n") == 0 and "no CUDA GPU here" in p.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written, no device file touched
    bad = subprocess.run(["bash", "scripts/gpu_profile.sh", "--only", "nonesuch"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_the_fit_recovers_the_curve_that_made_the_grid():
    dev = find_device("H100 SXM")
    truth = dev.with_gemm("bf16", 0.62, 48)
    g = GpuCompute(truth, ModelConfig("x", 1, 64, 1, 64, 0), "bf16")
    rows = [dict(precision="bf16", model=m, l=l, op=op, m=a, n=b, k=c, seconds=g.gemm(a, b, c))
            for m, (h, _) in WIDTHS.items() for l in (16, 128, 1024, 2048) for op, a, b, c in gemm_shapes(h, l)]
    e, half, err = fit_gemm_curve(dev, rows, "bf16")
    assert e == pytest.approx(0.62, rel=0.02) and half == 48 and err < 0.01
    with pytest.raises(ValueError):
        fit_gemm_curve(dev, rows, "fp16")


def test_the_page_sets_predictions_beside_measurements():
    dev = find_device("H100 SXM")
    layers = predicted_layers(dev, [dict(precision="bf16", model="gpt3-xl", l=512, forward=1e-3, step=3e-3)])
    systems = predicted_systems(dev, [dict(label="reference", status="ok", step=1.0, mfu=0.4, memory_gb=10.0),
                                      dict(label="ours K=4", status="ok", step=1.2, mfu=0.33, memory_gb=12.0),
                                      dict(label="megatron", status="not run (budget)")])
    assert layers[0]["predicted_step"] > 0 and systems[1]["predicted"] > 0 and "error" in systems[1]
    text = page("NVIDIA H100 80GB HBM3", {"bf16": (0.7, 64.0, 0.05)}, layers, systems, ["bash scripts/gpu_profile.sh"])
    assert "| ours K=4 | ok | 1.200 | 1.20x |" in text and "| megatron | not run (budget) |" in text
    assert "| bf16 | 0.700 | 64 | 5.0 % |" in text


def test_gemms_timed_as_the_host_are_left_out_of_the_fit():
    """A grid whose small GEMMs read the host's issue time (a floor) gives the kernels' curve back."""
    dev = find_device("H200")
    truth = dev.with_gemm("bf16", 0.8, 256)
    g = GpuCompute(truth, ModelConfig("x", 1, 64, 1, 64, 0), "bf16")
    floor = 25e-6
    rows = [dict(precision="bf16", model=m, l=l, op=op, m=a, n=b, k=c, seconds=max(floor, g.gemm(a, b, c)))
            for m, (h, _) in WIDTHS.items() for l in (16, 128, 512, 1024, 2048) for op, a, b, c in gemm_shapes(h, l)]
    e, half, err = fit_gemm_curve(dev, rows, "bf16")
    assert e == pytest.approx(0.8, rel=0.03) and half == 256 and err < 0.02


def test_refit_writes_the_page_again_without_a_gpu(tmp_path):
    """--refit reads a profile's raw measurements, fits, and writes the page beside them; with
    --no-write-device the device files stay as they are."""
    dev = find_device("H200")
    g = GpuCompute(dev.with_gemm("bf16", 0.7, 128), ModelConfig("x", 1, 64, 1, 64, 0), "bf16")
    rows = [dict(precision="bf16", model="gpt3-xl", l=l, op=op, m=a, n=b, k=c, seconds=g.gemm(a, b, c))
            for l in (512, 2048) for op, a, b, c in gemm_shapes(2048, l)]
    raw = tmp_path / "gpu-profile-x.json"
    raw.write_text(json.dumps(dict(gpu="NVIDIA H200", torch="2.11", cuda="13.0", created="now", gemm=rows,
                                   notes=["A note."])))
    before = Path(dev.path).read_text()
    p = subprocess.run(["bash", "scripts/gpu_profile.sh", "--refit", str(raw), "--no-write-device"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "gpu-profile-x.md").read_text()
    assert "| bf16 | 0.700 | 128 |" in text and "A note." in text
    assert Path(dev.path).read_text() == before
    bad = subprocess.run(["bash", "scripts/gpu_profile.sh", "--refit", str(tmp_path / "none.json")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_a_prediction_on_the_profiled_gpu_says_its_device_file_is_measured():
    p = subprocess.run([sys.executable, "-m", "predict", "run", "--system", "torch_pipe", "--model", "gpt3-xl",
                        "--num-layers", "8", "--seq-length", "2048", "--batch-size", "8", "--micro-batch-size", "1",
                        "--precision", "bf16", "--gpu", "NVIDIA H200"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "device file: measured (scripts/gpu_profile.sh)" in p.stdout
    assert find_device("NVIDIA H200").measured["gpu"] == "NVIDIA H200"
