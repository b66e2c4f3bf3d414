"""What a system's ranks are given (``Context``), what they give back (``Measurements``), and the
timing discipline every system runs under (``run_steps``): barrier, step, device synchronise,
barrier; warm-up steps run and their losses kept, their times excluded; under ``--eval-every`` the
held-out eval between steps (``contract.evaluation``), and ``--target-loss`` ending the run early.
"""
from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from contract.config import RunConfig
from contract.evaluation import Evaluator, Weights
from contract.faults import StepHooks
from contract.groups import op_timeout
from contract.links import link_groups, posts_ahead
from workload.data import TokenSource
from workload.model import GPT, build_gpt
from workload.partition import StageSpec, build_stage


@dataclass
class Measurements:
    """One rank's measurements. ``losses`` covers every step (warm-up included) and is set only on
    ranks that see the loss (a pipeline's last stage); the times cover the measured steps only."""

    step_times: list[float]
    losses: list[float] | None = None
    dp_sync_times: list[float] = field(default_factory=list)  # data-parallel synchronisation inside each step
    barrier_times: list[float] = field(default_factory=list)  # the step's closing barrier, waited on this rank
    # CPU time of the rank's process (every thread: fairscale's Pipe computes in worker threads) in each
    # measured step, on CPU devices only (a GPU rank's host time says nothing of its device): over the
    # step time, how busy the rank was, its bubbles and waits left out.
    busy_times: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # choices resolved at run time (e.g. the slicing)
    # Under --verify: the last step's gradients (full tensors, averaged over data parallelism) of the
    # parameters this rank holds, by the shared model's parameter names. Never written to a record.
    grads: dict[str, torch.Tensor] | None = None
    # Under --eval-every, on rank 0: the eval points (step, tokens, wall_time, loss, bytes_sent per
    # rank; see contract.evaluation), the first before any step.
    evals: list[dict[str, Any]] = field(default_factory=list)
    # When each measured step began, in seconds since the first step began (this rank's clock): where
    # the steps fall in a run whose links change (--network-trace).
    step_starts: list[float] = field(default_factory=list)
    steps_run: list[int] = field(default_factory=list)  # the indices of the steps this rank ran (warm-up included)


@dataclass
class StepPlan:
    """How many steps the run takes: the config's warm-up and measured steps, fewer once an eval
    reaches --target-loss. A system that prepares a step ahead (posts its receives) asks
    ``more_after`` whether another step follows, never the config."""

    total: int

    def more_after(self, step: int) -> bool:
        return step + 1 < self.total


@dataclass(frozen=True)
class Context:
    """Everything a rank needs besides the config: where it runs and the seeded workload."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device  # the rank's (first) device
    backend: str  # nccl on CUDA, gloo on CPU
    config: RunConfig
    plan: StepPlan = None  # type: ignore[assignment]  # the steps this run takes (made from the config)
    # Every device the process computes on, ``device`` first (fairscale: its pipe's GPUs); () = (device,)
    devices: tuple[torch.device, ...] = ()
    hooks: StepHooks = field(default_factory=StepHooks)  # the harness's, around each step (run_steps)
    # A data-parallel replica that is a world of its own (torchrun's ``rank`` and ``world_size`` are
    # then the replica's): its index, and the step it starts at (a replica that rejoined starts late).
    # None: the world holds every replica. Only a fault-tolerant system is launched so (contract.faults).
    replica: int | None = None
    first_step: int = 0

    def __post_init__(self) -> None:
        if self.plan is None:
            object.__setattr__(self, "plan", StepPlan(self.config.total_steps))
        if not self.devices:
            object.__setattr__(self, "devices", (self.device,))

    @property
    def data(self) -> TokenSource:
        m = self.config.model
        return TokenSource(seq_len=m.seq_len, vocab_size=m.vocab_size, seed=self.config.seed,
                           text_path=self.config.data, tokenizer=self.config.tokenizer)

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of data-parallel replica dp_rank at this step, on this rank's device."""
        x, y = self.data.replica_batch(step, self.config.batch_size, dp_rank, self.config.dp)
        return x.to(self.device), y.to(self.device)

    def build_model(self) -> GPT:
        return build_gpt(self.config.model, self.config.seed, self.device)

    def build_stage(self, spec: StageSpec) -> GPT:
        return build_stage(self.config.model, spec, self.config.seed, self.device)

    @property
    def op_timeout(self) -> datetime.timedelta:
        """How long one operation of this run may wait: give it to every process group a system makes
        (``contract.groups``; ``dist.new_group`` would give NCCL's 10 minutes)."""
        return datetime.timedelta(seconds=op_timeout(self.backend, self.config.timeout))

    def synchronize(self) -> None:
        """Wait until every GPU this process uses has finished the work queued on its current stream.
        Not the whole device (``torch.cuda.synchronize``): that waits for every stream, NCCL's too, and
        a receive posted there ahead of its send (the next step's) would never finish; each system
        joins its communication into the current stream (``Work.wait``) before its step returns."""
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()


