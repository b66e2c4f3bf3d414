"""diloco: the ranks' training (see ``ours.diloco``), through torchft's public API.

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
first step, as other systems' process groups are; where the replicas are worlds of their own (a
run that loses one: ``contract.faults``), each replica's manager is first made known to the
lighthouse (a heartbeat, answered) and every replica has come that far before any asks for it, so
that the lighthouse holds the first quorum for all of them.

A replica that rejoins (--rejoin: the standby of a killed one) joins the others' next quorum and
heals from one of them, as torchft's recovery does: its weights, inner optimizer and the step they
are at come with the fragments' global weights and outer optimizers (``rejoin``).

Measurements: ``dp_sync_time`` is the inner optimizer's step on the steps where a fragment was
synced (the quorum, the all-reduce, the outer step); under --verify the last step's gradients (the
inner ones, before the inner step), averaged over the replicas; under --eval-every the global
weights (``GlobalWeights``), which change only when a fragment is synced: every H/F steps
(``eval_weights_every`` in the record's options).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torchft.checkpointing.pg_transport import PGTransport
from torchft.coordination import LighthouseClient
from torchft.local_sgd import DiLoCo
from torchft.manager import REPLICA_ID_KEY, Manager
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
from workload.partition import StageSpec, stage_specs
from workload.training import autocast, checkpoint_blocks, make_optimizer

HEARTBEAT = datetime.timedelta(seconds=1)  # each manager's to the lighthouse
ForwardBackward = Callable[[int, torch.Tensor, torch.Tensor], "float | None"]


def local_address() -> str:
    """This rank's address towards the rendezvous host (a virtual host's eth0, or loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], 9))
        return s.getsockname()[0]


def make_manager(cfg: RunConfig, ctx: Context, dp_rank: int, pp_rank: int) -> tuple[Manager, dist.TCPStore | None]:
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
        heartbeat_interval=HEARTBEAT, init_sync=False,
        # a replica that heals receives its state over the manager's own process group (as torchft's
        # train_ddp example does): its HTTP transport would advertise the machine's host name, which a
        # virtual host shares with the others
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=ctx.device))
    return manager, store


def announce(store: dist.TCPStore | None, timeout: datetime.timedelta) -> None:
    """Make this replica's manager known to the lighthouse now: one heartbeat under the id its manager
    server heartbeats with (which the manager keeps in the replica's store), answered before this
    returns. Only the replica's stage 0 (the store's holder) runs the manager server."""
    if store is None:
        return
    replica_id = store.get(REPLICA_ID_KEY).decode()
    LighthouseClient(os.environ["TORCHFT_LIGHTHOUSE"], connect_timeout=timeout).heartbeat(replica_id, timeout=timeout)


class GlobalWeights:
    """The global weights (the outer optimizer's) of a stage, by the shared model's names, on the CPU:
    the weights at start, then each fragment's parameters after its outer step (its outer optimizer's
    step post-hook: they hold the new global weights then, before torchft mixes the local ones back
    in). A replica that heals takes them over with the rest of its state (``ReplicaState``)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], fragments: list[nn.Module],
                 outer: list[torch.optim.Optimizer]):
        shared = {id(p): n for n, p in named}
        self.values = {n: p.detach().to("cpu", copy=True) for n, p in named}
        for fragment, opt in zip(fragments, outer):
            names = [(shared[id(p)], p) for p in fragment.parameters()]
            opt.register_step_post_hook(lambda *_, names=names: self.keep(names))

    @torch.no_grad()
    def keep(self, names: list[tuple[str, nn.Parameter]]) -> None:
        """Copy a fragment's parameters (just stepped by its outer optimizer): the new global weights."""
        for n, p in names:
            self.values[n].copy_(p)


@dataclasses.dataclass
class ReplicaState:
    """What a replica that rejoins heals from, beside what torchft's ``DiLoCo`` registers (the
    fragments' global weights as torchft keeps them, their outer optimizers): the weights, the inner
    optimizer, the global weights the eval sees, and the step running when the quorum was asked for
    (registered with the manager as one state dict, ``register``)."""

    model: nn.Module
    inner: torch.optim.Optimizer
    global_weights: GlobalWeights
    step: int | None = None  # the step being run (set as each begins); a healed replica's: the others'

    def register(self, manager: Manager) -> None:
        manager.register_state_dict_fn("replica", self.load, self.save)

    def save(self) -> dict:
        """Copies: a peer may fetch them while this replica's next steps change the weights."""
        return copy.deepcopy({"model": self.model.state_dict(), "inner": self.inner.state_dict(),
                              "global": self.global_weights.values, "step": self.step})

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        for n, t in state["global"].items():
            self.global_weights.values[n].copy_(t)
        self.step = state["step"]


