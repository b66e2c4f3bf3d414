"""Scenario files: a training run on a GPU cluster described whole, without the run command's CPU
defaults, and its predicted step (``python -m predict scenario FILE.toml [--json]``).

    [model]
    layers = 24            # transformer layers
    hidden = 2048
    heads = 16
    seq_len = 2048
    vocab = 50257          # 0: no embeddings
    head = "lm"            # "lm" (the vocabulary), "classifier:N" (N outputs), "none"

    [cluster]
    gpu = "V100 SXM2 16GB" # a device file's name (workload/devices)
    nodes = 12
    gpus_per_node = 1
    intra_gbps = 1000      # between two GPUs of a node, per GPU (default: the device file's NVLink)
    intra_delay_ms = 0.005
    inter_gbps = 10        # between nodes: one network card per node, shared by its GPUs
    inter_delay_ms = 0.1
    # or: matrix = "two-sites.json" (beside the scenario) or [cluster.matrix] with delay_ms and
    # bandwidth_gbps, node x node (the run command's per-link format)

    [run]
    system = "gpipe"       # gpipe (the seed's, as DT-FM ran it), torch_pipe, megatron, fairscale_fsdp, ours
    tp = 1
    pp = 12
    dp = 1
    batch = 64             # global: batch / dp sequences per pipeline
    micro_batch = 1
    precision = "fp32"     # fp32, bf16, fp16
    recompute = true       # default false
    schedule = "gpipe"     # default: the system's (gpipe; megatron and ours 1f1b)
    dp_mode = "central_ps" # default: the system's (gpipe central_ps, ours allreduce, megatron allreduce,
                           # torch_pipe and fairscale fsdp)
    n_slices = "auto"      # ours: a number of equal token slices, or "auto" (the planner)
    attention = "materialized"  # optional: "flash" or "materialized" (default: the GPU's era)
    optimizer = "adam"     # optional: "adam" (default), "sgd" (no state) or "sgd_momentum" (one buffer)

A required key that is missing, an unknown key or a value that cannot be is a ``ScenarioError`` (one
line naming the key). The answer: the step time and its parts, the fullest GPU's memory, and
``oom`` (with that estimate) where it does not fit the GPU.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from predict.run_spec import Cluster, Link, RunSpec
from workload.compute import (UPDATE_RULES, Device, DeviceError, GpuCompute, default_attention, find_device,
                              read_data)
from workload.configs import ModelConfig
from workload.memory import GB, Memory, rank_memory

SYSTEMS = ("gpipe", "torch_pipe", "megatron", "fairscale_fsdp", "ours")
SCHEDULES = {"gpipe": ("gpipe",), "torch_pipe": ("gpipe", "1f1b", "interleaved"), "megatron": ("1f1b", "interleaved"),
             "fairscale_fsdp": ("gpipe",), "ours": ("1f1b", "gpipe")}
DP_MODES = {"gpipe": ("central_ps", "sharded_ps", "allreduce"), "torch_pipe": ("fsdp",), "megatron": ("allreduce",),
            "fairscale_fsdp": ("fsdp",), "ours": ("allreduce", "central_ps", "sharded_ps")}
KEYS = {
    "model": {"layers": True, "hidden": True, "heads": True, "seq_len": True, "vocab": True, "head": False},
    "cluster": {"gpu": True, "nodes": True, "gpus_per_node": True, "intra_gbps": False, "intra_delay_ms": False,
                "inter_gbps": False, "inter_delay_ms": False, "matrix": False},
    "run": {"system": True, "tp": True, "pp": True, "dp": True, "batch": True, "micro_batch": True,
            "precision": True, "recompute": False, "schedule": False, "dp_mode": False, "n_slices": False,
            "attention": False, "virtual_pp": False, "optimizer": False},
}
# Inside a node, when the scenario does not say: NCCL's all-reduce bus bandwidth over the part's NVLink
# (DGX-1-class V100 SXM2 hybrid cube mesh; NVSwitch on A100 / H100 / H200), per GPU.
NVLINK_GBPS = {"V100": 1000.0, "A100": 1900.0, "H100": 3600.0, "H200": 3600.0}
NVLINK_DELAY_MS = 0.005


class ScenarioError(ValueError):
    """A scenario that cannot be predicted as written (one line)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelConfig
    head: int | None  # output width: None the vocabulary, 0 none
    device: Device
    cluster: Cluster
    system: str
    tp: int
    pp: int
    dp: int
    batch: int
    micro_batch: int
    precision: str
    recompute: bool
    schedule: str
    dp_mode: str
    n_slices: int | str
    attention: str
    virtual_pp: int = 1
    source: dict = field(default_factory=dict)
    optimizer: str = "adam"

    @property
    def batch_per_pipeline(self) -> int:
        return self.batch // self.dp


