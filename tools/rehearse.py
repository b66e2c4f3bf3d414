"""Rehearse a cluster on one machine: the cluster sweep, scaled down, over real ssh on virtual nodes.

    python -m tools.rehearse N [--slurm] [--sweep FILE] [--out FILE] [--dir DIR] [--nproc-per-node S]
                                 [--only SYSTEM] [--retry-failed] [--no-report]
    (runners/run_all.sh --rehearse N [--slurm] [--sweep FILE] ...)

1. N virtual nodes come up (``tools.nodes``: one network namespace, sshd, host name
   and /etc/hosts each; DIR/hostfile with ``slots=1`` per node and DIR/ssh_config);
2. the nodes are set up as a real cluster's are (``runners.sweep.setup_nodes``): the suite is
   copied to DIR/<node>/suite on every node (removed when the sweep ends); its .venv is a link to
   this interpreter's venv (the nodes share this machine's file system; building a venv per node
   takes minutes);
3. the sweep (default: the seed's GPT-3 XL cluster sweep) runs in cluster mode, exactly as
   ``run_all.sh --hostfile`` runs it, but ``--scale-down`` (``runners.sweep.scale``): same layouts,
   micro-batch sizes and network settings, a tiny model; runs the N nodes cannot hold are recorded
   as unfit; the report follows;
4. the nodes go down: at the end, on a failure, on Ctrl-C or SIGTERM (SIGKILL leaves them to the
   next ``up``, rehearsal or ``python -m network_emulation cleanup``).

With ``--slurm`` the launcher rehearsed is Slurm instead (``tools.rehearse_slurm``): slurmctld and
slurmd on the nodes, the sweep submitted with sbatch on node01 and run with srun.

The default sweep is the seed's GPT-3 XL cluster sweep on 12 nodes or more; on fewer, whose nodes
could hold none of its runs, a small one they can (``rehearsal-4.toml``, ``rehearsal-2.toml``).

Exit status: that of the sweep (0 all ran, 1 some failed), 2 a bad request (not root, no sshd, a bad
sweep file), 130 / 143 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from contract.cli import POSITIVE_INT
from network_emulation.netem import NotRootError
from network_emulation.signals import Terminated, signals_raise
from network_emulation.ssh_shaping import for_host
from tools.rehearse_slurm import rehearse_slurm
from runners.request import Parser
from runners.sweep import __main__ as sweep_command
from runners.sweep.execute import select_runs
from runners.sweep.hostfile import DoesNotFit, Host, place
from runners.sweep.plan import Sweep, SweepError, load_sweep
from runners.sweep.scale import scale_down
from runners.sweep.setup_nodes import SetupError, setup_nodes, venv_ready

DEFAULT_SWEEP = "sweeps/gpt3-xl-cluster.toml"
SMALL_SWEEPS = ((4, "rehearsal-4.toml"), (1, "rehearsal-2.toml"))  # (nodes at least, sweep) below 12 nodes
DEFAULT_DIR = Path(tempfile.gettempdir()) / "pipebench-rehearsal"
IFACE = "eth0"  # the virtual nodes' interface


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m tools.rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("nodes", type=POSITIVE_INT, help="number of virtual nodes")
    ap.add_argument("--sweep", default=None,
                    help=f"the cluster sweep to rehearse (default {DEFAULT_SWEEP}; on fewer than 12 nodes "
                         "rehearsal-4.toml or rehearsal-2.toml)")
    ap.add_argument("--slurm", action="store_true",
                    help="rehearse the Slurm launcher: slurmctld and slurmd (with munge) on the nodes, the sweep "
                         "submitted with sbatch on node01 and run with srun")
    ap.add_argument("--out", default=None, help="the record file (default results/<sweep name>-scaled.jsonl)")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                    help=f"the nodes' keys, configs, logs and suite copies (default {DEFAULT_DIR})")
    ap.add_argument("--nproc-per-node", type=POSITIVE_INT, default=None, metavar="S",
                    help="GPU slots per node (default: the hostfile's 1, as on p3.2xlarge nodes)")
    ap.add_argument("--only", action="append", default=[], metavar="SYSTEM", help="only this system (repeatable)")
    ap.add_argument("--retry-failed", action="store_true", help="re-run configurations recorded as failed")
    ap.add_argument("--no-report", action="store_true", help="do not run report.py at the end")
    return ap


def default_sweep(nodes: int) -> str:
    """The sweep a rehearsal on ``nodes`` nodes runs unless told: the largest its nodes can hold."""
    if nodes >= 12:
        return DEFAULT_SWEEP
    return next((sweep for least, sweep in SMALL_SWEEPS if nodes >= least), SMALL_SWEEPS[-1][1])


def sweep_argv(args: argparse.Namespace, hostfile: Path, ssh_config: Path, remote_dir: str, out: Path) -> list[str]:
    """The cluster sweep's own command line (``python -m runners.sweep``), scaled down."""
    argv = [args.sweep, "--scale-down", "--hostfile", str(hostfile), "--ssh-config", str(ssh_config),
            "--iface", IFACE, "--remote-dir", remote_dir, "--out", str(out)]
    if args.nproc_per_node is not None:
        argv += ["--nproc-per-node", str(args.nproc_per_node)]
    for system in args.only:
        argv += ["--only", system]
    return argv + ["--retry-failed"] * args.retry_failed + ["--no-report"] * args.no_report


