"""How long the operations of a GPT layer take on a device: the one compute model.

The simulator (``predict``), ours' latency model and slicing planner (``ours.plan``) and
``--n-slices auto`` ask this module, and nothing else computes an operation's time. Every model
answers the same questions, in seconds of one rank:

- ``layer_forward(b, l, c, tp)``: one transformer layer's forward on b sequences of l tokens that
  attend to c earlier tokens (a token slice after c tokens of context; c = 0: a whole sequence), on
  one of tp tensor-parallel ranks;
- ``layer_backward_input(b, l, c, tp)`` / ``layer_wgrad(b, l, tp)``: its backward, split into the
  input gradients and the weight gradients (ours defers the latter);
- ``head_forward / head_backward_input / head_wgrad(tokens, tp, width)``: ln_f, the output layer
  (``width`` outputs; None: the vocabulary) and the loss;
- ``embed(tokens)``: the embeddings' forward and backward; ``optimizer(params)``: one optimizer step;
- ``overheads(system)``: a framework's own time per step and per unit (``Overheads``).

Two kinds:

- ``GpuCompute``: a GPU from its device file (``workload/devices/*.json``), operation by operation.
  A GEMM of (M, N, K) takes max(2MNK / (peak x e), bytes / (bandwidth x e_mem)) plus a kernel's fixed
  cost, with e = e_max x the best tile shape's use of the SMs (its padding and its last wave) x
  K / (K + k_half): a thin token slice under-fills the GPU and reads the whole weight for few tokens.
  Attention over a slice and its context is the slice's queries against c + l keys (materialised scores
  and softmax, or one fused kernel), the memory-bound operations (layer norms, GELU, softmax, residual
  adds, the optimizer) move their bytes at the memory bandwidth, and a phase takes at least the host's
  time to issue its kernels (eager PyTorch: ``host_op_us`` each). Forward, backward, and the forward
  again under recompute (``attention_forward``: the attention core alone, what selective recompute
  runs again). Sequence parallelism (Megatron's) divides the norms', residual adds' and dropouts'
  work by tp; a GEMM precision of its own (``gemm_precision="fp8"``: TransformerEngine's fp8 GEMMs on
  Hopper) runs the layers' linear GEMMs at that precision's peak and curve, everything else as the
  run's precision.
- ``CpuCompute``: this machine, from a profile of its operations at the model's shape
  (``ours.plan.profile``): measured tables, interpolated.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from workload.configs import OPTIMIZERS, PRECISIONS, ModelConfig, block_params, norm_params
from workload.flops import GPU_PEAK_TFLOPS, gpu_model

DEVICES = Path(__file__).resolve().parent / "devices"
ATTENTION = ("flash", "materialized")
OPTIMIZER_KERNELS = ("single", "fused")


@dataclass(frozen=True)
class Overheads:
    """Framework time outside the modelled math, per rank (seconds)."""

    step: float = 0.0
    """Once per step: zero_grad, schedule set-up, loss bookkeeping, the barrier's own cost."""
    unit: float = 0.0
    """Per micro-batch (ours: per batch slice x token slice) and stage, half in its forward and half in its
    backward."""
    unit_layer: float = 0.0
    """The same per layer of the stage."""
    dp: float = 0.0
    """Per data-parallel synchronisation: flattening, copying, the collectives' own bookkeeping."""
    compute: float = 1.0
    """The factor the system's own kernels take over the modelled ones on the layers', head's and
    embeddings' math (1: as modelled)."""
    tp: float = 1.0
    """The factor a tensor-parallel rank's math takes over 1/tp of the modelled math."""

    def per_unit(self, layers: int) -> float:
        return self.unit + self.unit_layer * layers


@dataclass(frozen=True)
class SliceCost:
    """One unit of ours' token pipeline (b sequences x l tokens after c of context) on one stage: seconds
    of its forward, its backward (the input gradients; the forward again under recompute) and its weight
    gradients (deferred by the engine: they fill its waits), each the stage's layers' math plus the
    engine's own time per unit beyond it (``ComputeModel.engine_unit``)."""

    forward: float
    backward: float
    wgrad: float

    @property
    def total(self) -> float:
        """The unit's work on the stage: what every unit adds to a stage's step."""
        return self.forward + self.backward + self.wgrad


