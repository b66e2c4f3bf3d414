"""The per-message stall of this machine's emulated links, measured with gloo itself.

What a gloo message costs on the virtual cluster beyond the probed one-way delay and its bytes at the
link's bandwidth, measured with gloo itself: ``probe_stall`` runs a ping-pong of several sizes between
two gloo ranks on two virtual hosts, at a setting none of the validation's profiles uses, and fits

- a per-message stall: the last byte of an n-byte message arrives min(1, n / S) one-way delays late
  (``Link.stall_bytes``; None when no stall fits better than none). Before the cluster set TCP CUBIC
  and no slow start after idle, S was about 25 KiB (a 64 KiB activation paid two one-way delays); with
  them the stall is gone (2 KiB to 256 KiB round trips within 2.3 ms of two one-way delays at 20 ms);
- gloo's own per-message latency over the emulated link: half a small message's round trip minus the
  probed one-way delay (the simulator adds it to the link's latency).

Each rank is ``python -m ours.plan.ping_pong`` on a virtual host of its own.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (2048, 4096, 8192, 16384, 32768, 65536, 262144)
PROBE_NETWORK = "delay 20ms bandwidth 1Gbps"


def fit_stall(points: list[dict], delay: float, bandwidth: float) -> float | None:
    """S of stall(n) = delay * min(1, n / S) that best fits the one-way extras (least squares over a
    grid of S from 1 KiB to about 370 KiB, and no stall at all: None when that fits best)."""
    extras = [(p["bytes"], p["round_trip"] / 2 - delay - p["bytes"] / bandwidth) for p in points]
    best, best_err = None, sum(e * e for _, e in extras)
    for k in range(200):
        s = 1024 * 1.03 ** k
        err = sum((e - delay * min(1.0, n / s)) ** 2 for n, e in extras)
        if err < best_err:
            best, best_err = s, err
    return best


def fit_message_latency(points: list[dict], delay: float, bandwidth: float, small: int = 16384) -> float:
    """gloo's own one-way latency per message beyond the probed delay: the median over messages of at
    most ``small`` bytes of half the round trip minus the delay and the bytes' wire time (>= 0)."""
    extras = [p["round_trip"] / 2 - delay - p["bytes"] / bandwidth for p in points if p["bytes"] <= small]
    return max(0.0, statistics.median(extras)) if extras else 0.0


def probe_stall(network: str = PROBE_NETWORK, sizes=SIZES, iters: int = 8, log=print) -> dict:
    """Ping-pong of each size between two virtual hosts under ``network`` (root needed)."""
    from network_emulation import VirtualCluster
    from network_emulation.signals import stop_process

    points = []
    with VirtualCluster(2, network, name="stall", log=None) as vc:
        measured = vc.probe(0, 1, duration_s=0).describe()
        delay = measured["one_way_delay_ms"] / 1e3
        for nbytes in sizes:
            procs = []
            for h in vc.hosts:
                env = {**os.environ, **h.env(), "MASTER_ADDR": vc.hosts[0].address, "MASTER_PORT": "29541",
                       "PYTHONPATH": str(REPO)}
                argv = [*h.command_prefix(), "env", *[f"{k}={v}" for k, v in env.items() if k in (
                    "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "GLOO_SOCKET_IFNAME", "PATH")],
                        sys.executable, "-m", "ours.plan.ping_pong", str(h.index), str(nbytes), str(iters)]
                procs.append(subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            try:
                outs = [p.communicate(timeout=120) for p in procs]
            finally:
                for p in procs:
                    stop_process(p, signal.SIGKILL, 5.0)
            points.append(json.loads(outs[0][0].strip().splitlines()[-1]))
            log(f"  {nbytes} bytes: round trip {points[-1]['round_trip'] * 1e3:.1f} ms")
    from network_emulation.profiles import parse_profile

    bandwidth = parse_profile(network).link(0, 1).bandwidth_gbps * 1e9 / 8
    stall = fit_stall(points, delay, bandwidth)
    extra = fit_message_latency(points, delay, bandwidth)
    log(f"  stall: {'none' if stall is None else f'{stall / 1024:.1f} KiB'}; gloo's latency per message beyond "
        f"the probed one-way delay ({delay * 1e3:.2f} ms): {extra * 1e6:.0f} us")
    return dict(network=network, one_way_delay_ms=delay * 1e3, points=points, stall_bytes=stall,
                message_latency=extra)

