"""What each pipeline rank runs in one step, action by action, for the schedules that are lists of
actions: torch.distributed.pipelining's runtime schedules as torch builds them, and the zero-bubble
schedules of Qi et al. (ZB-H1 and ZB-H2, "Zero Bubble Pipeline Parallelism", ICLR 2024) built here.

An action (``Action``) is a forward ``F``, a backward split in two (``I``: the gradient of the
stage's input; ``W``: the gradients of its weights, deferred), a whole backward ``B``, ``F+B`` (a
forward and a whole backward run back to back, DualPipeV's overlapped pair), a message (``SEND_F``,
``SEND_B`` post a send of the activation or gradient a stage produced; ``RECV_F``, ``RECV_B`` post a
receive of the one a stage consumes; a forward or backward waits for its receive; sends are waited
at the end of the step), or FSDP's ``UNSHARD`` (all-gather a stage's parameters), ``RESHARD`` (free
them) and ``REDUCE_GRAD`` (reduce-scatter its gradients once its last backward ran).

- torch_pipe's ``zb`` (ScheduleInterleavedZeroBubble), ``zbv`` (ScheduleZBVZeroBubble) and
  ``dualpipev`` (ScheduleDualPipeV): read from torch's own classes, built for stand-in stages (their
  orders depend only on the ranks, stages and micro-batches), with the messages and FSDP actions
  torch's runtime adds (``_PipelineScheduleRuntime``: a receive is posted as soon as its sender's
  forward or backward comes in the ranks' joint order). This module is the one place that reads
  torch's schedule internals (``pipeline_order_with_comms``, ``_Action``).
- ``zb1p`` (ZB-H1): stage s runs P - 1 - s warm-up forwards, then F and I in turn, each I followed
  by the W of the oldest micro-batch once s Ws wait (the W delayed by s), the cool-down I's (each with
  a W past the same delay), then the Ws left. Every stage holds at most P micro-batches' activations
  (an activation lives until its W), 1F1B's first stage's; at T_F = T_B = T_W the bubble is a third
  of 1F1B's, (P - 1) / 3M of the step. torch's ZB1P (its interleaved zero bubble at one chunk a rank)
  is this order.
- ``zb2p`` (ZB-H2): stage s runs 2 (P - s) - 1 warm-up forwards (the bubble before its first backward
  filled with forwards), then I and F in turn, each I followed by the oldest W once 2s Ws wait, the
  cool-down I's likewise, then the Ws left: every stage holds at most 2P - 1 micro-batches'
  activations, and the stages form the paper's parallelogram: at T_F = T_B = T_W no bubble in the
  steady state, where no synchronisation closes a step (the paper's optimizer post-validation), a
  step's makespan still (P - 1) T_F longer.
  Both are lowered to messages as torch's runtime lowers its own orders.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from baselines.torch_pipe import V_SHAPED

TORCH_RUNTIME = ("zb", "zbv", "dualpipev")  # torch_pipe's, read from torch
ZERO_BUBBLE = ("zb1p", "zb2p")  # the paper's handcrafted ZB-H1 and ZB-H2, built here


@dataclass(frozen=True)
class Action:
    kind: str  # F, I, W, B, F+B, SEND_F, SEND_B, RECV_F, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD
    stage: int = -1
    mb: int = -1
    sub: tuple = ()  # F+B: the forward and the backward, in the order they run


def owner(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that holds ``stage``: in a V (zbv, dualpipev) or looped, as
    ``baselines.torch_pipe.stage_indices`` places them."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _plain(a) -> Action:
    """torch's _Action as an Action."""
    sub = tuple(_plain(s) for s in a.sub_actions) if a.sub_actions else ()
    kind = "F+B" if sub else a.computation_type.value
    return Action(kind, a.stage_index, -1 if a.microbatch_index is None else a.microbatch_index, sub)


def _stand_ins(pp: int, n_stages: int, per_rank: int) -> list:
    """What torch's schedule classes read of a stage to build their orders (all ranks' at once)."""
    return [SimpleNamespace(num_stages=n_stages, group_size=pp, group_rank=0, stage_index=i, submod=None)
            for i in range(per_rank)]


def _loss(output, target):  # a schedule builds a backward only when it has a loss
    return output


@lru_cache(maxsize=64)
def torch_order(schedule: str, pp: int, virtual_pp: int, n_micro: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in one step under torch's ``schedule`` (zb, zbv, dualpipev), with
    the messages and FSDP actions torch's runtime adds. ValueError where torch refuses the micro-batch
    count."""
    from torch.distributed.pipelining import (ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    cls = {"zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
           "dualpipev": ScheduleDualPipeV}[schedule]
    sched = cls(_stand_ins(pp, pp * virtual_pp, virtual_pp), n_micro, loss_fn=_loss)
    return tuple(tuple(_plain(a) for a in sched.pipeline_order_with_comms[r]) for r in range(pp))


def handcrafted(schedule: str, pp: int, stage: int, n_micro: int) -> list[tuple[str, int]]:
    """The paper's ZB-H1 (``zb1p``) or ZB-H2 (``zb2p``) on ``stage``: its compute actions as (kind,
    micro-batch), see the module docstring."""
    s, M = stage, n_micro
    if schedule == "zb1p":
        warm, delay, forward_first = min(M, pp - 1 - s), s, True
    else:
        warm, delay, forward_first = min(M, 2 * (pp - s) - 1), 2 * s, False
    out = [("F", i) for i in range(warm)]
    i_done = w_done = 0

    def backward_input():
        nonlocal i_done, w_done
        out.append(("I", i_done))
        i_done += 1
        if i_done > delay:  # past the delay: the oldest W
            out.append(("W", w_done))
            w_done += 1

    for f in range(warm, M):
        if forward_first:
            out.append(("F", f))
        backward_input()
        if not forward_first:
            out.append(("F", f))
    while i_done < M:
        backward_input()
    return out + [("W", w) for w in range(w_done, M)]


@lru_cache(maxsize=64)
def zero_bubble_order(schedule: str, pp: int, n_micro: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank (one stage each), its actions in one step under ``zb1p`` or ``zb2p``, lowered to
    messages as torch's runtime lowers its own orders."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    kinds = {"F": _ComputationType.FORWARD, "I": _ComputationType.BACKWARD_INPUT,
             "W": _ComputationType.BACKWARD_WEIGHT}
    compute = {s: [_Action(s, kinds[k], i) for k, i in handcrafted(schedule, pp, s, n_micro)] for s in range(pp)}
    runtime = _PipelineScheduleRuntime(_stand_ins(pp, pp, 1), n_micro, loss_fn=_loss)
    runtime._prepare_schedule_with_comms(compute)
    return tuple(tuple(_plain(a) for a in runtime.pipeline_order_with_comms[r]) for r in range(pp))


def order(schedule: str, pp: int, virtual_pp: int, n_micro: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in one step under ``schedule`` (``TORCH_RUNTIME`` or
    ``ZERO_BUBBLE``)."""
    if schedule in ZERO_BUBBLE:
        return zero_bubble_order(schedule, pp, n_micro)
    return torch_order(schedule, pp, virtual_pp, n_micro)