def rejoin(inner: torch.optim.Optimizer, state: ReplicaState, o: DiLoCoOptions) -> int:
    """A standby's joining (inside ``DiLoCo``): inner steps that change nothing (no gradient) until
    DiLoCo's schedule is at the point where the others ask for a quorum, the last of which asks for it
    too (torchft's own path: it joins the others' next quorum, heals from one of them, and prepares
    its fragment with them). Returns the step the others were running then: this replica's steps go
    on from the next one, in step with theirs."""
    for _ in range(o.inner_steps // o.fragments - o.sync_delay):
        inner.step()
    if state.step is None:
        raise RuntimeError("the rejoining replica joined a quorum without healing from another replica "
                           "(the others had no outer step to heal it from)")
    return state.step


def pipeline_step(cfg: RunConfig, ctx: Context, model: nn.Module, spec: StageSpec,
                  replicas_in_world: int) -> tuple[ForwardBackward, StageEngine, dict]:
    """The forward and backward of a stage of ours' pipeline inside the replica (P > 1), its engine,
    and the slicing it resolved (for the record)."""
    o: DiLoCoOptions = cfg.options
    slices, source = resolve_slices(cfg.replace(options=o.pipeline()), ctx)
    engine = StageEngine(
        model, spec, slices=slices, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
        device=ctx.device, rank=ctx.rank, prev_rank=None if spec.is_first else ctx.rank - 1,
        next_rank=None if spec.is_last else ctx.rank + 1, tracer=Tracer(ctx.rank, enabled=False),
        precision=cfg.precision, recompute=cfg.recompute, schedule=o.schedule,
        links=link_groups(pipeline_links(cfg.pp, replicas_in_world), ctx.device, ctx.op_timeout))

    def forward_backward(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        loss = engine.step(inputs, targets, post_next=ctx.plan.more_after(i))
        return float(loss) if loss is not None else None
    return forward_backward, engine, dict(slices=list(slices), slicing=source, n_batch_slices=cfg.n_micro_batches)


def whole_model_step(cfg: RunConfig, ctx: Context, model: nn.Module) -> ForwardBackward:
    """The forward and backward of the whole model (P = 1), its micro-batches accumulated."""
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
    return forward_backward


def replica_average(cfg: RunConfig, ctx: Context, pp_rank: int) -> dist.ProcessGroup | None:
    """Under --verify (one world): this stage's process group across the replicas, to average the last
    gradients; every rank makes every stage's (new_group is collective)."""
    if not cfg.verify or cfg.dp < 2:
        return None
    mine = None
    for s in range(cfg.pp):
        g = dist.new_group([d * cfg.pp + s for d in range(cfg.dp)], timeout=ctx.op_timeout)
        if s == pp_rank:
            mine = g
    return mine


def quiet_torchft() -> None:
    """torchft's errors only (e.g. not "Unable to reset NCCL flight recorder" on gloo), and not torch's
    warnings of what torchft's checkpoint transport does to heal a replica (bytes it only reads, a
    deprecated pytree check): nothing the run can change."""
    logging.getLogger("torchft").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    quiet_torchft()
    o: DiLoCoOptions = cfg.options
    P, D = cfg.pp, cfg.dp
    # the whole run in one world (rank = replica x P + stage), or this replica alone in its own
    # (a run that loses a replica: contract.faults)
    dp_rank, pp_rank = divmod(ctx.rank, P) if ctx.replica is None else (ctx.replica, ctx.rank)
    spec = stage_specs(cfg.model.n_layer, P)[pp_rank]
    model = ctx.build_stage(spec)
    named = list(model.named_parameters())
    inner = make_optimizer([p for _, p in named], cfg.optimizer)
    engine, extra = None, {}
    if P > 1:
        forward_backward, engine, extra = pipeline_step(cfg, ctx, model, spec, D if ctx.replica is None else 1)
    else:
        forward_backward = whole_model_step(cfg, ctx, model)
    average = replica_average(cfg, ctx, pp_rank)
    fragments = stage_fragments(model, cfg.model.n_layer, P, pp_rank, o.fragments)
    outer = [torch.optim.SGD(f.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.outer_momentum > 0)
             for f in fragments]
    state = ReplicaState(model, inner, GlobalWeights(named, fragments, outer))
    rejoining = ctx.replica is not None and ctx.first_step > 0
    ctx.hooks.take_place()  # a standby, built: it waits here for the replica it stands in for to be gone
    manager, store = make_manager(cfg, ctx, dp_rank, pp_rank)
    if cfg.rejoin:
        state.register(manager)
    if ctx.replica is not None and not rejoining:  # replica worlds: the first quorum held for every one
        announce(store, datetime.timedelta(seconds=cfg.timeout))
        ctx.hooks.start_together()
    last_grads: dict[str, torch.Tensor] = {}

    def step(i: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        state.step = i
        inner.zero_grad(set_to_none=True)
        loss = forward_backward(i, inputs, targets)
        if cfg.verify and not ctx.plan.more_after(i):
            for n, p in named:
                g = p.grad.detach().clone()
                if average is not None:
                    dist.all_reduce(g, group=average)
                    g /= D
                last_grads[n] = g
        outer_steps = manager.current_step()
        took = _timed(inner.step)  # DiLoCo's hooks sync here when a fragment is due
        return StepOutput(loss=loss, dp_sync_time=took if manager.current_step() != outer_steps else 0.0)

    def weights() -> dict[str, torch.Tensor]:
        if dp_rank != 0 and ctx.replica is None:  # every replica holds the global weights: the first one's
            return {}
        return state.global_weights.values

    try:
        with DiLoCo(manager, list(fragments), inner, outer, sync_every=o.inner_steps, backup_device=None,
                    pin_memory=False, use_bucketization=True, should_quantize=o.quantize,
                    fragment_sync_delay=o.sync_delay, fragment_update_alpha=o.fragment_alpha):
            if rejoining:
                ctx = dataclasses.replace(ctx, first_step=rejoin(inner, state, o) + 1)
            else:
                manager.start_quorum()  # the first quorum connects the manager's process group
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


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
