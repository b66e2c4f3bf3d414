"""The seed's GPT-3 XL tables (``/work/shared/seeds/gpt3-xl-results.md``) predicted from one row.

The seed's workload, read from its own numbers: 24 layers, hidden 2048, 16 heads, sequence 2048, batch
64 per pipeline, micro-batch 1, P-12 over 12 p3.2xlarge (one V100 each), fp32 with activation
recompute (as its Megatron tables say). Its dataset is QQP: "parameters of a regular instance: 400 MB"
are two layers in fp32 (100.7 M parameters = 384 MiB) and "626 MB" on the first instance adds
28,996 x 2048 + 2048 x 2048 fp32 embeddings (BERT's cased vocabulary: 242 MiB), and its loss is "very
light-weighted": a two-class head, not a language-model head. "Storage of a micro-batch: 16 MB" is
1 x 2048 x 2048 activations in fp32 (16 MiB): messages between stages are fp32.

The seed's GPipe (and its GPipe + central-PS rows) posts every receive ahead on its own CUDA stream and
keeps one message in flight per link and direction (the issue's hint: from 10 to 50 ms the step grows
by about one one-way delay per micro-batch message); that is ours' engine at K = 1 (one token slice),
over NCCL, with in_flight = 1. Its central PS (the DP-4 rows) is DT-FM's over NCCL, not ours'
point-to-point star: per 25 MB bucket a chain reduce to the server, its Adam step and a chain broadcast
(``dp_mode="chain_ps"``). The device file's efficiency is fitted on the default GPipe row only
(15.16 s); every other cell is a prediction.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from predict.fitting import fit_efficiency
from predict.compute import GpuCompute, load_device
from predict.step_time import predict
from predict.run_spec import Link, RunSpec
from workload.configs import ModelConfig

DEVICE_FILE = Path(__file__).resolve().parent / "devices" / "v100.json"
WORKLOAD = ModelConfig("gpt3-xl (QQP)", n_layer=24, n_embd=2048, n_head=16, seq_len=2048, vocab_size=28996)
HEAD_CLASSES = 2
NETWORKS = {  # the seed's labels: (one-way delay ms, Gbit/s)
    "default": (0.1, 10.0), "d1-5g": (1.0, 5.0), "d5-2g": (5.0, 2.0), "d10-1g": (10.0, 1.0), "d50-1g": (50.0, 1.0)}
GPIPE = {"default": 15.16, "d1-5g": 15.49, "d5-2g": 16.80, "d10-1g": 22.90, "d50-1g": 29.08}
DP4_CENTRAL_PS = {"default": 16.17, "d1-5g": 17.55, "d5-2g": 21.99, "d10-1g": 33.39}
# Megatron, one p3.16xlarge (8 V100, NVLink), batch 64, fp32 + recompute; None = Fail (OOM)
MEGATRON_LAYOUTS = {"T-8": (8, 1), "P-8": (1, 8), "T-4 P-2": (4, 2), "T-2 P-4": (2, 4)}  # (tp, pp)
MEGATRON = {
    1: {"T-8": 25.00, "P-8": 19.71, "T-4 P-2": 20.64, "T-2 P-4": 20.81},
    2: {"T-8": 24.18, "P-8": 21.52, "T-4 P-2": 26.72, "T-2 P-4": 21.46},
    4: {"T-8": 23.31, "P-8": 25.14, "T-4 P-2": 20.91, "T-2 P-4": 22.79},
    8: {"T-8": 20.90, "P-8": None, "T-4 P-2": 21.67, "T-2 P-4": None},
}
# NVLink inside a p3.16xlarge: NCCL's all-reduce bus bandwidth for 16 MB messages (about 100 GB/s on
# a DGX-1-like hybrid cube mesh) and a few microseconds per hop. A datasheet-level guess, not fitted.
NVLINK = Link(latency=8e-6, bandwidth=100e9)


def network(name: str, in_flight: int | None = 1) -> Link:
    delay, gbps = NETWORKS[name]
    return Link.from_ms_gbps(delay, gbps, in_flight)


def gpipe_spec(net: str, dp: int = 1, precision: str = "fp32", system: str = "ours") -> RunSpec:
    """The seed's GPipe row (``system="torch_pipe"``: what torch.distributed.pipelining's GPipe would do
    on the same cluster: receives posted one at a time, right before each micro-batch)."""
    return RunSpec(system, WORKLOAD, batch_size=64, micro_batch_size=1, link=network(net), pp=12, dp=dp,
                   schedule="gpipe", dp_mode="chain_ps", precision=precision, recompute=True, transport="nccl",
                   head_classes=HEAD_CLASSES, slices=(WORKLOAD.seq_len,) if system == "ours" else None)


def megatron_spec(layout: str, micro: int) -> RunSpec:
    tp, pp = MEGATRON_LAYOUTS[layout]
    return RunSpec("megatron", WORKLOAD, batch_size=64, micro_batch_size=micro, link=NVLINK, pp=pp, tp=tp,
                   schedule="1f1b", recompute=True, transport="nccl", intra_link=NVLINK, ranks_per_host=8,
                   head_classes=HEAD_CLASSES)


def calibrate_seed(precision: str = "fp32", write: bool = True) -> GpuCompute:
    """The V100's efficiency for ``precision`` fitted on the default GPipe row (15.16 s)."""
    base = json.loads(DEVICE_FILE.read_text())
    dev = load_device(DEVICE_FILE, WORKLOAD, precision) if precision in base["efficiency"] else GpuCompute(
        base["device"], WORKLOAD, base["peak_tflops"], {precision: 0.5}, precision,
        base.get("optimizer_seconds_per_param", 0.0))
    spec = gpipe_spec("default", precision=precision)
    if precision == "mixed":
        spec = spec.replace(message_bytes=2)
    eff = fit_efficiency(spec, dev, GPIPE["default"])
    if write:
        base["efficiency"][precision] = round(eff, 4)
        base.setdefault("calibrated_on", {})[precision] = (
            "the seed's default GPipe row (GPT-3 XL, QQP, P-12 over 12 p3.2xlarge, batch 64, micro-batch 1, "
            "recompute): 15.16 s")
        DEVICE_FILE.write_text(json.dumps(base, indent=1) + "\n")
    return dev.with_efficiency(eff)


