"""How long each operation computes: from a profile of this machine, or from a GPU device file.

Both answer the same questions (seconds, one process, nominal — the simulator stretches them where
ranks share cores):
- ``layer_forward(b, l, c, tp)``: one transformer layer's forward on b sequences of l tokens that attend
  to c earlier tokens (ours' token slices; c = 0 for a whole sequence), 1/tp of it under tensor
  parallelism;
- ``layer_backward_input(b, l, c, tp)`` / ``layer_wgrad(b, l, tp)``: its backward, split into the input
  gradients and the weight gradients (which ours defers);
- ``head_forward / head_backward_input / head_wgrad(tokens, tp, width)``: ln_f + the output layer
  (``width`` outputs: the vocabulary for a language model) + the loss;
- ``embed(tokens)``: embeddings forward and backward; ``optimizer(params)``: one Adam step;
- ``overheads(system)``: the framework's own time per step and per micro-batch (or ours' unit),
  calibrated from runs without emulated delay (``predict.fitting``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workload.configs import ModelConfig


@dataclass(frozen=True)
class Overheads:
    """Framework time outside the profiled math, per rank (seconds).

    step: once per step (zero_grad, schedule set-up, loss bookkeeping, the barrier's own cost);
    unit: per micro-batch (ours: per batch slice x token slice) and stage, half in its forward and
    half in its backward; unit_layer: the same per layer of the stage; dp: per data-parallel
    synchronisation (flattening, copying, the collectives' own bookkeeping); compute: the factor the
    system's own kernels take over the profiled ones on the layers', head's and embeddings' math (the
    profile measures ours' kernels: a baseline's plain blocks, whose linears compute their input and
    weight gradients in one backward, run at their own speed; 1: as profiled); tp: the factor a
    tensor-parallel rank's math takes over 1/tp of the profiled math (its narrower matrices and, on a
    host's shared cores, the all-reduces' copies and reductions beside it; 1: the profile over tp)."""

    step: float = 0.0
    unit: float = 0.0
    unit_layer: float = 0.0
    dp: float = 0.0
    compute: float = 1.0
    tp: float = 1.0

    def per_unit(self, layers: int) -> float:
        return self.unit + self.unit_layer * layers


class ComputeModel:
    """The interface both compute models implement (seconds of one process)."""

    name = "compute"

    def layer_forward(self, b: int, l: int, c: int, tp: int = 1) -> float: ...
    def layer_backward_input(self, b: int, l: int, c: int, tp: int = 1) -> float: ...
    def layer_wgrad(self, b: int, l: int, tp: int = 1) -> float: ...
    def head_forward(self, tokens: int, tp: int = 1, width: int | None = None) -> float: ...
    def head_backward_input(self, tokens: int, tp: int = 1, width: int | None = None) -> float: ...
    def head_wgrad(self, tokens: int, tp: int = 1, width: int | None = None) -> float: ...
    def embed(self, tokens: int) -> float: ...
    def optimizer(self, params: int) -> float: ...
    def overheads(self, system: str) -> Overheads: ...

    def layer_backward(self, b: int, l: int, c: int, tp: int = 1) -> float:
        return self.layer_backward_input(b, l, c, tp) + self.layer_wgrad(b, l, tp)


class Scaled(ComputeModel):
    """``base`` with its layers', head's and embeddings' math scaled by ``factor`` (the optimizer and the
    overheads as they are)."""

    def __init__(self, base: ComputeModel, factor: float):
        self.base, self.factor, self.name = base, factor, base.name

    def layer_forward(self, b, l, c, tp=1):
        return self.base.layer_forward(b, l, c, tp) * self.factor

    def layer_backward_input(self, b, l, c, tp=1):
        return self.base.layer_backward_input(b, l, c, tp) * self.factor

    def layer_wgrad(self, b, l, tp=1):
        return self.base.layer_wgrad(b, l, tp) * self.factor

    def head_forward(self, tokens, tp=1, width=None):
        return self.base.head_forward(tokens, tp, width) * self.factor

    def head_backward_input(self, tokens, tp=1, width=None):
        return self.base.head_backward_input(tokens, tp, width) * self.factor

    def head_wgrad(self, tokens, tp=1, width=None):
        return self.base.head_wgrad(tokens, tp, width) * self.factor

    def embed(self, tokens):
        return self.base.embed(tokens) * self.factor

    def optimizer(self, params):
        return self.base.optimizer(params)

    def overheads(self, system):
        return self.base.overheads(system)


# ---- GPUs: FLOPs / (datasheet peak x efficiency) -------------------------------------------------
def layer_flops(h: int, b: int, l: int, c: int) -> tuple[float, float, float]:
    """(forward, backward input gradients, weight gradients) FLOPs of one layer on b x l tokens after c
    tokens of context. Matmuls 24 b l h^2 forward; attention scores and values 4 b l (c + l) h (no
    causal skipping: the seed's kernels computed the full square and masked it)."""
    mm = 24.0 * b * l * h * h
    attn = 4.0 * b * l * (c + l) * h
    return mm + attn, mm + 2 * attn, mm


@dataclass(frozen=True)
class GpuCompute(ComputeModel):
    """A GPU from its device file: dense peak per precision (datasheet) and one efficiency per
    precision, the share of the peak the layers reach (calibrated on one measured row)."""

    device: str
    model: ModelConfig
    peak_tflops: dict
    efficiency: dict
    precision: str = "fp32"
    optimizer_seconds_per_param: float = 0.0
    overhead: Overheads = field(default_factory=Overheads)
    name = "gpu"

    def _rate(self) -> float:
        key = "fp32" if self.precision == "fp32" else "fp16"
        return self.peak_tflops[key] * 1e12 * self.efficiency[self.precision]

    def _t(self, flops: float, tp: int) -> float:
        return flops / tp / self._rate()

    def layer_forward(self, b, l, c, tp=1):
        return self._t(layer_flops(self.model.n_embd, b, l, c)[0], tp)

    def layer_backward_input(self, b, l, c, tp=1):
        return self._t(layer_flops(self.model.n_embd, b, l, c)[1], tp)

    def layer_wgrad(self, b, l, tp=1):
        return self._t(layer_flops(self.model.n_embd, b, l, 0)[2], tp)

    def head_forward(self, tokens, tp=1, width=None):
        return self._t(2.0 * tokens * self.model.n_embd * (width or self.model.vocab_size), tp)

    def head_backward_input(self, tokens, tp=1, width=None):
        return self.head_forward(tokens, tp, width)

    def head_wgrad(self, tokens, tp=1, width=None):
        return self.head_forward(tokens, tp, width)

    def embed(self, tokens):
        return 0.0

    def optimizer(self, params):
        return params * self.optimizer_seconds_per_param

    def overheads(self, system):
        return self.overhead

    def with_efficiency(self, eff: float) -> "GpuCompute":
        return GpuCompute(self.device, self.model, self.peak_tflops, {**self.efficiency, self.precision: eff},
                          self.precision, self.optimizer_seconds_per_param, self.overhead)


def load_device(path: str | Path, model: ModelConfig, precision: str) -> GpuCompute:
    """A GpuCompute from a device file (JSON: device, peak_tflops {fp32, fp16}, efficiency {fp32, mixed},
    optimizer_seconds_per_param, overhead {step, unit, unit_layer})."""
    d = json.loads(Path(path).read_text())
    eff = d.get("efficiency") or {}
    if precision not in eff:
        raise ValueError(f"device file {path} has no efficiency for precision {precision!r}")
    return GpuCompute(d["device"], model, d["peak_tflops"], eff, precision, d.get("optimizer_seconds_per_param", 0.0),
                      Overheads(**(d.get("overhead") or {})))


# ---- this machine: a profile of one thread --------------------------------------------------------
def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear; linear extrapolation beyond the ends (clamped at 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x <= xs[0]:
        y = ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])
        return max(y, ys[0] * x / xs[0] if xs[0] else 0.0, 0.0)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return max(0.0, ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2]))


