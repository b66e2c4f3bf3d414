"""predict(spec, compute) -> Prediction: build the programs, simulate, read the timed step."""
from __future__ import annotations

from workload.compute import ComputeModel
from predict.simulator import Simulator
from predict.pipeline_orders import ZERO_BUBBLE
from predict.programs import build, prefetches
from predict.run_spec import Prediction, RunSpec

# accounting kinds -> the parts of a Prediction
PART_OF = {
    "forward": "compute", "backward": "compute", "recompute": "compute", "wgrad": "compute", "head": "compute",
    "embed": "compute", "optimizer": "compute",
    "overhead": "overhead",
    "bubble": "bubble",
    "comm": "exposed_comm", "tp_comm": "exposed_comm", "fsdp": "exposed_comm",
    "dp": "dp_sync",
    "barrier": "barrier",
}


def predict(spec: RunSpec, compute: ComputeModel, cores: float | tuple | None = None) -> Prediction:
    """The step time of ``spec`` with operation times from ``compute``; ``cores``: CPU cores the ranks
    share, or the capacity for 1, 2, ... computing processes (see ``engine.Simulator``); None: one device
    per rank. Over gloo the second of two simulated steps is the one reported
    (its ranks start as the first one's closing barrier left them; the first step's gloo messages pay the
    receive-posted notices of receives posted at time 0); over nccl every rank enters the first opening
    barrier at 0 and leaves it at once, so one step is enough, but for the zero-bubble schedules of Qi et
    al. (``predict.pipeline_orders.ZERO_BUBBLE``): nothing synchronises their stages between steps (the
    paper's optimizer post-validation), so each stage starts the next step as it ends this one, and the
    step reported is the second, the steady state's; and for ours' ``--prefetch``: its step is then the
    second, which began with its first forwards run in the first."""
    steps = 1 if spec.transport == "nccl" and spec.schedule not in ZERO_BUBBLE and not prefetches(spec) else 2
    built = build(spec, compute, steps=steps)
    res = Simulator(built.programs, built.network, cores, built.procs).run()
    last = steps - 1
    windows = [res.window(r, f"start{last}", f"end{last}") for r in range(built.timed)]
    elapsed = [w[0] for w in windows]
    crit = max(range(len(elapsed)), key=lambda r: (elapsed[r], -r))
    acc = windows[crit][1]
    parts = dict.fromkeys(("compute", "overhead", "exposed_comm", "bubble", "dp_sync", "barrier"), 0.0)
    for kind, seconds in acc.items():
        parts[PART_OF.get(kind, "compute")] += seconds
    return Prediction(step_time=elapsed[crit], critical_rank=crit, per_rank=tuple(elapsed),
                      detail={k: v for k, v in sorted(acc.items()) if v > 0}, **parts)
