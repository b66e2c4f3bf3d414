"""Removes a virtual cluster's namespaces when its owner ends, however it ends (even by SIGKILL).

    python -m network_emulation.watchdog --tag TAG

Started by the owner with a pipe on its standard input and in a session of its own (a Ctrl-C to the
owner's terminal does not reach it). When the pipe closes (the owner closed it after its own teardown,
or died), it deletes every namespace whose name starts with TAG, killing what still runs inside.
"""
from __future__ import annotations

import argparse
import sys

from .virtual_cluster import destroy_namespace, list_namespaces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m network_emulation.watchdog")
    ap.add_argument("--tag", required=True, help="namespace name prefix of the owner's cluster")
    args = ap.parse_args(argv)
    while sys.stdin.buffer.read(4096):
        pass
    for ns in list_namespaces():
        if ns.startswith(args.tag):
            destroy_namespace(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
