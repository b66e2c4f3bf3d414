"""The sweep's command line.

    python -m runners.sweep SWEEP_FILE [--out results/NAME.jsonl] [--dry-run] [--only SYSTEM] [--scale-down]
                                       [--repeats N] [--set KEY=VALUE ...]
                                       [--hostfile FILE [--ssh-config FILE] [--iface IFACE] [--nproc-per-node N] ...]
                                       [--slurm [--iface IFACE] [--nproc-per-node N] ...]   (inside a Slurm allocation)
    python -m runners.sweep --networks PROFILE... [--out FILE] [--dry-run] -- RUN_ARGS...   (netem_sweep.sh)

A sweep file expands into run commands (``runners.sweep.plan``); they run one after another
(``runners.sweep.execute``), locally, across a cluster's hosts over ssh (``runners.sweep.cluster``) or
across the nodes of a Slurm allocation with srun (``runners.sweep.slurm``);
``--scale-down`` plans the sweep scaled down to one small machine (``runners.sweep.scale``).
Runs already recorded in the out file are skipped; at the end, a summary and the report.
Exit status: 0 all ran, 1 some failed, 2 a bad sweep, hostfile or request, 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from contract.cli import PORT, POSITIVE_INT, Parser, cannot_create_in, cannot_write_file
from network_emulation.profiles import SEED_PROFILES
from network_emulation.signals import cli_status, signals_raise
from runners.sweep.cluster import ClusterExecutor, parse_hostfile
from runners.sweep.execute import run_sweep, select_runs
from runners.sweep.plan import (REPO, SweepError, adhoc_sweep, check_out, check_repeats, fixed_settings, load_sweep,
                                 sweep_path)
from runners.sweep.scale import scale_down
from runners.sweep.slurm import SlurmExecutor, read_allocation


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = Parser(prog=prog or "python -m runners.sweep", description=__doc__.split("\n\n")[1])
    ap.add_argument("sweep", nargs="?", help="a sweep file (TOML), e.g. sweeps/local.toml")
    ap.add_argument("--out", default=None, help="the record file (default results/<sweep name>.jsonl)")
    ap.add_argument("--dry-run", action="store_true", help="print the run commands, run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="SYSTEM", help="only this system (repeatable)")
    ap.add_argument("--retry-failed", action="store_true", help="re-run configurations recorded as failed")
    ap.add_argument("--repeats", type=int, default=None, metavar="N",
                    help="launches of every run, each its own record, round-robin through each experiment's runs "
                         "(default: the sweep file's 'repeats', else 1); a resumed sweep makes only the missing ones")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                    help="a [fixed] setting of the sweep file given here instead (KEY as in the file, VALUE in TOML: "
                         "5.95, \"bpe\", true), over the file's own (repeatable)")
    ap.add_argument("--no-report", action="store_true", help="do not run report.py at the end")
    ap.add_argument("--no-probe", action="store_true", help="do not probe the emulated networks first")
    ap.add_argument("--speed-probes", action="store_true", help="probe this host's speed before each experiment "
                    "and after the last (OUT.speed: what predict records judges the host's speed during the runs by)")
    ap.add_argument("--plots", default=None, help="also write the report's plots into this directory")
    ap.add_argument("--scale-down", action="store_true",
                    help="the sweep scaled down to one small machine: same layouts, micro-batch sizes and networks, "
                         "a tiny model, a smaller batch, fewer steps (the cluster rehearsal's sweep)")
    ap.add_argument("--networks", nargs="*", default=None, metavar="PROFILE",
                    help="ad-hoc sweep: the run arguments after -- across these network profiles "
                         "(none given: the five seed profiles)")
    c = ap.add_argument_group("cluster (hosts over ssh; the network shaped on each node)")
    c.add_argument("--hostfile", default=None,
                   help="one host per line, 'HOST slots=N' (N GPUs; a bare name is one), the first is node 0")
    c.add_argument("--ssh-config", default=None, help="ssh -F FILE for every ssh to the nodes (e.g. virtual nodes')")
    c.add_argument("--iface", default="eth0",
                   help="the nodes' network interface: shaped, and given to the ranks "
                        "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)")
    c.add_argument("--nproc-per-node", type=POSITIVE_INT, default=None, metavar="N",
                   help="every host has N GPU slots (overrides the hostfile's slots=)")
    c.add_argument("--ssh-user", default=None)
    c.add_argument("--sudo", action="store_true", help="shape through 'sudo -n' on the nodes")
    c.add_argument("--remote-dir", default=str(REPO),
                   help="the suite's directory on the nodes, '{host}' for the host's name (default: this one)")
    c.add_argument("--remote-python", default=None,
                   help="python on the nodes (default: this interpreter's path, or REMOTE_DIR/.venv/bin/python "
                        "with --remote-dir)")
    c.add_argument("--port", type=PORT, default=29500, help="rendezvous port on node 0")
    c.add_argument("--slurm", action="store_true",
                   help="inside a Slurm allocation: its nodes (SLURM_JOB_NODELIST) and GPUs per node instead of a "
                        "hostfile, every run started with srun + torchrun, the network shaped through srun")
    return ap


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, run_args = argv[:i], argv[i + 1:]
    ap = build_parser(prog)
    args = ap.parse_args(argv)

    def sweep() -> int:
        with signals_raise():  # SIGTERM / SIGHUP stop the sweep as Ctrl-C does
            outcome = _sweep(args, run_args)
        return 1 if outcome is not None and outcome.failed else 0

    return cli_status(ap.prog, sweep, (SweepError,), failed=(), said=("error: ", ""), interrupted="sweep")


def _sweep(args: argparse.Namespace, run_args: list[str]):
    """The sweep of the parsed arguments: its outcome (None for a cluster dry run)."""
    here = not (args.hostfile or args.slurm)  # the runs' ranks start on this machine: they must fit it
    if args.networks is not None:
        if args.sweep or not run_args:
            raise SweepError("--networks takes the run arguments after --, and no sweep file")
        if args.scale_down:
            raise SweepError("--scale-down scales a sweep file, not --networks")
        sweep = adhoc_sweep(run_args, args.networks or list(SEED_PROFILES), here=here)
    else:
        if not args.sweep:
            raise SweepError("give a sweep file (or --networks PROFILE... -- RUN_ARGS)")
        if run_args:
            raise SweepError("run arguments after -- go with --networks only")
        sweep = load_sweep(args.sweep, _transform(args), here=here)
    if args.repeats is not None:
        sweep.repeats = check_repeats(args.repeats, "--repeats")
    unknown = [s for s in args.only if s not in {r.system for r in sweep.runs}]
    if unknown:
        raise SweepError(f"--only {', '.join(unknown)}: not in this sweep (it has "
                         f"{', '.join(sorted({r.system for r in sweep.runs}))})")
    out = Path(args.out or f"results/{sweep.name}.jsonl")
    if not out.is_absolute():
        out = Path.cwd() / out
    check_out(out, [("sweep file", sweep_path(args.sweep) if args.sweep else None), ("--hostfile", args.hostfile),
                    ("--ssh-config", args.ssh_config)])
    _check_outputs(args, out)
    executor = None
    if args.slurm:
        executor = _slurm_executor(args)
        if args.dry_run:
            executor.print_plan(sweep, select_runs(sweep, args.only), out)
            return None
    elif args.hostfile:
        if args.ssh_config and not Path(args.ssh_config).is_file():
            raise SweepError(f"--ssh-config {args.ssh_config}: no such file")
        ssh_config = str(Path(args.ssh_config).absolute()) if args.ssh_config else None
        executor = ClusterExecutor(parse_hostfile(args.hostfile, args.nproc_per_node), iface=args.iface,
                                   ssh_config=ssh_config, ssh_user=args.ssh_user, sudo=args.sudo,
                                   remote_dir=args.remote_dir, remote_python=args.remote_python, port=args.port,
                                   dry_run=args.dry_run)
        if args.dry_run:
            executor.print_plan(sweep, select_runs(sweep, args.only), out)
            return None
    return run_sweep(sweep, out, executor=executor, only=args.only, dry_run=args.dry_run,
                     retry_failed=args.retry_failed, need_root_for_network=executor is None,
                     probe=not args.no_probe, report=not args.no_report, plots=args.plots,
                     speed_probes=args.speed_probes)


def _check_outputs(args: argparse.Namespace, out: Path) -> None:
    """SweepError, before any run, if the records file, the report beside it or --plots cannot be written
    (a dry run writes none of them)."""
    if args.plots and args.no_report:
        raise SweepError("--plots are the report's: drop --no-report or --plots")
    if args.dry_run:
        return
    if why := cannot_write_file(str(out), "--out"):
        raise SweepError(why)
    if not args.no_report and (why := cannot_write_file(str(out.with_suffix(".md")), "the report")):
        raise SweepError(why)
    if args.plots and (why := cannot_create_in(Path(args.plots))):
        raise SweepError(f"--plots {args.plots}: {why}")


def _transform(args: argparse.Namespace):
    """What --set and --scale-down make of the sweep file's contents before it is planned (None: nothing)."""
    settings = fixed_settings(args.settings)
    if not settings and not args.scale_down:
        return None

    def transform(data: dict) -> dict:
        data = {**data, "fixed": {**(data.get("fixed") or {}), **settings}}
        return scale_down(data) if args.scale_down else data
    return transform


def _slurm_executor(args: argparse.Namespace) -> SlurmExecutor:
    """The Slurm mode's executor, from the allocation this process runs in (judged here: one line, exit 2)."""
    for flag, given in (("--hostfile", args.hostfile), ("--ssh-config", args.ssh_config),
                        ("--ssh-user", args.ssh_user)):
        if given:
            raise SweepError(f"{flag} is for a cluster over ssh; --slurm takes its nodes from the allocation")
    allocation = read_allocation(os.environ)
    return SlurmExecutor(allocation.slots(args.nproc_per_node), allocation=allocation, iface=args.iface,
                         sudo=args.sudo, remote_dir=args.remote_dir, remote_python=args.remote_python, port=args.port,
                         dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
