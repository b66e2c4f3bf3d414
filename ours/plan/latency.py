"""TeraPipe's latency model of a token slice on one stage, from the one compute model
(``workload.compute``) and the link between stages.

A slice of b sequences, l tokens after c tokens of context, on a stage of ``layers`` layers split over
``tp`` tensor-parallel ranks takes

    t(b, l, c) = forward + backward + weight gradients   (``ComputeModel.slice_cost``: the layers' math
                                                          of ours' engine and its own time per unit; the
                                                          forward again under recompute)
                 + 2 x (a + bytes / bandwidth)            (its activations out, their gradients back)

where bytes = b l hidden x the bytes of an element, over the link to the next stage (latency a); on T
tensor-parallel ranks each layer adds its all-reduces of the slice's activations (rings over the group's
link). The pipeline of P stages and M = B / b batch slices sharing one slicing then takes

    T = M sum_i t_i + (P - 1) max_i f_i - hidden(first slice)      (``ours.plan.solve``)

TeraPipe's formula with ours' engine's fill: f, what the neighbouring stages wait for, is a slice's
forward and input gradient with their messages (the last stage waits for the first slices' forwards
through the earlier stages, the first stage for the input gradients through the later ones; the
weight gradients are no part of it: the engine defers them into its waits), less what of the wait at
the step's end the last stage's deferred weight gradients hide (``hidden_at_end``). Checked against
the simulator, which runs ours' schedule with the same cost of a slice (``predict.programs.ours``):
over uniform and lopsided slicings at P-2 and P-4, batch 1 to 8, the slicing either calls fastest is
within 1 % of the other's fastest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from contract.links import Link
from workload.compute import ComputeModel

BYTES_PER_ELEMENT = 4  # ours sends fp32 activations unless --wire-dtype says otherwise
# Megatron-style tensor parallelism (``ours.tp``, megatron): a layer's all-reduces in each pass, one after
# attention and one after the MLP; a step runs its forward, its backward and, under recompute, the forward
# again.
TP_ALLREDUCES_PER_PASS = 2


def tp_allreduces(layers: int, recompute: bool) -> int:
    """The tensor-parallel all-reduces of ``layers`` layers in one step (forward, backward, recompute)."""
    return layers * TP_ALLREDUCES_PER_PASS * (3 if recompute else 2)


@dataclass(frozen=True)
class SliceTimes:
    """One slice on one stage (seconds), each part with its messages and all-reduces."""

    time: float
    """t: all its work (forward, input gradient, weight gradients) and its two messages."""
    fill: float
    """f: what the neighbouring stages wait for: its forward and input gradient and their messages."""
    backward: float
    """Its input gradient and the message back: what the previous stage waits for at the step's end."""
    wgrad: float
    """Its weight gradients (ours' engine defers them into its waits)."""


def slice_times(cm: ComputeModel, hidden: int, b: int, l: int, c: int, *, layers: int, n_stages: int, tp: int = 1,
                recompute: bool = False, link: Link | None = None, element_bytes: int = BYTES_PER_ELEMENT,
                tp_link: Link | None = None, act_bytes: int = 4) -> SliceTimes:
    """The slice (b, l, c) on one stage (see the module docstring): ours' cost of a slice
    (``ComputeModel.slice_cost``), with ``tp_link`` the tensor-parallel group's all-reduces of the
    slice's activations (``tp_allreduces``: the forward's, and the backward's with the recompute's), each a ring
    over the group, and with ``link`` a message each way to the neighbouring stages."""
    cost = cm.slice_cost(b, l, c, layers, tp, recompute)
    ar_fwd = ar_bwd = msg = 0.0
    if tp > 1 and tp_link is not None:
        ring = tp_link.collective("allreduce", tp, b * l * hidden * act_bytes)
        per_pass = layers * TP_ALLREDUCES_PER_PASS * ring
        ar_fwd, ar_bwd = per_pass, tp_allreduces(layers, recompute) * ring - per_pass
    if n_stages > 1 and link is not None:
        msg = link.transfer(b * l * hidden * element_bytes)
    fwd, bwd = cost.forward + ar_fwd + msg, cost.backward + ar_bwd + msg
    return SliceTimes(time=fwd + bwd + cost.wgrad, fill=fwd + bwd, backward=bwd, wgrad=cost.wgrad)


def slice_time(cm: ComputeModel, hidden: int, b: int, l: int, c: int, **kw) -> float:
    """t(b, l, c) of one slice on one stage (``slice_times``)."""
    return slice_times(cm, hidden, b, l, c, **kw).time


def hidden_at_end(first: SliceTimes, rest_wgrad: float, n_stages: int) -> float:
    """The part of the fill the deferred weight gradients hide at the step's end: the first stage
    waits (P - 1) x the first slice's input gradient for the later stages' last input gradients, while
    the last stage still runs the weight gradients it deferred for the batch slice's other token slices
    (``rest_wgrad``: the rest of the sequence's as one slice, which thinner slices only add to)."""
    if n_stages < 2:
        return 0.0
    return min((n_stages - 1) * first.backward, rest_wgrad)


def slice_table(cm: ComputeModel, hidden: int, seq_len: int, granularity: int, b: int,
                **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(boundary token positions, table[s, e] = t of the slice from boundary s to boundary e, fill[s, e]
    its fill (inf where s >= e), hidden[e] = ``hidden_at_end`` with the first slice ending at boundary e),
    the boundaries every ``granularity`` tokens and at the sequence's end."""
    pos = np.asarray(list(range(0, seq_len, granularity)) + [seq_len], dtype=np.int64)
    n = len(pos)
    table = np.full((n, n), math.inf)
    fill = np.full((n, n), math.inf)
    parts = {}
    for i in range(n):
        for j in range(i + 1, n):
            parts[i, j] = st = slice_times(cm, hidden, b, int(pos[j] - pos[i]), int(pos[i]), **kw)
            table[i, j], fill[i, j] = st.time, st.fill
    last = n - 1
    hidden_end = np.zeros(n)
    for j in range(1, n):
        hidden_end[j] = hidden_at_end(parts[0, j], parts[j, last].wgrad if j < last else 0.0, kw.get("n_stages", 1))
    return pos, table, fill, hidden_end


def fit_comm(nbytes, times) -> tuple[float, float]:
    """(latency a, bandwidth bytes/s) of t = a + bytes / bandwidth, by least squares on relative residuals
    (a ping-pong's: sizes span three or more decades, so absolute residuals would let the largest message's
    noise set the latency). A latency is positive: where noise drives the intercept to zero or below, it is
    the smallest time left after the bandwidth term, or the smallest message's whole time."""
    x = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.size == 0:
        return 0.0, math.inf
    if x.size == 1 or np.ptp(x) == 0:
        return float(y.mean()), math.inf
    w = 1.0 / np.maximum(y, 1e-12)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, inv_bw), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    bw = 1.0 / float(inv_bw) if inv_bw > 0 else math.inf
    a = float(a)
    if a <= 0:
        left = y - x / bw
        a = float(left[left > 0].min()) if (left > 0).any() else float(y[np.argmin(x)])
    return a, bw
