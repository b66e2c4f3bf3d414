"""The one place that knows the run command's RunConfig: a RunSpec from a config (or a record's config),
the link a local run under ``--network`` sees, and the prediction a record carries.
"""
from __future__ import annotations

from contract import RunConfig
from runners.predict.spec import SYSTEMS, Link, Prediction, RunSpec
from runners.registry import get_system


class NotModelled(ValueError):
    """A run the simulator has no program for (a system or an option it does not model)."""


def spec_from_config(cfg: RunConfig, link: Link, transport: str = "gloo") -> RunSpec:
    """RunSpec of a RunConfig over ``link``; ours' 'auto' slicing is resolved as the run would resolve it."""
    if cfg.system not in SYSTEMS:
        raise NotModelled(f"the simulator has no program for {cfg.system} (it models {', '.join(SYSTEMS)})")
    o = cfg.options
    schedule, virtual_pp, slices, dp_mode = "gpipe", 1, None, "allreduce"
    if cfg.system == "ours":
        if o.auto:
            from ours.plan.auto import auto_slicing

            slices = auto_slicing(cfg, "cuda" if transport == "nccl" else "cpu").slices
        else:
            slices = tuple(o.token_slices(cfg.model.seq_len))
        dp_mode = o.dp_mode
    else:
        schedule, virtual_pp = o.schedule, o.virtual_pp
    try:
        return RunSpec(system=cfg.system, model=cfg.model, batch_size=cfg.batch_size,
                       micro_batch_size=cfg.micro_batch_size, link=link, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp,
                       schedule=schedule, virtual_pp=virtual_pp, slices=slices, dp_mode=dp_mode,
                       precision="mixed" if cfg.mixed_precision else "fp32", recompute=cfg.recompute,
                       transport=transport)
    except ValueError as exc:
        raise NotModelled(str(exc)) from None


def config_of_record(record: dict) -> RunConfig:
    return RunConfig.from_dict(record["config"], get_system(record["config"]["system"]).options)


def spec_from_record(record: dict, link: Link, transport: str = "gloo") -> RunSpec:
    return spec_from_config(config_of_record(record), link, transport)


def predict_here(cfg: RunConfig, probed: dict | None = None) -> Prediction:
    """The prediction of a run on this machine from its calibration (``results/predict``): the link is
    the probed one under emulation (``probed``: a LinkMeasurement.describe() dict), else the profile's.
    FileNotFoundError without a calibration or a profile that covers the shape; NotModelled."""
    from runners.predict.local import find_profile, load_calibration
    from runners.predict.compute import CpuCompute
    from runners.predict.predict import predict

    cal = load_calibration()
    spec = spec_from_config(cfg, cal.link(cfg.network, probed))
    return predict(spec, CpuCompute(find_profile(cfg.model), dict(cal.overhead)), cal.cores)


def record_prediction(cfg: RunConfig, probed: dict | None = None) -> dict | None:
    """What a record carries: the predicted step time and its parts, or None where this machine has no
    calibration for the run (a GPU cluster, an unprofiled shape) or the simulator does not model it."""
    if cfg.device == "cuda":
        return None
    try:
        p = predict_here(cfg, probed)
    except (FileNotFoundError, NotModelled):
        return None
    return {"step_time": p.step_time, **p.parts(), "source": "runners.predict, this machine's calibration"}


def local_link(network: str, loopback: tuple[float, float], probed: dict | None = None,
               stall_bytes: float | None = None) -> Link:
    """The link between two ranks of a local run: gloo over loopback for ``none``; under a network
    profile the probe's one-way delay and bandwidth (``probed``: a LinkMeasurement.describe() dict),
    or the profile's own values where there is no probe, plus gloo's own per-message latency;
    ``stall_bytes``: the emulator's per-message stall (``Link.stall``)."""
    lat, bw = loopback
    if network == "none":
        return Link(lat, bw)
    from network_emulation.profiles import parse_profile

    spec = parse_profile(network).link(0, 1)
    delay_ms, gbps = spec.delay_ms, spec.bandwidth_gbps
    if probed:
        delay_ms = probed.get("one_way_delay_ms") or delay_ms
        measured = probed.get("bandwidth_gbps")
        if measured and measured == measured and measured > 0:  # not NaN
            gbps = measured
    return Link(delay_ms / 1e3 + lat, min(gbps * 1e9 / 8, bw), stall_bytes=stall_bytes)
