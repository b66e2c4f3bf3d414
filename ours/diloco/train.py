"""diloco: the ranks' training (see ``ours.diloco``).

Global rank r = replica x P + stage. Replica d's P ranks form its torchft replica group: its stage 0
runs the group's TCP store and torchft's manager server; every rank runs a torchft ``Manager``
(group rank = its stage) whose process group joins the same stage of every replica (what DiLoCo's
all-reduces cross: a pipeline within a site, DiLoCo across sites). The lighthouse that forms the
quorums was started by the run command (``$TORCHFT_LIGHTHOUSE``).

A step: the replica's forward and backward (ours' ``StageEngine`` over the replica's pipeline, or
the whole model at P = 1, micro-batches accumulated), then the inner optimizer's step, on which
torchft's ``DiLoCo`` hooks: every H/F steps it prepares a fragment (quorum, its pseudo-gradient's
all-reduce started, bucketed into one message) and, tau steps later, waits for it and applies the
outer step. The manager's first quorum (which connects its process group) is formed before the
first step, as other systems' process groups are.

Measurements: ``dp_sync_time`` is the inner optimizer's step on the steps where a fragment was
synced (the quorum, the all-reduce, the outer step); under --verify the last step's gradients (the
inner ones, before the inner step), averaged over the replicas; under --eval-every the global
weights (the outer optimizer's, the same on every replica), which change only when a fragment is
synced: every H/F steps (``eval_weights_every`` in the record's options).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch
import torch.distributed as dist
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from contract import RunConfig
from contract.links import link_groups
from contract.rank import Context, Measurements, StepOutput, run_steps
from ours.diloco import DiLoCoOptions
from ours.diloco.fragments import stage_fragments
from ours.engine import StageEngine, pipeline_links
from ours.trace import Tracer
from ours.train import resolve_slices
from workload.model import lm_loss
from workload.partition import stage_specs
from workload.training import autocast, checkpoint_blocks, make_optimizer


HEARTBEAT = datetime.timedelta(seconds=1)  # each manager's to the lighthouse


def local_address() -> str:
    """This rank's address towards the rendezvous host (a virtual host's eth0, or loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], 9))
        return s.getsockname()[0]


