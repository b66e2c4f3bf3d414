"""TeraPipe's latency model of a token slice on one stage, from the one compute model
(``workload.compute``) and the link between stages.

A slice of b sequences, l tokens after c tokens of context, on a stage of ``layers`` layers split over
``tp`` tensor-parallel ranks takes

    t(b, l, c) = layers x (forward + backward)(b, l, c)   (the forward twice under recompute)
                 + 2 x (a + bytes / bandwidth)              (its activations out, their gradients back)

where the forward and backward come from the compute model (a GPU's device file, or this machine's
profile) and bytes = b l hidden x the bytes of an element, over the link to the next stage (latency a);
on T tensor-parallel ranks each layer adds its all-reduces of the slice's activations (rings over the
group's link).
The pipeline of P stages and M = B / b batch slices sharing one slicing then takes
T = M sum_i t_i + (P - 1) max_i t_i (``ours.plan.solve``).
"""
from __future__ import annotations

import math

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


def slice_time(cm: ComputeModel, hidden: int, b: int, l: int, c: int, *, layers: int, n_stages: int, tp: int = 1,
               recompute: bool = False, link: Link | None = None, element_bytes: int = BYTES_PER_ELEMENT,
               tp_link: Link | None = None, act_bytes: int = 4) -> float:
    """t(b, l, c) of one slice on one stage (see the module docstring); with ``tp_link``, the tensor-parallel
    group's all-reduces of the slice's activations (``tp_allreduces``), each a ring over the group."""
    t = layers * cm.layer_step(b, l, c, tp, recompute)
    if tp > 1 and tp_link is not None:
        t += tp_allreduces(layers, recompute) * tp_link.collective("allreduce", tp, b * l * hidden * act_bytes)
    if n_stages > 1 and link is not None:
        t += 2 * link.transfer(b * l * hidden * element_bytes)
    return t


def slice_table(cm: ComputeModel, hidden: int, seq_len: int, granularity: int, b: int,
                **kw) -> tuple[np.ndarray, np.ndarray]:
    """(boundary token positions, table[s, e] = t of the slice from boundary s to boundary e; inf where
    s >= e), the boundaries every ``granularity`` tokens and at the sequence's end."""
    pos = np.asarray(list(range(0, seq_len, granularity)) + [seq_len], dtype=np.int64)
    n = len(pos)
    table = np.full((n, n), math.inf)
    for i in range(n):
        for j in range(i + 1, n):
            table[i, j] = slice_time(cm, hidden, b, int(pos[j] - pos[i]), int(pos[i]), **kw)
    return pos, table


def fit_comm(nbytes, times) -> tuple[float, float]:
    """(latency a, bandwidth bytes/s) of t = a + bytes / bandwidth, by least squares (a ping-pong's)."""
    x = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.size == 0:
        return 0.0, math.inf
    if x.size == 1 or np.ptp(x) == 0:
        return float(y.mean()), math.inf
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    a = max(float(a), 0.0)
    bw = 1.0 / float(inv_bw) if inv_bw > 0 else math.inf
    return a, bw