def rehearse(args: argparse.Namespace) -> int:
    from tools.nodes import VirtualNodes

    sweep = load_sweep(args.sweep, scale_down)  # a bad sweep file stops here, before any node is up
    check_fits(sweep, args.nodes, args.nproc_per_node or 1, args.only)
    out = Path(args.out or f"results/{sweep.name}.jsonl").absolute()
    venv = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or not venv_ready(venv):
        raise SweepError(f"the nodes share this interpreter's venv, and {sys.prefix} is not one set up by "
                         "scripts/setup_env.sh (run runners/run_all.sh, or PYTHON=.venv/bin/python)")
    if args.slurm:
        return rehearse_slurm(args, out)
    directory = args.dir.absolute()
    remote_dir = f"{directory}/{{host}}/suite"
    t0 = time.monotonic()
    with VirtualNodes(args.nodes, directory, log=sys.stdout) as vn:
        print(f"rehearse: {args.nodes} virtual node(s) up in {time.monotonic() - t0:.1f} s", flush=True)
        hosts = [n.name for n in vn.nodes]
        try:
            setup_nodes(hosts, remote_dir=remote_dir, ssh_config=str(vn.ssh_config), share_venv=str(venv))
            rc = sweep_command.main(sweep_argv(args, vn.hostfile, vn.ssh_config, remote_dir, out))
        finally:
            remove_copies(remote_dir, hosts)
        t1 = time.monotonic()
    print(f"rehearse: nodes down in {time.monotonic() - t1:.1f} s; {time.monotonic() - t0:.0f} s in all "
          f"(records: {out})", flush=True)
    return rc


def check_fits(sweep: Sweep, nodes: int, slots: int, only: Sequence[str] = ()) -> None:
    """SweepError unless some run of ``sweep`` (of ``only``'s systems) fits ``nodes`` virtual nodes of
    ``slots`` slots each: a rehearsal of nothing but unfit runs measures nothing."""
    hosts = [Host(f"node{k + 1}", slots) for k in range(nodes)]
    why = None
    for run in select_runs(sweep, only):
        try:
            place(run.world, hosts, devices_per_process=run.devices_per_process, ranks_per_node=run.nproc_per_node,
                  emulated=run.emulated)
            return
        except DoesNotFit as e:
            why = why or f"{run.label()}: {e}"
    raise SweepError(f"no run of {sweep.name} fits {nodes} virtual node(s) of {slots} slot(s) ({why}): give more "
                     "nodes, or --nproc-per-node")


def remove_copies(remote_dir: str, hosts: Sequence[str]) -> None:
    """The suite's copies on the nodes removed (with their nodes' directories where that leaves them
    empty): a rehearsal leaves nothing behind."""
    for host in hosts:
        copy = Path(for_host(remote_dir, host))
        shutil.rmtree(copy, ignore_errors=True)
        with contextlib.suppress(OSError):
            copy.parent.rmdir()


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from tools.nodes import NodesError

    args.sweep = args.sweep or default_sweep(args.nodes)
    try:
        with signals_raise():
            rc = rehearse(args)
    except (SweepError, NodesError, NotRootError, FileNotFoundError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except SetupError as e:
        print(f"{ap.prog}: setting up the nodes failed on {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the nodes did not come up (tools.nodes names the node)
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        print("rehearse: interrupted; nodes down", file=sys.stderr)
        return e.code if isinstance(e, Terminated) else 130
    if rc in (130, 143):
        print("rehearse: interrupted; nodes down", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
