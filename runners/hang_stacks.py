"""Every thread's Python stack, printed by a rank still running late in its run: what a hang waits on.

NCCL's watchdog names the operation that never completed and where it was issued, not where each
rank's host is; on gloo a hang ends as the launcher's timeout. A rank that is still running at
``STACKS_AT`` of the run's ``--timeout`` prints every thread's stack once (``faulthandler``) to its
stderr, after a line that announces them; then the run goes on. The terminal shows the line, the
run's record the stacks (``withheld_output``: ``runners.output.Withheld``).
"""
from __future__ import annotations

import faulthandler
import sys
import threading

STACKS_AT = 0.7  # of --timeout: before NCCL's watchdog (0.8, contract.groups.op_timeout) and the launcher's kill


def stacks_if_still_running(run_timeout: float, rank: int) -> threading.Timer:
    """Start a timer that prints every thread's stack at ``STACKS_AT`` of ``run_timeout``; cancel it
    when the rank's work is done."""
    seconds = STACKS_AT * run_timeout

    def dump() -> None:
        sys.stderr.write(f"[rank {rank}] still running {seconds:.0f} s after its start ({STACKS_AT:g} of --timeout "
                         f"{run_timeout:g} s): every thread's stack follows\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    timer = threading.Timer(seconds, dump)
    timer.daemon = True
    timer.start()
    return timer
