"""The layout planner: tensor-parallel degree T, pipeline stages P and the token slicing of ours on a
cluster, from the links between its devices (TeraPipe's third contribution: parallel matmul over the
fast links, the pipeline over the slow ones). ``python -m ours.plan layout`` prints the candidates.

Every (T, P) with T x P = the devices (D = 1), T dividing the heads and the hidden size, P the layers,
is judged by one step's predicted time with its optimal token slicing (``ours.plan.planner``): a
slice's time on a stage is ours' cost of a slice from the one compute model (the device file's GPU,
``workload.compute``: its layers' forward and backward on 1/T of the layer), the group's all-reduces of
the slice's activations (a ring over the slowest link inside the group), and its messages to and from
the neighbouring stages (on the slowest link between adjacent stages); the step is
M x sum t_i + (P - 1) x max f_i, f the slice's fill (``ours.plan.latency``). A layout that does not
fit the device's memory (``workload.memory``: parameters, gradients, Adam, and the activations ours'
1F1B order keeps) is listed last with its estimate.

Ranks are placed as ``ours.tp.rank_of`` numbers them (a stage's T ranks next to each other) and node
by node (``gpus_per_node``), or on a per-link matrix: the links give each group its latency and
bandwidth.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from contract.links import Link, given_link_error
from ours.plan.latency import tp_allreduces
from ours.plan.planner import plan
from ours.tp import rank_of
from workload.compute import GpuCompute
from workload.configs import ModelConfig
from workload.memory import GB, rank_memory


_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATES = {"gb/s": 1e9, "mb/s": 1e6, "gbps": 1e9 / 8, "gbit/s": 1e9 / 8, "mbps": 1e6 / 8, "mbit/s": 1e6 / 8}


def parse_link(text: str) -> Link:
    """'5us,300GB/s' or '10ms,1Gbps': one-way latency, bandwidth (GB/s, MB/s bytes; Gbps, Mbps bits);
    within what a link may be (``given_link_error``; ValueError, one line, otherwise)."""
    m = re.fullmatch(r"\s*([\d.e+-]+)\s*(s|ms|us|ns)\s*,\s*([\d.e+-]+)\s*([a-zA-Z/]+)\s*", text)
    if not m or m.group(4).lower() not in _RATES:
        raise ValueError(f"a link is LATENCY,BANDWIDTH, e.g. 5us,300GB/s or 10ms,1Gbps; got {text!r}")
    try:
        latency, rate = float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _RATES[m.group(4).lower()]
    except ValueError:
        raise ValueError(f"a link is LATENCY,BANDWIDTH with numbers, e.g. 10ms,1Gbps; got {text!r}") from None
    why = given_link_error(latency * 1e3, rate * 8 / 1e9)
    if why:
        raise ValueError(f"{text!r}: {why}")
    return Link(latency, rate)


@dataclass(frozen=True)
class Cluster:
    """The devices and the link between every two of them: a fast tier inside a node of
    ``gpus_per_node`` devices and a slow one between nodes, or a per-link ``matrix``."""

    n_devices: int
    gpus_per_node: int = 1
    intra: Link | None = None
    inter: Link | None = None
    matrix: tuple[tuple[Link | None, ...], ...] | None = None  # None on the diagonal

    @classmethod
    def from_matrix(cls, d: dict) -> "Cluster":
        """From ``{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}`` (N x N; the run command's format)."""
        delay, bw = d["delay_ms"], d["bandwidth_gbps"]
        n = len(delay)
        rows = tuple(tuple(Link(delay[i][j] * 1e-3, bw[i][j] * 1e9 / 8) if i != j else None for j in range(n))
                     for i in range(n))
        return cls(n_devices=n, matrix=rows)

    def link(self, i: int, j: int) -> Link:
        if self.matrix is not None:
            return self.matrix[i][j]
        same = i // self.gpus_per_node == j // self.gpus_per_node
        tier = self.intra if same else self.inter
        if tier is None:
            raise ValueError(f"no {'intra' if same else 'inter'}-node link given (devices {i} and {j})")
        return tier

    def slowest(self, pairs: list[tuple[int, int]]) -> Link:
        """A link as slow as the worst of ``pairs`` in latency and in bandwidth."""
        links = [self.link(i, j) for i, j in pairs]
        return Link(max(l.latency for l in links), min(l.bandwidth for l in links))


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    batch_slice: int
    slices: tuple[int, ...]
    step: float  # predicted seconds, inf where it does not fit
    compute: float  # of the step: the slices' compute on a stage
    tp_comm: float  # the all-reduces
    p2p: float  # pipeline messages
    bubble: float  # (P - 1) x max f_i: the fill
    memory_gb: float
    fits: bool

    @property
    def label(self) -> str:
        return f"T-{self.tp} P-{self.pp}"


def layouts(n_devices: int, model: ModelConfig) -> list[tuple[int, int]]:
    """Every (T, P) with T x P = the devices that ours can run on the model."""
    out = []
    for tp in range(1, n_devices + 1):
        pp, rest = divmod(n_devices, tp)
        if rest or model.n_head % tp or model.n_embd % tp or model.n_layer % pp:
            continue
        out.append((tp, pp))
    return out


def evaluate(model: ModelConfig, cluster: Cluster, cm: GpuCompute, tp: int, pp: int, *, batch_size: int,
             batch_slice: int, recompute: bool = False, granularity: int | None = None,
             memory_gb: float | None = None) -> Candidate:
    """One layout's predicted step with its optimal token slicing (see the module docstring)."""
    rings = [[rank_of(0, s, t, pp, tp) for t in range(tp)] for s in range(pp)]
    ring = cluster.slowest([(g[t], g[(t + 1) % tp]) for g in rings for t in range(tp)]) if tp > 1 else None
    hop = (cluster.slowest([(rank_of(0, s, t, pp, tp), rank_of(0, s + 1, t, pp, tp))
                            for s in range(pp - 1) for t in range(tp)]) if pp > 1 else None)
    act = 4 if cm.precision == "fp32" else 2
    p = plan(cm, model, n_stages=pp, batch_size=batch_size, tp=tp, recompute=recompute, link=hop,
             granularity=granularity, batch_slices=[batch_slice], tp_link=ring, act_bytes=act)
    layers, h = model.n_layer // pp, model.n_embd
    compute = tp_comm = p2p = 0.0
    ctx = 0
    M = batch_size // batch_slice
    for l in p.slices:
        compute += M * cm.slice_cost(batch_slice, l, ctx, layers, tp, recompute).total
        if ring is not None:
            ring_s = ring.collective("allreduce", tp, batch_slice * l * h * act)
            tp_comm += M * tp_allreduces(layers, recompute) * ring_s
        if hop is not None:
            p2p += M * 2 * hop.transfer(batch_slice * l * h * 4)
        ctx += l
    mem = rank_memory(model, system="ours", tp=tp, pp=pp, dp=1, micro_batch=batch_slice, n_micro=M,
                      precision=cm.precision, recompute=recompute, schedule="1f1b", attention=cm.attention)
    limit = memory_gb * GB if memory_gb is not None else cm.device.usable_bytes()
    fits = mem.total <= limit
    bubble = p.predicted_pipeline - (compute + tp_comm + p2p)
    return Candidate(tp=tp, pp=pp, batch_slice=batch_slice, slices=p.slices,
                     step=p.predicted_pipeline if fits else math.inf,
                     compute=compute, tp_comm=tp_comm, p2p=p2p, bubble=bubble, memory_gb=mem.total / GB, fits=fits)


def plan_layout(model: ModelConfig, cluster: Cluster, cm: GpuCompute, *, batch_size: int, batch_slice: int = 1,
                recompute: bool = False, granularity: int | None = None,
                memory_gb: float | None = None) -> list[Candidate]:
    """Every layout's candidate, fastest first (those that do not fit last)."""
    if batch_size % batch_slice:
        raise ValueError(f"batch slice {batch_slice} does not divide the batch size {batch_size}")
    found = layouts(cluster.n_devices, model)
    if not found:
        raise ValueError(f"no T x P = {cluster.n_devices} divides the model ({model.n_head} heads, hidden "
                         f"{model.n_embd}, {model.n_layer} layers)")
    cands = [evaluate(model, cluster, cm, tp, pp, batch_size=batch_size, batch_slice=batch_slice, recompute=recompute,
                      granularity=granularity, memory_gb=memory_gb) for tp, pp in found]
    return sorted(cands, key=lambda c: (not c.fits, c.step if c.fits else c.memory_gb, c.tp))


def why(c: Candidate) -> str:
    """The candidate's step in its parts, or why it cannot run."""
    if not c.fits:
        return f"does not fit: {c.memory_gb:.1f} GiB of weights, gradients, Adam state and activations"
    parts = [("compute", c.compute), ("TP all-reduce", c.tp_comm), ("pipeline messages", c.p2p), ("bubble", c.bubble)]
    return ", ".join(f"{name} {t:.3f} s" for name, t in parts if t > 0)


def describe(cands: list[Candidate]) -> str:
    """The candidates as a table, then the choice (or that nothing fits)."""
    from tabulate import tabulate

    rows = [[c.label, len(c.slices), _slicing(c.slices), f"{c.step:.3f}" if c.fits else "-", f"{c.memory_gb:.1f}",
             why(c)] for c in cands]
    table = tabulate(rows, headers=["layout", "K", "slices", "pipeline s", "GiB", "why"], tablefmt="github")
    best = cands[0]
    if not best.fits:
        return f"{table}\n\nno layout fits the devices' memory"
    return f"{table}\n\nchosen: {best.label}, K={len(best.slices)} token slices ({_slicing(best.slices)}), " \
           f"predicted pipeline {best.step:.3f} s (TeraPipe's formula: the forwards and backwards, no optimizer)"


def _slicing(slices: tuple[int, ...]) -> str:
    if len(set(slices)) == 1:
        return f"{slices[0]}x{len(slices)}"
    return ",".join(map(str, slices))
