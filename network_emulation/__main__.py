"""Command line: python -m network_emulation {apply,clear,show,probe,cleanup} ..."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import netem
from .profiles import PROFILES, SEED_PROFILES, ProfileError, parse_profile
from .signals import cli_status
from .virtual_cluster import VirtualCluster, cleanup_stale


def _runners(args: argparse.Namespace) -> list[netem.Runner]:
    hosts = args.host or [None]
    if not args.dry_run and not args.host and not args.sudo:
        netem.require_root("netem")
    return [netem.Runner(h, args.dry_run, args.sudo) for h in hosts]


def cmd_apply(args: argparse.Namespace) -> None:
    profile = parse_profile(args.profile)
    if not profile.uniform and len(args.address) != len(args.host or [None]):
        raise ProfileError("a matrix profile needs one --address per --host, in rank order")
    for i, r in enumerate(_runners(args)):
        netem.apply(r, profile, args.iface, i, args.address)


def cmd_clear(args: argparse.Namespace) -> None:
    for r in _runners(args):
        netem.clear(r, args.iface)


def cmd_show(args: argparse.Namespace) -> None:
    for r in _runners(args):
        out = netem.show(r, args.iface)
        if out:
            print(f"# {r.host or 'localhost'}\n{out}", end="")


def cmd_probe(args: argparse.Namespace) -> None:
    names = list(SEED_PROFILES) if args.profile == "seeds" else [args.profile]
    for name in names:
        profile = parse_profile(name)
        with VirtualCluster(2, profile, name="probe", backend=args.backend) as vc:
            m = vc.probe(0, 1, samples=args.samples, duration_s=args.duration)
            if args.json:
                print(json.dumps({"profile": profile.label, "backend": vc.backend, **m.describe()}), flush=True)
            else:
                print(f"{profile.label:40s} [{vc.backend}] {m}", flush=True)


def cmd_cleanup(args: argparse.Namespace) -> None:
    netem.require_root("cleanup")
    removed = cleanup_stale(log=None)
    print(f"removed {len(removed)} stale namespace(s)" + "".join(f"\n  {n}" for n in removed))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m network_emulation", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    def real_hosts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--iface", required=True, help="interface to shape, e.g. eth0")
        p.add_argument("--host", action="append", default=[], help="ssh host (repeatable; default: this host)")
        p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
        p.add_argument("--sudo", action="store_true", help="prefix the commands with 'sudo -n'")

    p = sub.add_parser("apply", help="apply a profile with netem (replaces what is there)")
    p.add_argument("--profile", required=True, help=f"one of {', '.join(PROFILES)}, 'delay 10ms bandwidth 1Gbps' "
                   "or a matrix .json")
    p.add_argument("--address", action="append", default=[], help="per --host address (matrix profiles only)")
    real_hosts(p)
    p.set_defaults(func=cmd_apply)
    for name, func, text in (("clear", cmd_clear, "remove the root qdisc"), ("show", cmd_show, "show the qdiscs")):
        p = sub.add_parser(name, help=text)
        real_hosts(p)
        p.set_defaults(func=func)
    p = sub.add_parser("probe", help="measure a profile on a 2-host virtual cluster")
    p.add_argument("--profile", default="seeds", help="profile, or 'seeds' for the five seed settings")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--duration", type=float, default=None,
                   help="bulk transfer seconds (default: 1 s, up to 4 s on long round trips)")
    p.add_argument("--backend", default="auto", choices=["auto", "netem", "tbf+delayer", "none"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("cleanup", help="remove virtual clusters left by dead processes")
    p.set_defaults(func=cmd_cleanup)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli_status("network_emulation", lambda: args.func(args),
                      (ProfileError, netem.NotRootError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
