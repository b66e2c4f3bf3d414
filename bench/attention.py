"""One layer's attention over a token slice and its cached context, timed in one process on one thread
(as a rank runs it): ``python -m bench attention``.

For each slice length l and context c (the slice covers positions [c, c + l) of a sequence of the
model's length; micro-batch 1, the model's heads and head size), forward and backward of:

- ``ours``: ``ours.kernels.SliceAttention`` as the engine runs it (the keys and values of [0, c) in the
  sequence's state, the slice's written there; its backward accumulating the context's gradient);
- ``masked``: one flash-attention-for-CPU call over [0, c + l) with an explicit additive bottom-right
  causal mask, forward and backward (the plain masked attention a slice after the first amounts to);

alternating which of the two runs first, repetition by repetition; and, as the yardstick, the
reference's causal attention over the whole sequence (one call, forward and backward). A repetition's
value is the fastest of ``--inner`` calls (a neighbour on a shared core only slows a call down); the
clock (``--clock``) is by default the calling thread's CPU time (the kernels run on that one thread, so
the time a loaded host gives other processes is left out), or the wall clock.
Prints per (l, c) the median of each over the repetitions with its interval (``contract.estimate``)
and the paired ratio ours / masked (the median over repetitions of the ratio within one repetition,
with its min-max); then, per slice length, the whole sequence cut into equal slices of that length
(the sum over its slices' medians) against the reference's one call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

from contract.estimate import estimate
from ours.kernels import KVState, SliceAttention
from workload.configs import get_model_config
from contract.cli import NONNEGATIVE_INT, POSITIVE_INT

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _ours(qkv: torch.Tensor, kv_ctx: torch.Tensor, c: int, H: int, T: int, gout: torch.Tensor) -> tuple[float, float]:
    """SliceAttention's forward and backward (s) on a state whose context [0, c) is ``kv_ctx``."""
    state = KVState()
    if c:
        state.write(kv_ctx, 0, T)
    x = qkv.detach().requires_grad_()
    t0 = _clock()
    out = SliceAttention.apply(x, state, c, H, H, T)
    t1 = _clock()
    out.backward(gout)
    t2 = _clock()
    return t1 - t0, t2 - t1


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            dout: torch.Tensor) -> tuple[float, float]:
    """One flash-for-CPU call over the slice and its context with the additive mask (causal when None)."""
    t0 = _clock()
    out, lse = _flash_fwd(q, k, v, 0.0, mask is None, attn_mask=mask)
    t1 = _clock()
    _flash_bwd(dout, q, k, v, out, lse, 0.0, mask is None, attn_mask=mask)
    t2 = _clock()
    return t1 - t0, t2 - t1


def _bottom_right_mask(c: int, l: int, dtype: torch.dtype) -> torch.Tensor:
    allowed = torch.ones(l, c + l, dtype=torch.bool).tril(c)
    return torch.zeros(l, c + l, dtype=dtype).masked_fill(~allowed, float("-inf"))


def _fastest(fn, inner: int) -> tuple[float, float]:
    """The (forward, backward) times of the fastest of ``inner`` calls of ``fn``."""
    return min((fn() for _ in range(inner)), key=sum)


def time_point(l: int, c: int, H: int, D: int, T: int, dtype: torch.dtype, reps: int, inner: int) -> dict:
    """Every repetition's (forward, backward) times of ours and masked at slice length l after context c."""
    g = torch.Generator().manual_seed(l * 10007 + c)
    C = H * D
    qkv = torch.randn(1, l, 3 * C, generator=g).to(dtype)
    kv_ctx = torch.randn(1, c, 2, H, D, generator=g).to(dtype)
    gout = torch.randn(1, l, C, generator=g).to(dtype)
    x = qkv.view(1, l, 3, H, D)
    q = x[:, :, 0].transpose(1, 2)
    kv = torch.cat([kv_ctx, x[:, :, 1:]], dim=1)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    mask = _bottom_right_mask(c, l, dtype) if c else None
    dout = gout.view(1, l, H, D).transpose(1, 2)
    runs = {"ours": lambda: _ours(qkv, kv_ctx, c, H, T, gout), "masked": lambda: _masked(q, k, v, mask, dout)}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            times[name].append(_fastest(runs[name], inner))
    return times