class ComputeModel:
    """The interface every compute model implements (seconds of one rank)."""

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

    def attention_forward(self, b: int, l: int, c: int, tp: int = 1) -> float:
        """The attention core's forward alone (scores, softmax, dropout and context, or the fused kernel):
        what selective recompute runs again before a layer's backward. A model that cannot tell it
        apart from the rest of the layer raises NotImplementedError."""
        raise NotImplementedError(f"{self.name}: the attention core's time is not modelled apart from its layer")

    def linear_time(self, kind: str, b: int, l: int, c: int, tp: int = 1) -> float:
        """Seconds of a layer's linear GEMMs in one phase (forward, backward_input, wgrad): what a
        tensor-parallel collective can hide behind where it overlaps them; 0 where not modelled."""
        return 0.0

    def layer_step(self, b: int, l: int, c: int, tp: int = 1, recompute: bool = False) -> float:
        """One layer's forward and backward on a slice (the forward twice under recompute): TeraPipe's
        t(l, ctx) per layer."""
        f = self.layer_forward(b, l, c, tp)
        return f * (2 if recompute else 1) + self.layer_backward(b, l, c, tp)

    # -- ours' token slices: the one cost of a slice (the planner, the layout chooser and the simulator) --
    def slice_layer(self, b: int, l: int, c: int, tp: int = 1) -> tuple[float, float, float]:
        """(forward, input gradient, weight gradient) of one layer of ours' engine on a token slice; by
        default the shared layer's (a model that measured ours' own kernels answers with those)."""
        return self.layer_forward(b, l, c, tp), self.layer_backward_input(b, l, c, tp), self.layer_wgrad(b, l, tp)

    def engine_unit(self, layers: int) -> tuple[float, float, float]:
        """(forward, backward, weight gradients): ours' engine's own time per unit on a stage of
        ``layers`` layers beyond the layers' math (its Python, autograd and bookkeeping); none by default."""
        return 0.0, 0.0, 0.0

    def slice_cost(self, b: int, l: int, c: int, layers: int, tp: int = 1, recompute: bool = False) -> SliceCost:
        """One unit of ours' token pipeline on a stage of ``layers`` layers (``SliceCost``)."""
        f, bi, w = self.slice_layer(b, l, c, tp)
        ef, eb, ew = self.engine_unit(layers)
        forward = layers * f + ef
        return SliceCost(forward=forward, backward=layers * bi + eb + (forward if recompute else 0.0),
                         wgrad=layers * w + ew)


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

    def slice_layer(self, b, l, c, tp=1):
        return tuple(t * self.factor for t in self.base.slice_layer(b, l, c, tp))

    def engine_unit(self, layers):
        return self.base.engine_unit(layers)

    def attention_forward(self, b, l, c, tp=1):
        return self.base.attention_forward(b, l, c, tp) * self.factor

    def linear_time(self, kind, b, l, c, tp=1):
        return self.base.linear_time(kind, b, l, c, tp) * self.factor

    def optimizer(self, params):
        return self.base.optimizer(params)

    def overheads(self, system):
        return self.base.overheads(system)


# ---- GPUs: device files ------------------------------------------------------------------------------
class DeviceError(ValueError):
    """A device file that cannot be read or used (one line, for the command line)."""


@dataclass(frozen=True)
class Device:
    """A GPU as its device file describes it (``workload/devices/*.json``)."""

    name: str
    """As people name it: "V100 SXM2 16GB"."""
    part: str
    """The model in ``workload.flops.GPU_PEAK_TFLOPS`` whose dense datasheet peaks it has."""
    memory_gb: float
    """Memory, GiB."""
    bandwidth_gbs: float
    """Memory bandwidth, GB/s (datasheet)."""
    sms: int
    """Streaming multiprocessors (what a GEMM's tiles are spread over)."""
    gemm: dict
    """Per precision: ``efficiency`` (e_max, the share of the dense peak a large GEMM reaches) and ``half``
    (the depth K at which a GEMM's main loop reaches half of that)."""
    memory_efficiency: float = 0.8
    """The share of the bandwidth a memory-bound kernel moves."""
    kernel_us: float = 4.0
    """A kernel's fixed cost on the GPU (launch, ramp, tail)."""
    host_op_us: float = 8.0
    """The host's cost to issue one operation (eager PyTorch)."""
    reserved_gb: float = 0.75
    """Memory no tensor can have (the CUDA context, library workspaces)."""
    calibrated_on: dict = field(default_factory=dict)
    """Per precision, the one published or measured cell its efficiency was fitted on (none: a prior)."""
    sources: dict = field(default_factory=dict)
    """Where each number comes from."""
    measured: dict | None = None
    """What ``scripts/gpu_profile.sh`` measured on such a GPU (None where none was had)."""
    validated: dict = field(default_factory=dict)
    """Where its predictions were validated on published steps it was not fitted to: cells, median and
    largest error, by which command (``pipebench predict validate-published --calibrate`` writes it)."""
    kernels: dict = field(default_factory=dict)
    """Per precision, the published kernel benchmark its GEMM curve was fitted to: the file (under
    ``workload/devices/kernels/``), the rows used and the fit's error (``python -m predict fit-kernels``)."""
    path: str = ""
    """The file it was read from."""
    peak_tflops: dict | None = None
    """Measured peaks per precision instead of the part's datasheet (a CPU host's)."""

    def peak_flops(self, precision: str) -> float:
        """The dense datasheet peak (FLOP/s) that ``precision``'s GEMMs run at (``peak_tflops``: measured
        peaks instead, a CPU host's): a part without half units for it (V100's bf16) runs them at its
        fp32 rate."""
        peaks = self.peak_tflops or GPU_PEAK_TFLOPS[self.part]
        return (peaks.get(precision) or peaks["fp32"]) * 1e12

    def has_fp8(self) -> bool:
        """Whether the part has fp8 tensor cores (a datasheet fp8 peak) and the file a curve for them."""
        return bool((self.peak_tflops or GPU_PEAK_TFLOPS[self.part]).get("fp8")) and "fp8" in self.gemm

    def gemm_curve(self, precision: str) -> tuple[float, float]:
        """(e_max, half) of ``precision``'s GEMMs: its own curve; a precision the part has no peak for
        runs at the fp32 rate (``peak_flops``), so at fp32's curve too (V100's bf16); bf16 without a
        curve of its own, fp16's (the same tensor cores). fp8 only where the part has it
        (``has_fp8``)."""
        peaks = self.peak_tflops or GPU_PEAK_TFLOPS[self.part]
        if precision == "fp8" and not self.has_fp8():
            raise DeviceError(f"the {self.name} has no fp8 GEMMs (no fp8 peak or no fp8 curve in {self.path})")
        if not peaks.get(precision):
            precision = "fp32"
        g = self.gemm.get(precision) or self.gemm.get("fp16" if precision == "bf16" else "fp32")
        if not g:
            raise DeviceError(f"device file {self.path}: no GEMM efficiency for {precision}")
        return float(g["efficiency"]), float(g.get("half", 32.0))

    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * 2**30

    def with_gemm(self, precision: str, efficiency: float, half: float | None = None) -> "Device":
        e, h = self.gemm_curve(precision)
        gemm = {**self.gemm, precision: {"efficiency": efficiency, "half": h if half is None else half}}
        return Device(**{**asdict(self), "gemm": gemm})

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("path")
        return {"kind": "workload.device", **d}


