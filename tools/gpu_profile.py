"""Profile a GPU for the compute model (scripts/gpu_profile.sh): measure, fit its device file, check it.

    python -m tools.gpu_profile [--out-dir DIR] [--device-file NAME] [--budget-s 480] [--only PART]...

On a machine with a CUDA GPU, in at most ``--budget-s`` seconds (default 8 minutes), each part written
as soon as it is done (a lease that ends part-way keeps what was measured):

- gemm: the GEMMs of a layer's forward, input and weight gradients at the widths of GPT-3 XL, 2.7B, 6.7B
  and 13B (hidden 2048, 2560, 4096, 5120), slice lengths 16 to 2048, in fp32, bf16 and fp16;
- attention: the fused attention of a slice after 0, 512 and 1536 tokens of context at those widths;
- layer: one transformer layer's forward and backward (``workload.model.Block``) at those shapes;
- systems: every system at one rank at GPT-3 XL width (sequence 2048, bf16, layers enough to fill the
  GPU), its step time, MFU and peak memory, and ours at K = 1, 4 and 16 against the reference (what
  ours' engine costs over plain training where kernel launches show).

Then the GEMM grid is fitted (per precision: e_max, the share of the dense peak large GEMMs reach, and
the depth at which the main loop reaches half of it: ``workload.compute``'s curve) and written into
the GPU's device file (``workload/devices``) with what was measured; the compute model's predictions
of the layer grid and of the one-rank systems are set beside the measurements; and a page
(``--out-dir``, default results/measured-here/gpu-profile-<gpu>.md) gives every table and the commands.

Without a GPU it says so in one line and exits 0. Exit status: 0 done (or nothing to do), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from contract.cli import POSITIVE
from tools.gpu_check import slug
from workload.configs import PRECISIONS

REPO = Path(__file__).resolve().parent.parent
WIDTHS = {"gpt3-xl": (2048, 16), "gpt3-2.7b": (2560, 32), "gpt3-6.7b": (4096, 32), "gpt3-13b": (5120, 40)}
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
CONTEXTS = (0, 512, 1536)
PARTS = ("gemm", "attention", "layer", "systems")
SYSTEM_RUNS = {  # label -> the run command's system arguments at one rank
    "reference": ["--system", "reference"],
    "torch_pipe": ["--system", "torch_pipe", "--schedule", "gpipe"],
    "fairscale_fsdp": ["--system", "fairscale_fsdp"],
    "megatron": ["--system", "megatron"],
    "ours K=1": ["--system", "ours", "--n-slices", "1"],
    "ours K=4": ["--system", "ours", "--n-slices", "4"],
    "ours K=16": ["--system", "ours", "--n-slices", "16"],
}
SYSTEM_LAYERS = 8  # GPT-3 XL width, 8 layers: about 0.4 B parameters, enough to fill an H100 at batch 8
SYSTEM_BATCH = 8


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/gpu_profile.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=None, help="where the page and the raw measurements go "
                    "(default results/measured-here)")
    ap.add_argument("--device-file", default=None, help="the device file to fit (default: the one for this GPU)")
    ap.add_argument("--budget-s", type=POSITIVE, default=480.0, help="seconds for everything (default 480)")
    ap.add_argument("--only", action="append", choices=PARTS, default=[], help="only this part (repeatable)")
    ap.add_argument("--no-write-device", action="store_true", help="fit, but leave the device file as it is")
    ap.add_argument("--refit", metavar="RAW.json", default=None,
                    help="no measuring: fit and write the page again from a profile's raw measurements (no GPU needed)")
    return ap


# ---- measuring (on a GPU) ---------------------------------------------------------------------------
def _dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def cuda_time(fn, reps: int = 5, warmup: int = 2) -> float:
    """The median seconds of ``fn`` on the GPU (CUDA events), after a warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemm_shapes(h: int, l: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of a layer's GEMMs on l tokens: the four linears forward, input and weight gradients."""
    out = []
    for name, n_in, n_out in (("qkv", h, 3 * h), ("proj", h, h), ("fc", h, 4 * h), ("fc proj", 4 * h, h)):
        out += [(f"{name} fwd", l, n_out, n_in), (f"{name} dgrad", l, n_in, n_out), (f"{name} wgrad", n_in, n_out, l)]
    return out


def grid(deadline: float):
    """(precision, its torch dtype, model, hidden, heads) of every width in every precision, while there is
    time before ``deadline``."""
    for precision in PRECISIONS:
        for model, (h, heads) in WIDTHS.items():
            if time.monotonic() > deadline:
                return
            yield precision, _dtype(precision), model, h, heads


def measure_gemms(deadline: float) -> list[dict]:
    import torch

    rows = []
    for precision, dt, model, h, _ in grid(deadline):
        for l in LENGTHS:
            for name, m, n, k in gemm_shapes(h, l):
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(k, n, device="cuda", dtype=dt)
                t = cuda_time(lambda: a @ b)
                rows.append(dict(precision=precision, model=model, l=l, op=name, m=m, n=n, k=k, seconds=t))
    return rows


def measure_attention(deadline: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    for precision, dt, model, h, heads in grid(deadline):
        for c, l in ((c, l) for c in CONTEXTS for l in LENGTHS if c + l <= 2048):
            q = torch.randn(1, heads, l, h // heads, device="cuda", dtype=dt)
            kv = torch.randn(1, heads, c + l, h // heads, device="cuda", dtype=dt)
            mask = None if c == 0 else torch.ones(l, c + l, device="cuda", dtype=torch.bool).tril(c)
            t = cuda_time(lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, is_causal=c == 0))
            rows.append(dict(precision=precision, model=model, l=l, c=c, seconds=t))
    return rows


def measure_layers(deadline: float) -> list[dict]:
    import torch

    from workload.configs import ModelConfig
    from workload.model import Block, block_forward

    rows = []
    for precision, dt, model, h, heads in grid(deadline):
        block = Block(ModelConfig(model, 1, h, heads, 2048, 0)).to("cuda")
        for l in LENGTHS:
            x = torch.randn(1, l, h, device="cuda", requires_grad=True)

            def fwd():
                with torch.autocast("cuda", dtype=dt, enabled=precision != "fp32"):
                    return block_forward(block, x)

            def step():
                fwd().float().sum().backward()

            rows.append(dict(precision=precision, model=model, l=l, forward=cuda_time(fwd), step=cuda_time(step)))
        torch.cuda.empty_cache()
    return rows


def measure_systems(deadline: float, out: Path) -> list[dict]:
    from runners.invoke import run_command

    rows = []
    common = ["--model", "gpt3-xl", "--num-layers", str(SYSTEM_LAYERS), "--seq-length", "2048", "--batch-size",
              str(SYSTEM_BATCH), "--micro-batch-size", "1", "--precision", "bf16", "--steps", "3", "--warmup", "1",
              "--device", "cuda", "--timeout", "150"]
    for label, args in SYSTEM_RUNS.items():
        left = deadline - time.monotonic()
        if left < 60:
            rows.append(dict(label=label, status="not run (budget)"))
            continue
        inv = run_command([*args, *common], out=out, timeout=min(left, 180))
        rec = inv.record or {}
        rows.append(dict(label=label, status=rec.get("status", f"no record (exit {inv.returncode})"),
                         step=rec.get("median_step_time"), mfu=rec.get("mfu"),
                         memory_gb=max((m or 0) for m in (rec.get("peak_memory_bytes") or [0])) / 2**30,
                         error=(rec.get("error") or "")[:200]))
    return rows


# ---- fitting and checking (no GPU needed) ----------------------------------------------------------
# A GEMM timed alone includes the host's time to issue it (the GPU waits for the launch): the grid's
# fastest time is that floor. GEMMs shorter than HOST_BOUND times it are timed mostly as the host and
# say nothing of the kernel's speed; the curve is fitted on the others.
HOST_BOUND = 3.0
# The one-rank cell that sets the device's host time per modelled kernel (``host_op_us``): the most
# host-bound run (ours' thinnest slices). Named on the page and not scored.
HOST_CELL = "ours K=16"
# The attention each system's one-rank run uses on a GPU: megatron-core's local layers (no
# TransformerEngine) materialise the scores and softmax; the others call torch's fused SDPA.
SYSTEM_ATTENTION = {"megatron": "materialized"}


def fit_gemm_curve(device, rows: list[dict], precision: str) -> tuple[float, float, float]:
    """(e_max, half, median |error|) of ``precision``: the pair that makes the compute model's GEMM times
    closest to the measured ones (mean squared log ratio; half over a grid, e_max over a coarse then a fine
    geometric grid for each), on the GEMMs not bound by the host's issue time (``HOST_BOUND``)."""
    from workload.configs import ModelConfig
    from workload.compute import GpuCompute

    pts = [r for r in rows if r["precision"] == precision]
    if not pts:
        raise ValueError(f"no GEMM measured in {precision}")
    floor = min(r["seconds"] for r in pts)
    pts = [r for r in pts if r["seconds"] >= HOST_BOUND * floor] or pts
    model = ModelConfig("gemm", 1, 64, 1, 64, 0)

    def loss(eff: float, half: float) -> float:
        g = GpuCompute(device.with_gemm(precision, eff, half), model, precision)
        return sum(math.log(g.gemm(r["m"], r["n"], r["k"]) / r["seconds"]) ** 2 for r in pts)

    best = None
    for half in (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024):
        grid = [0.05 * (1.0 / 0.05) ** (i / 24) for i in range(25)]
        for _ in range(3):
            e = min(grid, key=lambda x: loss(x, half))
            step = grid[1] / grid[0] if len(grid) > 1 else 1.01
            grid = [min(1.0, e * step ** (j / 8)) for j in range(-8, 9)]
        score = loss(e, half)
        if best is None or score < best[0]:
            best = (score, e, float(half))
    _, e, half = best
    g = GpuCompute(device.with_gemm(precision, e, half), model, precision)
    err = statistics.median(abs(g.gemm(r["m"], r["n"], r["k"]) / r["seconds"] - 1) for r in pts)
    return e, half, err


def predicted_layers(device, rows: list[dict]) -> list[dict]:
    """Each measured layer's GPU time as the compute model gives it (no host: a layer timed alone waits
    for its host at small slices, the ``host-bound`` rows)."""
    from dataclasses import replace

    from workload.compute import GpuCompute
    from workload.configs import ModelConfig

    out = []
    gpu_only = replace(device, host_op_us=0.0)
    for r in rows:
        h, heads = WIDTHS[r["model"]]
        g = GpuCompute(gpu_only, ModelConfig(r["model"], 1, h, heads, 2048, 0), r["precision"], "flash")
        pred = g.layer_forward(1, r["l"], 0) + g.layer_backward(1, r["l"], 0)
        out.append(dict(r, predicted_step=pred, error=pred / r["step"] - 1, host_bound=pred < r["step"] / HOST_BOUND))
    return out


def predict_system(gpu: str, label: str) -> float | None:
    """The simulator's one-rank step of the system run ``label`` (``SYSTEM_RUNS``) on the device file ``gpu``."""
    from predict.scenario import parse, predict_scenario

    system = label.split()[0]
    run = dict(system=system, model="gpt3-xl", num_layers=SYSTEM_LAYERS, seq_length=2048, batch_size=SYSTEM_BATCH,
               micro_batch_size=1, precision="bf16")  # the run's own flags (``measure_systems``)
    if system == "ours":
        run["n_slices"] = int(label.split("K=")[1])
    sc = dict(run=run, cluster=dict(gpu=gpu, nodes=1, gpus_per_node=1),
              predict=dict(attention=SYSTEM_ATTENTION.get(system, "flash")))
    return predict_scenario(parse(sc, label))["step_time_s"]


def predicted_systems(device, rows: list[dict], fitted_on: str | None = None) -> list[dict]:
    """The one-rank step of each measured system as the simulator predicts it on ``device``; the row
    ``fitted_on`` is marked as the fit's cell (not scored)."""
    out = []
    for r in rows:
        if r.get("step") is None or r["label"] == "reference":
            out.append(r)
            continue
        pred = predict_system(device.path or device.name, r["label"])
        out.append(dict(r, predicted=pred, error=None if pred is None else pred / r["step"] - 1,
                        fit=r["label"] == fitted_on))
    return out


def fit_host_op_us(device, rows: list[dict], cell: str = HOST_CELL) -> float | None:
    """The host time per modelled kernel (``host_op_us``, microseconds) at which the simulator's step of
    ``cell`` is the measured one (bisection: the step grows with it), or None where the cell was not
    measured."""
    import tempfile

    measured = next((r.get("step") for r in rows if r["label"] == cell), None)
    if not measured:
        return None
    d = device.to_json()
    lo, hi = 0.1, 1000.0
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "device.json")
        for _ in range(24):
            mid = math.sqrt(lo * hi)
            Path(path).write_text(json.dumps(dict(d, host_op_us=mid)))
            if predict_system(path, cell) > measured:
                hi = mid
            else:
                lo = mid
    return round(math.sqrt(lo * hi), 2)


def _pct(x) -> str:
    return f"{x * 100:+.1f} %" if isinstance(x, (int, float)) else "-"


def page(name: str, fitted: dict, layers: list[dict], systems: list[dict], commands: list[str],
         host: tuple[float, str] | None = None, about: list[str] | None = None) -> str:
    lines = [f"# GPU profile: {name}", "", *(about or []), "Commands:", "", "```", *commands, "```", "",
             "## GEMM curve fitted (workload.compute)", "",
             f"GEMMs shorter than {HOST_BOUND:g}x the grid's fastest (the host's time to issue one) left out "
             "of the fit.",
             "", "| precision | e_max | half (depth) | median error |", "| --- | --- | --- | --- |"]
    for p, (e, h, err) in fitted.items():
        lines.append(f"| {p} | {e:.3f} | {h:g} | {err * 100:.1f} % |")
    if host:
        lines += ["", f"Host time per modelled kernel (`host_op_us`): {host[0]:g} us, fitted on `{host[1]}` "
                  "(not scored)."]
    if layers:
        lines += ["", "## One layer, forward and backward, timed alone (GPU time as modelled)", "",
                  "| precision | width | tokens | measured ms | modelled GPU ms | error | bound |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in layers:
            lines.append(f"| {r['precision']} | {r['model']} | {r['l']} | {r['step'] * 1e3:.3f} | "
                         f"{r['predicted_step'] * 1e3:.3f} | {_pct(r['error'])} | "
                         f"{'host' if r.get('host_bound') else 'GPU'} |")
    if systems:
        lines += _systems_table(systems)
    return "\n".join(lines) + "\n"


def _systems_table(systems: list[dict]) -> list[str]:
    ref = next((r.get("step") for r in systems if r["label"] == "reference"), None)
    lines = ["", f"## Every system at one rank (GPT-3 XL width, {SYSTEM_LAYERS} layers, sequence 2048, batch "
             f"{SYSTEM_BATCH}, micro-batch 1, bf16)", "",
             "| system | status | step s | over reference | MFU | peak GiB | predicted s | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in systems:
        step = r.get("step")
        if not step:
            lines.append(f"| {r['label']} | {r['status']} | - | - | - | - | - | - |")
            continue
        over = f"{step / ref:.2f}x" if ref else "-"
        pred = f"{r['predicted']:.3f}" if r.get("predicted") else "-"
        err = _pct(r.get("error")) + (" (fit cell)" if r.get("fit") else "")
        mfu = f"{r['mfu'] * 100:.1f} %" if r.get("mfu") else "-"
        lines.append(f"| {r['label']} | {r['status']} | {step:.3f} | {over} | {mfu} | {r.get('memory_gb', 0):.1f} | "
                     f"{pred} | {err} |")
    scored = [r for r in systems if isinstance(r.get("error"), float) and not r.get("fit")]
    if scored:
        inside = [r["label"] for r in scored if abs(r["error"]) <= 0.10]
        lines += ["", f"Within 10 %: {len(inside)} of {len(scored)} scored ({', '.join(inside) or 'none'})."]
    return lines


def _driver() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def measure(args, name: str, raw_path: Path) -> dict:
    """Every part asked for, in the budget; the raw measurements written after each part."""
    import torch

    deadline = time.monotonic() + args.budget_s
    raw = dict(gpu=name, driver=_driver(), torch=torch.__version__, cuda=torch.version.cuda,
               created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    parts = args.only or list(PARTS)
    shares = {"gemm": 0.15, "attention": 0.05, "layer": 0.15, "systems": 0.65}  # of the budget
    for part in parts:
        t0 = time.monotonic()
        part_deadline = min(deadline, t0 + shares[part] * args.budget_s * len(PARTS) / len(parts))
        try:
            if part == "gemm":
                raw["gemm"] = measure_gemms(part_deadline)
            elif part == "attention":
                raw["attention"] = measure_attention(part_deadline)
            elif part == "layer":
                raw["layer"] = measure_layers(part_deadline)
            else:
                raw["systems"] = measure_systems(deadline, raw_path.with_suffix(".jsonl"))
        except Exception as exc:  # noqa: BLE001 - a part that fails leaves the others' measurements
            raw.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"[:500]
        raw.setdefault("seconds", {})[part] = round(time.monotonic() - t0, 1)
        raw_path.write_text(json.dumps(raw, indent=1))
        print(f"gpu_profile: {part} done in {raw['seconds'][part]:.0f} s", flush=True)
    return raw


def fit_and_write(raw: dict, raw_path: Path, device, write_device: bool, commands: list[str]) -> Path:
    """Fit the GEMM curves and the host time from ``raw``, write them into ``device``'s file (a
    temporary copy under ``write_device=False``), set the compute model's predictions beside the
    measurements and write the page; returns the page's path."""
    import tempfile

    from workload.compute import DEVICES, read_device

    fitted = {}
    for precision in PRECISIONS:
        if raw.get("gemm"):
            try:
                fitted[precision] = fit_gemm_curve(device, raw["gemm"], precision)
                device = device.with_gemm(precision, *fitted[precision][:2])
            except ValueError:
                pass
    host = fit_host_op_us(device, raw.get("systems") or [])
    path = Path(device.path) if device.path else DEVICES / f"{slug(raw['gpu'])}.json"
    d = json.loads(path.read_text()) if path.exists() else device.to_json()
    for p, (e, h, _) in fitted.items():
        d["gemm"][p] = {"efficiency": round(e, 4), "half": h}
    if "bf16" in fitted and "fp8" in d["gemm"]:  # fp8 GEMMs are not measured: bf16's curve, as the prior did
        d["gemm"]["fp8"] = dict(d["gemm"]["bf16"])
    if host is not None:
        d["host_op_us"] = host
    rel = str(raw_path.relative_to(REPO)) if raw_path.is_relative_to(REPO) else str(raw_path)
    d["measured"] = dict(gpu=raw["gpu"], driver=raw.get("driver"), torch=raw["torch"], cuda=raw["cuda"],
                         created=raw["created"], gemm_fit={p: dict(efficiency=e, half=h, median_error=err)
                                                           for p, (e, h, err) in fitted.items()},
                         host_op_us_fitted_on=HOST_CELL if host is not None else None,
                         command="bash scripts/gpu_profile.sh", raw=rel)
    d["sources"]["gemm"] = (f"measured on {raw['gpu']} by scripts/gpu_profile.sh ({raw['created']}; GEMMs shorter "
                            f"than {HOST_BOUND:g}x the grid's fastest left out: the host's issue time)")
    if host is not None:
        d["sources"]["host_op_us"] = (f"measured on {raw['gpu']}'s host by scripts/gpu_profile.sh: the simulator's "
                                      f"one-rank step of `{HOST_CELL}` set to the measured one")
    with tempfile.TemporaryDirectory() as tmp:
        target = path if write_device else Path(tmp) / path.name
        target.write_text(json.dumps(d, indent=1) + "\n")
        if write_device:
            print(f"gpu_profile: device file {path} fitted")
        device = read_device(target)
        layers = predicted_layers(device, raw.get("layer") or [])
        systems = predicted_systems(device, raw.get("systems") or [], HOST_CELL)
    raw.update(layer=layers, systems=systems, fitted=fitted, host_op_us=host)
    raw_path.write_text(json.dumps(raw, indent=1))
    about = [f"Measured on {raw['gpu']} (driver {raw.get('driver') or '?'}, CUDA {raw['cuda']}, torch {raw['torch']}), "
             f"{raw['created']}; parts took {raw.get('seconds')} s.", "", *raw.get("notes", [])]
    page_path = raw_path.with_suffix(".md")
    page_path.write_text(page(raw["gpu"], fitted, layers, systems, commands,
                              (host, HOST_CELL) if host is not None else None, about))
    return page_path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from workload.compute import DeviceError, find_device

    if args.refit:
        raw_path = Path(args.refit)
        try:
            raw = json.loads(raw_path.read_text())
            device = find_device(args.device_file or raw["gpu"])
        except (OSError, ValueError, KeyError, DeviceError) as exc:
            print(f"scripts/gpu_profile.sh: error: --refit {raw_path}: {exc}", file=sys.stderr)
            return 2
        commands = [*raw.get("commands", []), f"bash scripts/gpu_profile.sh --refit {args.refit}"]
        print(f"gpu_profile: {fit_and_write(raw, raw_path, device, not args.no_write_device, commands)}")
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_profile: no torch here: nothing measured")
        return 0
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured")
        return 0
    started = time.monotonic()
    name = torch.cuda.get_device_name(0)
    device = find_device(args.device_file or name)
    out_dir = Path(args.out_dir or REPO / "results" / "measured-here")
    out_dir.mkdir(parents=True, exist_ok=True)
    raw_path = out_dir / f"gpu-profile-{slug(name)}.json"
    raw = measure(args, name, raw_path)
    raw["commands"] = ["bash scripts/gpu_profile.sh" + "".join(f" --only {p}" for p in args.only)]
    page_path = fit_and_write(raw, raw_path, device, not args.no_write_device, raw["commands"])
    print(f"gpu_profile: {page_path} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