def reference_time(H: int, D: int, T: int, dtype: torch.dtype, reps: int, inner: int) -> list[float]:
    """The reference's causal attention over the whole sequence, forward + backward (s), per repetition."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, H, T, D, generator=g).to(dtype) for _ in range(4))
    _masked(q, k, v, None, dout)
    return [sum(_fastest(lambda: _masked(q, k, v, None, dout), inner)) for _ in range(reps)]


def _ms(values: list[float]) -> str:
    e = estimate(values)
    return f"{e.median * 1e3:.1f} {e.plus_minus()}"


def run(opts: argparse.Namespace) -> int:
    global _clock
    _clock = CLOCKS[opts.clock]
    torch.set_num_threads(opts.threads)
    cfg = get_model_config(opts.model)
    H, T = cfg.n_head, cfg.seq_len
    D = cfg.n_embd // H
    dtype = DTYPES[opts.dtype]
    rows, per_l = [], {}
    for l in opts.slices:
        for c in opts.contexts:
            if c + l > T:
                continue
            times = time_point(l, c, H, D, T, dtype, opts.reps, opts.inner)
            total = {name: [f + b for f, b in ts] for name, ts in times.items()}
            ratios = [a / b for a, b in zip(total["ours"], total["masked"])]
            rows.append([l, c, _ms([f for f, _ in times["ours"]]), _ms([b for _, b in times["ours"]]),
                         _ms(total["ours"]), _ms(total["masked"]),
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"])
            per_l.setdefault(l, {})[c] = statistics.median(total["ours"])
    print(f"attention of one layer over a slice after its context, {opts.model} (heads {H}, head size {D}, "
          f"sequence {T}), micro-batch 1, {opts.dtype}, {opts.threads} thread(s), {opts.clock} clock, "
          f"{opts.reps} alternating repetitions, each the fastest of {opts.inner} calls (ms: median ± its "
          f"interval, contract.estimate; paired: the median of the per-repetition ratios, min-max)")
    print(tabulate(rows, headers=["slice", "context", "ours fwd ms", "ours bwd ms", "ours fwd+bwd ms",
                                  "masked fwd+bwd ms", "ours / masked (paired)"], tablefmt="github"))
    ref = reference_time(H, D, T, dtype, opts.reps, opts.inner)
    seq = []
    for l, by_c in per_l.items():
        starts = range(0, T, l)
        if all(c in by_c or c == 0 for c in starts) and 0 in by_c:
            seq.append([l, T // l, f"{sum(by_c[c] for c in starts) * 1e3:.1f}"])
    print(f"\nthe reference's causal attention over the whole sequence, forward + backward: {_ms(ref)} ms")
    if seq:
        print(tabulate(seq, headers=["slice", "slices", "ours over the sequence, ms (sum of medians)"],
                       tablefmt="github"))
    return 0


def fill_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cpu-small")
    p.add_argument("--slices", type=POSITIVE_INT, nargs="+", default=[128, 256], help="slice lengths l")
    p.add_argument("--contexts", type=NONNEGATIVE_INT, nargs="+", default=[0, 128, 256, 384, 512, 640, 768, 896],
                   help="contexts c (positions before the slice); pairs with c + l past the sequence are skipped")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--reps", type=POSITIVE_INT, default=9, help="alternating repetitions")
    p.add_argument("--inner", type=POSITIVE_INT, default=3, help="calls per repetition (its value: the fastest)")
    p.add_argument("--threads", type=POSITIVE_INT, default=1, help="torch threads (a rank runs one)")
    p.add_argument("--clock", choices=CLOCKS, default="cpu",
                   help="cpu: the calling thread's CPU time (with --threads 1 the kernels' own); wall: elapsed time")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    fill_parser(parser)
    raise SystemExit(run(parser.parse_args()))