class StepBarrier:
    """The timing barrier: returns once every rank has called it. A dissemination barrier (Hensgen,
    Finkel and Manber, 1988): ceil(log2 n) rounds, in round k each rank signals rank + 2^k and waits
    for rank - 2^k, so it pays one one-way network delay per round, where gloo's barrier (an
    all-reduce) pays 2 at 2 ranks and 4 at 4 (measured on the virtual cluster). Each round's signal
    travels on a link of its own (``contract.links``: a process group per ordered pair, which also
    keeps it from matching a system's own messages). Over gloo a message moves only once its receive
    is posted, so each use posts the next use's receives (the last use leaves none behind); on a
    link that carries one direction only, a pending receive holds back no send, as NCCL's rules
    require. On CUDA it posts a use's receives when that use begins instead: a receive posted ahead
    is an NCCL kernel that spins on the GPU until its message comes, through the whole step, and a
    device-wide synchronise inside a system (megatron's point-to-point does one) or a CUDA call that
    waits for the device (a lazily loaded kernel's first launch) would wait for it forever. And it
    blocks the host: an NCCL ``wait`` only orders the current stream, so the barrier synchronises that
    stream after its last round (else its wait moves into the next step)."""

    def __init__(self, ctx: Context, uses: int):
        self.ctx, self.uses = ctx, uses
        n = ctx.world_size
        rounds = _powers_below(n)
        self.links = link_groups(((r, (r + k) % n) for r in range(n) for k in rounds), ctx.device, ctx.op_timeout)
        self.peers = [((ctx.rank + k) % n, (ctx.rank - k) % n) for k in rounds]  # (to, from) per round
        self.token = torch.zeros(1, device=ctx.device)
        self.ahead = posts_ahead(ctx.device)  # gloo: the next use's receives ahead; NCCL: at the use
        self._posted = self._post() if self.ahead else None

    def _post(self) -> list[tuple[torch.Tensor, Any]] | None:
        if self.uses <= 0:
            return None
        me = self.ctx.rank
        bufs = [torch.empty(1, device=self.ctx.device) for _ in self.peers]
        return [(b, dist.irecv(b, src, group=self.links[src, me])) for b, (_, src) in zip(bufs, self.peers)]

    def wait(self) -> None:
        posted = self._posted if self.ahead else self._post()
        self.uses -= 1
        assert posted is not None, "StepBarrier used more often than declared"
        me = self.ctx.rank
        for (dst, _), (_, recv) in zip(self.peers, posted):
            send = dist.isend(self.token, dst, group=self.links[me, dst])
            recv.wait()
            send.wait()
        self._posted = self._post() if self.ahead else None
        if self.ctx.device.type == "cuda":
            torch.cuda.current_stream(self.ctx.device).synchronize()


