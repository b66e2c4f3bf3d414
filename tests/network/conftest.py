"""Fixtures for the network_emulation tests: root/tool checks and leftover inspection."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from network_emulation.signals import processes_where

REPO = Path(__file__).resolve().parents[2]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"'{tool}' missing: apt-get install -y iproute2 iptables"
    return None


needs_root = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"nemu-{pid}.")]


def delayers_of(pid: int) -> list[int]:
    """pids of delayer processes owned by ``pid`` (their argv carries --owner <pid>)."""
    return processes_where(lambda argv: any(a.endswith(b"delayer.py") for a in argv) and b"--owner" in argv
                           and argv[argv.index(b"--owner") + 1] == str(pid).encode())


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}
