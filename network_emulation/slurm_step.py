"""Commands as tasks of a Slurm job step: the srun command line, and a guard that ends a task whose
step Slurm has given up.

``srun_argv(hosts, argv)`` runs ``argv`` once on each of ``hosts`` (one task per node) inside the
current allocation. Every step may share the allocation's resources with the others (``--overlap``):
a run's ranks, the shaping agents of its nodes and the link probe run side by side.

Slurm ends a step's tasks through each node's slurmd. When a node's slurmd is gone (the daemon died,
or the node is unreachable), slurmctld sets the node DOWN after SlurmdTimeout and srun gives the step
up ("Node failure on nodeX"), but the tasks on that node live on: a shaping agent waiting for its
stdin would keep the node shaped, a rank its port. The guard, started as the task::

    srun ... python -m network_emulation.slurm_step -- CMD ARGS...

runs CMD as its child (stdin, stdout and stderr passed through), asks slurmctld every ``POLL_S``
whether the step still exists (``scontrol show step JOB.STEP``: this needs the node's munge and the
controller, not its slurmd), and once Slurm says it does not, interrupts CMD (SIGINT, SIGKILL after
``STOP_S``). Signals need no forwarding: Slurm signals every process of a step (scancel, srun's
Ctrl-C), the guard waits them out. Outside a step the guard just becomes CMD. Exit status: CMD's
(128 + N when signal N ended it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

POLL_S = 5.0  # how often the guard asks slurmctld whether its step still exists
STOP_S = 10.0  # after the SIGINT, how long CMD gets before SIGKILL
# What scontrol answers for a step that Slurm no longer has (its own step, or the whole job, ended);
# anything else (the controller unreachable for a moment) is not taken as the step's end.
_GONE = ("not found", "Invalid job id")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def srun_argv(hosts: Sequence[str], argv: Sequence[str], *, chdir: str | None = None, label: bool = False,
              name: str | None = None) -> list[str]:
    """srun argv running ``argv`` as one task on each of ``hosts`` (node names of the allocation), in
    directory ``chdir``; ``label`` prefixes each output line with its task number (task i runs on
    the i-th node in the allocation's order); ``name`` names the step (squeue shows it)."""
    if not hosts:
        raise ValueError("srun needs at least one node")
    for h in hosts:
        if not h or h.startswith("-") or "," in h:
            raise ValueError(f"bad node name {h!r}")
    n = len(hosts)
    return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
            "--overlap", "--kill-on-bad-exit=0", *(["--label"] if label else []),
            *([f"--job-name={name}"] if name else []), *([f"--chdir={chdir}"] if chdir else []), *argv]


def guarded(python: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run under the guard (in the suite's directory, with the suite's ``python``)."""
    return [python, "-m", "network_emulation.slurm_step", "--", *argv]


def step_gone(step: str) -> bool:
    """Slurm says the job step ``JOB.STEP`` does not exist (any more)."""
    try:
        p = subprocess.run(["scontrol", "show", "step", step], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode != 0 and any(g in p.stdout + p.stderr for g in _GONE)


def guard(argv: Sequence[str], step: str, poll_s: float = POLL_S, stop_s: float = STOP_S) -> int:
    """Run ``argv`` until it ends, or until Slurm no longer has ``step``; its exit status."""
    previous = {s: signal.signal(s, lambda signum, frame: None) for s in _SIGNALS}  # the child got it too
    try:
        child = subprocess.Popen(list(argv))  # (exec resets a caught signal to its default)
        _watch(child, argv, step, poll_s, stop_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    rc = child.returncode
    return 128 - rc if rc < 0 else rc


def _watch(child: subprocess.Popen, argv: Sequence[str], step: str, poll_s: float, stop_s: float) -> None:
    """Wait for ``child``; interrupt it (SIGINT, SIGKILL ``stop_s`` later) once Slurm no longer has ``step``."""
    while True:
        try:
            child.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            pass
        if step_gone(step):
            print(f"slurm_step: Slurm no longer has step {step} (its srun gave it up); stopping {argv[0]}",
                  file=sys.stderr, flush=True)
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            break


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m network_emulation.slurm_step -- CMD [ARGS...]", file=sys.stderr)
        return 2
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if not job or not step:
        os.execvp(args[0], args)
    return guard(args, f"{job}.{step}")


if __name__ == "__main__":
    sys.exit(main())
