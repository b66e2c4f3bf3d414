"""The one place that knows the run command's RunConfig: a RunSpec from a config (or a record's config)."""
from __future__ import annotations

from contract import RunConfig
from network_emulation.profiles import LinkSpec, link_classes, parse_profile
from predict.run_spec import SYSTEMS, Link, RunSpec
from contract.registry import get_system


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


def spec_from_config(cfg: RunConfig, link: Link, transport: str = "gloo", compute=None) -> RunSpec:
    """RunSpec of a RunConfig over ``link``; ours' 'auto' slicing is resolved as the run would resolve it
    (``compute``: the GPU's compute model, for a run on a GPU; None: this machine's)."""
    check_faults_modelled(cfg)
    systems = SYSTEMS if compute is not None else CALIBRATED
    if cfg.system not in systems:
        raise NotModelled(f"the simulator has no program for {cfg.system} {'on a GPU' if compute else 'here'} "
                          f"(it models {', '.join(systems)})")
    o = cfg.options
    schedule, virtual_pp, slices, dp_mode = "gpipe", 1, None, "allreduce"
    if cfg.system == "ours":
        if o.search:
            raise NotModelled("--n-slices search keeps the K its timed steps ran fastest: nothing to predict "
                              "before the run")
        if o.auto:
            from ours.plan.auto import auto_slicing

            slices = auto_slicing(cfg, "cpu", cm=compute, link=link if compute is not None else None).slices
        else:
            slices = tuple(o.token_slices(cfg.model.seq_len))
        dp_mode, schedule = o.dp_mode, o.schedule
        if o.prefetch:
            raise NotModelled("the simulator models one step on its own, not ours' --prefetch (the next step's "
                              "first forwards run during this one)")
    else:
        schedule, virtual_pp = o.schedule, o.virtual_pp
    if compute is None and cfg.precision != "fp32":
        raise NotModelled(f"--precision {cfg.precision} on this machine: its calibration is of fp32 runs")
    try:
        return RunSpec(system=cfg.system, model=cfg.model, batch_size=cfg.batch_size,
                       micro_batch_size=cfg.micro_batch_size, link=link, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp,
                       schedule=schedule, virtual_pp=virtual_pp, slices=slices, dp_mode=dp_mode,
                       precision=modelled_precision(cfg), recompute=cfg.recompute,
                       transport=transport)
    except ValueError as exc:
        raise NotModelled(str(exc)) from None


class OutOfMemory(Exception):
    """A run on a GPU that does not fit its memory (``workload.memory``): the fullest GPU's estimate."""

    def __init__(self, memory, usable: float, device: str):
        self.memory, self.usable, self.device = memory, usable, device
        super().__init__(f"oom: needs {memory.describe()}; a {device} holds {usable / 2**30:.1f} GiB")


def check_memory(cfg: RunConfig, compute) -> None:
    """OutOfMemory where ``cfg``'s fullest GPU needs more than ``compute``'s device holds."""
    from workload.memory import rank_memory

    o = cfg.options
    schedule = getattr(o, "schedule", "1f1b")
    dp_mode = "fsdp" if cfg.system in ("torch_pipe", "fairscale_fsdp") else getattr(o, "dp_mode", "allreduce")
    mem = rank_memory(cfg.model, system=cfg.system, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp,
                      micro_batch=cfg.micro_batch_size, n_micro=cfg.batch_size // cfg.micro_batch_size,
                      precision=cfg.precision, recompute=cfg.recompute,
                      schedule=schedule if schedule in ("gpipe", "1f1b", "interleaved") else "1f1b",
                      attention=compute.attention, dp_mode=dp_mode, virtual_pp=getattr(o, "virtual_pp", 1),
                      distributed_optimizer=bool(getattr(o, "distributed_optimizer", False)))
    usable = compute.device.usable_bytes()
    if mem.total > usable:
        raise OutOfMemory(mem, usable, compute.device.name)


def modelled_precision(cfg: RunConfig) -> str:
    """The simulator's precision of a run: the run's own (fp32, bf16, fp16)."""
    return cfg.precision


def config_of_record(record: dict) -> RunConfig:
    return RunConfig.from_dict(record["config"], get_system(record["config"]["system"]).options)


def spec_from_record(record: dict, link: Link, transport: str = "gloo") -> RunSpec:
    return spec_from_config(config_of_record(record), link, transport)
