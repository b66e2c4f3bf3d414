"""Where a pipeline's step time goes, per rank: ``python -m bench breakdown``.

Each configuration (ours, and every Torch Pipe schedule that can run the batch: the run command's own
judgement decides) is launched once through torchrun with ``bench.profiled_rank`` in place of the
usual rank entry: the same worker, system and steps, with torch's profiler over the measured steps and
the waits for messages marked (the hooks live in the benchmark, not in any system's training code).
Every measured step of every rank is cut into parts (``account``): each profiled operation's own time
(its span less its children's) goes to the part of the innermost range around it that names one:

- **GEMM**: matrix products (``aten::mm``, ``addmm``, ``matmul``, ``linear``, ...), forward, input and
  weight gradients alike;
- **attention**: the attention kernels (``scaled_dot_product_attention`` and the flash kernels), and in
  ours' ``SliceAttention`` every operation but the copies (the merge of its two passes);
- **key/value**: ours' copies of keys and values into a sequence's cache and of their gradients out of
  it and into the qkv gradient (``SliceAttention``'s copies, accumulations and allocations; the
  baselines have none);
- **other compute**: every other operation (layer norms, GELU, residual adds, embeddings, the loss,
  casts, the gradient accumulation);
- **comm wait**: blocked on a point-to-point message (Torch Pipe: ``_wait_batch_p2p``; ours: its
  receive and send spans);
- **Python/engine**: time on the step's thread inside no operation: Python and dispatch (for ours the
  engine's work per unit and layer, which grows with the slice count: the per-slice engine cost; for
  Torch Pipe its schedule's and modules' Python);
- **optimizer**: ``Optimizer.step`` / ``zero_grad`` (ours: its optimizer span, with the loss scaler);
- **idle**: the step's time after its work until every rank has finished it (the closing barrier of
  ``contract.rank.run_steps``: waiting for the slowest rank).

The parts of a step sum to its time (``account``'s parts to the profiled window, idle the rest). The
table gives the median of each part over the measured steps (so the medians of the parts need not sum
exactly to the median step). Torch's profiler costs each operation about a microsecond or two, which
lands mostly in Python/engine and weighs more on a configuration that runs more operations (ours at
many slices): each row's step time is the profiled one.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate
from contract.cli import POSITIVE, POSITIVE_INT, count_or_word

REPO = Path(__file__).resolve().parent.parent
WAIT_RANGE = "pipebench::wait"
GEMM, ATTENTION, KV, OTHER, WAIT, PYTHON, OPTIMIZER, IDLE = (
    "GEMM", "attention", "key/value", "other compute", "comm wait", "Python/engine", "optimizer", "idle")
PARTS = (GEMM, ATTENTION, KV, OTHER, WAIT, PYTHON, OPTIMIZER, IDLE)

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul",
                      "aten::linear", "aten::_addmm_activation"})
ATTENTION_OPS = frozenset({
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_efficient_attention_backward"})
SLICE_ATTENTION = frozenset({"SliceAttention", "SliceAttentionBackward"})  # ours' Function, forward and backward
KV_OPS = frozenset({"aten::copy_", "aten::add_", "aten::empty", "aten::empty_strided", "aten::zero_", "aten::fill_",
                    "aten::cat", "aten::clone"})
WAITS = frozenset({WAIT_RANGE, "ours::recv", "ours::send"})
OPTIMIZER_RANGES = frozenset({"ours::sync"})


@dataclass
class Op:
    """One profiled range on the step's thread: its name, start and end (µs) and the ranges inside it."""

    name: str
    start: float
    end: float
    children: list["Op"] = field(default_factory=list)


def op_tree(event) -> Op:
    """A torch profiler FunctionEvent and the ranges inside it as ``Op``s."""
    return Op(event.name, event.time_range.start, event.time_range.end, [op_tree(c) for c in event.cpu_children])


def part_of(chain: list[str]) -> str:
    """The part of an operation's own time, from its name and its enclosing ranges' (``chain``: outermost
    first, the operation last): the innermost range that names a part decides (module docstring)."""
    for depth in range(len(chain) - 1, -1, -1):
        name = chain[depth]
        if name in GEMM_OPS:
            return GEMM
        if name in ATTENTION_OPS:
            return ATTENTION
        if name in SLICE_ATTENTION:
            if depth == len(chain) - 1:
                return PYTHON  # the Function's own Python
            return KV if chain[depth + 1] in KV_OPS else ATTENTION
        if name.startswith("Optimizer.") or name in OPTIMIZER_RANGES:
            return OPTIMIZER
        if name in WAITS:
            return WAIT
    return OTHER if chain[-1].startswith("aten::") else PYTHON


def account(step: Op) -> dict[str, float]:
    """A step's window (its range ``step``) cut into parts (s): every range's own time (its span less
    its children's spans, children running one at a time within it) to ``part_of`` its chain. The parts
    sum to the window."""
    sums = dict.fromkeys(PARTS, 0.0)
    stack = [(step, [step.name])]
    while stack:
        op, chain = stack.pop()
        inside = sum(c.end - c.start for c in op.children)
        sums[part_of(chain)] += max(0.0, op.end - op.start - inside) * 1e-6
        stack.extend((c, chain + [c.name]) for c in op.children)
    return sums


