"""ours: the training entry point the ranks call (``train``).

Global rank r = (dp_rank * pp + pp_rank) * tp + tp_rank (``ours.tp.rank_of``; with tp = 1,
dp_rank * pp + pp_rank). Stage pp_rank holds the layers of ``stage_specs(n_layer, pp)[pp_rank]``, its
block linears split over its tp ranks (``ours.tp``); each DP group is the ranks with the same
(pp_rank, tp_rank). See ``ours.engine`` (the pipeline), ``ours.kernels`` (exact sliced attention,
deferred weight gradients), ``ours.tp`` (tensor parallelism) and ``ours.dp`` (data parallelism).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from contract import RunConfig
from contract.links import link_groups
from contract.rank import Context, Measurements, StepOutput, run_steps
from ours import WIRE_DTYPES, OursOptions, uniform_slices
from ours.dp import dp_links, make_sync
from ours.engine import StageEngine, pipeline_links
from ours.plan.auto import auto_slicing
from ours.plan.tune import Tuning, candidates, descend, nearest
from ours.schedule import ahead
from ours.tp import coords, gather_full, rank_of, shard_stage, tp_groups
from ours.trace import Tracer
from workload.partition import stage_specs
from workload.training import LOSS_SCALING

def resolve_slices(cfg: RunConfig, ctx: Context) -> tuple[tuple[int, ...], str]:
    """The token slicing every rank uses and how it was chosen: explicit / K equal slices, or
    ``auto`` / ``search`` (rank 0 decides: the planner; see ``ours.plan.auto``)."""
    options: OursOptions = cfg.options
    if not options.auto:
        return options.token_slices(cfg.model.seq_len), "given"
    box: list = [auto_slicing(cfg, ctx.device) if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    chosen = box[0]
    if sum(chosen.slices) != cfg.model.seq_len or any(s < 1 for s in chosen.slices):
        raise RuntimeError(f"auto slicing {chosen.slices} does not cover the sequence length {cfg.model.seq_len}")
    return chosen.slices, chosen.source


def tune_slices(planned: tuple[int, ...], make_engine, params: list[torch.nn.Parameter], ctx: Context,
                dp_rank: int) -> Tuning:
    """``--n-slices search``: time a step of K equal slices for a few K, starting near the planner's
    ``planned`` slicing, and keep the fastest (``ours.plan.tune``). Every rank times the same steps; a
    step's time is the slowest rank's (an all-reduce, which every rank then agrees on). The steps
    leave nothing behind: no optimizer step, gradients dropped."""
    seq = ctx.config.model.seq_len
    inputs, targets = ctx.batch(0, dp_rank)

    def time_k(k: int) -> float:
        engine = make_engine(uniform_slices(seq, k), Tracer(ctx.rank, enabled=False))
        dist.barrier()
        start = time.perf_counter()
        engine.step(inputs, targets)
        ctx.synchronize()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=ctx.device)  # NCCL: on the GPU
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        for p in params:
            p.grad = None
        return float(took)

    ks = candidates(seq)
    start = nearest(len(planned), ks)
    time_k(start)  # untimed: allocation, the first messages
    return descend(start, time_k, ks)


class _LossScaler:
    """fp16's dynamic loss scaling (``workload.training.LOSS_SCALING``, on any device): one scale for
    the whole world, kept in step by an all-reduced overflow flag: an overflow on any rank skips the
    step on every rank and halves the scale. Disabled (scale 1) under fp32 and bf16."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.scale = LOSS_SCALING["init_scale"] if enabled else 1.0
        self.good_steps = 0

    def check_and_unscale(self, params: list[torch.nn.Parameter]) -> bool:
        """True if the step may be applied (grads finite everywhere; grads unscaled in place)."""
        if not self.enabled:
            return True
        bad = torch.zeros((), device=self.device)
        for p in params:
            if p.grad is not None:
                bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            self.scale *= LOSS_SCALING["backoff_factor"]
            self.good_steps = 0
            return False
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
        self.good_steps += 1
        if self.good_steps % LOSS_SCALING["growth_interval"] == 0:
            self.scale *= LOSS_SCALING["growth_factor"]
        return True


def _groups(cfg: RunConfig, ctx: Context, pp_rank: int, tp_rank: int):
    """(this rank's DP group, its TP group, the link groups). Every rank creates every (stage, tp_rank)'s
    DP group (--verify's collectives) and every stage's TP group, in the same order, and a group per link
    and direction of the pipelines and of DP (their point-to-point traffic)."""
    pp, tp, dp = cfg.pp, cfg.tp, cfg.dp
    group = None
    if dp > 1:
        for s in range(pp):
            for t in range(tp):
                g = dist.new_group([rank_of(d, s, t, pp, tp) for d in range(dp)], timeout=ctx.op_timeout)
                if (s, t) == (pp_rank, tp_rank):
                    group = g
    tp_group = tp_groups(pp, tp, dp, ctx.rank, ctx.op_timeout)
    for g in (tp_group, group):  # NCCL creates a group's communicator at its first collective (it blocks the
        if g is not None:        # host and allocates on the GPU): here, before any receive is posted
            dist.all_reduce(torch.zeros(1, device=ctx.device), group=g)
    links = link_groups(pipeline_links(pp, dp, tp) + dp_links(pp, dp, tp), ctx.device, ctx.op_timeout)
    return group, tp_group, links


