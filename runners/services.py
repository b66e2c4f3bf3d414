"""Services a system's ranks need running beside them (``SystemSpec.services``), which the run
command starts before the ranks and stops with them: today torchft's lighthouse, the server that
forms DiLoCo's quorums (``ours.diloco``).

Nothing outlives the run: a service runs in a session of its own, dies with the run command
(``runners.lifetime.die_with_parent``, also on SIGKILL) and is stopped (SIGTERM, then SIGKILL) when
its launch ends, however it ends; under ``--network`` it runs inside virtual host 0, whose namespace
goes with the cluster. Its output goes to ``RUN_DIR/<service>.log``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract import ConfigError, RunConfig
from network_emulation.signals import stop_process

LIGHTHOUSE = "torchft-lighthouse"
SERVICES = (LIGHTHOUSE,)
LIGHTHOUSE_PORT = 29510  # in a virtual host (a fresh namespace) or on node 0 of a cluster; locally a free port
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Placing:
    """Where the services run and how the ranks reach them."""

    bind: str  # the address they listen on
    advertise: str  # the address the ranks connect to
    port: int
    prefix: tuple[str, ...] = ()  # an argv prefix that runs a command there (a virtual host's namespace)
    start: bool = True  # False on the nodes of a cluster other than node 0: only the environment


class ServiceError(RuntimeError):
    """A service did not start: the run fails with this error (one line)."""


def lighthouse_binary() -> Path:
    return Path(sysconfig.get_path("scripts")) / "torchft_lighthouse"


def check(names: Sequence[str]) -> None:
    """ConfigError if a service cannot be started here (judged before launching)."""
    for name in names:
        if name not in SERVICES:
            raise ConfigError(f"unknown service {name!r}; known: {', '.join(SERVICES)}")
        if name == LIGHTHOUSE and not os.access(lighthouse_binary(), os.X_OK):
            raise ConfigError(f"torchft's lighthouse is not installed ({lighthouse_binary()}): "
                              "run scripts/setup_env.sh (torchft is pinned in pyproject.toml)")


def _lighthouse(cfg: RunConfig, where: Placing) -> tuple[list[str], dict[str, str], str]:
    """(argv, the ranks' environment, the line its log shows once it listens)."""
    argv = [str(lighthouse_binary()), "--min_replicas", str(min_replicas(cfg)), "--bind", f"{where.bind}:{where.port}",
            "--quorum_tick_ms", "10"]
    env = {"TORCHFT_LIGHTHOUSE": f"http://{where.advertise}:{where.port}",
           "RUST_LOG": "warn"}  # the ranks' torchft managers: warnings only (info logs every quorum)
    return argv, env, "Lighthouse listening on"


def min_replicas(cfg: RunConfig) -> int:
    """The fewest replicas a quorum needs: every one, or (when --kill-replica ends one) the others."""
    return cfg.dp - 1 if cfg.kill_replica is not None else cfg.dp


@contextlib.contextmanager
def started(names: Sequence[str], cfg: RunConfig, run_dir: Path, where: Placing) -> Iterator[dict[str, str]]:
    """Start the named services (where ``where.start``); yields the environment the ranks need to
    reach them; stops them on leaving, however it is left."""
    from runners.lifetime import die_with_parent

    env: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    try:
        for name in names:
            argv, their_env, ready = _lighthouse(cfg, where)
            env.update(their_env)
            if not where.start:
                continue
            log_path = run_dir / f"{name}.log"
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen([*where.prefix, *argv], stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=die_with_parent, env=dict(os.environ, RUST_LOG="info")))
            _wait_ready(procs[-1], log_path, ready, name)
        yield env
    finally:
        for proc in procs:
            stop_process(proc, signal.SIGTERM, 5.0, group=True)


def _wait_ready(proc: subprocess.Popen, log_path: Path, ready: str, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if ready in text:
            return
        if proc.poll() is not None:
            last = [line for line in text.splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
            raise ServiceError(f"{name} did not start: {last[0]}")
        time.sleep(0.05)
    raise ServiceError(f"{name} did not start listening within {READY_TIMEOUT_S:g} s (see {log_path})")
