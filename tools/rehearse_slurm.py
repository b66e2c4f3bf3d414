"""Rehearse the Slurm launcher on one machine: a real Slurm on virtual nodes, the sweep submitted to it.

    python -m tools.rehearse N --slurm [--sweep FILE] [--out FILE] [--dir DIR] [--nproc-per-node S] ...
    (runners/run_all.sh --rehearse N --slurm ...)

1. N virtual nodes come up (``tools.nodes``), then Slurm on them
   (``tools.slurm_nodes``): munged and slurmd on every node, slurmctld on node01, each
   node with S GPUs (generic resources; default 1, as the ssh rehearsal's ``slots=1``);
2. on node01, the cluster's login node, over ssh, exactly what a user types there:
   ``runners/run_all.sh --sweep FILE --scale-down --out OUT --iface eth0 --slurm-submit --nodes=N
   --gpus-per-node=S --wait``: the batch script is written beside the records and submitted; the job
   runs ``runners/run_all.sh --slurm`` on node01, which starts every run with srun + torchrun and shapes
   the nodes through srun; the job's output (the runs, the summary, the report) is copied here as it
   grows;
3. Slurm and the nodes go down: at the end, on a failure, on Ctrl-C or SIGTERM (the job is cancelled
   first; the daemons live in the nodes' pid namespaces, so nothing of them outlives the nodes).

The nodes share this machine's file system: the suite is used in place (a Slurm cluster's shared
file system), with this interpreter's venv.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from network_emulation.signals import signals_deferred
from runners.sweep.plan import REPO

IFACE = "eth0"  # the virtual nodes' interface
_SUBMITTED = re.compile(r"^slurm-submit: submitted batch job (\d+); output: (\S+);")


class Follow:
    """Copies a growing file to ``stream`` from a thread (the job's output, as the job writes it)."""

    def __init__(self, path: Path, stream=sys.stdout) -> None:
        self.path, self.stream = path, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        f = None
        try:
            while True:
                stopping = self._stop.is_set()
                if f is None and self.path.exists():
                    f = open(self.path, errors="replace")
                chunk = f.read() if f else ""
                if chunk:
                    self.stream.write(chunk)
                    self.stream.flush()
                elif stopping:
                    return
                else:
                    time.sleep(0.2)
        finally:
            if f:
                f.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Copy what is left, then stop."""
        self._stop.set()
        self._thread.join(timeout)


def submit_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """What the rehearsal types on node01: run_all.sh with the sweep, scaled down, submitted with --wait."""
    gpus = args.nproc_per_node or 1
    sweep = ["--sweep", args.sweep, "--scale-down", "--out", str(out), "--iface", IFACE,
             *(a for system in args.only for a in ("--only", system)),
             *["--retry-failed"] * args.retry_failed, *["--no-report"] * args.no_report]
    return ["env", "-C", str(REPO), f"PYTHON={sys.executable}", "bash", "runners/run_all.sh", *sweep,
            "--slurm-submit", f"--nodes={args.nodes}", f"--gpus-per-node={gpus}", "--wait"]


def rehearse_slurm(args: argparse.Namespace, out: Path) -> int:
    """Nodes, Slurm, the sweep submitted and followed; everything down again. The job's exit status."""
    from tools.nodes import VirtualNodes
    from tools.slurm_nodes import SlurmOnNodes

    directory = args.dir.absolute()
    t0 = time.monotonic()
    with VirtualNodes(args.nodes, directory, log=sys.stdout) as vn:
        print(f"rehearse: {args.nodes} virtual node(s) up in {time.monotonic() - t0:.1f} s", flush=True)
        with SlurmOnNodes(vn, gpus_per_node=args.nproc_per_node or 1, log=sys.stdout) as slurm:
            rc = _submit_and_follow(slurm, submit_argv(args, out))
            t1 = time.monotonic()
    print(f"rehearse: Slurm and nodes down in {time.monotonic() - t1:.1f} s; {time.monotonic() - t0:.0f} s in all "
          f"(records: {out})", flush=True)
    return rc


def _submit_and_follow(slurm, argv: list[str]) -> int:
    """Run the submission on the login node; copy its lines and then the job's output here."""
    p = subprocess.Popen(slurm.submit_argv(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job, follow = None, None
    try:
        assert p.stdout is not None
        for line in p.stdout:
            print(line, end="", flush=True)
            m = _SUBMITTED.match(line)
            if m and follow is None:
                job, follow = m.group(1), Follow(Path(m.group(2)))
        rc = p.wait()
        return 1 if rc == 255 else rc  # 255: ssh to the login node failed
    finally:
        with signals_deferred():
            if p.poll() is None:  # interrupted: the job first, then the submission waiting for it
                if job:
                    subprocess.run(slurm.on(slurm.controller, ["scancel", job]), stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=30)
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if follow:
                follow.stop()