@dataclass(frozen=True)
class Table3:
    """t(b, l, c) from measurements on a grid: per b (nearest profiled b, scaled linearly), piecewise
    linear in l at c = 0 plus a term linear in c and l*c fitted to the points with c > 0."""

    points: tuple  # (b, l, c, t)

    def __call__(self, b: int, l: int, c: int) -> float:
        bs = sorted({p[0] for p in self.points})
        bb = min(bs, key=lambda x: (abs(x - b), x))
        zero = sorted((p[1], p[3]) for p in self.points if p[0] == bb and p[2] == 0)
        t0 = _interp(l, [z[0] for z in zero], [z[1] for z in zero])
        if c > 0:
            kc, klc = self._context_terms(bb)
            t0 += max(0.0, kc * c + klc * l * c)
        return t0 * b / bb

    def _context_terms(self, bb: int) -> tuple[float, float]:
        """Least squares of t(l, c) - t(l, 0) = kc c + klc l c over the points with c > 0 (>= 0)."""
        zero = sorted((p[1], p[3]) for p in self.points if p[0] == bb and p[2] == 0)
        xs, ys = [z[0] for z in zero], [z[1] for z in zero]
        rows = [(p[2], p[1] * p[2], p[3] - _interp(p[1], xs, ys)) for p in self.points if p[0] == bb and p[2] > 0]
        if not rows:
            return 0.0, 0.0
        s11 = sum(a * a for a, _, _ in rows)
        s12 = sum(a * b for a, b, _ in rows)
        s22 = sum(b * b for _, b, _ in rows)
        y1 = sum(a * y for a, _, y in rows)
        y2 = sum(b * y for _, b, y in rows)
        det = s11 * s22 - s12 * s12
        if abs(det) < 1e-30:
            return max(0.0, y1 / s11 if s11 else 0.0), 0.0
        kc, klc = (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det
        if kc < 0 or klc < 0:  # one term alone, the better non-negative one
            a = max(0.0, y1 / s11) if s11 else 0.0
            bq = max(0.0, y2 / s22) if s22 else 0.0
            ea = sum((y - a * u) ** 2 for u, _, y in rows)
            eb = sum((y - bq * v) ** 2 for _, v, y in rows)
            return (a, 0.0) if ea <= eb else (0.0, bq)
        return kc, klc


@dataclass(frozen=True)
class CpuCompute(ComputeModel):
    """This machine, one thread per rank, from a profile (``predict.machine_profile``) and calibrated
    overheads per system. Tensor parallelism divides the math by tp (an estimate; not profiled)."""

    profile: dict
    overhead: dict = field(default_factory=dict)  # system -> Overheads
    name = "cpu"

    def _table(self, key: str) -> Table3:
        """The profile's points of one quantity; at c = 0 cleaned of contention outliers (points more
        than 25 % off what their neighbours predict, as the planner's fit does) and made non-decreasing
        in l, so that a measurement slowed by contention does not make a longer slice look cheaper."""
        cache = self.__dict__.setdefault("_tables", {})
        if key not in cache:
            import numpy as np

            from ours.plan.latency import clean_outliers, isotonic

            pts = [(p["b"], p["l"], p["c"], p[key]) for p in self.profile["layer"]]
            out = [q for q in pts if q[2] > 0]
            for b in sorted({q[0] for q in pts}):
                row = sorted(q for q in pts if q[0] == b and q[2] == 0)
                ys, _ = clean_outliers(np.array([q[1] for q in row], float), np.array([q[3] for q in row], float))
                out += [(b, l, 0, float(t)) for (_, l, _, _), t in zip(row, isotonic(ys))]
            cache[key] = Table3(tuple(out))
        return cache[key]

    def layer_forward(self, b, l, c, tp=1):
        return self._table("fwd")(b, l, c) / tp

    def layer_backward_input(self, b, l, c, tp=1):
        return self._table("bwd_in")(b, l, c) / tp

    def layer_wgrad(self, b, l, tp=1):
        return max(0.0, self._table("wgrad")(b, l, 0)) / tp

    def _head(self, key: str, tokens: int, tp: int, width: int | None) -> float:
        scale = (width / self.profile["model"]["vocab_size"]) if width else 1.0
        return self.profile["head"][key] * tokens * scale / tp

    def head_forward(self, tokens, tp=1, width=None):
        return self._head("fwd_per_token", tokens, tp, width)

    def head_backward_input(self, tokens, tp=1, width=None):
        return self._head("bwd_in_per_token", tokens, tp, width)

    def head_wgrad(self, tokens, tp=1, width=None):
        return self._head("wgrad_per_token", tokens, tp, width)

    def embed(self, tokens):
        return self.profile["embed_per_token"] * tokens

    def optimizer(self, params):
        return self.profile["optimizer_per_param"] * params

    def overheads(self, system):
        return self.overhead.get(system, Overheads())

    def with_overheads(self, system: str, o: Overheads) -> "CpuCompute":
        return CpuCompute(self.profile, {**self.overhead, system: o})

    def loopback(self) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of a gloo message between two local processes, from the profile."""
        p = self.profile.get("p2p_fit") or {}
        return p.get("latency", 50e-6), p.get("bandwidth", 2e9)

    def to_json(self) -> dict:
        return {"profile": self.profile, "overhead": {k: asdict(v) for k, v in self.overhead.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "CpuCompute":
        return cls(d["profile"], {k: Overheads(**v) for k, v in (d.get("overhead") or {}).items()})


def stage_params(model: ModelConfig, layers: int, first: bool, last: bool, tp: int = 1,
                 head: int | None = None) -> int:
    """Parameters a stage (or one tensor-parallel rank of it) holds; ``head``: the output layer's width
    (None: the vocabulary)."""
    h = model.n_embd
    n = layers * (12 * h * h + 13 * h) // tp
    if first:
        n += (model.vocab_size * h) // tp + model.seq_len * h
    if last:
        n += 2 * h + ((head or model.vocab_size) * h) // tp
    return n