_REQUIRED = ("name", "part", "memory_gb", "bandwidth_gbs", "sms", "gemm")
# What a device file's GEMM curves may be of: a run's precisions, and fp8 (a GEMM precision only).
GEMM_PRECISIONS = PRECISIONS + ("fp8",)
# A device file's numbers: (field, the least it may be, whether it may be that least, an integer).
_BOUNDS = (("memory_gb", 0.0, False, False), ("bandwidth_gbs", 0.0, False, False), ("sms", 1, True, True),
           ("memory_efficiency", 0.0, False, False), ("kernel_us", 0.0, True, False), ("host_op_us", 0.0, True, False),
           ("reserved_gb", 0.0, True, False))


def _is_number(v, integer: bool = False) -> bool:
    return not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and math.isfinite(v)


def _check_fields(d: dict, path: Path) -> None:
    """DeviceError (one line) for a field of the wrong kind or out of its range."""
    for key in ("name", "part"):
        if not isinstance(d[key], str):
            raise DeviceError(f"device file {path}: {key} must be a string, got {d[key]!r}")
    for key, least, inclusive, integer in _BOUNDS:
        v = d.get(key, least if inclusive else 1)
        if not _is_number(v, integer) or v < least or (v == least and not inclusive):
            what = "a whole number" if integer else "a finite number"
            raise DeviceError(f"device file {path}: {key} must be {what} {'>=' if inclusive else '>'} {least:g}, "
                              f"got {v!r}")
    if d.get("memory_efficiency", 0.8) > 1:
        raise DeviceError(f"device file {path}: memory_efficiency is a share of the bandwidth, at most 1, "
                          f"got {d['memory_efficiency']!r}")
    if d.get("reserved_gb", 0.75) >= d["memory_gb"]:
        raise DeviceError(f"device file {path}: reserved_gb {d.get('reserved_gb', 0.75)!r} leaves nothing of "
                          f"memory_gb {d['memory_gb']!r}")
    curves = d["gemm"]
    if not isinstance(curves, dict) or not curves or not all(isinstance(c, dict) for c in curves.values()):
        raise DeviceError(f"device file {path}: gemm must map each precision to {{\"efficiency\": e, \"half\": k}}, "
                          f"got {curves!r}")
    for prec, c in curves.items():
        e, h = c.get("efficiency"), c.get("half", 32.0)
        if prec not in GEMM_PRECISIONS or not _is_number(e) or not _is_number(h) or not (0 < e <= 1 and h > 0):
            raise DeviceError(f"device file {path}: gemm {prec!r}: a precision ({', '.join(GEMM_PRECISIONS)}) with an "
                              f"efficiency in (0, 1] and a half > 0, got {c!r}")
    peaks = d.get("peak_tflops")
    if peaks is not None and not (isinstance(peaks, dict) and all(_is_number(v) and v > 0 for v in peaks.values())):
        raise DeviceError(f"device file {path}: peak_tflops must map precisions to peaks > 0, got {peaks!r}")
    for key in ("calibrated_on", "sources"):
        if not isinstance(d.get(key, {}), dict):
            raise DeviceError(f"device file {path}: {key} must be an object, got {d[key]!r}")


