"""tc command building and applying: netem on real hosts (local or over ssh), tbf/htb for the fallback.

Every command is an argument list. Over ssh the remote command line is built
with ``shlex.join`` so no user value ever reaches a shell unquoted.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TextIO

from .profiles import LinkSpec, Profile, ProfileError
from .signals import Guarded, signals_deferred

Kind = Literal["netem", "tbf"]
MTU_BYTES = 1500
NETEM_MIN_LIMIT = 1000
TBF_MIN_BURST = 128 * 1024
TBF_MAX_BURST = 1024 * 1024
TBF_LATENCY = "50ms"


class NotRootError(PermissionError):
    """Shaping needs root (CAP_NET_ADMIN)."""


def require_root(what: str = "network emulation") -> None:
    if os.geteuid() != 0:
        raise NotRootError(f"{what} needs root (CAP_NET_ADMIN): run as root or with sudo")


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise FileNotFoundError(
            f"missing tool(s) {', '.join(missing)}: apt-get install -y iproute2 iptables"
        )


def fmt(x: float) -> str:
    """Shortest decimal text for tc: 10.0 -> '10', 0.1 -> '0.1'."""
    return f"{x:.6g}"


def netem_limit(delay_ms: float, rate_gbps: float) -> int:
    """netem queue limit (packets): max(1000, DT-FM's R*15000*D*1.5, 2 x BDP in MTU packets)."""
    dtfm = rate_gbps * 15000 * delay_ms * 1.5
    bdp_packets = rate_gbps * 1e9 / 8 * delay_ms / 1e3 / MTU_BYTES
    return int(math.ceil(max(NETEM_MIN_LIMIT, dtfm, 2 * bdp_packets)))


def tbf_burst(rate_gbps: float) -> int:
    """tbf bucket (bytes): about 1 ms of traffic, at least 128 KB, never more than 1 MB."""
    return int(min(TBF_MAX_BURST, max(TBF_MIN_BURST, rate_gbps * 1e9 / 8 * 1e-3)))


def netem_argv(iface: str, link: LinkSpec, *, parent: str = "root", handle: str | None = None,
               rate: bool = True) -> list[str]:
    argv = ["tc", "qdisc", "replace", "dev", iface, *_where(parent), *(["handle", handle] if handle else []),
            "netem", "delay", f"{fmt(link.delay_ms)}ms"]
    if link.jitter_ms:  # uniform over delay ± jitter (netem's default distribution)
        argv.append(f"{fmt(link.jitter_ms)}ms")
    if link.loss_pct:
        argv += ["loss", f"{fmt(link.loss_pct)}%"]
    if rate:
        argv += ["rate", f"{fmt(link.bandwidth_gbps)}gbit"]
    return argv + ["limit", str(netem_limit(link.delay_ms, link.bandwidth_gbps))]


def tbf_argv(iface: str, rate_gbps: float) -> list[str]:
    return ["tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", f"{fmt(rate_gbps)}gbit",
            "burst", str(tbf_burst(rate_gbps)), "latency", TBF_LATENCY]


def clear_argv(iface: str) -> list[str]:
    return ["tc", "qdisc", "del", "dev", iface, "root"]


def show_argv(iface: str) -> list[str]:
    return ["tc", "qdisc", "show", "dev", iface]


def _where(parent: str) -> list[str]:
    return ["root"] if parent == "root" else ["parent", parent]


def per_destination_argv(iface: str, links: Mapping[str, LinkSpec], kind: Kind,
                         change: bool = False) -> list[list[str]]:
    """htb root with one class per destination address (u32 match on ip dst); with kind='netem'
    each class also gets a netem child for the delay. Unmatched traffic (ARP, others) is unshaped.
    ``change``: only what changes the links of shaping already there (each class's rate, its netem
    child), in place: an htb root cannot be replaced."""
    cmds = [] if change else [
        ["tc", "qdisc", "replace", "dev", iface, "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "class", "replace", "dev", iface, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"]]
    for k, (dst, link) in enumerate(links.items()):
        cls = f"1:{k + 10:x}"
        burst = str(tbf_burst(link.bandwidth_gbps))
        rate = f"{fmt(link.bandwidth_gbps)}gbit"
        cmds.append(["tc", "class", "replace", "dev", iface, "parent", "1:", "classid", cls, "htb",
                     "rate", rate, "ceil", rate, "burst", burst, "cburst", burst])
        if kind == "netem":
            cmds.append(netem_argv(iface, link, parent=cls, handle=f"{k + 10:x}:", rate=False))
        if not change:
            cmds.append(["tc", "filter", "replace", "dev", iface, "parent", "1:", "protocol", "ip", "prio", "1",
                         "handle", f"800::{k + 10:x}", "u32", "match", "ip", "dst", f"{dst}/32", "flowid", cls])
    return cmds


def host_shaping_argv(profile: Profile, src: int, iface: str, addresses: Sequence[str], kind: Kind,
                      change: bool = False) -> list[list[str]]:
    """Commands that shape host ``src``'s egress on ``iface`` for ``profile``.

    kind='netem': delay and rate in the kernel; kind='tbf': rate only (delay is the delayer's).
    ``addresses`` (host order) is needed only for matrix profiles. ``change``: the links of shaping
    already there change to ``profile``'s (``per_destination_argv``)."""
    if not profile.emulated:
        return []
    if profile.uniform:
        link = profile.link(src, src)
        assert link is not None
        return [netem_argv(iface, link) if kind == "netem" else tbf_argv(iface, link.bandwidth_gbps)]
    profile.check_hosts(len(addresses))
    links = {addresses[d]: profile.link(src, d) for d in range(len(addresses)) if d != src}
    return per_destination_argv(iface, links, kind, change)  # type: ignore[arg-type]


def ssh_base(ssh_config: str | os.PathLike[str] | None = None) -> list[str]:
    """The ssh client's own arguments: batch mode (never a password prompt), and ``-F ssh_config``
    when given (e.g. virtual nodes' DIR/ssh_config) instead of ~/.ssh/config."""
    return ["ssh", "-o", "BatchMode=yes", *(["-F", os.fspath(ssh_config)] if ssh_config else [])]


def ssh_argv(host: str, argv: Sequence[str], ssh: Sequence[str] = ("ssh", "-o", "BatchMode=yes")) -> list[str]:
    """Run ``argv`` on ``host`` over ssh: the remote command line is shlex-quoted."""
    if host.startswith("-"):
        raise ValueError(f"bad host name {host!r}")
    return [*ssh, host, "--", shlex.join(argv)]


@dataclass(frozen=True)
class Runner:
    """Runs argument lists locally, on one host over ssh, or only prints them (dry run)."""

    host: str | None = None
    dry_run: bool = False
    sudo: bool = False
    out: TextIO = field(default=sys.stdout, compare=False)
    ssh_config: str | None = None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        argv = ["sudo", "-n", *argv] if self.sudo else list(argv)
        return ssh_argv(self.host, argv, ssh_base(self.ssh_config)) if self.host else argv

    def run(self, argv: Sequence[str], check: bool = True, quiet_errors: Sequence[str] = ()) -> str:
        full = self.wrap(argv)
        if self.dry_run:
            print(shlex.join(full), file=self.out)
            return ""
        p = subprocess.run(full, capture_output=True, text=True)
        if p.returncode != 0:
            err = (p.stderr or p.stdout).strip()
            if any(q in err for q in quiet_errors):
                return p.stdout
            if check:
                where = f" on {self.host}" if self.host else ""
                first = err.splitlines()[0] if err else f"exit status {p.returncode}"
                if "Operation not permitted" in err:
                    first += " (needs root)"
                raise RuntimeError(f"{shlex.join(argv)}{where} failed: {first}")
        return p.stdout


# tc's answers when there is nothing to delete: clearing twice is not an error.
_NOTHING_TO_CLEAR = ("Cannot delete qdisc with handle of zero", "No such file or directory", "Invalid handle")


def clear(runner: Runner, iface: str) -> None:
    runner.run(clear_argv(iface), quiet_errors=_NOTHING_TO_CLEAR)


def show(runner: Runner, iface: str) -> str:
    return runner.run(show_argv(iface))


def apply(runner: Runner, profile: Profile, iface: str, src: int = 0, addresses: Sequence[str] = ()) -> None:
    """Idempotent: ``tc qdisc replace``; a matrix first clears the old root."""
    if not profile.emulated:
        clear(runner, iface)
        return
    if not profile.uniform:
        clear(runner, iface)
    for argv in host_shaping_argv(profile, src, iface, addresses, "netem"):
        runner.run(argv)


class NetemSession(Guarded):
    """Apply netem on ``hosts`` (ssh names; empty = this host) and always clear afterwards,
    also after an exception, Ctrl-C, SIGTERM or SIGHUP.

    >>> with NetemSession(parse_profile("d10-1g"), iface="eth0"):   # doctest: +SKIP
    ...     run_benchmark()
    """

    def __init__(self, profile: Profile, iface: str, hosts: Sequence[str] = (), addresses: Sequence[str] = (),
                 dry_run: bool = False, sudo: bool = False, out: TextIO = sys.stdout) -> None:
        if not profile.uniform and len(addresses) != max(1, len(hosts)):
            raise ProfileError("a matrix profile on real hosts needs one --address per --host, in rank order")
        self.profile, self.iface, self.addresses = profile, iface, tuple(addresses)
        self.runners = [Runner(h, dry_run, sudo, out) for h in (hosts or [None])]  # type: ignore[list-item]
        if not dry_run and not hosts and not sudo:
            require_root("netem")

    def start(self) -> None:
        for i, r in enumerate(self.runners):
            apply(r, self.profile, self.iface, i, self.addresses)

    def close(self) -> None:
        self._clear()

    def _clear(self) -> None:
        with signals_deferred():
            for r in self.runners:
                try:
                    clear(r, self.iface)
                except Exception as e:  # keep clearing the other hosts
                    print(f"network_emulation: clearing {r.host or 'localhost'} failed: {e}", file=sys.stderr)
