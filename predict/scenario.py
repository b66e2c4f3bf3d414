"""Scenario files: a training run on a GPU cluster described whole, and its predicted step
(``pipebench predict scenario FILE.toml [--json]``).

    [run]                  # a run, as `pipebench run --config FILE.toml` reads it: RunConfig's keys
    system = "megatron"    # any system of the registry, or "gpipe" (predict.systems: the seed's GPipe
                           # as DT-FM ran it, predicted only)
    model = "gpt3-xl"      # a model by name; its fields overridden as the run command's flags do:
    vocab_size = 28996     # num_layers, hidden_size, num_heads, seq_length, vocab_size
    tp = 4
    pp = 2
    dp = 6
    batch_size = 42        # per pipeline (the global batch: batch_size x dp), as everywhere
    micro_batch_size = 1
    precision = "fp16"     # fp32 (default), bf16, fp16
    recompute = true
    optimizer = "sgd_momentum"   # adam (default), sgd, sgd_momentum
    schedule = "1f1b"      # and every other option of the system, by its name (dp_mode, n_slices,
                           # virtual_pp, layers_per_stage = [5, 7, 7, 5] or "ends", ...); megatron
                           # also "zb1p", "zb2p" (predict.systems: the zero-bubble ZB-H1 and ZB-H2)

    [cluster]              # what only a cluster has
    gpu = "V100 SXM2 16GB" # a device file's name (workload/devices)
    nodes = 6
    gpus_per_node = 8
    intra_gbps = 1000      # between two GPUs of a node, per GPU (default: the device file's NVLink)
    intra_delay_ms = 0.005
    inter_gbps = 25        # between nodes: the bandwidth of one network card
    inter_delay_ms = 0.05
    nics_per_node = 1      # network cards a node (default 1: one card shared by the node's GPUs; = gpus_per_node:
                           # a rail-optimized fabric, each GPU its own card at inter_gbps), GPUs on cards round-robin
    flow_gbps = 10         # optional: a provider's limit on one TCP flow between two instances (AWS documents
                           # 5 Gbit/s outside a cluster placement group, 10 inside one; default: none)
    flows_per_message = 16 # with flow_gbps: the flows a message between nodes is spread over (NCCL's socket
                           # transport: NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD, on AWS 2 x 8 = 16 by
                           # default since NCCL 2.4.8, src/transport/net_socket.cc; elsewhere 1 x 1); a
                           # message then moves at min(inter_gbps, flows x flow_gbps) (default 1)
    # or: matrix = "two-sites.json" (beside the scenario) or [cluster.matrix] with delay_ms and
    # bandwidth_gbps, node x node (the run command's per-link format; no loss_pct, no jitter_ms)

    [predict]              # optional: what only a prediction has (the run command has no such thing)
    head = "classifier:2"  # the output layer: "lm" (the vocabulary; default), "classifier:N", "none"
    attention = "materialized"   # the attention kernels: "flash" or "materialized" (default: the GPU's era)
    gemm_precision = "fp8" # the layers' linear GEMMs at fp8 (TransformerEngine's, on H100 / H200; [run]
                           # precision bf16 or fp16 for everything else); default: the run's precision

``[run]`` is read and judged as the run command reads ``--config`` and judges a request (one
judgement; ``runners.request.config_from_table``), but for what this repository's build of a system
cannot run though the system as published can (``SystemOptions.check_build``: megatron's vocabulary
over --tp, which Megatron-LM pads). Its links are the ``[cluster]``'s, so ``network`` and the faults
(``network_trace``, ``slow_rank``, ``kill_replica``) are refused; keys that do not change a step
(``steps``, ``seed``, ``data``...) are accepted and change nothing. A missing key, an unknown key or
a value that cannot be is a ``ScenarioError`` (one line naming the key); so is a run the simulator
has no program for. The answer: the step time and its parts, the fullest GPU's memory, and ``oom``
(with that estimate) where it does not fit the GPU.

Megatron's options as the run command takes them, and what the simulator makes of them:
``sequence_parallel`` (the TP all-reduces a reduce-scatter and an all-gather, the norms' work and
activations over tp), ``recompute_granularity`` (``full`` or ``selective``, under ``recompute``),
``distributed_optimizer``, ``overlap_grad_reduce`` and ``overlap_param_gather`` (its DP collectives
bucket by bucket behind the backward and the next forward), and ``tp_comm_overlap``
(TransformerEngine's: accepted here, refused by the run command, which has no TransformerEngine).
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from contract import ConfigError, RunConfig
from predict.from_config import NotModelled, gpu_compute_of, memory_of as config_memory, spec_from_config
from contract.cli import toml_value
from contract.links import Link, given_link_error
from predict.run_spec import Cluster, RunSpec
from predict.stacks import StackError, stall_share
from predict.stacks import check as check_stack
from predict.systems import prediction_systems
from workload.compute import Device, DeviceError, GpuCompute, Overheads, default_attention, find_device, read_data
from workload.configs import ModelConfig
from workload.memory import GB, Memory

SECTIONS = {"run": True, "cluster": True, "predict": False}  # section -> required
CLUSTER_KEYS = {"gpu": True, "nodes": True, "gpus_per_node": True, "intra_gbps": False, "intra_delay_ms": False,
                "inter_gbps": False, "inter_delay_ms": False, "matrix": False, "nics_per_node": False,
                "flow_gbps": False, "flows_per_message": False}  # -> required
PREDICT_KEYS = ("head", "attention", "gemm_precision", "stack")
ATTENTION = ("flash", "materialized")
NOT_A_PREDICTION = {"network": "a scenario's links are its [cluster]'s",
                    "network_trace": "links that change are not modelled",
                    "slow_rank": "a straggler is not modelled", "kill_replica": "a killed replica is not modelled"}
# Inside a node, when the scenario does not say: NCCL's all-reduce bus bandwidth over the part's NVLink
# (DGX-1-class V100 SXM2 hybrid cube mesh; NVSwitch on A100 / H100 / H200), per GPU.
NVLINK_GBPS = {"V100": 1000.0, "A100": 1900.0, "H100": 3600.0, "H200": 3600.0}
NVLINK_DELAY_MS = 0.005
# A cluster's links are bounded far above an emulated link's (the run command's --network: 1 Tbit/s): a node's
# network cards together (eight 400 Gbit/s cards: 3.2 Tbit/s) and NVLink (7.2 Tbit/s on H100) exceed that.


class ScenarioError(ValueError):
    """A scenario that cannot be predicted as written (one line)."""


@dataclass(frozen=True)
class Scenario:
    """A scenario file read: its run (``config``, a judged RunConfig), the GPU and the cluster, and what
    only a prediction has: the output layer (``head``: None the vocabulary, 0 none, N classes) and the
    attention kernels."""

    name: str
    config: RunConfig
    device: Device
    cluster: Cluster
    attention: str
    head: int | None = None
    source: dict = field(default_factory=dict)
    gemm_precision: str | None = None
    """The layers' linear GEMMs' precision where not the run's (``fp8``)."""
    stack: str | None = None
    """The software stack and machines whose step the scenario describes (``predict.stacks``): what a
    whole step adds beyond its kernels; None: kernels only."""

    @property
    def system(self) -> str:
        return self.config.system

    @property
    def model(self) -> ModelConfig:
        return self.config.model


