"""The layout planner: tensor-parallel degree T, pipeline stages P and the token slicing of ours on a
cluster, from the links between its devices (TeraPipe's third contribution: parallel matmul over the
fast links, the pipeline over the slow ones). ``python -m ours.plan layout`` prints the candidates.

Every (T, P) with T x P = the devices (D = 1), T dividing the heads and the hidden size, P the layers,
is judged by one step's predicted time, each with its optimal token slicing (``ours.plan.solve``):

- **Compute** of one layer, forward and backward, for a slice of b sequences, l tokens after c tokens
  of context: 72 b l h^2 (the four linears, x 4/3 with recompute) + 12 b l (c + l/2) h (attention)
  FLOPs, split over the T ranks, at ``efficiency`` of the device's peak, plus a fixed ``overhead``
  per layer and slice (kernel launches, Python: what makes thin slices dear). The last stage adds
  the LM head (6 b l h V FLOPs, split by vocabulary over its T ranks, as ours runs it: its input's
  gradient all-reduced, and the loss's three all-reduces of b l floats).
- **TP all-reduces**: 2 per layer forward and 2 backward (2 more with recompute: the forward again),
  each of b l h x bytes, as a ring over the stage's T ranks: 2(T - 1)/T x bytes / bandwidth + 2(T - 1) x
  latency, on the slowest link of the ring.
- **Pipeline messages**: what a stage sends of each slice (its activations to the next stage, their
  gradients to the previous one), 2 x b l h x bytes / bandwidth on the slowest link between adjacent
  stages (links full duplex), in every slice's time, not overlapped with compute (TeraPipe's latency
  model adds them too); the links' latency once per direction and stage boundary (the fill and the
  drain: 2 (P - 1) latencies), since a message's latency overlaps the other slices' work.
- A slice's time t_i on a stage is its layers' compute and all-reduces plus its messages (the slowest
  stage's); the step is TeraPipe's M x sum t_i + (P - 1) x max t_i (M = B / b batch slices), plus the
  fill/drain latencies.
- **Memory**: the weights, their gradients and Adam's two moments (16 bytes a parameter, fp32) of the
  fullest rank must fit the device; activations are not counted.

Ranks are placed as ``ours.tp.rank_of`` numbers them (a stage's T ranks next to each other) and node
by node (``gpus_per_node``), or on a per-link matrix: the links give each group its latency and
bandwidth.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ours.plan.solve import solve_table
from ours.tp import rank_of
from workload.configs import ModelConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_BYTES_PER_PARAM = 16  # fp32 weight, gradient and two moments


@dataclass(frozen=True)
class Link:
    latency: float  # seconds, one way
    bandwidth: float  # bytes per second

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATES = {"gb/s": 1e9, "mb/s": 1e6, "gbps": 1e9 / 8, "gbit/s": 1e9 / 8, "mbps": 1e6 / 8, "mbit/s": 1e6 / 8}


def parse_link(text: str) -> Link:
    """'5us,300GB/s' or '10ms,1Gbps': one-way latency, bandwidth (GB/s, MB/s bytes; Gbps, Mbps bits)."""
    m = re.fullmatch(r"\s*([\d.e+-]+)\s*(s|ms|us|ns)\s*,\s*([\d.e+-]+)\s*([a-zA-Z/]+)\s*", text)
    if not m or m.group(4).lower() not in _RATES:
        raise ValueError(f"a link is LATENCY,BANDWIDTH, e.g. 5us,300GB/s or 10ms,1Gbps; got {text!r}")
    return Link(float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _RATES[m.group(4).lower()])


@dataclass(frozen=True)
class Cluster:
    """The devices and the link between every two of them: a fast tier inside a node of
    ``gpus_per_node`` devices and a slow one between nodes, or a per-link ``matrix``."""

    n_devices: int
    gpus_per_node: int = 1
    intra: Link | None = None
    inter: Link | None = None
    matrix: tuple[tuple[Link, ...], ...] | None = None

    @classmethod
    def from_matrix(cls, d: dict) -> "Cluster":
        """From ``{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}`` (N x N; the run command's format)."""
        delay, bw = d["delay_ms"], d["bandwidth_gbps"]
        n = len(delay)
        rows = tuple(tuple(Link(delay[i][j] * 1e-3, bw[i][j] * 1e9 / 8) for j in range(n)) for i in range(n))
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
class Device:
    tflops: float  # peak at the run's precision
    memory_gb: float
    efficiency: float = 0.5  # of the peak the layers' matmuls reach
    overhead: float = 200e-6  # seconds per layer and slice, forward and backward


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    batch_slice: int
    slices: tuple[int, ...]
    step: float  # predicted seconds, inf where it does not fit
    compute: float  # of the step: the slices' compute on the slowest stage
    tp_comm: float  # the all-reduces on the critical path
    p2p: float  # pipeline messages (bandwidth) and fill/drain latencies
    bubble: float  # (P - 1) x max t_i
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


def memory_gb(model: ModelConfig, tp: int, pp: int) -> float:
    """The fullest rank's weights, gradients and Adam moments: a stage's layers over T, its
    embeddings (first stage) replicated on its T ranks, the LM head (last stage) split over them."""
    h, V, S = model.n_embd, model.vocab_size, model.seq_len
    layers = model.n_layer // pp * ((12 * h * h + 9 * h) / tp + 4 * h)
    first = (V + S) * h + (0 if pp > 1 else V * h / tp + 2 * h)
    last = V * h / tp + 2 * h
    return (layers + max(first, last if pp > 1 else 0)) * ADAM_BYTES_PER_PARAM / 1e9


def evaluate(model: ModelConfig, cluster: Cluster, device: Device, tp: int, pp: int, *, batch_size: int,
             batch_slice: int, precision: str = "fp32", recompute: bool = False, granularity: int = 64) -> Candidate:
    """One layout's predicted step with its optimal token slicing (see the module docstring)."""
    h, V, L, S = model.n_embd, model.vocab_size, model.n_layer, model.seq_len
    nbytes = BYTES[precision]
    flops_per_s = device.tflops * 1e12 * device.efficiency
    b, M, lp = batch_slice, batch_size // batch_slice, L // pp
    # the slowest ring of TP ranks and the slowest link between adjacent stages
    rings = [[rank_of(0, s, t, pp, tp) for t in range(tp)] for s in range(pp)]
    ring = cluster.slowest([(g[t], g[(t + 1) % tp]) for g in rings for t in range(tp)]) if tp > 1 else None
    hop = (cluster.slowest([(rank_of(0, s, t, pp, tp), rank_of(0, s + 1, t, pp, tp))
                            for s in range(pp - 1) for t in range(tp)]) if pp > 1 else None)
    pos = np.asarray(list(range(0, S, granularity)) + [S], dtype=np.float64)
    c, e = pos[:, None], pos[None, :]
    l = np.maximum(e - c, 0.0)
    linear = 72 * b * l * h * h * (4 / 3 if recompute else 1)
    attention = 12 * b * l * (c + l / 2) * h
    compute = lp * ((linear + attention) / tp / flops_per_s + device.overhead)
    head = 6 * b * l * h * V / tp / flops_per_s  # the last stage's LM head, split by vocabulary

    def ring_allreduce(n):  # seconds of one all-reduce of n bytes over the slowest ring
        return 2 * (tp - 1) / tp * n / ring.bandwidth + 2 * (tp - 1) * ring.latency

    allreduce = np.zeros_like(l)
    if ring is not None:
        allreduce = (4 + (2 if recompute else 0)) * lp * ring_allreduce(b * l * h * nbytes)
        head = head + ring_allreduce(b * l * h * nbytes) + 3 * ring_allreduce(b * l * 4)
    # a slice's messages: what a stage sends of it, its activations to the next stage and their
    # gradients to the previous one (a middle stage's, at full duplex); the last stage, which also
    # runs the head, is the slowest
    messages = 2 * b * l * h * nbytes / hop.bandwidth if hop is not None else np.zeros_like(l)
    head_part, message_part = head, messages
    table = np.where(e > c, compute + allreduce + head_part + message_part, np.inf)
    sol = solve_table(table, pp, M)
    cuts = list(zip(sol.cuts[:-1], sol.cuts[1:]))
    slices = tuple(int(pos[j] - pos[i]) for i, j in cuts)
    parts = [(compute[i, j] + head_part[i, j], allreduce[i, j], message_part[i, j]) for i, j in cuts]
    fill = 2 * (pp - 1) * hop.latency if hop is not None else 0.0
    mem = memory_gb(model, tp, pp)
    fits = mem <= device.memory_gb
    return Candidate(tp=tp, pp=pp, batch_slice=b, slices=slices, step=sol.latency + fill if fits else math.inf,
                     compute=M * sum(p[0] for p in parts), tp_comm=M * sum(p[1] for p in parts),
                     p2p=M * sum(p[2] for p in parts) + fill, bubble=(pp - 1) * sol.max_slice, memory_gb=mem,
                     fits=fits)


def plan_layout(model: ModelConfig, cluster: Cluster, device: Device, *, batch_size: int,
                batch_slice: int = 1, precision: str = "fp32", recompute: bool = False,
                granularity: int = 64) -> list[Candidate]:
    """Every layout's candidate, fastest first (those that do not fit last)."""
    if batch_size % batch_slice:
        raise ValueError(f"batch slice {batch_slice} does not divide the batch size {batch_size}")
    found = layouts(cluster.n_devices, model)
    if not found:
        raise ValueError(f"no T x P = {cluster.n_devices} divides the model ({model.n_head} heads, hidden "
                         f"{model.n_embd}, {model.n_layer} layers)")
    cands = [evaluate(model, cluster, device, tp, pp, batch_size=batch_size, batch_slice=batch_slice,
                      precision=precision, recompute=recompute, granularity=granularity) for tp, pp in found]
    return sorted(cands, key=lambda c: (not c.fits, c.step, c.tp))


def why(c: Candidate) -> str:
    """The candidate's step in its parts, or why it cannot run."""
    if not c.fits:
        return f"does not fit: {c.memory_gb:.1f} GB of weights, gradients and Adam state"
    parts = [("compute", c.compute), ("TP all-reduce", c.tp_comm), ("pipeline messages", c.p2p), ("bubble", c.bubble)]
    return ", ".join(f"{name} {t:.2f} s" for name, t in parts if t > 0)


def describe(cands: list[Candidate]) -> str:
    """The candidates as a table, then the choice."""
    from tabulate import tabulate

    rows = [[c.label, len(c.slices), _slicing(c.slices), f"{c.step:.2f}" if c.fits else "-", f"{c.memory_gb:.1f}",
             why(c)]
            for c in cands]
    best = cands[0]
    table = tabulate(rows, headers=["layout", "K", "slices", "step s", "GB", "why"], tablefmt="github")
    return f"{table}\n\nchosen: {best.label}, K={len(best.slices)} token slices ({_slicing(best.slices)}), " \
           f"predicted step {best.step:.2f} s"


def _slicing(slices: tuple[int, ...]) -> str:
    if len(set(slices)) == 1:
        return f"{slices[0]}x{len(slices)}"
    return ",".join(map(str, slices))