def read_data(path: Path, what: str, error: type[Exception], parse=json.loads):
    """A file's contents as ``parse`` reads them (JSON by default; tomllib.loads for TOML), or ``error`` in
    one line naming ``what`` it is (missing, unreadable, not UTF-8, not parseable)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise error(f"no such {what}: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read the {what} {path} ({exc.__class__.__name__})") from None
    try:
        return parse(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise error(f"the {what} {path} is not valid ({' '.join(str(exc).split())})") from None


def read_device(path: str | Path) -> Device:
    """A device file; DeviceError (one line) for a missing, unreadable or incomplete one."""
    path = Path(path)
    d = read_data(path, "device file", DeviceError)
    if not isinstance(d, dict):
        raise DeviceError(f"device file {path} holds no JSON object")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise DeviceError(f"device file {path} lacks {', '.join(missing)}")
    _check_fields(d, path)
    if d["part"] not in GPU_PEAK_TFLOPS:
        raise DeviceError(f"device file {path}: unknown part {d['part']!r} (known: {', '.join(GPU_PEAK_TFLOPS)})")
    fields = {k: v for k, v in d.items() if k in Device.__dataclass_fields__ and k != "path"}
    try:
        return Device(**fields, path=str(path))
    except TypeError as exc:
        raise DeviceError(f"device file {path}: {exc}") from None


def device_files() -> list[Path]:
    return sorted(DEVICES.glob("*.json"))


@lru_cache(maxsize=None)
def _devices() -> tuple[Device, ...]:
    return tuple(read_device(p) for p in device_files())


def device_names() -> list[str]:
    return [d.name for d in _devices()]


def find_device(name: str) -> Device:
    """A device file by the GPU's name ("V100 SXM2 16GB", case and spaces aside), by its file's stem
    ("v100-sxm2-16gb"), by a path, or by what torch.cuda.get_device_name says ("Tesla V100-SXM2-16GB")."""
    if name.endswith(".json") or "/" in name:
        return read_device(name)
    key = " ".join(name.lower().replace("-", " ").replace("_", " ").split())
    for d in _devices():
        if key in (" ".join(d.name.lower().replace("-", " ").split()), Path(d.path).stem.replace("-", " ")):
            return d
    part = gpu_model(name)
    if part is not None:
        gb = [int(t[:-2]) for t in name.replace("-", " ").split() if t.upper().endswith("GB") and t[:-2].isdigit()]
        same = [d for d in _devices() if d.part == part]
        exact = [d for d in same if gb and round(d.memory_gb) == gb[0]]
        if exact or same:
            return (exact or same)[0]
    raise DeviceError(f"no device file for {name!r}; known: {', '.join(device_names())}")


# ---- GPUs: the operations of a layer ---------------------------------------------------------------
# A fused attention kernel's share of a GEMM's efficiency on the same tiles (its softmax, masking and
# rescaling between the two products): FlashAttention-2 reports 50-73 % of A100's dense peak where
# cuBLAS's GEMMs reach 80-90 %. A prior until scripts/gpu_profile.sh's attention grid says otherwise.
FLASH_SHARE = 0.75


def _s(x: float, half: float) -> float:
    return x / (x + half)


# cuBLAS's choice of output tiles, as (rows, columns, the tile's own share of the peak, tiles an SM runs at
# once): big tiles run closest to the peak but leave SMs idle on small outputs; the best choice wins.
TILES = ((256, 128, 1.0, 1), (128, 128, 0.95, 1), (128, 64, 0.85, 2), (64, 64, 0.7, 4))


def tile_efficiency(m: float, n: float, k: float, batch: float, sms: int, k_half: float) -> float:
    """The share of the peak ``batch`` GEMMs of (m x k) @ (k x n) can reach on ``sms`` SMs: per tile
    shape, the padding of the last tile row and column, the last wave's idle SMs and the depth each
    tile's main loop runs (K / (K + k_half)); split-K where the output has too few tiles to fill the
    SMs (K cut into up to 8 parts of at least 256, each part a tile of its own, 5 % for summing them);
    the best choice, as cuBLAS's heuristics pick."""
    best = 0.0
    for tm, tn, rel, per_sm in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        pad = m * n * batch / (tiles * tm * tn)
        slots = sms * per_sm
        for split in (1, 2, 4, 8):
            if split > 1 and k / split < 256:
                break
            t = tiles * split
            wave = t / (math.ceil(t / slots) * slots)
            depth = _s(k / split, k_half)
            best = max(best, rel * pad * wave * depth * (1.0 if split == 1 else 0.95))
    return best


# The layer's linear GEMMs (``GpuCompute.layer_ops``' names): what fp8 speeds up and a tensor-parallel
# collective can overlap.
LINEAR_OPS = frozenset(f"{name}{phase}" for name in ("qkv", "proj", "fc", "fc proj")
                       for phase in ("", " dgrad", " wgrad"))