def _number(section: str, table: dict, key: str, kind=float, default=None):
    """A number of a table: an integer (``kind`` int) or a finite one; None/``default`` where absent."""
    if key not in table:
        return default
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or not math.isfinite(v):
        raise ScenarioError(f"[{section}] {key} must be {'an integer' if kind is int else 'a finite number'}, "
                            f"got {v!r}")
    return float(v) if kind is float else v


def _positive(section: str, key: str, v, zero: bool = False):
    if v < 0 or (v == 0 and not zero):
        raise ScenarioError(f"[{section}] {key} must be {'>= 0' if zero else '> 0'}, got {v!r}")
    return v


def _link_of(where: str, delay_ms, gbps) -> Link:
    """A link of a delay and a bandwidth, bounded as every link a person gives (``given_link_error``)."""
    why = given_link_error(delay_ms, gbps)
    if why:
        raise ScenarioError(f"{where}: {why}")
    return Link.from_ms_gbps(delay_ms, gbps)


def _link(c: dict, gbps_key: str, delay_key: str) -> Link | None:
    gbps, delay_ms = _number("cluster", c, gbps_key), _number("cluster", c, delay_key)
    if gbps is None:
        if delay_ms is not None:
            raise ScenarioError(f"[cluster] {delay_key} given without {gbps_key}")
        return None
    _positive("cluster", gbps_key, gbps)
    _positive("cluster", delay_key, delay_ms or 0.0, zero=True)
    return _link_of(f"[cluster] {gbps_key} / {delay_key}", delay_ms or 0.0, gbps)