def step_parts(rank: dict) -> list[dict[str, float]]:
    """Every measured step of a rank's breakdown file: its parts and its idle time (the step time less
    the profiled window), plus 'step' (its time as ``run_steps`` measured it)."""
    steps = []
    for parts, t in zip(rank["parts"], rank["step_times"]):
        window = sum(parts.values())
        steps.append({**parts, IDLE: max(0.0, t - window), "step": t})
    return steps


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]}


# ---- running the configurations ----------------------------------------------------------------------
def profiled_run(args: list[str], timeout: float) -> tuple[list[dict], dict] | None:
    """Launch the run command's request ``args`` with ``bench.profiled_rank`` as every rank's entry:
    each rank's breakdown file and what rank 0 measured (``runners.worker``'s result; None if the run
    failed)."""
    from runners.launcher import torchrun_argv
    from runners.request import Placement, judge, parse_request, resolve_devices

    cfg, spec = parse_request(args)
    judge(cfg, spec)
    cfg = resolve_devices(cfg, spec, Placement())
    world = spec.processes(cfg)
    with tempfile.TemporaryDirectory(prefix="pipebench-breakdown-") as d:
        run_dir = Path(d)
        (run_dir / "config.json").write_text(cfg.to_json())
        argv = torchrun_argv(world, 1, 0, None, run_dir)
        argv = argv[: argv.index("runners.worker")] + ["bench.profiled_rank", str(run_dir)]
        try:
            proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            print(f"  timed out: {' '.join(args)}", file=sys.stderr)
            return None
        files = [run_dir / f"breakdown-rank{r}.json" for r in range(world)]
        if proc.returncode != 0 or not all(f.exists() for f in files):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"  run failed ({' '.join(args)}): {' | '.join(tail)[:600]}", file=sys.stderr)
            return None
        result = json.loads((run_dir / "result.json").read_text())["ranks"][0]
        return [json.loads(f.read_text()) for f in files], result


def configurations(batch: int, opts: argparse.Namespace) -> dict[str, list[str]]:
    """The run command's request of every configuration at ``batch``: ours at each --ours-slices, then
    every Torch Pipe schedule the run command judges able to run it (the others said and skipped)."""
    from bench import cannot_run

    common = ["--model", opts.model, "--pp", str(opts.pp), "--batch-size", str(batch), "--micro-batch-size", "1",
              "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--device", "cpu"]
    configs = {f"ours K={k}": ["--system", "ours", "--n-slices", str(k), *common] for k in opts.ours_slices}
    for schedule in opts.schedules:
        args = ["--system", "torch_pipe", "--schedule", schedule, *common]
        why = cannot_run(args)
        if why:
            print(f"batch {batch}: torch_pipe {schedule} skipped: {why}", file=sys.stderr, flush=True)
            continue
        configs[f"torch_pipe {schedule}"] = args
    return configs


def _cell(t: float, step: float) -> str:
    return f"{t * 1e3:.0f} ({100 * t / step:.0f} %)" if step else "-"


def table(rows: list[tuple[int, str, int, dict[str, float]]]) -> str:
    """(batch, configuration, rank, median parts) -> the table: each part in ms and its share of the step."""
    body = [[batch, name, rank, f"{m['step'] * 1e3:.0f}", *(_cell(m[p], m["step"]) for p in PARTS)]
            for batch, name, rank, m in rows]
    return tabulate(body, headers=["batch", "configuration", "rank", "step ms", *PARTS], tablefmt="github")


def run(opts: argparse.Namespace) -> int:
    command = "python -m bench " + shlex.join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    rows = []
    for batch in opts.batch:
        for name, args in configurations(batch, opts).items():
            print(f"batch {batch}: {name} ...", file=sys.stderr, flush=True)
            ran = profiled_run(args, opts.timeout)
            if ran is None:
                continue
            ranks, result = ran
            slices = (result.get("extra") or {}).get("slices")
            if name.startswith("ours") and slices:
                name = f"ours K={len(slices)}" + (" (auto)" if name.endswith("auto") else "")
            for r in ranks:
                rows.append((batch, name, r["rank"], medians(step_parts(r))))
    text = "\n".join([
        f"# {command}",
        f"# {opts.model}, P={opts.pp}, micro-batch 1, {opts.steps} measured steps after {opts.warmup} warm-up "
        f"(profiled: torch.profiler); each part: the median over the steps in ms (its share of the median step); "
        f"parts as bench/breakdown.py defines them",
        f"# the host's load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{os.cpu_count()} cores: one launch per configuration, so a loaded host's share weighs on each row",
        "", table(rows), ""])
    print(text)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(text)
    return 0


def fill_parser(p: argparse.ArgumentParser) -> None:
    from baselines.torch_pipe import SCHEDULES
    from ours import slice_count

    p.add_argument("--batch", type=POSITIVE_INT, nargs="+", default=[1, 2, 4], help="batch sizes per pipeline")
    p.add_argument("--model", default="cpu-small")
    p.add_argument("--pp", type=POSITIVE_INT, default=2)
    p.add_argument("--ours-slices", type=count_or_word(slice_count, 1), nargs="+", default=["auto"], metavar="K|auto",
                   help="ours' token slice counts (default: auto, the planner's slicing)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   help="the Torch Pipe schedules (each where it can run the batch)")
    p.add_argument("--steps", type=POSITIVE_INT, default=4, help="measured (profiled) steps per run")
    p.add_argument("--warmup", type=POSITIVE_INT, default=2,
                   help="warm-up steps (at least 1: the profiler starts after the last)")
    p.add_argument("--timeout", type=POSITIVE, default=900.0)
    p.add_argument("--out", help="also write the table to this file")