def _tuned(cfg: RunConfig, ctx: Context, slices: tuple[int, ...], source: str, make_engine, params, dp_rank: int):
    """The slicing ``tune_slices`` keeps of a few tried near the planner's (``--n-slices auto`` with
    the search), and its source in words."""
    tuning = tune_slices(slices, make_engine, params, ctx, dp_rank)
    planned = f"K={len(slices)} by {source.split(' ')[0]}"
    return uniform_slices(cfg.model.seq_len, tuning.k), f"{tuning.describe()}; started near {planned}"


def train(config: RunConfig, ctx: Context) -> Measurements:
    cfg = config
    pp, tp, dp = cfg.pp, cfg.tp, cfg.dp
    dp_rank, pp_rank, tp_rank = coords(ctx.rank, pp, tp)
    spec = stage_specs(cfg.model.n_layer, pp)[pp_rank]
    model = ctx.build_stage(spec)
    shard_stage(model, tp, tp_rank)
    options: OursOptions = cfg.options
    slices, slicing_source = resolve_slices(cfg, ctx)
    tracer = Tracer(ctx.rank, enabled=options.trace is not None)

    group, tp_group, links = _groups(cfg, ctx, pp_rank, tp_rank)

    wire = getattr(torch, WIRE_DTYPES[options.wire_dtype])

    def make_engine(slices: tuple[int, ...], tracer: Tracer) -> StageEngine:
        return StageEngine(
            model, spec, slices=slices, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
            device=ctx.device, rank=ctx.rank,
            prev_rank=None if spec.is_first else rank_of(dp_rank, pp_rank - 1, tp_rank, pp, tp),
            next_rank=None if spec.is_last else rank_of(dp_rank, pp_rank + 1, tp_rank, pp, tp), tracer=tracer,
            precision=cfg.precision, recompute=cfg.recompute, wire_dtype=wire, schedule=options.schedule,
            links=links, tp=tp, tp_rank=tp_rank, tp_group=tp_group)

    named = list(model.named_parameters())
    params = [p for _, p in named]
    if options.search and cfg.pp > 1 and cfg.model.seq_len > 1:  # one stage: one slice (nothing to fill)
        slices, slicing_source = _tuned(cfg, ctx, slices, slicing_source, make_engine, params, dp_rank)
    engine = make_engine(slices, tracer)
    sync = make_sync(options.dp_mode, named, cfg.optimizer, group=group, dp=dp, dp_rank=dp_rank,
                     ranks=[rank_of(d, pp_rank, tp_rank, pp, tp) for d in range(dp)], links=links,
                     order=engine.grad_order(), wire_dtype=wire, tracer=tracer)
    # the next step's forwards this stage runs at the end of a step (--prefetch; ours.schedule.ahead)
    n_ahead = ahead(options.first_ahead(pp), options.schedule, cfg.n_micro_batches, len(slices), pp_rank, pp)
    scaler = _LossScaler(cfg.precision == "fp16", ctx.device)
    if not scaler.enabled:  # gradients are final as the engine reports them: DP starts moving them at once
        engine.grads_ready = sync.grads_ready

    def step(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        with tracer.span("step", f"step {i}"):  # all of a step's work, inside run_steps's timed window
            loss, dt = one_step(i, inputs, targets)
        # the T ranks of the last stage compute the same loss: tp_rank 0 reports it
        return StepOutput(loss=float(loss) if loss is not None and tp_rank == 0 else None, dp_sync_time=dt)

    def one_step(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        more = ctx.plan.more_after(i)  # post the next step's receives a step ahead (on gloo: post_ahead)
        for p in params:
            p.grad = None
        engine.loss_scale = scaler.scale
        sync.post_receives()  # no-op where the previous step posted them
        loss = engine.step(inputs, targets, post_next=more)
        dt = 0.0
        with tracer.span("sync", f"dp {options.dp_mode} + optimizer" if dp > 1 else "optimizer"):
            if scaler.check_and_unscale(params):
                dt = sync.step()
            if more:
                sync.post_ahead()
            ctx.synchronize()
        if more and n_ahead:  # the stage's weights are final for step i + 1; its gradients are spent
            for p in params:
                p.grad = None
            engine.prefetch(ctx.batch(i + 1, dp_rank)[0], n_ahead)
        return loss, dt

    def weights() -> dict[str, torch.Tensor]:
        """Full tensors (gathered over TP: every TP rank takes part) on the first replica's tp_rank 0."""
        full = gather_full({n: p.detach() for n, p in named}, cfg.model, tp, tp_group)
        return full if dp_rank == 0 and tp_rank == 0 else {}

    engine.post_ahead()  # the first step's receives, before the first step (gloo)
    sync.post_ahead()
    m = run_steps(ctx, dp_rank, step, weights=weights)
    if cfg.verify:
        grads = gather_full(sync.grads(), cfg.model, tp, tp_group)
        m.grads = grads if tp_rank == 0 else {}
    if options.trace:
        tracer.write(options.trace, ctx.world_size)
    _record_choices(m, cfg, slices, slicing_source)
    return m


def _record_choices(m: Measurements, cfg: RunConfig, slices: tuple[int, ...], slicing_source: str) -> None:
    """The run's resolved choices in its measurements: the slicing and what the first stage ran ahead."""
    options: OursOptions = cfg.options
    m.extra.update(slices=list(slices), slicing=slicing_source, n_batch_slices=cfg.n_micro_batches)
    asked = options.first_ahead(cfg.pp)
    if asked:  # what the first stage ran ahead (known before launch only for a count and a slicing given)
        ran = ahead(asked, options.schedule, cfg.n_micro_batches, len(slices), 0, cfg.pp)
        m.extra["prefetch"] = ran
        if ran < asked and options.prefetch != "auto":  # the slicing 'auto' has fewer forwards before the
            m.extra["prefetch_asked"] = options.prefetch  # first backward than the count given