def _matrix(value, base: Path, nodes: int) -> tuple:
    """A per-link matrix (the run command's format: delay_ms and bandwidth_gbps, node x node; lossless)."""
    if isinstance(value, str):
        path = (base / value) if not Path(value).is_absolute() else Path(value)
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ScenarioError(f"[cluster] matrix {value!r}: cannot read {path} ({exc.__class__.__name__})") from None
    if not isinstance(value, dict) or "delay_ms" not in value or "bandwidth_gbps" not in value:
        raise ScenarioError("[cluster] matrix needs delay_ms and bandwidth_gbps, node x node")
    unknown = sorted(set(value) - {"delay_ms", "bandwidth_gbps"})
    if unknown:
        why = "not modelled (the simulator's links deliver every message, each after the same delay)" \
            if set(unknown) & {"loss_pct", "jitter_ms"} else "unknown (known: delay_ms, bandwidth_gbps)"
        raise ScenarioError(f"[cluster] matrix {unknown[0]}: {why}")
    delay, bw = value["delay_ms"], value["bandwidth_gbps"]
    if not all(isinstance(m, list) and len(m) == nodes and all(isinstance(r, list) and len(r) == nodes for r in m)
               for m in (delay, bw)):
        raise ScenarioError(f"[cluster] matrix must be {nodes} x {nodes} (one row and column per node)")
    rows = []
    for a in range(nodes):
        row = []
        for b in range(nodes):
            if a == b:
                row.append(None)
                continue
            d, g = delay[a][b], bw[a][b]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                       for x in (d, g)) or d < 0 or g <= 0:
                raise ScenarioError(f"[cluster] matrix[{a}][{b}]: delay must be >= 0 ms and bandwidth > 0 Gbit/s, "
                                    f"got {d!r} ms, {g!r} Gbit/s")
            row.append(_link_of(f"[cluster] matrix[{a}][{b}]", float(d), float(g)))
        rows.append(tuple(row))
    return tuple(rows)


