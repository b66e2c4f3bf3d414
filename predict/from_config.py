"""The one place that knows the run command's RunConfig: a RunSpec, a GPU's compute model and the
memory per GPU of a config (or a record's config). A scenario's ``[run]`` is a RunConfig too
(``predict.scenario``): it is predicted through the same functions."""
from __future__ import annotations

from contract import RunConfig
from contract.registry import get_system
from network_emulation.profiles import LinkSpec, link_classes, parse_profile
from contract.links import Link
from predict.pipeline_orders import owner
from predict.run_spec import MEGATRON_ONLY, MODELLED, Cluster, RunSpec

CALIBRATED = ("torch_pipe", "megatron", "ours")  # the systems this machine's calibration fits


class NotModelled(ValueError):
    """A run the simulator has no program for (a system or an option it does not model)."""


def single_link(network: str, matrix: dict | None = None) -> LinkSpec | None:
    """The one link the simulator puts between every pair of a run's ranks: its profile's (None without
    emulation; ``matrix``: a per-link matrix's contents as the run read them). NotModelled for a
    matrix with more than one kind of link: the simulator models no per-link matrices."""
    classes = link_classes(parse_profile(network, matrix))
    lossy = [c[2] for c in classes if c[2].lossy]
    if lossy:
        raise NotModelled(f"--network {network}: packet loss and jitter are not modelled (the simulator's links "
                          "deliver every message, each after the same delay)")
    if len(classes) > 1:
        raise NotModelled(f"--network {network}: a per-link matrix with {len(classes)} kinds of link is not modelled "
                          "(the simulator puts one link between every pair of ranks)")
    return classes[0][2] if classes else None


def check_faults_modelled(cfg: RunConfig) -> None:
    """NotModelled for a run with faults the simulator does not model: a trace of links that change,
    a straggler, a killed replica (``contract.faults``)."""
    faults = [flag for flag, value in (("--network-trace", cfg.network_trace), ("--slow-rank", cfg.slow_rank),
                                       ("--kill-replica", cfg.kill_replica)) if value is not None]
    if faults:
        raise NotModelled(f"{', '.join(faults)}: not modelled (the simulator's links and devices stay as they start)")


def schedule_of(cfg: RunConfig) -> tuple[str, int]:
    """(schedule, model chunks per rank) of a run: its system's options' (fairscale's Pipe: GPipe)."""
    o = cfg.options
    return getattr(o, "schedule", "gpipe"), getattr(o, "virtual_pp", 1)


def stage_layers_of(cfg: RunConfig) -> tuple[int, ...] | None:
    """The layers of each pipeline stage (model chunk) a run asks for (--layers-per-stage), None: equal."""
    o = cfg.options
    return o.stage_layers(cfg) if getattr(o, "layers_per_stage", None) is not None else None


def rank_layers_of(cfg: RunConfig) -> tuple[int, ...] | None:
    """The layers each pipeline rank holds (its model chunks', placed looped or in a V), None: equal."""
    counts = stage_layers_of(cfg)
    if counts is None:
        return None
    schedule, _ = schedule_of(cfg)
    held = [0] * cfg.pp
    for stage, n in enumerate(counts):
        held[owner(schedule, cfg.pp, stage)] += n
    return tuple(held)


def sync_of(cfg: RunConfig) -> str:
    """The simulator's data parallelism of a run (``RunSpec.dp_mode``): ours' mode; the seed's GPipe's
    central PS as DT-FM runs it (``chain_ps``); the baselines' all-reduce (FSDP's in its program)."""
    mode = getattr(cfg.options, "dp_mode", "allreduce")
    if cfg.system == "gpipe":
        return "chain_ps" if mode == "central_ps" else mode
    return mode if cfg.system == "ours" else "allreduce"


def megatron_options(cfg: RunConfig) -> dict:
    """RunSpec's megatron-only fields (``MEGATRON_ONLY``) from the run's options of the same names."""
    return {name: getattr(cfg.options, name) for name in MEGATRON_ONLY if hasattr(cfg.options, name)}


def _check_ours_modelled(cfg: RunConfig) -> None:
    """ours' options the simulator has no model of, whoever gives its slices."""
    o = cfg.options
    if o.search:
        raise NotModelled("--n-slices search keeps the K its timed steps ran fastest: nothing to predict before "
                          "the run")
    if o.wire_dtype != "fp32":
        raise NotModelled(f"ours' --wire-dtype {o.wire_dtype}: the simulator sends ours' messages in fp32")


def _ours_slices(cfg: RunConfig, link: Link, compute) -> tuple[int, ...]:
    o = cfg.options
    if o.auto:
        from ours.plan.auto import auto_slicing

        return auto_slicing(cfg, "cpu", cm=compute, link=link if compute is not None else None).slices
    return tuple(o.token_slices(cfg.model.seq_len))