def _powers_below(n: int) -> list[int]:
    """1, 2, 4, ... below n: the dissemination barrier's rounds."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out


@dataclass(frozen=True)
class StepOutput:
    loss: float | None  # the replica's loss on ranks that see it, else None
    dp_sync_time: float = 0.0  # seconds of data-parallel synchronisation inside the step


StepFn = Callable[[int, torch.Tensor, torch.Tensor], StepOutput]


def run_steps(ctx: Context, dp_rank: int, step_fn: StepFn, weights: Weights | None = None) -> Measurements:
    """Run the warm-up and measured steps of ``step_fn(step, inputs, targets)`` and time each one:
    barrier, step, device synchronise, barrier. A step's time includes its closing barrier (every
    rank has finished the step); ``barrier_times`` holds that barrier's share on this rank.

    Under ``--eval-every N``, ``weights()`` (called on every rank at each eval) gives the parameters
    the rank holds, full tensors by the shared model's names (``contract.evaluation``); the eval runs
    before the first step, after every N steps and after the last. When an eval's loss is at or below
    ``--target-loss``, one more step runs and the run ends (the system may have prepared that step
    already: ``ctx.plan``); it counts in no eval point."""
    cfg = ctx.config
    m = Measurements(step_times=[])
    losses: list[float] = []
    barrier = StepBarrier(ctx, uses=2 * (ctx.plan.total - ctx.first_step))
    on_cpu = ctx.device.type == "cpu"
    evaluator = Evaluator(ctx, weights) if cfg.eval_every else None
    # an eval's loss was at the target: the step running now is the last, and not evaluated
    reached = evaluator is not None and _evaluated(ctx, evaluator, ctx.first_step - 1, barrier)
    step = ctx.first_step - 1
    first_start = None
    while ctx.plan.more_after(step):
        step += 1
        inputs, targets = ctx.batch(step, dp_rank)
        ctx.hooks.before_step(step)
        barrier.wait()
        start, cpu_start, clock_start = time.perf_counter(), time.process_time(), time.time()
        if first_start is None:
            first_start = start
            ctx.hooks.started()
        out = step_fn(step, inputs, targets)
        ctx.synchronize()
        done, busy, clock_done = time.perf_counter(), time.process_time() - cpu_start, time.time()
        ctx.hooks.after_step(step, done - start, busy)
        barrier.wait()
        end = time.perf_counter()
        m.steps_run.append(step)
        warm = step < cfg.warmup
        if not warm:
            m.step_starts.append(start - first_start)
            m.step_times.append(end - start)
            m.barrier_times.append(end - done)
            m.dp_sync_times.append(out.dp_sync_time)
            if on_cpu:
                m.busy_times.append(busy)
        if out.loss is not None:
            losses.append(out.loss)
        if ctx.rank == 0:
            loss = f" loss {out.loss:.4f}" if out.loss is not None else ""
            tag = " (warm-up)" if warm else ""
            print(f"[{cfg.system}] step {step + 1}/{cfg.total_steps} {end - start:.3f} s{loss}{tag}",
                  file=sys.stderr, flush=True)
        if evaluator is not None and not reached:
            evaluator.step_done(clock_start, clock_done)
            if (step + 1) % cfg.eval_every == 0 or not ctx.plan.more_after(step):
                reached = _evaluated(ctx, evaluator, step, barrier)
    m.losses = losses or None
    if evaluator is not None:
        m.evals = evaluator.points
    return m


def _evaluated(ctx: Context, evaluator: Evaluator, step: int, barrier: StepBarrier) -> bool:
    """The eval after ``step`` (-1: before the first); True if it reached the target loss (the next
    step, if the run had one, becomes its last)."""
    loss = evaluator.evaluate(step + 1)
    target = ctx.config.target_loss
    reached = target is not None and loss <= target
    if ctx.rank == 0:
        note = f" <= target {target:g}: the run ends" if reached else ""
        print(f"[{ctx.config.system}] eval after {step + 1} steps: held-out loss {loss:.4f}{note}", file=sys.stderr,
              flush=True)
    if reached and ctx.plan.more_after(step):
        ctx.plan.total = step + 2
        barrier.uses = 2  # the last step's two barriers: the last one leaves no receive posted
    return reached