def _sections(data: dict) -> None:
    for section, value in data.items():
        if section not in SECTIONS:
            raise ScenarioError(f"unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if not isinstance(value, dict):
            raise ScenarioError(f"[{section}] must be a table")
    for section, required in SECTIONS.items():
        if required and section not in data:
            raise ScenarioError(f"[{section}] is missing")
    for section, known in (("cluster", CLUSTER_KEYS), ("predict", PREDICT_KEYS)):
        unknown = sorted(set(data.get(section, {})) - set(known))
        if unknown:
            raise ScenarioError(f"[{section}] unknown key {unknown[0]} (known: {', '.join(known)})")


def _run(table: dict) -> RunConfig:
    """The [run] table as the run command reads ``--config`` and judges a request, but for the limits
    of this repository's build of a system (``SystemOptions.check_build``)."""
    from runners.request import config_from_table

    for key, why in NOT_A_PREDICTION.items():
        if key in table:
            raise ScenarioError(f"[run] {key}: {why}")
    if table.get("device", "cuda") != "cuda":
        raise ScenarioError(f"[run] device = {table['device']!r}: a scenario runs on its [cluster]'s GPUs (cuda)")
    specs = prediction_systems()
    try:
        cfg, spec = config_from_table(table, specs)
        spec.validate(cfg, build=False)
    except ConfigError as exc:
        text = str(exc)
        raise ScenarioError(text if text.startswith("[run]") else f"[run] {text}") from None
    return cfg


def _cluster(c: dict, base: Path) -> tuple[Device, Cluster]:
    for key, required in CLUSTER_KEYS.items():
        if required and key not in c:
            raise ScenarioError(f"[cluster] {key} is missing")
    if not isinstance(c["gpu"], str):
        raise ScenarioError(f"[cluster] gpu must be a string, got {c['gpu']!r}")
    try:
        device = find_device(c["gpu"])
    except DeviceError as exc:
        raise ScenarioError(f"[cluster] gpu: {exc}") from None
    nodes = _positive("cluster", "nodes", _number("cluster", c, "nodes", int))
    per_node = _positive("cluster", "gpus_per_node", _number("cluster", c, "gpus_per_node", int))
    intra = _link(c, "intra_gbps", "intra_delay_ms")
    if intra is None:
        intra = Link.from_ms_gbps(NVLINK_DELAY_MS, NVLINK_GBPS.get(device.part.split()[0], 1000.0))
    inter = _link(c, "inter_gbps", "inter_delay_ms")
    matrix = None
    if "matrix" in c:
        if inter is not None:
            raise ScenarioError("[cluster] give either inter_gbps / inter_delay_ms or matrix, not both")
        matrix = _matrix(c["matrix"], base, nodes)
    if nodes > 1 and inter is None and matrix is None:
        raise ScenarioError("[cluster] inter_gbps is missing (the link between nodes; or give matrix)")
    nics = _positive("cluster", "nics_per_node", _number("cluster", c, "nics_per_node", int, 1))
    if per_node % nics:
        raise ScenarioError(f"[cluster] nics_per_node {nics} must divide gpus_per_node {per_node} (the GPUs map to "
                            "the cards round-robin)")
    if nics > 1 and matrix is not None:
        raise ScenarioError("[cluster] nics_per_node: a matrix gives every pair of nodes a link of its own")
    return device, Cluster(nodes, per_node, intra, _per_flow(c, inter, matrix), matrix, nics)


def _per_flow(c: dict, inter: Link | None, matrix) -> Link | None:
    """The link between nodes as a message reaches it under a per-flow limit (``flow_gbps``, spread over
    ``flows_per_message`` flows): min(the card, flows x the flow limit). The card's other messages queue
    behind it as before (one message at a time a port)."""
    flow = _number("cluster", c, "flow_gbps")
    flows = _number("cluster", c, "flows_per_message", int)
    if flow is None:
        if flows is not None:
            raise ScenarioError("[cluster] flows_per_message given without flow_gbps (the limit of one flow)")
        return inter
    _positive("cluster", "flow_gbps", flow)
    flows = _positive("cluster", "flows_per_message", 1 if flows is None else flows)
    if matrix is not None or inter is None:
        raise ScenarioError("[cluster] flow_gbps needs inter_gbps (a matrix gives each link's bandwidth as its "
                            "messages reach it)")
    rate = min(inter.bandwidth, flows * flow * 1e9 / 8)
    return replace(inter, bandwidth=rate)


def _head(p: dict) -> int | None:
    text = p.get("head", "lm")
    if text == "lm":
        return None
    if text == "none":
        return 0
    if isinstance(text, str) and text.startswith("classifier:") and text[11:].isdigit() and int(text[11:]) > 0:
        return int(text[11:])
    raise ScenarioError(f"[predict] head must be \"lm\", \"classifier:N\" or \"none\", got {text!r}")


def parse(data: dict, name: str = "scenario", base: Path = Path(".")) -> Scenario:
    """A Scenario from a scenario file's contents (see the module docstring)."""
    _sections(data)
    cfg = _run(data["run"])
    device, cluster = _cluster(data["cluster"], base)
    p = data.get("predict", {})
    attention = p.get("attention", default_attention(device))
    if attention not in ATTENTION:
        raise ScenarioError(f"[predict] attention must be \"flash\" or \"materialized\", got {attention!r}")
    gemm = _gemm_precision(p, cfg, device)
    gpus = cfg.pp * cfg.tp * cfg.dp
    if gpus > cluster.gpus:
        raise ScenarioError(f"[run] T-{cfg.tp} P-{cfg.pp} D-{cfg.dp} needs {gpus} GPUs; the cluster has "
                            f"{cluster.nodes} x {cluster.gpus_per_node}")
    stack = p.get("stack")
    if stack is not None:
        try:
            check_stack(stack if isinstance(stack, str) else repr(stack))
        except StackError as exc:
            raise ScenarioError(f"[predict] stack: {exc}") from None
    return Scenario(name, cfg, device, cluster, attention, _head(p), source=data, gemm_precision=gemm, stack=stack)


def _gemm_precision(p: dict, cfg: RunConfig, device: Device) -> str | None:
    """[predict] gemm_precision: None (the run's precision), or fp8 on a part that has it, inside a half
    precision run."""
    value = p.get("gemm_precision", cfg.precision)
    if value == cfg.precision:
        return None
    if value != "fp8":
        raise ScenarioError(f"[predict] gemm_precision must be the run's precision ({cfg.precision}) or \"fp8\", "
                            f"got {value!r}")
    if not device.has_fp8():
        raise ScenarioError(f"[predict] gemm_precision fp8: the {device.name} has no fp8 GEMMs (H100 and H200 do)")
    if cfg.precision == "fp32":
        raise ScenarioError("[predict] gemm_precision fp8 runs the GEMMs of a bf16 or fp16 run: [run] precision "
                            "is fp32")
    return value


def with_settings(data: dict, settings: list[str] | tuple[str, ...]) -> dict:
    """A scenario's contents with ``SECTION.KEY=VALUE`` settings applied in order (``pipebench predict
    scenario --set``): VALUE is read as a TOML value (``8``, ``true``, ``"zbv"``, ``[2, 2, 1, 1]``), else
    taken as a bare string (``--set run.schedule=zbv``). ``parse`` judges the result as it judges a file."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for setting in settings:
        where, eq, text = setting.partition("=")
        section, dot, key = where.strip().partition(".")
        key = key.strip()
        if not eq or not dot or not section or not key:
            raise ScenarioError(f"--set {setting!r}: give SECTION.KEY=VALUE (e.g. run.pp=4)")
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise ScenarioError(f"--set {setting!r}: [{section}] is not a table")
        table[key] = toml_value(text.strip())
    return out


def load(path: str | Path, settings: list[str] | tuple[str, ...] = ()) -> Scenario:
    """A scenario file, with ``settings`` (``with_settings``) applied before it is judged."""
    path = Path(path)
    data = with_settings(read_data(path, "scenario file", ScenarioError, tomllib.loads), settings)
    return parse(data, path.stem, path.parent)


def compute_of(sc: Scenario, stalls: float | None = None) -> GpuCompute:
    """The scenario's compute model: its GPU's kernels (its linear GEMMs in ``gemm_precision`` where set),
    its stack's stalls (``stalls``: this share instead of the stack's) as its system's factor over the
    modelled math."""
    cm = gpu_compute_of(sc.config, sc.device, sc.attention, sc.gemm_precision)
    share = stall_share(sc.stack, sc.device.part, sc.config.precision) if stalls is None else stalls
    if not share:
        return cm
    return replace(cm, overhead={**cm.overhead, sc.system: Overheads(compute=1.0 + share)})


def memory_of(sc: Scenario) -> Memory:
    """The fullest GPU's memory; the V100-era stacks' materialised attention keeps its dropout masks."""
    return config_memory(sc.config, sc.attention, sc.head, dropout=sc.attention == "materialized")


def spec_of(sc: Scenario, slices: tuple[int, ...] | None = None) -> RunSpec:
    """The simulator's run of a scenario; ours' token slices given, or its options' (K equal ones)."""
    c = sc.cluster
    try:
        return spec_from_config(sc.config, c.inter or c.intra, "nccl", compute_of(sc), slices=slices, cluster=c,
                                head=sc.head)
    except NotModelled as exc:
        raise ScenarioError(f"[run] {exc}") from None