@dataclass(frozen=True)
class GpuCompute(ComputeModel):
    """A GPU from its device file, operation by operation (see the module docstring).

    precision: fp32, or bf16 / fp16 (mixed: GEMMs and activations in the half type, weight gradients
    accumulated and the optimizer run in fp32); attention: ``flash`` (one fused kernel, causal blocks
    skipped) or ``materialized`` (scores written out, a softmax and a dropout pass over them, as the
    V100-era stacks ran); optimizer: ``single`` (torch's Adam, a few kernels per parameter tensor) or
    ``fused`` (one multi-tensor kernel, apex's as Megatron runs it); overhead: per-system Overheads;
    update_rule: ``adam``, ``sgd`` (plain: no state) or ``sgd_momentum`` (one momentum buffer);
    sequence_parallel: the norms, residual adds and dropouts of a layer (and ln_f) split along the
    sequence over the tp ranks (Megatron's, Korthikanti et al. 2022); gemm_precision: the precision
    of the layers' linear GEMMs where it is not ``precision`` (``fp8``: TransformerEngine's, on a part
    with fp8 tensor cores; a half ``precision`` around it), the attention core, the output layer and
    every memory-bound operation staying in ``precision``."""

    device: Device
    model: ModelConfig
    precision: str = "fp32"
    attention: str = "flash"
    optimizer_kind: str = "single"
    overhead: dict = field(default_factory=dict)
    update_rule: str = "adam"
    sequence_parallel: bool = False
    gemm_precision: str | None = None
    name = "gpu"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DeviceError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.attention not in ATTENTION:
            raise DeviceError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.optimizer_kind not in OPTIMIZER_KERNELS:
            raise DeviceError(f"optimizer must be one of {', '.join(OPTIMIZER_KERNELS)}, got {self.optimizer_kind!r}")
        if self.update_rule not in OPTIMIZERS:
            raise DeviceError(f"update rule must be one of {', '.join(OPTIMIZERS)}, got {self.update_rule!r}")
        if self.gemm_precision not in (None, self.precision, "fp8"):
            raise DeviceError(f"gemm precision must be the run's ({self.precision}) or fp8, "
                              f"got {self.gemm_precision!r}")
        if self.gemm_precision == "fp8":
            if self.precision == "fp32":
                raise DeviceError("fp8 GEMMs run inside a half precision (bf16 or fp16), not fp32")
            self.device.gemm_curve("fp8")  # DeviceError where the part has none

    # -- primitives ------------------------------------------------------------------------------
    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def gemm(self, m: float, n: float, k: float, batch: float = 1, out_bytes: float | None = None,
             accumulate: bool = False, precision: str | None = None) -> float:
        """Seconds of ``batch`` GEMMs of (m x k) @ (k x n) on the GPU: the slower of its math (at
        ``precision``'s peak and curve; None: the run's) and its bytes (inputs in the activation type,
        the output in ``out_bytes`` per element, read back too where it ``accumulate``s), plus one
        kernel's fixed cost."""
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        dev = self.device
        precision = precision or self.precision
        e_max, half = dev.gemm_curve(precision)
        eff = e_max * tile_efficiency(m, n, k, batch, dev.sms, half)
        math_s = 2.0 * m * n * k * batch / (dev.peak_flops(precision) * eff)
        ob = self.act_bytes if out_bytes is None else out_bytes
        nbytes = batch * ((m * k + k * n) * self.act_bytes + m * n * ob * (2 if accumulate else 1))
        return max(math_s, nbytes / (dev.bandwidth_gbs * 1e9 * dev.memory_efficiency)) + dev.kernel_us * 1e-6

    def linear(self, m: float, n: float, k: float, out_bytes: float | None = None, accumulate: bool = False) -> float:
        """A layer's linear GEMM (qkv, proj, the MLP's; forward, input or weight gradient): at the GEMM
        precision (``gemm_precision``)."""
        return self.gemm(m, n, k, 1, out_bytes, accumulate, self.gemm_precision)

    def memory(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of memory-bound kernels moving ``nbytes`` in all."""
        dev = self.device
        return nbytes / (dev.bandwidth_gbs * 1e9 * dev.memory_efficiency) + kernels * dev.kernel_us * 1e-6

    def phase(self, ops: list[tuple[str, float, int]]) -> float:
        """A phase's seconds: its kernels one after another on the GPU, or the host's time to issue
        them where that is longer (a thin slice's many small kernels)."""
        gpu = sum(t for _, t, _ in ops)
        kernels = sum(k for _, _, k in ops)
        return max(gpu, kernels * self.device.host_op_us * 1e-6)

    # -- a layer ---------------------------------------------------------------------------------
    def layer_ops(self, kind: str, b: int, l: int, c: int, tp: int = 1) -> list[tuple[str, float, int]]:
        """(operation, GPU seconds, kernels) of one layer's ``kind`` (forward, backward_input, wgrad)
        on b x l tokens after c, on one of tp tensor-parallel ranks. The family's shapes: q of the
        query heads, k and v of the key/value heads (``qkv_rows``); gpt's MLP c_fc and c_proj with GELU
        between, llama's gate and up (fused, 2 x ffn wide) and down with SwiGLU between, its query and
        key heads rotated, no biases. The linears' GEMMs (``LINEAR_OPS``) run at the GEMM precision;
        under sequence parallelism the norms and residual adds see 1/tp of the tokens."""
        m, h = self.model, self.model.n_embd
        T, a = b * l, self.act_bytes
        Tn = T / tp if self.sequence_parallel else T  # the tokens a norm or residual add sees
        heads = max(1, m.n_head // tp)
        ht = h / tp  # this rank's share of the query heads' width
        qkv = ht * (1 + 2 * m.n_kv_head / m.n_head)  # of the fused q, k and v (gpt: 3 ht)
        kvt = ht * m.n_kv_head / m.n_head  # of k (and of v)
        ft = m.ffn_dim / h * ht  # of the MLP's hidden width (gpt: 4 ht)
        fc = 2 * ft if m.llama else ft  # of c_fc's output (llama: gate and up)
        keys = c + l  # the keys each query of the slice is scored against
        mem, lin = self.memory, self.linear
        mat = self.attention == "materialized"
        act, rope = ("swiglu", 3) if m.llama else ("gelu", 2)  # the activation and the elements it moves per ft
        if kind == "forward":
            ops = [("ln_1", mem(2 * Tn * h * a), 1), ("qkv", lin(T, qkv, h), 1),
                   ("split heads", mem(2 * T * qkv * a), 1)]
            if m.llama:
                ops.append(("rotary", mem(2 * T * (ht + kvt) * a), 1))
            ops += self.attention_ops(b, l, c, tp)
            ops += [("merge heads", mem(2 * T * ht * a), 1), ("proj", lin(T, h, ht), 1),
                    ("residual", mem(3 * Tn * h * a), 1), ("ln_2", mem(2 * Tn * h * a), 1),
                    ("fc", lin(T, fc, h), 1), (act, mem(rope * T * ft * a), 1),
                    ("fc proj", lin(T, h, ft), 1), ("residual", mem(3 * Tn * h * a), 1)]
            return ops
        if kind == "backward_input":
            ops = [("residual", mem(2 * Tn * h * a), 1), ("fc proj dgrad", lin(T, ft, h), 1),
                   (act, mem((rope + 1) * T * ft * a + (T * ft * a if m.llama else 0)), 1),
                   ("fc dgrad", lin(T, h, fc), 1),
                   ("ln_2", mem(5 * Tn * h * a), 2), ("proj dgrad", lin(T, ht, h), 1),
                   ("merge heads", mem(2 * T * ht * a), 1)]
            if mat:
                s = b * heads * l * keys
                ops += [("attention dropout", mem(2 * s * a + s), 1),
                        ("context dgrad", self.gemm(l, keys, m.head_dim, b * heads), 1),
                        ("value grad", self.gemm(keys, m.head_dim, l, b * heads), 1),
                        ("softmax", mem(3 * s * a), 1),
                        ("query grad", self.gemm(l, m.head_dim, keys, b * heads), 1),
                        ("key grad", self.gemm(keys, m.head_dim, l, b * heads), 1)]
            else:
                ops.append(("attention", self._flash(b, l, c, heads, m.head_dim, 2.5, max(1, m.n_kv_head // tp)), 2))
            if c:  # the context's key and value gradients, accumulated for the earlier slices
                ops.append(("context kv grad", mem(3 * b * c * 2 * kvt * 4), 1))
            if m.llama:
                ops.append(("rotary", mem(2 * T * (ht + kvt) * a), 1))
            ops += [("split heads", mem(2 * T * qkv * a), 1), ("qkv dgrad", lin(T, h, qkv), 1),
                    ("ln_1", mem(5 * Tn * h * a), 2)]
            return ops
        if kind == "wgrad":  # each linear's weight gradient over the slice's tokens, summed in fp32 (and its bias's)
            ops = []
            for name, n_in, n_out in (("qkv", h, qkv), ("proj", ht, h), ("fc", h, fc), ("fc proj", ft, h)):
                ops.append((f"{name} wgrad", lin(n_in, n_out, T, out_bytes=4, accumulate=True), 1))
                if not m.llama:
                    ops.append((f"{name} bias grad", mem(T * n_out * a + 8 * n_out), 1))
            return ops
        raise ValueError(f"unknown layer phase {kind!r}")

    def attention_ops(self, b: int, l: int, c: int, tp: int = 1) -> list[tuple[str, float, int]]:
        """The attention core's forward on one of tp ranks: the scores, their softmax and dropout and the
        context (materialised), or one fused kernel."""
        m = self.model
        heads, hd = max(1, m.n_head // tp), m.head_dim
        if self.attention != "materialized":
            return [("attention", self._flash(b, l, c, heads, hd, 1.0, max(1, m.n_kv_head // tp)), 1)]
        keys, a = c + l, self.act_bytes
        s = b * heads * l * keys  # score elements
        return [("scores", self.gemm(l, keys, hd, b * heads), 1), ("softmax", self.memory(2 * s * a), 1),
                ("attention dropout", self.memory(2 * s * a + s), 1), ("context", self.gemm(l, hd, keys, b * heads), 1)]

    def attention_forward(self, b, l, c, tp=1):
        return self._cached(("a", b, l, c, tp), lambda: self.phase(self.attention_ops(b, l, c, tp)))

    def linear_time(self, kind, b, l, c, tp=1):
        return self._cached(("lin", kind, b, l, c, tp),
                            lambda: sum(t for name, t, _ in self.layer_ops(kind, b, l, c, tp) if name in LINEAR_OPS))

    def _flash(self, b: int, l: int, c: int, heads: int, hd: int, factor: float, kv_heads: int | None = None) -> float:
        """A fused attention kernel: the slice's queries against its c + l keys (the causal square's
        masked half skipped), ``factor`` times the forward's math (2.5 for the backward, which
        recomputes the scores), its bytes those of q and the output (``heads``) and of k and v
        (``kv_heads``, None: ``heads``)."""
        kv_heads = heads if kv_heads is None else kv_heads
        e_max, half = self.device.gemm_curve(self.precision)
        eff = FLASH_SHARE * e_max * tile_efficiency(l, hd, c + l, b * heads, self.device.sms, half)
        flops = factor * 4.0 * b * heads * l * (c + l / 2) * hd
        nbytes = factor * b * hd * (2 * l * heads + 2 * (c + l) * kv_heads) * self.act_bytes
        t = max(flops / (self.device.peak_flops(self.precision) * eff),
                nbytes / (self.device.bandwidth_gbs * 1e9 * self.device.memory_efficiency))
        return t + self.device.kernel_us * 1e-6

    def _cached(self, key: tuple, fn) -> float:
        cache = self.__dict__.setdefault("_times", {})
        if key not in cache:
            cache[key] = fn()
        return cache[key]

    def layer_forward(self, b, l, c, tp=1):
        return self._cached(("f", b, l, c, tp), lambda: self.phase(self.layer_ops("forward", b, l, c, tp)))

    def layer_backward_input(self, b, l, c, tp=1):
        return self._cached(("b", b, l, c, tp), lambda: self.phase(self.layer_ops("backward_input", b, l, c, tp)))

    def layer_wgrad(self, b, l, tp=1):
        return self._cached(("w", b, l, tp), lambda: self.phase(self.layer_ops("wgrad", b, l, 0, tp)))

    # -- the head, the embeddings, the optimizer -------------------------------------------------
    def head_ops(self, kind: str, tokens: int, tp: int = 1, width: int | None = None) -> list[tuple[str, float, int]]:
        h, a = self.model.n_embd, self.act_bytes
        v = (self.model.vocab_size if width is None else width) / tp
        if v == 0:
            return []
        tn = tokens / tp if self.sequence_parallel else tokens  # ln_f's tokens
        if kind == "forward":  # ln_f, the logits, the loss on fp32 logits (a cast, log-softmax, the pick)
            return [("ln_f", self.memory(2 * tn * h * a), 1), ("logits", self.gemm(tokens, v, h), 1),
                    ("loss", self.memory(tokens * v * (a + 4 * 3)), 3)]
        if kind == "backward_input":
            return [("loss", self.memory(tokens * v * (4 * 2 + 2 * a)), 2),
                    ("logits dgrad", self.gemm(tokens, h, v), 1),
                    ("ln_f", self.memory(5 * tn * h * a), 2)]
        if kind == "wgrad":
            return [("logits wgrad", self.gemm(h, v, tokens, out_bytes=4, accumulate=True), 1)]
        raise ValueError(f"unknown head phase {kind!r}")

    def head_forward(self, tokens, tp=1, width=None):
        return self._cached(("hf", tokens, tp, width), lambda: self.phase(self.head_ops("forward", tokens, tp, width)))

    def head_backward_input(self, tokens, tp=1, width=None):
        return self._cached(("hb", tokens, tp, width),
                            lambda: self.phase(self.head_ops("backward_input", tokens, tp, width)))

    def head_wgrad(self, tokens, tp=1, width=None):
        return self._cached(("hw", tokens, tp, width), lambda: self.phase(self.head_ops("wgrad", tokens, tp, width)))

    def embed(self, tokens):
        """Token and (gpt) position embeddings: the gather and sum forward; backward a dense gradient of the
        whole table (zeroed, then the tokens' rows added: eager PyTorch's embedding backward)."""
        m, a = self.model, self.act_bytes
        if not m.vocab_size:
            return 0.0
        fwd = [("embed", self.memory(tokens * m.n_embd * (3 * a)), 2)]
        table = (m.vocab_size + (0 if m.llama else m.seq_len)) * m.n_embd * 4 * 2  # llama: no position table
        bwd = [("embed grad", self.memory(table + 2 * tokens * m.n_embd * 4), 3)]
        return self.phase(fwd) + self.phase(bwd)

    def optimizer(self, params):
        """The update of ``params`` parameters. Adam: fused, 28 bytes a parameter (weight, gradient and
        two moments read, three written); torch's single-tensor Adam makes about seven passes more (72
        bytes) in a few kernels per tensor. SGD: 12 bytes (weight and gradient read, weight written), with
        momentum 20 (the buffer read and written too; single-tensor: one pass more, 28). Mixed precision:
        4 bytes more to keep the half copy."""
        fused = self.optimizer_kind == "fused"
        per, passes = {"adam": (28 if fused else 72, 7), "sgd": (12, 1),
                       "sgd_momentum": (20 if fused else 28, 2)}[self.update_rule]
        if self.precision != "fp32":
            per += 4
        kernels = 2 if fused else max(1, int(passes * params / 4e6))
        return self.memory(params * per, kernels)

    def overheads(self, system):
        return self.overhead.get(system, Overheads())

    def with_device(self, device: Device) -> "GpuCompute":
        return replace(self, device=device)


def gpu_compute(device: str | Device, model: ModelConfig, precision: str = "fp32", attention: str | None = None,
                optimizer: str = "single") -> GpuCompute:
    """A GpuCompute from a device file (by name or path); ``attention`` None: the era's kernels
    (``default_attention``)."""
    dev = device if isinstance(device, Device) else find_device(device)
    return GpuCompute(dev, model, precision, attention or default_attention(dev), optimizer)


def default_attention(device: Device) -> str:
    """The attention kernels a stack ran on this GPU: materialised scores on V100s (the fused kernels of
    today need sm80), one fused kernel from A100 on."""
    return "materialized" if device.part.startswith("V100") else "flash"


# ---- this machine: a profile of one thread -----------------------------------------------------------
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


def local_prediction(x: list[float], y: list[float], i: int, half: int = 3) -> float:
    """y at x[i] from its neighbours only: the median of the lines through every pair of them within
    ``half`` positions (exact on locally linear data, robust to a few outliers nearby)."""
    n = len(y)
    nb = [j for j in range(max(0, i - half), min(n, i + half + 1)) if j != i]
    preds = sorted(y[j] + (y[k] - y[j]) * (x[i] - x[j]) / (x[k] - x[j])
                   for a, j in enumerate(nb) for k in nb[a + 1:] if x[k] != x[j])
    if not preds:
        return float(y[i])
    mid = len(preds) // 2
    return preds[mid] if len(preds) % 2 else (preds[mid - 1] + preds[mid]) / 2


def clean_outliers(x: list[float], y: list[float], tol: float = 0.25, half: int = 3) -> tuple[list[float], list[bool]]:
    """Measurements on a shared machine have bursts of contention: a point more than ``tol`` off the
    prediction of its neighbours (``local_prediction``) is replaced by interpolation of the kept ones.
    Returns (cleaned y, which points were dropped)."""
    x, y = [float(v) for v in x], [float(v) for v in y]
    if len(y) < 4:
        return y, [False] * len(y)
    pred = [local_prediction(x, y, i, half) for i in range(len(y))]
    bad = [abs(y[i] - pred[i]) > tol * abs(pred[i]) for i in range(len(y))]
    if sum(bad) > len(y) // 2:
        return y, [False] * len(y)
    kx = [x[i] for i in range(len(y)) if not bad[i]]
    ky = [y[i] for i in range(len(y)) if not bad[i]]
    out = [(_interp_clamped(x[i], kx, ky) if bad[i] else y[i]) for i in range(len(y))]
    return out, bad


def _interp_clamped(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear, extrapolated linearly above the grid and clamped below it."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2])
    return _interp(x, xs, ys)


def isotonic(y: list[float]) -> list[float]:
    """The non-decreasing sequence closest to y in least squares (pool adjacent violators)."""
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for v in y:
        vals.append(float(v)), wts.append(1.0), lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w
            n = lens[-2] + lens[-1]
            vals[-2:], wts[-2:], lens[-2:] = [v2], [w], [n]
    return [v for v, n in zip(vals, lens) for _ in range(n)]


@dataclass(frozen=True)
class Table3:
    """t(b, l, c) from measurements on a grid: per b (nearest profiled b, scaled linearly), piecewise
    linear in l at c = 0 plus a term linear in c and l*c fitted to the points with c > 0 (relative
    least squares: a thin slice's point weighs as much as a long one's)."""

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
        """Least squares of t(l, c) - t(l, 0) = kc c + klc l c over the points with c > 0 (>= 0), each
        point's equation divided by its measured t(l, c): relative errors, so that the fixed part kc c
        (the cached keys and values read whatever the slice's length) is fitted on the thin slices
        too, not drowned by the long ones."""
        cache = self.__dict__.setdefault("_terms", {})
        if bb not in cache:
            cache[bb] = self._fit_context(bb)
        return cache[bb]

    def _fit_context(self, bb: int) -> tuple[float, float]:
        zero = sorted((p[1], p[3]) for p in self.points if p[0] == bb and p[2] == 0)
        xs, ys = [z[0] for z in zero], [z[1] for z in zero]
        rows = [(p[2] / p[3], p[1] * p[2] / p[3], (p[3] - _interp(p[1], xs, ys)) / p[3])
                for p in self.points if p[0] == bb and p[2] > 0 and p[3] > 0]
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


ENGINE_PHASES = ("forward", "backward", "wgrad")  # a profile's ``engine`` fits, per phase of a unit


@dataclass(frozen=True)
class CpuCompute(ComputeModel):
    """This machine, one thread per rank, from a profile (``ours.plan.profile``) and calibrated
    overheads per system. Tensor parallelism divides the math by tp (an estimate; not profiled)."""

    profile: dict
    overhead: dict = field(default_factory=dict)  # system -> Overheads
    name = "cpu"

    def _table(self, key: str, grid: str = "layer") -> Table3:
        """The profile's points of one quantity of ``grid`` ("layer": the shared model's layer; "slice":
        ours' engine's layer on a token slice); at c = 0 cleaned of contention outliers (points more
        than 25 % off what their neighbours predict) and made non-decreasing in l, so that a
        measurement slowed by contention does not make a longer slice look cheaper."""
        cache = self.__dict__.setdefault("_tables", {})
        if (grid, key) not in cache:
            pts = [(p["b"], p["l"], p["c"], p[key]) for p in self.profile[grid]]
            out = [q for q in pts if q[2] > 0]
            for b in sorted({q[0] for q in pts}):
                row = sorted(q for q in pts if q[0] == b and q[2] == 0)
                ys, _ = clean_outliers([q[1] for q in row], [q[3] for q in row])
                out += [(b, l, 0, float(t)) for (_, l, _, _), t in zip(row, isotonic(ys))]
            cache[grid, key] = Table3(tuple(out))
        return cache[grid, key]

    def layer_forward(self, b, l, c, tp=1):
        return self._table("fwd")(b, l, c) / tp

    def layer_backward_input(self, b, l, c, tp=1):
        return self._table("bwd_in")(b, l, c) / tp

    def layer_wgrad(self, b, l, tp=1):
        return max(0.0, self._table("wgrad")(b, l, 0)) / tp

    def slice_layer(self, b, l, c, tp=1):
        """ours' engine's own layer on a token slice (its sliced attention over the cached keys and
        values, its deferred-gradient linears), where the profile measured it (``slice``), times what
        the engine's layers took beyond it in a two-rank run (``engine``'s scale); else the shared
        layer's."""
        if not self.profile.get("slice"):
            return super().slice_layer(b, l, c, tp)
        times = (self._table("fwd", "slice")(b, l, c), self._table("bwd_in", "slice")(b, l, c),
                 max(0.0, self._table("wgrad", "slice")(b, l, 0)))
        return tuple(t * self._engine_scale(k) / tp for t, k in zip(times, ENGINE_PHASES))

    def _engine_scale(self, phase: str) -> float:
        e = (self.profile.get("engine") or {}).get(phase) or {}
        return max(0.5, 1.0 + e.get("scale", 0.0))

    def engine_unit(self, layers):
        """The engine's own time per unit from the profile (``engine``: per phase, a part per unit and a
        part per layer, fitted to ours' engine traced in a two-rank run; none where it has no such field)."""
        e = self.profile.get("engine")
        if not e:
            return super().engine_unit(layers)
        return tuple(max(0.0, e[k]["unit"] + e[k]["layer"] * layers) for k in ENGINE_PHASES)

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


# ---- what a stage holds ------------------------------------------------------------------------------
def stage_params(model: ModelConfig, layers: int, first: bool, last: bool, tp: int = 1,
                 head: int | None = None) -> int:
    """Parameters a stage (or one tensor-parallel rank of it) holds; ``head``: the output layer's width
    (None: the vocabulary; 0: none)."""
    h = model.n_embd
    n = layers * block_params(model) // tp
    if first and model.vocab_size:  # vocabulary 0: no embeddings
        n += (model.vocab_size * h) // tp + (0 if model.llama else model.seq_len * h)
    if last:
        n += norm_params(model) + ((model.vocab_size if head is None else head) * h) // tp
    return n


def fmt_seconds(t: float) -> str:
    return "inf" if math.isinf(t) else f"{t:.4g} s"
