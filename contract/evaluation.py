"""The eval of a run (``--eval-every N``), done by the harness the same way for every system.

Before the first step and after every N steps (and after the last), between the step's closing
barrier and the next step's opening one, each rank hands over the weights it holds by the shared
model's names (the system's ``weights`` function, called on every rank: FSDP and tensor parallelism
gather their shards in it); rank 0 puts the full model together, measures its loss on the held-out
batch (``workload.heldout``) and tells every rank, so that all stop together at ``--target-loss``.

Each eval point (rank 0's ``Measurements.evals``) carries:
- ``step`` and ``tokens``: the steps trained so far and their tokens (steps x global batch x sequence);
- ``wall_time``: the training's seconds so far: the sum over the steps of (the last rank's end of
  the step, device synchronised) - (the last rank's start, leaving the opening barrier), on the
  ranks' common clock (``time.time()``: one clock on one machine, NTP's agreement across a
  cluster's). The harness's timing barriers are left out (a method that talks only every H steps is
  not charged a global barrier per step), and so are the evals. Ranks leave a barrier up to a
  network delay apart; a rank that starts early mostly waits for the late ones (the late start is on
  the step's critical path), which is why the step is counted from the last start;
- ``loss``: the held-out loss of the model after those steps;
- ``bytes_sent``: per rank, the TCP payload bytes it has sent since the first step began
  (``contract.traffic``): the training's messages, the timing barriers' few bytes, and whatever
  else the rank's libraries send (a torchft manager's heartbeats); the evals' own traffic (the
  weights' gathering, the loss) is measured and subtracted.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from contract.traffic import SentBytes
from workload.heldout import heldout_loss
from workload.model import meta_gpt

Weights = Callable[[], dict[str, torch.Tensor]]  # the parameters a rank holds, full tensors, by shared names


class Evaluator:
    """One rank's part of the evals. Every rank calls ``step_done`` after each step and ``evaluate``
    at the same steps (collective)."""

    def __init__(self, ctx, weights: Weights | None):
        if weights is None:
            raise RuntimeError(f"system {ctx.config.system!r} gives no weights to evaluate (--eval-every): "
                               "it must pass run_steps a weights function")
        self.ctx, self.weights = ctx, weights
        self.group = dist.new_group(list(range(ctx.world_size)), timeout=ctx.op_timeout) if ctx.world_size > 1 else None
        self.sent = SentBytes()
        self.eval_bytes = 0  # sent by the evals themselves, subtracted
        self.step_spans: list[tuple[float, float]] = []  # this rank's steps since the last eval: start, end
        self.wall_time = 0.0  # rank 0: the training's seconds so far
        self.points: list[dict[str, Any]] = []  # rank 0

    def step_done(self, start: float, end: float) -> None:
        """A step ran from ``start`` to ``end`` on this rank (``time.time()``)."""
        self.step_spans.append((start, end))

    def evaluate(self, steps: int) -> float:
        """The held-out loss after ``steps`` steps, on every rank; rank 0 records the point."""
        before = self.sent.read()
        ours = {n: t.detach().float().cpu() for n, t in self.weights().items()}
        payload = (ours, before - self.eval_bytes, self.step_spans)
        self.step_spans = []
        gathered: list | None = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        if self.group is None:
            gathered = [payload]
        else:
            dist.gather_object(payload, gathered, dst=0, group=self.group)
        loss = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.rank == 0:
            loss.fill_(self._record(steps, gathered))
        if self.group is not None:
            dist.broadcast(loss, src=0, group=self.group)
        self.eval_bytes += self.sent.read() - before
        return float(loss)

    def _record(self, steps: int, gathered: list) -> float:
        cfg = self.ctx.config
        weights: dict[str, torch.Tensor] = {}
        for held, _, _ in gathered:  # every name once, from the lowest rank that holds it
            for name, t in held.items():
                weights.setdefault(name, t)
        model = meta_gpt(cfg.model)
        missing = sorted(set(dict(model.named_parameters())) - set(weights))
        if missing:
            raise RuntimeError(f"eval: no rank gave the weights of {len(missing)} parameters, e.g. {missing[0]}")
        model.load_state_dict({n: t.to(self.ctx.device) for n, t in weights.items()}, strict=True, assign=True)
        loss = heldout_loss(model.eval(), self.ctx.data)
        for spans in zip(*(s for _, _, s in gathered)):  # one step, every rank's (start, end)
            self.wall_time += max(end for _, end in spans) - max(start for start, _ in spans)
        self.points.append({"step": steps, "tokens": steps * cfg.global_batch_size * cfg.model.seq_len,
                            "wall_time": self.wall_time, "loss": loss, "bytes_sent": [b for _, b, _ in gathered]})
        return loss