def _get(table: dict, section: str, key: str, kind, default=None):
    required = KEYS[section][key]
    if key not in table:
        if required:
            raise ScenarioError(f"[{section}] {key} is missing")
        return default
    v = table[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ScenarioError(f"[{section}] {key} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v or v in (float("inf"),)):
        raise ScenarioError(f"[{section}] {key} must be a finite number, got {v!r}")
    if kind is str and not isinstance(v, str):
        raise ScenarioError(f"[{section}] {key} must be a string, got {v!r}")
    if kind is bool and not isinstance(v, bool):
        raise ScenarioError(f"[{section}] {key} must be true or false, got {v!r}")
    return float(v) if kind is float else v


def _positive(section: str, key: str, v, zero: bool = False):
    if v < 0 or (v == 0 and not zero):
        raise ScenarioError(f"[{section}] {key} must be {'>= 0' if zero else '> 0'}, got {v!r}")
    return v


def _link(section: str, gbps_key: str, delay_key: str, gbps: float | None, delay_ms: float | None) -> Link | None:
    if gbps is None:
        if delay_ms is not None:
            raise ScenarioError(f"[{section}] {delay_key} given without {gbps_key}")
        return None
    _positive(section, gbps_key, gbps)
    _positive(section, delay_key, delay_ms or 0.0, zero=True)
    return Link.from_ms_gbps(delay_ms or 0.0, gbps)


def _matrix(value, base: Path, nodes: int) -> tuple:
    if isinstance(value, str):
        path = (base / value) if not Path(value).is_absolute() else Path(value)
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ScenarioError(f"[cluster] matrix {value!r}: cannot read {path} ({exc.__class__.__name__})") from None
    if not isinstance(value, dict) or "delay_ms" not in value or "bandwidth_gbps" not in value:
        raise ScenarioError("[cluster] matrix needs delay_ms and bandwidth_gbps, node x node")
    delay, bw = value["delay_ms"], value["bandwidth_gbps"]
    if len(delay) != nodes or len(bw) != nodes or any(len(r) != nodes for r in delay + bw):
        raise ScenarioError(f"[cluster] matrix must be {nodes} x {nodes} (one row and column per node)")
    rows = []
    for a in range(nodes):
        row = []
        for b in range(nodes):
            if a == b:
                row.append(None)
                continue
            d, g = delay[a][b], bw[a][b]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x != float("inf")
                       for x in (d, g)) or d < 0 or g <= 0:
                raise ScenarioError(f"[cluster] matrix[{a}][{b}]: delay must be >= 0 ms and bandwidth > 0 Gbit/s, "
                                    f"got {d!r} ms, {g!r} Gbit/s")
            row.append(Link.from_ms_gbps(float(d), float(g)))
        rows.append(tuple(row))
    return tuple(rows)


def parse(data: dict, name: str = "scenario", base: Path = Path(".")) -> Scenario:
    """A Scenario from a scenario file's contents (see the module docstring)."""
    for section in data:
        if section not in KEYS:
            raise ScenarioError(f"unknown section [{section}] (known: {', '.join(KEYS)})")
    for section in KEYS:
        if section not in data or not isinstance(data[section], dict):
            raise ScenarioError(f"[{section}] is missing")
        unknown = sorted(set(data[section]) - set(KEYS[section]))
        if unknown:
            raise ScenarioError(f"[{section}] unknown key {unknown[0]} (known: {', '.join(KEYS[section])})")
    m, c, r = data["model"], data["cluster"], data["run"]
    layers = _positive("model", "layers", _get(m, "model", "layers", int))
    hidden = _positive("model", "hidden", _get(m, "model", "hidden", int))
    heads = _positive("model", "heads", _get(m, "model", "heads", int))
    seq = _positive("model", "seq_len", _get(m, "model", "seq_len", int))
    vocab = _positive("model", "vocab", _get(m, "model", "vocab", int), zero=True)
    if hidden % heads:
        raise ScenarioError(f"[model] hidden {hidden} is not a multiple of heads {heads}")
    head_text = _get(m, "model", "head", str, "lm")
    if head_text == "lm":
        if not vocab:
            raise ScenarioError("[model] head = \"lm\" needs a vocabulary (vocab > 0)")
        head = None
    elif head_text == "none":
        head = 0
    elif head_text.startswith("classifier:") and head_text.split(":", 1)[1].isdigit() and int(head_text[11:]) > 0:
        head = int(head_text[11:])
    else:
        raise ScenarioError(f"[model] head must be \"lm\", \"classifier:N\" or \"none\", got {head_text!r}")
    model = ModelConfig(name, layers, hidden, heads, seq, vocab)

    gpu = _get(c, "cluster", "gpu", str)
    try:
        device = find_device(gpu)
    except DeviceError as exc:
        raise ScenarioError(f"[cluster] gpu: {exc}") from None
    nodes = _positive("cluster", "nodes", _get(c, "cluster", "nodes", int))
    per_node = _positive("cluster", "gpus_per_node", _get(c, "cluster", "gpus_per_node", int))
    intra = _link("cluster", "intra_gbps", "intra_delay_ms", _get(c, "cluster", "intra_gbps", float),
                  _get(c, "cluster", "intra_delay_ms", float))
    if intra is None:
        family = device.part.split()[0]
        intra = Link.from_ms_gbps(NVLINK_DELAY_MS, NVLINK_GBPS.get(family, 1000.0))
    inter = _link("cluster", "inter_gbps", "inter_delay_ms", _get(c, "cluster", "inter_gbps", float),
                  _get(c, "cluster", "inter_delay_ms", float))
    matrix = None
    if "matrix" in c:
        if inter is not None:
            raise ScenarioError("[cluster] give either inter_gbps / inter_delay_ms or matrix, not both")
        matrix = _matrix(c["matrix"], base, nodes)
    if nodes > 1 and inter is None and matrix is None:
        raise ScenarioError("[cluster] inter_gbps is missing (the link between nodes; or give matrix)")
    cluster = Cluster(nodes, per_node, intra, inter, matrix)

    system = _get(r, "run", "system", str)
    if system not in SYSTEMS:
        raise ScenarioError(f"[run] system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    tp = _positive("run", "tp", _get(r, "run", "tp", int))
    pp = _positive("run", "pp", _get(r, "run", "pp", int))
    dp = _positive("run", "dp", _get(r, "run", "dp", int))
    batch = _positive("run", "batch", _get(r, "run", "batch", int))
    micro = _positive("run", "micro_batch", _get(r, "run", "micro_batch", int))
    precision = _get(r, "run", "precision", str)
    if precision not in ("fp32", "bf16", "fp16"):
        raise ScenarioError(f"[run] precision must be fp32, bf16 or fp16, got {precision!r}")
    recompute = _get(r, "run", "recompute", bool, False)
    schedule = _get(r, "run", "schedule", str, SCHEDULES[system][0] if system != "ours" else "1f1b")
    if schedule not in SCHEDULES[system]:
        raise ScenarioError(f"[run] schedule {schedule!r} is not one of {system}'s: {', '.join(SCHEDULES[system])}")
    dp_mode = _get(r, "run", "dp_mode", str, DP_MODES[system][0])
    if dp_mode not in DP_MODES[system]:
        raise ScenarioError(f"[run] dp_mode {dp_mode!r} is not one of {system}'s: {', '.join(DP_MODES[system])}")
    n_slices = r.get("n_slices", "auto" if system == "ours" else 1)
    if system == "ours":
        if not (n_slices == "auto" or (isinstance(n_slices, int) and not isinstance(n_slices, bool)
                                       and 1 <= n_slices <= seq)):
            raise ScenarioError(f"[run] n_slices must be \"auto\" or an integer from 1 to {seq}, got {n_slices!r}")
    elif "n_slices" in r and n_slices != 1:
        raise ScenarioError(f"[run] n_slices is ours' (token slices); {system} runs whole sequences")
    attention = _get(r, "run", "attention", str, default_attention(device))
    if attention not in ("flash", "materialized"):
        raise ScenarioError(f"[run] attention must be \"flash\" or \"materialized\", got {attention!r}")
    virtual_pp = _positive("run", "virtual_pp", _get(r, "run", "virtual_pp", int, 1))
    optimizer = _get(r, "run", "optimizer", str, "adam")
    if optimizer not in UPDATE_RULES:
        raise ScenarioError(f"[run] optimizer must be one of {', '.join(UPDATE_RULES)}, got {optimizer!r}")
    if virtual_pp > 1 and schedule != "interleaved":
        raise ScenarioError("[run] virtual_pp > 1 needs schedule = \"interleaved\"")
    if tp > 1 and system in ("torch_pipe", "fairscale_fsdp"):
        raise ScenarioError(f"[run] {system} has no tensor parallelism (tp must be 1)")
    if batch % dp:
        raise ScenarioError(f"[run] batch {batch} does not divide over dp {dp}")
    if (batch // dp) % micro:
        raise ScenarioError(f"[run] {batch // dp} sequences per pipeline do not divide into micro-batches of {micro}")
    if layers % (pp * virtual_pp):
        raise ScenarioError(f"[run] {layers} layers do not divide into {pp * virtual_pp} stages")
    if heads % tp or hidden % tp:
        raise ScenarioError(f"[run] tp {tp} does not divide the heads ({heads}) and the hidden size ({hidden})")
    if tp * pp * dp > cluster.gpus:
        raise ScenarioError(f"[run] T-{tp} P-{pp} D-{dp} needs {tp * pp * dp} GPUs; the cluster has "
                            f"{nodes} x {per_node}")
    return Scenario(name, model, head, device, cluster, system, tp, pp, dp, batch, micro, precision, recompute,
                    schedule, dp_mode, n_slices, attention, virtual_pp, source=data, optimizer=optimizer)


def load(path: str | Path) -> Scenario:
    path = Path(path)
    return parse(read_data(path, "scenario file", ScenarioError, tomllib.loads), path.stem, path.parent)


def compute_of(sc: Scenario) -> GpuCompute:
    return GpuCompute(sc.device, sc.model, sc.precision, sc.attention,
                      "fused" if sc.system == "megatron" else "single", update_rule=sc.optimizer)


def memory_of(sc: Scenario, slices: tuple[int, ...] | None = None) -> Memory:
    dp_mode = "fsdp" if sc.system in ("torch_pipe", "fairscale_fsdp") else sc.dp_mode
    return rank_memory(sc.model, system=sc.system, tp=sc.tp, pp=sc.pp, dp=sc.dp, micro_batch=sc.micro_batch,
                       n_micro=sc.batch_per_pipeline // sc.micro_batch, precision=sc.precision,
                       recompute=sc.recompute, schedule=sc.schedule, attention=sc.attention,
                       dropout=sc.attention == "materialized", dp_mode=dp_mode, head=sc.head,
                       virtual_pp=sc.virtual_pp, update_rule=sc.optimizer)


def spec_of(sc: Scenario, slices: tuple[int, ...] | None = None) -> RunSpec:
    """The simulator's run of a scenario; ours' token slices given, or K equal ones."""
    from ours import uniform_slices

    if sc.system in ("ours", "gpipe") and slices is None:
        slices = uniform_slices(sc.model.seq_len, 1 if sc.system == "gpipe" else int(sc.n_slices))
    dp_mode = {"fsdp": "allreduce", "central_ps": "chain_ps" if sc.system == "gpipe" else "central_ps"}.get(
        sc.dp_mode, sc.dp_mode)
    return RunSpec(sc.system, sc.model, batch_size=sc.batch_per_pipeline, micro_batch_size=sc.micro_batch,
                   link=sc.cluster.inter or sc.cluster.intra, pp=sc.pp, tp=sc.tp, dp=sc.dp, schedule=sc.schedule,
                   virtual_pp=sc.virtual_pp, slices=slices, dp_mode=dp_mode, precision=sc.precision,
                   recompute=sc.recompute, transport="nccl", head_classes=sc.head, cluster=sc.cluster)


def predict_scenario(sc: Scenario) -> dict:
    """The scenario's prediction as one JSON-able object: status (ok / oom), step_time_s (None where it
    does not fit), parts, memory, and ours' slicing."""
    from predict.step_time import predict

    cm = compute_of(sc)
    slices = None
    chosen = None
    if sc.system == "ours" and sc.n_slices == "auto":
        from ours.plan.planner import plan_for

        c = sc.cluster
        chosen = plan_for(cm, sc.model, tp=sc.tp, pp=sc.pp, batch=sc.batch_per_pipeline, micro_batch=sc.micro_batch,
                          recompute=sc.recompute, link=_stage_link(sc),
                          tp_link=c.intra if sc.tp <= c.gpus_per_node else (c.inter or _stage_link(sc)))
        slices = chosen.slices
    spec = spec_of(sc, slices)
    mem = memory_of(sc)
    usable = sc.device.usable_bytes()
    out = dict(scenario=sc.name, system=sc.system, layout=f"T-{sc.tp} P-{sc.pp} D-{sc.dp}", gpu=sc.device.name,
               precision=sc.precision, attention=sc.attention,
               memory_gb=round(mem.total / GB, 2), memory=mem.describe(), usable_gb=round(usable / GB, 2))
    if spec.slices is not None and sc.system == "ours":
        out["slices"] = list(spec.slices)
        out["n_slices"] = len(spec.slices)
    if mem.total > usable:
        return dict(out, status="oom", step_time_s=None, parts=None,
                    why=f"needs {mem.total / GB:.1f} GiB of the {usable / GB:.1f} GiB a {sc.device.name} holds")
    p = predict(spec, cm)
    opt = p.detail.get("optimizer", 0.0)
    parts = dict(compute=p.compute - opt, optimizer=opt, bubble=p.bubble, messages=p.exposed_comm,
                 dp_sync=p.dp_sync, other=p.overhead + p.barrier)
    return dict(out, status="ok", step_time_s=p.step_time, parts={k: round(v, 6) for k, v in parts.items()},
                critical_rank=p.critical_rank)


def _stage_link(sc: Scenario) -> Link:
    """The link between adjacent stages as the planner sees it: the nodes' link where a stage of T GPUs
    fills a node or more, else inside a node."""
    c = sc.cluster
    if c.nodes > 1 and sc.tp * sc.pp > c.gpus_per_node:
        return c.inter or min((l for row in c.matrix for l in row if l), key=lambda l: l.bandwidth)
    return c.intra


def line(res: dict) -> str:
    """One line of a prediction for people."""
    head = f"{res['scenario']}: {res['system']} {res['layout']} on {res['gpu']} ({res['precision']})"
    if res["status"] == "oom":
        return f"{head}: oom ({res['why']}; {res['memory']})"
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in res["parts"].items() if v)
    k = f", K={res['n_slices']}" if "n_slices" in res else ""
    return f"{head}{k}: predicted step {res['step_time_s']:.3f} s ({parts}); memory {res['memory']}"
