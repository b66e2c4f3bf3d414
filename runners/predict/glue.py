"""The one place that knows the run command's RunConfig: a RunSpec from a config (or a record's config)
and the link a local run under ``--network`` sees.

When the contract moves (issue #10: per-system options as ``config.options.<name>``), only
``spec_from_config`` changes.
"""
from __future__ import annotations

from runners.predict.spec import Link, RunSpec


def spec_from_config(cfg, link: Link, transport: str = "gloo") -> RunSpec:
    """RunSpec of a RunConfig (``runners.config.RunConfig``) over ``link``."""
    return RunSpec(
        system=cfg.system, model=cfg.model, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        link=link, pp=cfg.pp, tp=cfg.tp, dp=cfg.dp, schedule=cfg.schedule, virtual_pp=cfg.virtual_pp,
        slices=tuple(cfg.token_slices) if cfg.system == "ours" else None, dp_mode=cfg.dp_mode,
        precision="mixed" if cfg.mixed_precision else "fp32", recompute=cfg.recompute, transport=transport)


def spec_from_record(record: dict, link: Link, transport: str = "gloo") -> RunSpec:
    from runners.config import RunConfig

    return spec_from_config(RunConfig.from_dict(record["config"]), link, transport)


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
