"""A rank of ``bench.breakdown``: ``python -m bench.profiled_rank RUN_DIR``, started by torchrun in place
of ``runners.worker``, whose ``main`` it then runs unchanged (the same initialisation, system, steps and
result). Before that it installs the benchmark's timing hooks, from outside the systems' training code:

- ``contract.rank.run_steps`` wrapped (before any system's training module is imported, so that the
  system calls the wrapper): torch's profiler runs over the measured steps (started after the last
  warm-up step), each step's ``step_fn`` inside a profiler range ``pipebench::step``;
- Torch Pipe's waits for its point-to-point messages (``torch.distributed.pipelining.schedules``'
  ``_wait_batch_p2p``) inside a range ``pipebench::wait``;
- ours' tracer spans as profiler ranges ``ours::KIND`` (``ours.trace.Tracer.to_profiler``).

After the run it writes RUN_DIR/breakdown-rank<R>.json: per measured step the parts of its time
(``bench.breakdown.account``), its step time and closing-barrier time as ``run_steps`` measured them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import contract.rank
from bench.breakdown import WAIT_RANGE, account, op_tree

_run_steps = contract.rank.run_steps


def _profiled_run_steps(ctx, dp_rank, step_fn, weights=None):
    from torch.profiler import ProfilerActivity, profile, record_function

    warmup = ctx.config.warmup
    prof = profile(activities=[ProfilerActivity.CPU])
    started = []

    def start() -> None:
        if not started:
            prof.__enter__()
            started.append(True)

    def step(i, inputs, targets):
        if i < warmup:
            out = step_fn(i, inputs, targets)
            if i == warmup - 1:
                start()  # after the last warm-up step: no measured step pays for starting the profiler
            return out
        start()
        with record_function("pipebench::step"):
            return step_fn(i, inputs, targets)

    m = _run_steps(ctx, dp_rank, step, weights)
    if started:
        prof.__exit__(None, None, None)
        # the steps' ranges (on the main thread: ranges nest within a thread only)
        roots = [e for e in prof.events() if e.name == "pipebench::step" and e.cpu_parent is None]
        steps = [account(op_tree(e)) for e in sorted(roots, key=lambda e: e.time_range.start)]
        out = Path(sys.argv[1]) / f"breakdown-rank{ctx.rank}.json"
        out.write_text(json.dumps({"rank": ctx.rank, "parts": steps, "step_times": m.step_times,
                                   "barrier_times": m.barrier_times}))
    return m


def install() -> None:
    """The hooks (module docstring)."""
    from torch.distributed.pipelining import schedules
    from torch.profiler import record_function

    from ours.trace import Tracer

    contract.rank.run_steps = _profiled_run_steps
    wait = schedules._wait_batch_p2p

    def timed_wait(work):
        with record_function(WAIT_RANGE):
            return wait(work)

    schedules._wait_batch_p2p = timed_wait
    Tracer.to_profiler = True


if __name__ == "__main__":
    install()
    from runners.worker import main

    sys.exit(main(Path(sys.argv[1])))