def _err(pred: float, seed: float | None) -> float | None:
    return None if seed is None else (pred - seed) / seed


def predict_seed(device: GpuCompute | None = None) -> dict:
    """Every predicted cell against the seed: the GPipe column, the DP-4 column and the Megatron table,
    and (not in the seed) torch_pipe's GPipe on the same cluster."""
    dev = device or load_device(DEVICE_FILE, WORKLOAD, "fp32")
    out = {"efficiency": dev.efficiency["fp32"], "gpipe": [], "dp4": [], "megatron": [], "torch_pipe_gpipe": []}
    for net, seed in GPIPE.items():
        p = predict(gpipe_spec(net), dev)
        out["gpipe"].append(dict(network=net, seed=seed, predicted=p.step_time, error=_err(p.step_time, seed),
                                 parts=p.parts(), calibration=net == "default"))
        q = predict(gpipe_spec(net, system="torch_pipe"), dev)
        out["torch_pipe_gpipe"].append(dict(network=net, predicted=q.step_time, parts=q.parts()))
    for net, seed in DP4_CENTRAL_PS.items():
        p = predict(gpipe_spec(net, dp=4), dev)
        out["dp4"].append(dict(network=net, seed=seed, predicted=p.step_time, error=_err(p.step_time, seed),
                               parts=p.parts()))
    for micro, row in MEGATRON.items():
        for layout, seed in row.items():
            p = predict(megatron_spec(layout, micro), dev)
            out["megatron"].append(dict(micro=micro, layout=layout, seed=seed, predicted=p.step_time,
                                        error=_err(p.step_time, seed), parts=p.parts()))
    return out


def fp16_check() -> dict:
    """The GPipe column had the precision been fp16 (peak 125 TFLOP/s, 2-byte messages), calibrated the
    same way: the efficiency it implies and the column it predicts."""
    dev = calibrate_seed("mixed", write=False)
    rows = []
    for net, seed in GPIPE.items():
        p = predict(gpipe_spec(net, precision="mixed").replace(message_bytes=2), dev)
        rows.append(dict(network=net, seed=seed, predicted=p.step_time, error=_err(p.step_time, seed)))
    return dict(efficiency=dev.efficiency["mixed"], rows=rows)


def markdown(res: dict, fp16: dict | None = None) -> str:
    def pct(e):
        return "-" if e is None else f"{e * 100:+.1f} %"

    lines = [f"V100 fp32 efficiency fitted on the default GPipe row: {res['efficiency']:.3f} of 15.7 TFLOP/s.", "",
             "### GPipe, P-12 (seed column) and torch_pipe's GPipe on the same cluster", "",
             "| network | seed | predicted | error | torch_pipe GPipe (predicted) |", "| --- | --- | --- | --- | --- |"]
    for r, t in zip(res["gpipe"], res["torch_pipe_gpipe"]):
        note = " (calibration)" if r["calibration"] else ""
        lines.append(f"| {r['network']} | {r['seed']:.2f} s | {r['predicted']:.2f} s{note} | {pct(r['error'])} | "
                     f"{t['predicted']:.2f} s |")
    errs = [abs(r["error"]) for r in res["gpipe"] if not r["calibration"]]
    lines += ["", f"Rows other than the default: median absolute error {statistics.median(errs) * 100:.1f} %, "
              f"largest {max(errs) * 100:.1f} %.", "",
              "### GPipe + central PS, DP-4", "", "| network | seed | predicted | error | predicted DP sync |",
              "| --- | --- | --- | --- | --- |"]
    for r in res["dp4"]:
        lines.append(f"| {r['network']} | {r['seed']:.2f} s | {r['predicted']:.2f} s | {pct(r['error'])} | "
                     f"{r['parts']['dp_sync']:.2f} s |")
    lines += ["", "### Megatron, 8 V100 (one p3.16xlarge), batch 64, fp32 + recompute", "",
              "| micro-batch | " + " | ".join(MEGATRON_LAYOUTS) + " |", "| --- |" + " --- |" * len(MEGATRON_LAYOUTS)]
    for micro in MEGATRON:
        cells = []
        for layout in MEGATRON_LAYOUTS:
            r = next(x for x in res["megatron"] if x["micro"] == micro and x["layout"] == layout)
            seed = "Fail" if r["seed"] is None else f"{r['seed']:.2f}"
            cells.append(f"{r['predicted']:.2f} (seed {seed}, {pct(r['error'])})")
        lines.append(f"| {micro} | " + " | ".join(cells) + " |")
    merrs = [abs(r["error"]) for r in res["megatron"] if r["error"] is not None]
    lines += ["", f"Megatron cells with a seed time: median absolute error {statistics.median(merrs) * 100:.1f} %, "
              f"largest {max(merrs) * 100:.1f} %."]
    if fp16:
        lines += ["", f"### Had the GPipe table been fp16: efficiency {fp16['efficiency']:.3f} of 125 TFLOP/s", "",
                  "| network | seed | predicted | error |", "| --- | --- | --- | --- |"]
        for r in fp16["rows"]:
            lines.append(f"| {r['network']} | {r['seed']:.2f} s | {r['predicted']:.2f} s | {pct(r['error'])} |")
    return "\n".join(lines) + "\n"