def spec_from_config(cfg: RunConfig, link: Link, transport: str = "gloo", compute=None, *,
                     slices: tuple[int, ...] | None = None, cluster: Cluster | None = None,
                     head: int | None = None) -> RunSpec:
    """RunSpec of a RunConfig over ``link``; ours' 'auto' slicing is resolved as the run would resolve it
    (``compute``: the GPU's compute model, for a run on a GPU; None: this machine's) unless ``slices``
    gives it. A scenario adds its ``cluster`` and its output layer (``head``: ``RunSpec.head_classes``)."""
    check_faults_modelled(cfg)
    systems = tuple(MODELLED) if compute is not None else CALIBRATED
    if cfg.system not in systems:
        raise NotModelled(f"the simulator has no program for {cfg.system} {'on a GPU' if compute else 'here'} "
                          f"(it models {', '.join(systems)})")
    if cfg.system == "ours":
        _check_ours_modelled(cfg)
        if slices is None:
            slices = _ours_slices(cfg, link, compute)
    elif cfg.system == "gpipe" and slices is None:
        slices = (cfg.model.seq_len,)
    if compute is None and cfg.precision != "fp32":
        raise NotModelled(f"--precision {cfg.precision} on this machine: its calibration is of fp32 runs")
    mine = megatron_options(cfg)
    if compute is None and cfg.recompute and mine.get("recompute_granularity") == "selective":
        raise NotModelled("--recompute-granularity selective on this machine: its profile times a layer whole, not "
                          "its attention core apart")
    schedule, virtual_pp = schedule_of(cfg)
    ahead = {"prefetch": cfg.options.first_ahead(cfg.pp)} if cfg.system == "ours" else {}
    try:
        return RunSpec(system=cfg.system, model=cfg.model, batch_size=cfg.batch_size,
                       micro_batch_size=cfg.micro_batch_size, link=link, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp,
                       schedule=schedule, virtual_pp=virtual_pp, slices=slices, dp_mode=sync_of(cfg),
                       precision=cfg.precision, recompute=cfg.recompute, transport=transport,
                       head_classes=head, cluster=cluster, layers_per_stage=stage_layers_of(cfg), **ahead,
                       **mine)
    except ValueError as exc:
        raise NotModelled(str(exc)) from None


def gpu_compute_of(cfg: RunConfig, device, attention: str | None = None, gemm_precision: str | None = None):
    """The compute model of ``cfg``'s ranks on a GPU (``device``: a Device, or a device file's name or
    path): its precision, the attention kernels (None: the GPU's era's), megatron's fused optimizer,
    the run's optimizer's update, megatron's sequence parallelism, the GEMMs' own precision (None: the
    run's; ``fp8``)."""
    from workload.compute import Device, GpuCompute, default_attention, find_device

    dev = device if isinstance(device, Device) else find_device(device)
    return GpuCompute(dev, cfg.model, cfg.precision, attention or default_attention(dev),
                      "fused" if cfg.system == "megatron" else "single", update_rule=cfg.optimizer.kind,
                      sequence_parallel=bool(getattr(cfg.options, "sequence_parallel", False)),
                      gemm_precision=gemm_precision)


def memory_of(cfg: RunConfig, attention: str, head: int | None = None, dropout: bool = False):
    """The fullest GPU of ``cfg`` (``workload.memory.rank_memory``): what its system keeps of the weights,
    gradients and the optimizer's state, and the activations its schedule keeps (``attention``'s
    kernels; ``dropout``: its masks kept too; ``head``: ``RunSpec.head_classes``)."""
    from workload.memory import rank_memory

    schedule, virtual_pp = schedule_of(cfg)
    dp_mode = "fsdp" if cfg.system in ("torch_pipe", "fairscale_fsdp") else getattr(cfg.options, "dp_mode", "allreduce")
    return rank_memory(cfg.model, system=cfg.system, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp,
                       micro_batch=cfg.micro_batch_size, n_micro=cfg.n_micro_batches, precision=cfg.precision,
                       recompute=cfg.recompute, schedule=schedule, attention=attention, dropout=dropout,
                       dp_mode=dp_mode, head=head, virtual_pp=virtual_pp, rank_layers=rank_layers_of(cfg),
                       distributed_optimizer=bool(getattr(cfg.options, "distributed_optimizer", False)),
                       update_rule=cfg.optimizer.kind,
                       sequence_parallel=bool(getattr(cfg.options, "sequence_parallel", False)),
                       recompute_granularity=getattr(cfg.options, "recompute_granularity", "full"))


class OutOfMemory(Exception):
    """A run on a GPU that does not fit its memory (``workload.memory``): the fullest GPU's estimate."""

    def __init__(self, memory, usable: float, device: str):
        self.memory, self.usable, self.device = memory, usable, device
        super().__init__(f"oom: needs {memory.describe()}; a {device} holds {usable / 2**30:.1f} GiB")


def check_memory(cfg: RunConfig, compute) -> None:
    """OutOfMemory where ``cfg``'s fullest GPU needs more than ``compute``'s device holds."""
    mem = memory_of(cfg, compute.attention)
    usable = compute.device.usable_bytes()
    if mem.total > usable:
        raise OutOfMemory(mem, usable, compute.device.name)


def config_of_record(record: dict) -> RunConfig:
    return RunConfig.from_dict(record["config"], get_system(record["config"]["system"]).options)


def spec_from_record(record: dict, link: Link, transport: str = "gloo") -> RunSpec:
    return spec_from_config(config_of_record(record), link, transport)