def make_manager(cfg: RunConfig, ctx: Context, dp_rank: int, pp_rank: int) -> tuple[Manager, object]:
    """This rank's torchft manager (and its replica's TCP store, held by stage 0 to keep it serving).
    Its quorums need every replica, or, where --kill-replica ends one, the others."""
    P = cfg.pp
    address = local_address()
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False) if pp_rank == 0 else None
    stores: list = [None] * ctx.world_size
    dist.all_gather_object(stores, (address, store.port if store is not None else None))
    store_address, store_port = stores[0 if ctx.replica is not None else dp_rank * P]
    timeout = datetime.timedelta(seconds=cfg.timeout)
    pg = ProcessGroupNCCL(timeout=timeout) if ctx.backend == "nccl" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.dp - (cfg.kill_replica is not None),
        use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=pp_rank, world_size=P,
        store_addr=store_address, store_port=store_port, replica_id=f"diloco_{dp_rank}", hostname=address,
        heartbeat_interval=HEARTBEAT, init_sync=False)
    return manager, store


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    logging.getLogger("torchft").setLevel(logging.ERROR)  # e.g. "Unable to reset NCCL flight recorder" on gloo
    o: DiLoCoOptions = cfg.options
    P, D = cfg.pp, cfg.dp
    # the whole run in one world (rank = replica x P + stage), or this replica alone in its own
    # (a run that loses a replica: contract.faults)
    dp_rank, pp_rank = divmod(ctx.rank, P) if ctx.replica is None else (ctx.replica, ctx.rank)
    spec = stage_specs(cfg.model.n_layer, P)[pp_rank]
    model = ctx.build_stage(spec)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    inner = make_optimizer(params, cfg.optimizer)
    extra: dict = {}
    if P > 1:
        slices, source = resolve_slices(cfg.replace(options=o.pipeline()), ctx)
        engine = StageEngine(
            model, spec, slices=slices, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
            device=ctx.device, rank=ctx.rank, prev_rank=None if spec.is_first else ctx.rank - 1,
            next_rank=None if spec.is_last else ctx.rank + 1, tracer=Tracer(ctx.rank, enabled=False),
            precision=cfg.precision, recompute=cfg.recompute, schedule=o.schedule,
            links=link_groups(pipeline_links(P, D if ctx.replica is None else 1), ctx.device, ctx.op_timeout))
        extra.update(slices=list(slices), slicing=source, n_batch_slices=cfg.n_micro_batches)

        def forward_backward(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
            loss = engine.step(inputs, targets, post_next=ctx.plan.more_after(i))
            return float(loss) if loss is not None else None
    else:
        engine = None
        if cfg.recompute:
            checkpoint_blocks(model)

        def forward_backward(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
            total = torch.zeros((), device=ctx.device)
            for x, y in zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size)):
                with autocast(ctx.device, cfg.precision):
                    loss = lm_loss(model(x), y) / cfg.n_micro_batches
                loss.backward()
                total += loss.detach()
            return float(total)

    average = None  # under --verify: every stage's replicas, to average the last gradients
    if cfg.verify and D > 1:
        for s in range(P):
            g = dist.new_group([d * P + s for d in range(D)], timeout=ctx.op_timeout)
            if s == pp_rank:
                average = g

    fragments = stage_fragments(model, cfg.model.n_layer, P, pp_rank, o.fragments)
    outer = [torch.optim.SGD(f.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.outer_momentum > 0)
             for f in fragments]
    manager, store = make_manager(cfg, ctx, dp_rank, pp_rank)
    if ctx.replica is not None and not ctx.first_step:  # replicas that are worlds of their own: every manager
        # heartbeating before any asks for the first quorum, which the lighthouse then holds for all (a
        # quorum of the first D - 1 would leave the last one's first sync without partners)
        ctx.hooks.start_together()
        time.sleep(1.5 * HEARTBEAT.total_seconds())
    if cfg.rejoin:  # a replica that rejoins heals from another: its weights and inner optimizer too (the
        # fragments' global weights and outer optimizers are DiLoCo's own), as torchft's recovery does
        manager.register_state_dict_fn("replica", lambda sd: (model.load_state_dict(sd["model"]),
                                                              inner.load_state_dict(sd["inner"])),
                                       lambda: {"model": model.state_dict(), "inner": inner.state_dict()})
    diloco = DiLoCo(manager, list(fragments), inner, outer, sync_every=o.inner_steps, backup_device=None,
                    pin_memory=False, use_bucketization=True, should_quantize=o.quantize,
                    fragment_sync_delay=o.sync_delay, fragment_update_alpha=o.fragment_alpha)
    # the global weights (what the eval sees), by the shared names: each fragment's backup copy
    shared = {id(p): n for n, p in named}
    backups = [(f, {shared[id(p)]: n for n, p in frag.named_parameters()})
               for f, frag in zip(diloco._fragments, fragments)]
    last_grads: dict[str, torch.Tensor] = {}

    def step(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        for p in params:
            p.grad = None
        loss = forward_backward(i, inputs, targets)
        if cfg.verify and not ctx.plan.more_after(i):
            for n, p in named:
                g = p.grad.detach().clone()
                if average is not None:
                    dist.all_reduce(g, group=average)
                    g /= D
                last_grads[n] = g
        outer_steps = manager.current_step()
        start = time.perf_counter()
        inner.step()  # DiLoCo's hooks sync here when a fragment is due
        took = time.perf_counter() - start
        return StepOutput(loss=loss, dp_sync_time=took if manager.current_step() != outer_steps else 0.0)

    def weights() -> dict[str, torch.Tensor]:
        if dp_rank != 0 and ctx.replica is None:  # every replica holds the global weights: the first one's
            return {}
        return {name: frag.original_parameters[local] for frag, names in backups for name, local in names.items()}

    try:
        with diloco:
            if not ctx.first_step:  # the first quorum connects the manager's process group; a replica that
                # rejoins joins the others' quorum at its first sync (and heals there), as they sync
                manager.start_quorum()
            if engine is not None:
                engine.post_ahead()  # the first step's receives, before the first step (gloo)
            m = run_steps(ctx, dp_rank, step, weights)
    finally:
        manager.shutdown(wait=False)
        del store
    if cfg.verify:
        m.grads = last_grads if dp_rank == 0 else {}
    extra.update(outer_steps=manager.current_step(), replica_groups=D, pipeline_stages=P,
                 eval_weights_every=o.inner_steps // o.fragments)
    m.extra.update(extra)
    return m
