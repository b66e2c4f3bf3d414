"""The CPU's peak for MFU, measured the way the ranks compute: one thread, the model's own operations
at a micro-batch's shape, the best of several trials.

MFU counts model FLOPs (``workload.flops.flops_per_token``: 6N + 12·L·h·s, causal attention counted
whole, as PaLM and Megatron count it). A square 1024 matmul timed at start (the old CPU peak, 0.10
TFLOP/s here) is no bound on that: the model's own GEMMs ran faster than it, and causal attention
executes about half the FLOPs it is credited with (the masked half is skipped), so the reference's
MFU came out at 106 %. The peak here is the model's own best rate: every linear layer's three GEMMs
(forward, input gradient, weight gradient) and causal attention's forward and backward at the
micro-batch's shape, each timed alone and the best of several trials kept, and the model FLOPs of a
step (L layers and the LM head) over the sum of those best times. A training step runs exactly these
operations and more (norms, activations, the loss, the optimizer, messages), so its model-FLOP rate
cannot exceed this peak unless the host got faster since it was measured, which a quick check catches.

Measured once per host and kept (``cpu_peak_tflops``): ``cpu-peak.json`` in the suite's cache
(``workload.cache``), under a key of the CPU, the host, the torch version, the dtype and the shape.
Each later run times one trial of the largest GEMM (tens of milliseconds); if that beats the rate
kept for it, the host is faster than when it was measured (busy then), and the peak is measured
again and the higher one kept. Concurrent ranks take a file lock: one measures, the others wait.
"""
from __future__ import annotations

import fcntl
import json
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workload.cache import cache_dir
from workload.configs import ModelConfig, qkv_rows
from workload.flops import cpu_name

MAX_TOKENS = 8192  # a micro-batch's tokens beyond this cost time and no longer change the rate
TRIALS = 5
BUDGET_S = 6.0  # at most this long measuring (at least two trials of every operation)


@dataclass(frozen=True)
class Op:
    """One operation of the model's step, timed alone: its model FLOPs and how many of it a step runs."""

    name: str
    run: Callable[[], object]
    flops: float
    count: int  # per step: L for a layer's operations, 1 for the LM head's