def _planned_slices(sc: Scenario, cm: GpuCompute):
    """ours' 'auto' slicing: the planner's, over the links its stages and tensor-parallel groups cross."""
    from ours.plan.planner import plan_for

    c, cfg = sc.cluster, sc.config
    return plan_for(cm, cfg.model, tp=cfg.tp, pp=cfg.pp, batch=cfg.batch_size, micro_batch=cfg.micro_batch_size,
                    recompute=cfg.recompute, link=_stage_link(sc),
                    tp_link=c.intra if cfg.tp <= c.gpus_per_node else (c.inter or _stage_link(sc)))


def predict_scenario(sc: Scenario, stalls: float | None = None) -> dict:
    """The scenario's prediction as one JSON-able object: status (ok / oom), step_time_s (None where it
    does not fit), parts (the math, the stack's stalls, the optimizer, the bubble, exposed messages, the DP
    sync, the rest), memory, and ours' slicing (``stalls``: this stall share instead of the stack's).
    ScenarioError where the simulator finds the run cannot proceed (a deadlock: one line)."""
    from predict.simulator import SimulationError
    from predict.step_time import predict

    cm = compute_of(sc, stalls)
    cfg = sc.config
    auto = cfg.system == "ours" and cfg.options.auto
    spec = spec_of(sc, _planned_slices(sc, cm).slices if auto else None)
    mem = memory_of(sc)
    usable = sc.device.usable_bytes()
    out = dict(scenario=sc.name, system=cfg.system, layout=f"T-{cfg.tp} P-{cfg.pp} D-{cfg.dp}", gpu=sc.device.name,
               precision=cfg.precision, gemm_precision=sc.gemm_precision or cfg.precision, attention=sc.attention,
               memory_gb=round(mem.total / GB, 2), memory=mem.describe(), usable_gb=round(usable / GB, 2))
    if spec.slices is not None and cfg.system == "ours":
        out["slices"] = list(spec.slices)
        out["n_slices"] = len(spec.slices)
    if mem.total > usable:
        return dict(out, status="oom", step_time_s=None, parts=None,
                    why=f"needs {mem.total / GB:.1f} GiB of the {usable / GB:.1f} GiB a {sc.device.name} holds")
    try:
        p = predict(spec, cm)
    except SimulationError as exc:
        raise ScenarioError(f"the simulator cannot run it: {str(exc).splitlines()[0]}") from None
    opt = p.detail.get("optimizer", 0.0)
    factor = cm.overheads(cfg.system).compute  # the stack's stalls scale the math they stretch
    math_s = (p.compute - opt) / factor
    parts = dict(compute=math_s, stalls=p.compute - opt - math_s, optimizer=opt, bubble=p.bubble,
                 messages=p.exposed_comm, dp_sync=p.dp_sync, other=p.overhead + p.barrier)
    return dict(out, status="ok", step_time_s=p.step_time, parts={k: round(v, 6) for k, v in parts.items()},
                critical_rank=p.critical_rank)


def _stage_link(sc: Scenario) -> Link:
    """The link between adjacent stages as the planner sees it: the nodes' link where a stage of T GPUs
    fills a node or more, else inside a node."""
    c, cfg = sc.cluster, sc.config
    if c.nodes > 1 and cfg.tp * cfg.pp > c.gpus_per_node:
        return c.inter or min((l for row in c.matrix for l in row if l), key=lambda l: l.bandwidth)
    return c.intra


def line(res: dict) -> str:
    """One line of a prediction for people."""
    gemm = f", {res['gemm_precision']} GEMMs" if res.get("gemm_precision", res["precision"]) != res["precision"] else ""
    head = f"{res['scenario']}: {res['system']} {res['layout']} on {res['gpu']} ({res['precision']}{gemm})"
    if res["status"] == "oom":
        return f"{head}: oom ({res['why']}; {res['memory']})"
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in res["parts"].items() if v)
    k = f", K={res['n_slices']}" if "n_slices" in res else ""
    return f"{head}{k}: predicted step {res['step_time_s']:.3f} s ({parts}); memory {res['memory']}"