def model_ops(m: ModelConfig, micro_batch: int, dtype: torch.dtype = torch.float32) -> list[Op]:
    """A step's operations at one micro-batch of ``m``: each layer's QKV, projection and MLP linears
    (forward, input and weight gradient; llama's k and v by its key/value heads, its gate and up fused),
    its causal attention forward and backward (credited 12·h·s per token, as the FLOP count does), and
    the LM head's three GEMMs."""
    s = m.seq_len
    b = max(1, min(micro_batch, MAX_TOKENS // s)) if s <= MAX_TOKENS else 1
    T, h, L, f = b * min(s, MAX_TOKENS), m.n_embd, m.n_layer, m.ffn_dim
    ops: list[Op] = []
    fc = f * (2 if m.llama else 1)  # llama's gate and up
    for name, k, n, count in (("qkv", h, sum(qkv_rows(m)), L), ("proj", h, h, L), ("fc", h, fc, L),
                              ("fc_proj", f, h, L), ("head", h, m.vocab_size, 1)):
        x, w, dy = (torch.randn(T, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(T, n, dtype=dtype))
        flops = 2.0 * T * k * n
        ops += [Op(f"{name} forward", lambda x=x, w=w: F.linear(x, w), flops, count),
                Op(f"{name} input grad", lambda dy=dy, w=w: dy.mm(w), flops, count),
                Op(f"{name} weight grad", lambda dy=dy, x=x: dy.t().mm(x), flops, count)]
    d, t = h // m.n_head, min(s, MAX_TOKENS)
    q = torch.randn(b, m.n_head, t, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, m.n_kv_head, t, d, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, m.n_head, t, d, dtype=dtype)
    gqa = m.n_kv_head != m.n_head

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).backward(grad)
        q.grad = k.grad = v.grad = None

    ops.append(Op("attention forward+backward", attention, 12.0 * h * min(s, MAX_TOKENS) * T, L))
    return ops


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_times(ops: list[Op], trials: int = TRIALS, budget_s: float = BUDGET_S) -> list[float]:
    """Each operation's best time (s) on one thread over up to ``trials`` rounds (at least two; no more
    once ``budget_s`` is spent), after one untimed call each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for op in ops:
            op.run()
        best, began = [float("inf")] * len(ops), time.perf_counter()
        for t in range(trials):
            if t >= 2 and time.perf_counter() - began > budget_s:
                break
            best = [min(b, _seconds(op.run)) for b, op in zip(best, ops)]
        return best
    finally:
        torch.set_num_threads(threads)


def model_peak(ops: list[Op], times: list[float]) -> float:
    """The step's model FLOPs over the sum of its operations' best times (TFLOP/s)."""
    return sum(op.flops * op.count for op in ops) / sum(t * op.count for t, op in zip(times, ops)) / 1e12


def host_ops() -> list[Op]:
    """The host's speed, as every check of it times it: cpu-small's operations at one sequence of 256
    tokens (a whole step's in tens of milliseconds on one thread): the speed probe of a calibration
    (``predict.this_machine.speed_probe``, the best of trials) and the cores a benchmark finds at once
    (``bench.machine``, sustained over seconds)."""
    from workload.configs import get_model_config

    return model_ops(get_model_config("cpu-small").with_overrides(seq_len=256), 1)


def sustained_tflops(ops: list[Op], seconds: float) -> float:
    """One thread's model-FLOP rate (TFLOP/s) running ``ops`` round after round for ``seconds`` (at least
    one round, after an untimed one): the rate it gets while the host is shared, not its best."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for op in ops:
            op.run()
        flops, began = 0.0, time.perf_counter()
        while True:
            for op in ops:
                for _ in range(op.count):
                    op.run()
            flops += sum(op.flops * op.count for op in ops)
            if (elapsed := time.perf_counter() - began) >= seconds:
                return flops / elapsed / 1e12
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cpu_peak_tflops(m: ModelConfig, micro_batch: int, dtype: torch.dtype = torch.float32,
                    cache: Path | None = None) -> tuple[float, str]:
    """(peak TFLOP/s, where it came from): one CPU thread's best model-FLOP rate on ``m`` at
    ``micro_batch`` sequences, kept per host (see the module's docstring), measured again when a quick
    trial of the largest GEMM beats the rate kept for it."""
    ops = model_ops(m, micro_batch, dtype)
    largest = max(range(len(ops) - 1), key=lambda i: ops[i].flops)  # a GEMM (the last op is attention)
    shape = [m.n_layer, m.n_embd, m.n_head, m.seq_len, m.vocab_size, micro_batch]
    if m.llama or m.ffn_dim != 4 * m.n_embd:  # what else sets the ops' shapes (gpt's key as it always was)
        shape += [m.family, m.n_kv_head, m.ffn_dim]
    key = json.dumps({"cpu": cpu_name(), "host": platform.node(), "torch": torch.__version__, "dtype": str(dtype),
                      "shape": shape}, sort_keys=True)
    path = (cache or cache_dir()) / "cpu-peak.json"
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    with _locked(path):
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = {}
        entry = kept.get(key)
        if entry:
            quick = best_times([ops[largest]], trials=1)[0]
            if quick >= entry["largest_gemm_s"]:
                return entry["tflops"], f"model-ops:{name}, 1 thread (kept from {entry['when']})"
        times = best_times(ops)
        if entry and len(entry["times"]) == len(times):
            times = [min(t, was) for t, was in zip(times, entry["times"])]
        kept[key] = {"tflops": model_peak(ops, times), "times": times, "largest_gemm_s": times[largest],
                     "ops": [op.name for op in ops], "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_suffix(f".{id(kept)}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    return kept[key]["tflops"], f"model-ops:{name}, 1 thread (measured {kept[key]['when']})"
