"""The program every rank runs in one training step, for each system as it really runs.

- torch_pipe (torch.distributed.pipelining): GPipe (all forwards, each receive posted right before
  its micro-batch and waited; sends waited at the end of the phase; then all backwards in micro-batch
  order), 1F1B (torch's: stage s warms up with P - s forwards; a forward's send goes out with the next
  backward's receive, a backward's send with the next forward's receive, each pair waited together),
  interleaved (Megatron's interleaved order, several chunks per rank); zb, zbv, dualpipev: the actions
  torch's own schedule classes list for each rank, run as torch's runtime runs them (``_actions``,
  ``predict.pipeline_orders``). D > 1: FSDP2 on each stage's
  data-parallel group: every forward all-gathers each block, the first backward all-gathers them again
  (kept until the last), the last backward reduce-scatters the gradients (the stage's root parameters
  are gathered once and reduce-scattered once).
- megatron (megatron-core): 1F1B (P - s - 1 warm-up forwards, blocking sends and receives in pairs)
  or interleaved, or (predicted only) the zero-bubble ZB-H1 / ZB-H2 of ``predict.pipeline_orders``,
  run as torch's runtime runs an action list; tensor parallelism: per layer and pass the all-reduces of
  ``ours.plan.latency``'s count (after attention and after the MLP), in the forward, the backward and the
  recomputed forward; a tensor-parallel group is simulated as one rank (its members run in lock-step)
  that stands for tp processes; data parallel: the gradient all-reduce in finalize_model_grads.
- ours (``ours.engine``): every receive of a step posted a step ahead (the engine's at the end of the
  previous step's backward, the DP sync's after the previous sync; the first step's before the first
  barrier); every unit's (batch slice x token slice) forward and backward in the order of
  ``ours.schedule`` (1F1B over batch slices, or GPipe); each receive waited like the engine waits
  over gloo, running queued weight gradients until it arrives; the last stage computes the head and loss when a unit's
  backward starts; weight gradients deferred (queued per linear), run while waiting for a gradient and at the end,
  linear after linear; sends waited at the end. Data parallel (``ours.dp.PointToPointSync``), one round of
  point-to-point messages in 4 MiB buckets of the stage's gradients in the order they become final: a bucket is pushed
  as soon as its last gradient is (overlapping the remaining weight gradients), each range to the dp_rank that reduces
  it; that rank waits for the D - 1 pushes and, as a server, steps its range's optimizer and sends the result to every
  replica that does not reduce the whole bucket. central PS: dp_rank 0 reduces every bucket; sharded PS: each rank 1/D
  of every bucket; all-reduce: D = 2 a direct exchange of the buckets (each rank sums), D > 2 the sharded pattern
  sending back averaged gradients (a reduce-scatter and an all-gather point to point), then every rank's optimizer.
  ``chain_ps`` is the seed's (DT-FM's) central PS over NCCL, not an option of ours: per 25 MB bucket, once final, a
  chain reduce to dp_rank 0, its Adam step, a chain broadcast.

A stage's forward, backward (whole, or split into its input and its weight gradients) and parameters
are those of its own layers (``RunSpec.stage_layers``).

Every step is framed like the run command times it (``contract.rank.StepBarrier``): a
dissemination barrier (ceil(log2 n) rounds of a 1-element message to rank + 2^k, one one-way delay
per round; over gloo each use's receives posted one use ahead), the step, the closing barrier. The
simulator runs two steps and times the second (ranks enter it as the first one left them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from contract.links import Link
from predict import collectives as coll
from predict.simulator import Compute, Defer, FillWait, Flush, Group, Mark, Network, Recv, Send, Wait
from predict.pipeline_orders import TORCH_RUNTIME, ZERO_BUBBLE, order, owner
from predict.run_spec import RunSpec
from predict.placement import cards_of, hosts_of
from ours.dp import BUCKET_BYTES, bucket_ranges, bucket_starts, layout_of
from ours.plan.latency import TP_ALLREDUCES_PER_PASS
from ours.schedule import ahead, unit_order
from workload.compute import ComputeModel, Overheads, Scaled, stage_params
from workload.configs import block_params, norm_params, qkv_rows


@dataclass(frozen=True)
class Built:
    """Every simulated rank's program; the first ``timed`` are the step's ranks, the rest their
    communication streams (``Network.streams``)."""

    programs: list
    procs: list[int]
    network: Network
    timed: int = 0


class _Step:
    """Builds one rank's operations for one step of ``spec``; ``tag`` makes message keys unique."""

    def __init__(self, spec: RunSpec, cm: ComputeModel, network: Network, step: int):
        self.spec, self.net, self.step = spec, network, step
        self.o: Overheads = cm.overheads(spec.system)
        m = spec.model
        self.h, self.seq = m.n_embd, m.seq_len
        self.V = spec.virtual_pp
        self.n_chunks = spec.pp * spec.virtual_pp
        self.stage_layers = spec.stage_layers  # per model chunk (virtual stage), in model order
        self.tp = spec.tp if spec.system in TENSOR_PARALLEL else 1
        # the system's own kernels, and a tensor-parallel rank's math beyond 1/tp of the profiled
        factor = self.o.compute * (self.o.tp if self.tp > 1 else 1.0)
        self.cm = cm if factor == 1.0 else Scaled(cm, factor)
        self.width = spec.head_classes  # None: the vocabulary
        self.ddp: _MegatronDDP | None = None  # megatron's data parallelism, where it joins the passes

    def params(self, layers: int, first: bool, last: bool, tp: int = 1) -> int:
        return stage_params(self.spec.model, layers, first, last, tp, self.width)

    def chunk_params(self, chunks, tp: int = 1) -> int:
        """Parameters of the model chunks (virtual stages) ``chunks``, with the embeddings and the head
        where they hold the first and the last."""
        layers = sum(self.stage_layers[c] for c in chunks)
        return self.params(layers, 0 in chunks, self.n_chunks - 1 in chunks, tp)

    # ---- the math of one stage chunk on one micro-batch -------------------------------------
    def forward(self, chunk: int, b: int, l: int, c: int, stage: float | None = None) -> list:
        """Ops of a chunk's forward on b x l tokens after c (first chunk: embeddings; the last chunk of
        the baselines also runs the head and the loss here; ``stage``: its layers' time, ``_layers``).
        Where megatron's parameter all-gather runs behind the step's first forwards
        (``_MegatronDDP.gate``), each part waits for its bucket."""
        cm, tp, L = self.cm, self.tp, self.stage_layers[chunk]
        gate = self.ddp.gate(chunk) if self.ddp is not None else None
        ops = [Compute(self.o.per_unit(L) / 2, "overhead")]
        if chunk == 0:
            ops += (gate(L + 1) if gate else []) + [Compute(cm.embed(b * l) / 3, "embed")]
        if gate is None:
            ops += self._layers("forward", L, b, l, c, stage)
        else:
            for j in range(L):  # the layers in forward order: units L .. 1 (``_megatron_order``)
                ops += gate(L - j) + self._layers("forward", 1, b, l, c)
        if chunk == self.n_chunks - 1 and self.spec.system not in TOKEN_PIPELINE:
            ops += (gate(0) if gate else []) + [Compute(cm.head_forward(b * l, tp, self.width), "head")]
            ops += self._tp_comm(b * l, "head")
        return ops

    def backward(self, chunk: int, b: int, l: int, c: int) -> list:
        """Ops of a chunk's backward (the head first on the last chunk, the embeddings last on the
        first; under recompute each layer's forward again before its backward). Where megatron's
        gradient buckets leave as they become final (``_MegatronDDP.signal``), the chunk's last backward
        runs part by part, each followed by the signals of the buckets it completes."""
        cm, tp, L = self.cm, self.tp, self.stage_layers[chunk]
        head = []
        if chunk == self.n_chunks - 1:
            if self.spec.system in TOKEN_PIPELINE:
                head.append(Compute(cm.head_forward(b * l, 1, self.width), "head"))
            head.append(Compute(cm.head_backward_input(b * l, tp, self.width) + cm.head_wgrad(b * l, tp, self.width),
                                "head"))
            head += self._tp_comm(b * l, "head")
        embed = [Compute(cm.embed(b * l) * 2 / 3, "embed")] if chunk == 0 else []
        ops = [Compute(self.o.per_unit(L) / 2, "overhead")]
        signal = self.ddp.signal(chunk) if self.ddp is not None else None
        if signal is None:
            ops += head + (self._layers("recompute", L, b, l, c) if self.spec.recompute else [])
            return ops + self._layers("backward", L, b, l, c) + embed
        layer = (self._layers("recompute", 1, b, l, c) if self.spec.recompute else []) + \
            self._layers("backward", 1, b, l, c)
        for u, part in enumerate([head] + [layer] * L + [embed]):  # units in backward order (``_megatron_order``)
            ops += part + signal(u)
        return ops

    def backward_input(self, chunk: int, b: int, l: int, c: int) -> list:
        """Ops of a chunk's backward split off its weight gradients (a zero-bubble schedule's I): the
        head's and the layers' input gradients (after the recomputed forward), their tensor-parallel
        all-reduces, half the backward's framework time."""
        cm, tp, L = self.cm, self.tp, self.stage_layers[chunk]
        ops = [Compute(self.o.per_unit(L) / 4, "overhead")]
        if chunk == self.n_chunks - 1:
            ops.append(Compute(cm.head_backward_input(b * l, tp, self.width), "head"))
            ops += self._tp_comm(b * l, "head")
        if self.spec.recompute:
            ops += self._layers("recompute", L, b, l, c)
        return ops + self._layers("backward-input", L, b, l, c)

    def weight_grad(self, chunk: int, b: int, l: int) -> list:
        """Ops of a chunk's weight gradients (a zero-bubble schedule's W): the layers', the head's, the
        embeddings', the other half of the backward's framework time. Where megatron's gradient buckets
        leave as they become final (``_MegatronDDP.signal``), the chunk's last W hands them all over."""
        cm, tp, L = self.cm, self.tp, self.stage_layers[chunk]
        ops = [Compute(self.o.per_unit(L) / 4, "overhead"), Compute(L * cm.layer_wgrad(b, l, tp), "wgrad")]
        if chunk == self.n_chunks - 1:
            ops.append(Compute(cm.head_wgrad(b * l, tp, self.width), "head"))
        if chunk == 0:
            ops.append(Compute(cm.embed(b * l) * 2 / 3, "embed"))
        signal = self.ddp.signal(chunk) if self.ddp is not None else None
        return ops + ([op for u in range(L + 2) for op in signal(u)] if signal else [])

    def _layers(self, kind: str, L: int, b: int, l: int, c: int, stage: float | None = None) -> list:
        """A chunk's L layers of ``kind`` on b x l tokens after c: each layer's time from the compute
        model, or ``stage`` / L (ours: its cost of a slice, ``ComputeModel.slice_cost``)."""
        cm, tp = self.cm, self.tp
        if stage is not None:
            t = stage / L
        elif kind == "recompute" and self.spec.recompute_granularity == "selective":
            return [Compute(L * cm.attention_forward(b, l, c, tp), kind)]  # the attention core alone, no TP comm
        elif kind == "backward":
            t = cm.layer_backward_input(b, l, c, tp) + cm.layer_wgrad(b, l, tp)
        elif kind == "backward-input":  # ours: the weight gradients deferred
            t = cm.layer_backward_input(b, l, c, tp)
        else:
            t = cm.layer_forward(b, l, c, tp)
        label = "backward" if kind == "backward-input" else kind
        if tp == 1:
            return [Compute(L * t, label)]
        hidden = 0.0  # TransformerEngine's overlap: a collective hidden behind its part's linear GEMMs
        if self.spec.tp_comm_overlap:
            phases = ("backward_input", "wgrad") if kind == "backward" else ("forward",)
            hidden = sum(cm.linear_time(p, b, l, c, tp) for p in phases) / TP_ALLREDUCES_PER_PASS
        ops = []
        for _ in range(L):  # a layer's all-reduces in a pass, each after its share of the layer's math
            for _part in range(TP_ALLREDUCES_PER_PASS):
                ops.append(Compute(t / TP_ALLREDUCES_PER_PASS, label))
                ops += self._tp_comm(b * l, kind, hidden)
        return ops

    def _tp_comm(self, tokens: int, what: str, hidden: float = 0.0) -> list:
        """One tensor-parallel all-reduce of b*l*h activations (under sequence parallelism a
        reduce-scatter and an all-gather: the same bytes on a ring), in closed form (the group is one
        simulated rank), less ``hidden`` seconds of it that overlap GEMMs."""
        if self.tp == 1 or what == "head":
            return []
        nbytes = tokens * self.h * self.spec.activation_bytes
        link = self.net.intra_link or self.net.link
        c = self.spec.cluster
        if c is not None and self.tp > c.gpus_per_node:  # the group spans nodes: its ring crosses their cards
            link = c.crossing(c.gpus_per_node)
        if self.net.transport == "gloo":  # gloo's ring: a receive-posted handshake per step, two delays
            link = Link(2 * link.latency, link.bandwidth)
        if self.spec.sequence_parallel:
            t = link.collective("reduce_scatter", self.tp, nbytes) + link.collective("allgather", self.tp, nbytes)
        else:
            t = link.collective("allreduce", self.tp, nbytes)
        return [Compute(t - hidden, "tp_comm")] if t > hidden else []

    def optimizer(self, params: int) -> list:
        return [Compute(self.cm.optimizer(params), "optimizer")]

    def act_bytes(self, b: int, l: int) -> int:
        """Bytes of b x l activations (or their gradients) one GPU sends to the next stage: on a GPU
        cluster Megatron's tensor-parallel ranks each send 1/tp of them (its scatter-gather of the
        pipeline's messages), ours' each the whole (``Network.copies``)."""
        n = b * l * self.h * self.spec.activation_bytes
        if self.net.gpu and self.spec.system == "megatron":
            return n // self.tp
        return n

    def collective(self, op: str, group: tuple, rank: int, key: tuple, nbytes: float, kind: str) -> list:
        """One collective of this rank's over ``group`` (NCCL: rings ordered host by host; a group too
        large for that in closed form, over the cards one of its rings can use)."""
        host = self.net.host if self.net.gpu else None
        link, c = self.net.link, self.spec.cluster
        if c is not None and c.inter is not None:
            on_node = sum(1 for g in group if self.net.host(g) == self.net.host(rank))
            rings = min(on_node, max(1, c.nics_per_node // self.tp))  # each of tp rings its own cards
            messages = len(group) * rings * 2 * (len(group) - 1)  # an all-reduce's, every member's
            if len(group) > coll.MAX_RING or (on_node < len(group) and messages > coll.RING_MESSAGES):
                link = c.crossing(rings)
                host = None  # in closed form: its messages are too many to simulate one by one
        card = (lambda r: self.net.cards[self.net.gpus_of(r)]) if self.net.cards is not None else None
        return coll.collective(self.net.transport, op, group, rank, key, nbytes, link, kind, host, card)


def _key(step: int, *parts) -> tuple:
    return (step, *parts)


# ---- torch_pipe ------------------------------------------------------------------------------------
def _fsdp_sizes(spec: RunSpec, first: bool, last: bool) -> tuple[int, int]:
    """(bytes of one block's parameters, bytes of the root parameters of a stage that holds the
    embeddings (``first``: the first stage) or the final norm and the output layer (``last``)), fp32, of
    the model's family."""
    m = spec.model
    return block_params(m) * 4, stage_params(m, 0, first, last, 1, spec.head_classes) * 4


class _Stage:
    """One torch_pipe rank's view of its step: its stage, neighbours, message keys, and the ops of a
    micro-batch's forward and backward (with FSDP2's collectives when D > 1)."""

    def __init__(self, st: _Step, rank: int):
        spec = st.spec
        self.st, self.rank = st, rank
        self.P, self.m = spec.pp, spec.n_micro_batches
        self.d, self.s = divmod(rank, self.P)
        self.nb = st.act_bytes(spec.micro_batch_size, st.seq)
        self.prev, self.nxt = rank - 1, rank + 1
        self.first, self.last = self.s == 0, self.s == self.P - 1
        self.group = tuple(k * self.P + self.s for k in range(spec.dp))
        self.block_bytes, self.root_bytes = _fsdp_sizes(spec, self.first, self.last)
        self.fsdp = spec.dp > 1
        self.layers = st.stage_layers[self.s]

    def fk(self, i: int, src: int) -> tuple:  # activation of micro-batch i leaving stage src
        return _key(self.st.step, "f", self.d, src, i)

    def bk(self, i: int, src: int) -> tuple:  # gradient of micro-batch i leaving stage src
        return _key(self.st.step, "b", self.d, src, i)

    def _coll(self, op: str, tag: tuple, nbytes: int) -> list:
        st = self.st
        return st.collective(op, self.group, self.rank, _key(st.step, "fsdp", self.s, *tag), nbytes, "fsdp")

    def fwd(self, i: int) -> list:
        st, out = self.st, []
        if self.fsdp:
            if i == 0 and self.root_bytes:
                out += self._coll("allgather", ("root",), self.root_bytes)
            for j in range(self.layers):
                out += self._coll("allgather", ("f", i, j), self.block_bytes)
        return out + st.forward(self.s, st.spec.micro_batch_size, st.seq, 0)

    def bwd(self, i: int) -> list:
        st, out = self.st, []
        if self.fsdp and i == 0:
            for j in range(self.layers):
                out += self._coll("allgather", ("b", j), self.block_bytes)
        out += st.backward(self.s, st.spec.micro_batch_size, st.seq, 0)
        if self.fsdp and i == self.m - 1:
            for j in range(self.layers):
                out += self._coll("reduce_scatter", ("rs", j), self.block_bytes)
            if self.root_bytes:
                out += self._coll("reduce_scatter", ("rs", "root"), self.root_bytes)
        return out


def torch_pipe(st: _Step, rank: int) -> list:
    spec = st.spec
    if spec.schedule == "interleaved":
        return _interleaved(st, rank, *divmod(rank, spec.pp))
    if spec.schedule in TORCH_RUNTIME:
        ops, chunks = _actions(st, rank, first_in_w=True)
        params = st.chunk_params(chunks)
        return ops + st.optimizer(params // spec.dp if spec.dp > 1 else params)
    p = _Stage(st, rank)
    ops = [Compute(st.o.step, "overhead")]
    ops += _gpipe(p) if spec.schedule == "gpipe" else _torch_1f1b(p)
    params = st.params(p.layers, p.first, p.last)
    return ops + st.optimizer(params // spec.dp if p.fsdp else params)


def _gpipe(p: _Stage) -> list:
    """torch's ScheduleGPipe: each receive posted and waited right before its micro-batch; a phase's
    sends waited at its end."""
    return (_gpipe_phase(p, p.fk, p.fwd, p.s - 1, None if p.first else p.prev, None if p.last else p.nxt)
            + _gpipe_phase(p, p.bk, p.bwd, p.s + 1, None if p.last else p.nxt, None if p.first else p.prev))


def _gpipe_phase(p: _Stage, key, run, src: int, recv_from: int | None, send_to: int | None) -> list:
    """One direction of ScheduleGPipe over the micro-batches: receive from ``recv_from`` (None: the
    pipeline's end) what stage ``src`` sent, ``run`` it, send it on to ``send_to``; sends waited last."""
    ops, sends = [], []
    for i in range(p.m):
        if recv_from is not None:
            ops += [Recv(key(i, src), recv_from, p.nb), Wait((key(i, src),))]
        ops += run(i)
        if send_to is not None:
            ops.append(Send(key(i, p.s), send_to, p.nb))
            sends.append(key(i, p.s))
    return ops + ([Wait(tuple(sends))] if sends else [])


def _exchange(p: _Stage, sends: list, recvs: list, peer: int) -> list:
    """Send ``sends`` to and receive ``recvs`` from one neighbour, then wait for all of them."""
    ops = [Send(k, peer, p.nb) for k in sends] + [Recv(k, peer, p.nb) for k in recvs]
    return ops + ([Wait(tuple(sends + recvs))] if sends or recvs else [])


def _torch_1f1b(p: _Stage) -> list:
    """torch's Schedule1F1B: P - s warm-up forwards (the last one's send held back); then a forward's
    send goes out with the next backward's receive and a backward's send with the next forward's
    receive, each pair waited together; cool-down backwards, each send waited after the next backward."""
    ops: list = []
    warm = min(p.m, p.P - p.s)
    fi = bi = 0
    send_work: list = []
    fwd_sends: list = []
    for _ in range(warm):
        if not p.first:
            ops += [Recv(p.fk(fi, p.s - 1), p.prev, p.nb), Wait((p.fk(fi, p.s - 1),))]
        ops += p.fwd(fi)
        if send_work:
            ops.append(Wait(tuple(send_work)))
            send_work = []
        fwd_sends = [p.fk(fi, p.s)] if not p.last else []
        if fi != warm - 1:
            ops += [Send(k, p.nxt, p.nb) for k in fwd_sends]
            send_work, fwd_sends = fwd_sends, []
        fi += 1
    while True:
        ops += _exchange(p, fwd_sends, [p.bk(bi, p.s + 1)] if not p.last else [], p.nxt)
        ops += p.bwd(bi)
        bwd_sends = [p.bk(bi, p.s)] if not p.first else []
        bi += 1
        if fi == p.m:
            break
        ops += _exchange(p, bwd_sends, [p.fk(fi, p.s - 1)] if not p.first else [], p.prev)
        ops += p.fwd(fi)
        fwd_sends = [p.fk(fi, p.s)] if not p.last else []
        fi += 1
    ops += [Send(k, p.prev, p.nb) for k in bwd_sends]
    send_work = bwd_sends
    while bi < p.m:
        recvs = [p.bk(bi, p.s + 1)] if not p.last else []
        ops += [Recv(k, p.nxt, p.nb) for k in recvs]
        if recvs:
            ops.append(Wait(tuple(recvs)))
        ops += p.bwd(bi)
        if send_work:
            ops.append(Wait(tuple(send_work)))
        send_work = [p.bk(bi, p.s)] if not p.first else []
        ops += [Send(k, p.prev, p.nb) for k in send_work]
        bi += 1
    if send_work:
        ops.append(Wait(tuple(send_work)))
    return ops


# ---- action lists: torch's runtime schedules and the zero-bubble ones (predict.pipeline_orders) -------
def _actions(st: _Step, rank: int, first_in_w: bool) -> tuple[list, tuple[int, ...]]:
    """One rank's step under a schedule that is a list of actions (``predict.pipeline_orders``), run as
    torch's ``_PipelineScheduleRuntime`` runs it: a receive posted where the list has it, waited by the
    forward or backward that consumes it (none between two stages of one rank: the V's turn); a send
    posted after its forward or backward, every send waited at the end of the step; F+B's forward then
    its backward. I and W split a chunk's backward (``_Step.backward_input``, ``weight_grad``); torch's
    first stage computes no input gradient (``first_in_w``: its I is empty, its W the whole backward).
    D > 1 (torch_pipe): each stage one FSDP2 unit, its parameters all-gathered at UNSHARD and its
    gradients reduce-scattered at REDUCE_GRAD. (ops without the optimizer, the chunks the rank holds)."""
    spec = st.spec
    P, n = spec.pp, st.n_chunks
    d, s = divmod(rank, P)
    mb, seq = spec.micro_batch_size, st.seq
    nb = st.act_bytes(mb, seq)
    actions = order(spec.schedule, P, spec.virtual_pp, spec.n_micro_batches)[s]
    chunks = tuple(sorted({c.stage for a in actions for c in (a.sub or (a,)) if c.kind in ("F", "UNSHARD")}))
    group = tuple(k * P + s for k in range(spec.dp))

    def at(stage: int) -> int:  # the simulated rank holding a stage of this pipeline
        return d * P + owner(spec.schedule, P, stage)

    def key(kind: str, stage: int, i: int) -> tuple:  # the activation (f) or gradient (b) ``stage`` sent
        return _key(st.step, kind, d, stage, i)

    def fsdp(op: str, stage: int) -> list:
        if spec.dp == 1:
            return []
        block, root = _fsdp_sizes(spec, stage == 0, stage == n - 1)
        nbytes = block * st.stage_layers[stage] + root
        uses[stage, op] = uses.get((stage, op), -1) + 1  # a stage evicted and gathered again
        return st.collective(op, group, rank, _key(st.step, "fsdp", stage, op, uses[stage, op]), nbytes, "fsdp")

    def run(a) -> list:
        j, i = a.stage, a.mb
        if a.kind == "F":
            wait = [Wait((key("f", j - 1, i),))] if j > 0 and owner(spec.schedule, P, j - 1) != s else []
            return wait + st.forward(j, mb, seq, 0)
        if a.kind in ("I", "B"):
            wait = [Wait((key("b", j + 1, i),))] if j < n - 1 and owner(spec.schedule, P, j + 1) != s else []
            if a.kind == "B":
                return wait + st.backward(j, mb, seq, 0)
            return wait + ([] if first_in_w and j == 0 else st.backward_input(j, mb, seq, 0))
        if a.kind == "W":
            return st.backward(j, mb, seq, 0) if first_in_w and j == 0 else st.weight_grad(j, mb, seq)
        if a.kind == "F+B":
            return [op for sub in a.sub for op in run(sub)]
        if a.kind == "RECV_F":
            return [Recv(key("f", j - 1, i), at(j - 1), nb)]
        if a.kind == "RECV_B":
            return [Recv(key("b", j + 1, i), at(j + 1), nb)]
        if a.kind in ("SEND_F", "SEND_B"):
            k = key("f" if a.kind == "SEND_F" else "b", j, i)
            sends.append(k)
            return [Send(k, at(j + 1 if a.kind == "SEND_F" else j - 1), nb)]
        if a.kind == "UNSHARD":
            return fsdp("allgather", j)
        if a.kind == "REDUCE_GRAD":
            return fsdp("reduce_scatter", j)
        return []  # RESHARD: frees memory, no message

    sends: list = []
    uses: dict = {}
    ops = [Compute(st.o.step, "overhead")]
    for a in actions:
        ops += run(a)
    if sends:
        ops.append(Wait(tuple(sends)))
    return ops, chunks


# ---- interleaved (Megatron's order; also used for torch's Interleaved1F1B) -------------------------
def _interleaved(st: _Step, rank: int, d: int, s: int) -> list:
    """Megatron's interleaved 1F1B on rank s with V chunks, in rounds of R micro-batches (R = P where P
    divides m, as Megatron requires; torch's Interleaved1F1B: R = m // max(1, m // P), so m < P runs
    one round of m): the k-th forward runs chunk (k // R) % V, the j-th backward chunk
    V - 1 - (j // R) % V, each on its chunk's next micro-batch; warm-up (P - s - 1) 2 + (V - 1) R
    forwards. Receives are posted
    right before their use and waited; sends are waited at the end of the step (Megatron pairs each
    send with the next receive instead; the difference is a send's completion, which a receiver that
    posted early makes immediate)."""
    spec = st.spec
    P, V, m = spec.pp, spec.virtual_pp, spec.n_micro_batches
    mb, seq = spec.micro_batch_size, st.seq
    nb = st.act_bytes(mb, seq)
    total = m * V
    R = m // max(1, m // P)  # micro-batches per round
    warm = min(total, (P - s - 1) * 2 + (V - 1) * R)
    base = d * P  # simulated rank of stage 0 in this pipeline
    ops: list = [Compute(st.o.step, "overhead")]
    pending: list = []
    done = {(v, f): 0 for v in range(V) for f in (True, False)}  # micro-batches each chunk has run

    def ident(k: int, forward: bool) -> tuple[int, int]:
        v = (k // R) % V
        if not forward:
            v = V - 1 - v
        i = done[v, forward]
        done[v, forward] += 1
        return v, i

    def owner(vs: int) -> int:  # simulated rank holding virtual stage vs
        return base + vs % P

    def do(k: int, forward: bool):
        nonlocal ops
        v, i = ident(k, forward)
        vs = v * P + s
        if forward:
            if vs > 0:
                key = _key(st.step, "f", d, vs - 1, i)
                ops += [Recv(key, owner(vs - 1), nb), Wait((key,))]
            ops += st.forward(vs, mb, seq, 0)
            if vs < st.n_chunks - 1:
                key = _key(st.step, "f", d, vs, i)
                ops.append(Send(key, owner(vs + 1), nb))
                pending.append(key)
        else:
            if vs < st.n_chunks - 1:
                key = _key(st.step, "b", d, vs + 1, i)
                ops += [Recv(key, owner(vs + 1), nb), Wait((key,))]
            ops += st.backward(vs, mb, seq, 0)
            if vs > 0:
                key = _key(st.step, "b", d, vs, i)
                ops.append(Send(key, owner(vs - 1), nb))
                pending.append(key)

    for k in range(warm):
        do(k, True)
    for j in range(total - warm):
        do(warm + j, True)
        do(j, False)
    for j in range(total - warm, total):
        do(j, False)
    if pending:
        ops.append(Wait(tuple(pending)))
    return ops + st.optimizer(st.chunk_params([v * P + s for v in range(V)], st.tp))


# ---- megatron ------------------------------------------------------------------------------------
def megatron(st: _Step, rank: int) -> list:
    spec = st.spec
    P, D, m = spec.pp, spec.dp, spec.n_micro_batches
    d, s = divmod(rank, P)
    st.ddp = _MegatronDDP(st, rank) if D > 1 else None
    if spec.schedule == "interleaved":
        ops = _interleaved(st, rank, d, s)
        ops.pop()  # its optimizer: megatron's is below
    elif spec.schedule in ZERO_BUBBLE:
        ops, _ = _actions(st, rank, first_in_w=False)
    else:
        mb, seq = spec.micro_batch_size, st.seq
        nb = st.act_bytes(mb, seq)
        prev, nxt = rank - 1, rank + 1
        def fk(i, src):
            return _key(st.step, "f", d, src, i)

        def bk(i, src):
            return _key(st.step, "b", d, src, i)

        ops = [Compute(st.o.step, "overhead")]

        def pair(sends, recvs):  # megatron's _communicate: post all, wait all
            out = [Send(k, dst, nb) for k, dst in sends] + [Recv(k, src, nb) for k, src in recvs]
            keys = tuple(k for k, _ in sends) + tuple(k for k, _ in recvs)
            return out + ([Wait(keys)] if keys else [])

        warm = min(P - s - 1, m)
        rest = m - warm
        for i in range(warm):
            ops += pair([], [(fk(i, s - 1), prev)] if s > 0 else [])
            ops += st.forward(s, mb, seq, 0)
            ops += pair([(fk(i, s), nxt)] if s < P - 1 else [], [])
        if rest > 0:
            ops += pair([], [(fk(warm, s - 1), prev)] if s > 0 else [])
        for j in range(rest):
            i = warm + j
            ops += st.forward(s, mb, seq, 0)
            ops += pair([(fk(i, s), nxt)] if s < P - 1 else [], [(bk(j, s + 1), nxt)] if s < P - 1 else [])
            ops += st.backward(s, mb, seq, 0)
            if j == rest - 1:
                ops += pair([(bk(j, s), prev)] if s > 0 else [], [])
            else:
                ops += pair([(bk(j, s), prev)] if s > 0 else [], [(fk(i + 1, s - 1), prev)] if s > 0 else [])
        for j in range(rest, m):
            ops += pair([], [(bk(j, s + 1), nxt)] if s < P - 1 else [])
            ops += st.backward(s, mb, seq, 0)
            ops += pair([(bk(j, s), prev)] if s > 0 else [], [])
    params = st.chunk_params(range(s, st.n_chunks, P), st.tp)
    return ops + (st.ddp.finish(params) if st.ddp is not None else st.optimizer(params))


def _megatron_order(st: _Step, vs: int) -> list[tuple[int, int]]:
    """A megatron model chunk's (virtual stage ``vs``) parameters on one tensor-parallel rank in the
    order its backward finishes them (megatron-core's buffers take them in reverse order of
    registration): (elements, unit), units as ``_Step.backward`` runs them: 0 the output layer and
    final norm (the last chunk), 1 .. L its layers from the last, L + 1 the embeddings (the first)."""
    m, tp, L = st.spec.model, st.tp, st.stage_layers[vs]
    out = [(stage_params(m, 0, False, True, tp, st.width), 0)] if vs == st.n_chunks - 1 else []
    out += [(block_params(m) // tp, u) for u in range(1, L + 1)]
    if vs == 0:
        out.append((stage_params(m, 0, True, False, tp), L + 1))
    return [(n, u) for n, u in out if n]


MEGATRON_BUCKET = 40_000_000  # megatron-core's default bucket: max(40M, 1M x D) parameters


class _MegatronDDP:
    """megatron-core's DistributedDataParallel (and distributed optimizer) on one rank of stage s, replica
    d: its gradient buckets per model chunk (``_buckets`` over ``_megatron_order``; with
    overlap_grad_reduce the first chunk's of max(40M, 1M x D) parameters, every other chunk one bucket,
    as Megatron-LM disables bucketing beyond the first; without it one bucket), in the gradients' type
    (fp32, or the half one under mixed precision), the parameters gathered in theirs.

    Without overlap the rank all-reduces its gradients after the schedule (or reduce-scatters them,
    steps 1/D of the parameters and all-gathers them: the distributed optimizer). With
    overlap_grad_reduce the collectives run on the rank's communication stream (``Network.streams``),
    each bucket as soon as the chunk's last backward has finished it (``signal``), and the rank waits
    for the last before its optimizer; with overlap_param_gather the stream also all-gathers the
    previous step's parameters, bucket by bucket, at the step's start, each part of the first forward
    of a chunk waiting for its bucket (``gate``)."""

    def __init__(self, st: _Step, rank: int):
        spec = st.spec
        self.st, self.rank = st, rank
        self.s = rank % spec.pp
        self.group = tuple(k * spec.pp + self.s for k in range(spec.dp))
        self.stream = st.net.streams + rank if st.net.streams is not None else None
        self.grad_bytes = self.param_bytes = 4 if spec.precision == "fp32" else 2
        size = max(MEGATRON_BUCKET, 1_000_000 * spec.dp) * 4 if spec.overlap_grad_reduce else math.inf
        self.buckets = [_buckets(_megatron_order(st, v * spec.pp + self.s), size if v == 0 else math.inf)
                        for v in range(spec.virtual_pp)]
        self.forwards = [0] * spec.virtual_pp
        self.backwards = [0] * spec.virtual_pp
        self.gathered: set = set()

    def _ring(self, what: str, v: int, i: int) -> tuple:  # a collective's tag, the same on every replica
        return _key(self.st.step, "ddp", self.s, what, v, i)

    def _signal(self, what: str, v: int = 0, i: int = 0) -> tuple:  # between this rank and its stream
        return _key(self.st.step, "ddp signal", self.rank, what, v, i)

    def signal(self, vs: int):
        """Called by each backward of virtual stage ``vs``: for the chunk's last, unit -> the ops that
        hand the buckets that unit finishes to the stream; else None."""
        spec, v = self.st.spec, vs // self.st.spec.pp
        self.backwards[v] += 1
        if self.stream is None or self.backwards[v] != spec.n_micro_batches:
            return None
        return lambda u: [Send(self._signal("go", v, i), self.stream, 0)
                          for i, (_, at) in enumerate(self.buckets[v]) if at == u]

    def gate(self, vs: int):
        """Called by each forward of virtual stage ``vs``: for the chunk's first under
        overlap_param_gather, unit -> the wait for that unit's bucket of parameters (once); else None."""
        v = vs // self.st.spec.pp
        self.forwards[v] += 1
        if not self.st.spec.overlap_param_gather or self.forwards[v] != 1:
            return None

        def wait(u: int) -> list:
            i = next(i for i, (_, at) in enumerate(self.buckets[v]) if at >= u)
            if (v, i) in self.gathered:
                return []
            self.gathered.add((v, i))
            key = self._signal("gathered", v, i)
            return [Recv(key, self.stream, 0), Wait((key,), "dp")]
        return wait

    def finish(self, params: int) -> list:
        """After the schedule: the gradients' collectives (or the wait for the stream's last), the
        optimizer over the parameters this rank updates, the distributed optimizer's all-gather."""
        st, spec = self.st, self.st.spec
        op = "reduce_scatter" if spec.distributed_optimizer else "allreduce"
        if self.stream is not None:
            key = self._signal("done")
            ops = [Recv(key, self.stream, 0), Wait((key,), "dp")]
        else:
            ops = st.collective(op, self.group, self.rank, self._ring(op, 0, 0), params * self.grad_bytes, "dp")
        if not spec.distributed_optimizer:
            return ops + st.optimizer(params)
        ops += st.optimizer(params // spec.dp)
        if not spec.overlap_param_gather:
            ops += st.collective("allgather", self.group, self.rank, self._ring("allgather", 0, 0),
                                 params * self.param_bytes, "dp")
        return ops

    def stream_ops(self) -> list:
        """The communication stream's step: the previous step's parameters all-gathered bucket by bucket
        in forward order (overlap_param_gather), then each gradient bucket's collective once the rank
        hands it over, chunk after chunk as their last backwards end (the last chunk's first), then the
        signal that all are done."""
        st, spec = self.st, self.st.spec
        group = tuple(st.net.streams + g for g in self.group)
        ops: list = []
        if spec.overlap_param_gather:
            for v, buckets in enumerate(self.buckets):
                for i in reversed(range(len(buckets))):
                    ops += st.collective("allgather", group, self.stream, self._ring("gather", v, i),
                                         buckets[i][0] * self.param_bytes, "dp")
                    ops.append(Send(self._signal("gathered", v, i), self.rank, 0))
        op = "reduce_scatter" if spec.distributed_optimizer else "allreduce"
        for v in reversed(range(len(self.buckets))):
            for i, (n, _) in enumerate(self.buckets[v]):
                go = self._signal("go", v, i)
                ops += [Recv(go, self.rank, 0), Wait((go,), "dp")]
                ops += st.collective(op, group, self.stream, self._ring(op, v, i), n * self.grad_bytes, "dp")
        return ops + [Send(self._signal("done"), self.rank, 0)]




# ---- ours ----------------------------------------------------------------------------------------
def _grad_order(st: _Step, first: bool, last: bool, s: int = 0) -> list[tuple[int, int]]:
    """The stage's parameters as ``StageEngine.grad_order`` reports them final: (elements, the index of
    the deferred linear whose gradient finishes it; -1: final when the backward ends). First those
    autograd accumulates (embeddings, norms), then per layer the four linears' weight and (gpt) bias
    (qkv by ``qkv_rows``, the MLP's ``ffn_dim`` wide, llama's gate and up as one), then the output
    layer."""
    h, m = st.h, st.spec.model
    out = []
    if first and m.vocab_size:
        out += [(m.vocab_size * h, -1)] + ([] if m.llama else [(m.seq_len * h, -1)])
    layers = st.stage_layers[s]
    norm = [(h, -1)] * (norm_params(m) // h)  # LayerNorm's weight and bias, RMSNorm's weight
    out += norm * (2 * layers)  # ln_1, ln_2
    if last:
        out += norm  # ln_f
    f = m.ffn_dim
    linears = [(sum(qkv_rows(m)), h), (h, h), ((2 * f if m.llama else f), h), (h, f)]  # (rows, columns)
    for i, (rows, cols) in enumerate(linears * layers):
        out += [(rows * cols, i)] + ([] if m.llama else [(rows, i)])  # the weight and (gpt) its bias
    if last:
        out.append(((m.vocab_size if st.width is None else st.width) * h, 4 * layers))
    return out


# ours' data parallelism is simulated in at most this many buckets a stage: a larger stage's 4 MiB buckets are
# merged into this many of equal bytes (the sync's bytes and order as they are; the overlap with the remaining
# weight gradients coarser by at most one merged bucket's time), so that a billion-parameter stage does not
# post hundreds of thousands of messages a step.
SIMULATED_BUCKETS = 64


def _buckets(order: list[tuple[int, int]], bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """ours.dp's buckets over the gradient order, fp32: (elements, the linear that completes the bucket);
    at most ``SIMULATED_BUCKETS`` of them."""
    total = sum(numel for numel, _ in order) * 4
    bucket_bytes = max(bucket_bytes, -(-total // SIMULATED_BUCKETS))
    starts = bucket_starts([numel * 4 for numel, _ in order], bucket_bytes)
    parts = [order[a:b] for a, b in zip(starts, starts[1:] + [len(order)])]
    return [(sum(n for n, _ in part), max(at for _, at in part)) for part in parts]


@dataclass(frozen=True)
class _Sync:
    """ours.dp.PointToPointSync of one rank of stage s: its bucket ranges and message keys."""

    st: _Step
    d: int
    s: int
    buckets: tuple  # ((elements, completing linear, ranges by dp_rank), ...)
    serve: bool

    @staticmethod
    def of(st: _Step, rank: int) -> "_Sync":
        spec = st.spec
        d, s = divmod(rank, spec.pp)
        D = spec.dp
        order = _grad_order(st, s == 0, s == spec.pp - 1, s)
        buckets = tuple((n, at, bucket_ranges(n, D, layout_of(spec.dp_mode, D))) for n, at in _buckets(order))
        return _Sync(st, d, s, buckets, spec.dp_mode != "allreduce")

    def rank(self, j: int) -> int:
        return j * self.st.spec.pp + self.s

    def peers(self) -> list[int]:
        return [j for j in range(self.st.spec.dp) if j != self.d]

    def key(self, what: str, i: int, src: int, dst: int) -> tuple:
        return _key(self.st.step, "dp", self.s, what, i, src, dst)

    def returned(self, i: int, j: int) -> bool:
        """Does peer j send this rank its reduced range of bucket i?"""
        n, _, ranges = self.buckets[i]
        lo, hi = ranges[j]
        return hi > lo and ranges[self.d] != (0, n)

    def receives(self) -> list:
        """Every receive of the step's sync (posted a step ahead): the peers' pushes of the ranges this
        rank reduces, and what the peers send back of theirs."""
        ops = []
        for i, (_, _, ranges) in enumerate(self.buckets):
            lo, hi = ranges[self.d]
            for j in self.peers():
                if hi > lo:
                    ops.append(Recv(self.key("push", i, j, self.d), self.rank(j), (hi - lo) * 4))
                if self.returned(i, j):
                    jlo, jhi = ranges[j]
                    ops.append(Recv(self.key("back", i, j, self.d), self.rank(j), (jhi - jlo) * 4))
        return ops

    def push(self, i: int) -> tuple[list, list]:
        """Bucket i's gradient: each peer's range to that peer; (ops, send keys)."""
        ops, keys = [], []
        for j in self.peers():
            lo, hi = self.buckets[i][2][j]
            if hi > lo:
                keys.append(self.key("push", i, self.d, j))
                ops.append(Send(keys[-1], self.rank(j), (hi - lo) * 4))
        return ops, keys

    def step(self) -> tuple[list, list]:
        """sync.step(): reduce every range this rank serves (wait for the D - 1 pushes, as a server step
        its optimizer, send the result to the peers that do not reduce the whole bucket), then wait for
        what comes back, bucket by bucket; (ops, send keys). Without a server: every rank's optimizer."""
        st, ops, keys = self.st, [], []
        for i, (n, _, ranges) in enumerate(self.buckets):
            lo, hi = ranges[self.d]
            if hi <= lo:
                continue
            ops.append(Wait(tuple(self.key("push", i, j, self.d) for j in self.peers()), "dp"))
            if self.serve:
                ops += st.optimizer(hi - lo)
            for j in self.peers():
                if ranges[j] != (0, n):
                    keys.append(self.key("back", i, self.d, j))
                    ops.append(Send(keys[-1], self.rank(j), (hi - lo) * 4))
        for i in range(len(self.buckets)):
            back = tuple(self.key("back", i, j, self.d) for j in self.peers() if self.returned(i, j))
            if back:
                ops.append(Wait(back, "dp"))
        return ops, keys


def _ours_unit_receives(st: _Step, rank: int) -> list:
    """The engine's receives of a step (posted a step ahead): every unit's activation from the previous
    stage and its gradient from the next, in the order the stage consumes them (``ours.schedule``)."""
    spec = st.spec
    P, mb, slices = spec.pp, spec.micro_batch_size, spec.token_slices
    d, s = divmod(rank, P)
    ops = []
    for kind, b, i in unit_order(spec.schedule, spec.n_micro_batches, len(slices), s, P):
        u = b * len(slices) + i
        if kind == "F" and s > 0:
            ops.append(Recv(_key(st.step, "f", d, s - 1, u), rank - 1, st.act_bytes(mb, slices[i])))
        elif kind == "B" and s < P - 1:
            ops.append(Recv(_key(st.step, "b", d, s + 1, u), rank + 1, st.act_bytes(mb, slices[i])))
    return ops


def ours_receives(st: _Step, rank: int) -> list:
    """Everything rank posts a step ahead for step ``st.step``: the engine's and the DP sync's receives."""
    ops = _ours_unit_receives(st, rank)
    if st.spec.dp > 1 and st.spec.dp_mode != "chain_ps":
        ops += _Sync.of(st, rank).receives()
    return ops


def _ours_backward(st: _Step, rank: int, u: int, l: int, c: int, sends: list, wgrad: list[float]) -> tuple[list, float]:
    """Unit ``u``'s backward on ``rank`` (a token slice of l tokens after c): its operations and the
    weight-gradient work it defers (added to ``wgrad``, per deferred linear; its message to ``sends``)."""
    spec, cm, tp, mb = st.spec, st.cm, st.tp, st.spec.micro_batch_size
    d, s = divmod(rank, spec.pp)
    L = st.stage_layers[s]
    first, last = s == 0, s == spec.pp - 1
    ops: list = []
    if not last:
        ops.append(FillWait(_key(st.step, "b", d, s + 1, u), "wgrad"))
    ops.append(Compute(st.o.per_unit(L) / 2, "overhead"))
    if last:  # the head split by vocabulary over the T ranks (ours.tp)
        ops.append(Compute(cm.head_forward(mb * l, tp, st.width) + cm.head_backward_input(mb * l, tp, st.width),
                           "head"))
    cost = cm.slice_cost(mb, l, c, L, tp)  # the planner's cost of a slice (ours.plan.latency)
    if spec.recompute:
        ops += st._layers("recompute", L, mb, l, c, cost.forward)
    ops += st._layers("backward-input", L, mb, l, c, cost.backward)
    if first:
        ops.append(Compute(cm.embed(mb * l) * 2 / 3, "embed"))
    chunks = [cost.wgrad / (4 * L)] * (4 * L)  # one per linear (ours drains one stash entry at a time)
    if last:
        chunks.append(cm.head_wgrad(mb * l, tp, st.width))
    for k, t in enumerate(chunks):
        wgrad[k] += t
    ops.append(Defer(tuple(chunks)))
    if not first:
        key = _key(st.step, "b", d, s, u)
        ops.append(Send(key, rank - 1, st.act_bytes(mb, l)))
        sends.append(key)
    return ops, sum(chunks)


def _ours_forward(st: _Step, rank: int, b: int, i: int) -> tuple[list, tuple | None]:
    """Unit (b, i)'s forward on rank's stage: the wait for its input (not on the first stage), its
    math, its send to the next stage (not on the last); (ops, the send's key or None)."""
    spec = st.spec
    P, slices = spec.pp, spec.token_slices
    d, s = divmod(rank, P)
    u, l, c = b * len(slices) + i, slices[i], sum(slices[:i])
    ops = [FillWait(_key(st.step, "f", d, s - 1, u), "wgrad")] if s > 0 else []  # waited like a gradient
    cost = st.cm.slice_cost(spec.micro_batch_size, l, c, st.stage_layers[s], st.tp)  # ours.plan.latency's
    ops += st.forward(s, spec.micro_batch_size, l, c, cost.forward)
    if s == P - 1:
        return ops, None
    key = _key(st.step, "f", d, s, u)
    return ops + [Send(key, rank + 1, st.act_bytes(spec.micro_batch_size, l))], key


def ours_ahead(st: _Step, rank: int) -> list:
    """The forwards of step ``st.step`` rank's stage runs ahead, at the end of the step before
    (``--prefetch``: ``ours.schedule.ahead``; ``StageEngine.prefetch``): the first of its order."""
    spec = st.spec
    s = rank % spec.pp
    n = ahead(spec.prefetch, spec.schedule, spec.n_micro_batches, len(spec.token_slices), s, spec.pp)
    return unit_order(spec.schedule, spec.n_micro_batches, len(spec.token_slices), s, spec.pp)[:n]


def prefetches(spec: RunSpec) -> bool:
    """Whether ours' first stage runs forwards of the next step at the end of a step."""
    return spec.system == "ours" and ahead(spec.prefetch, spec.schedule, spec.n_micro_batches,
                                           len(spec.token_slices), 0, spec.pp) > 0


def _ours_units(st: _Step, rank: int) -> tuple[list, list, list[float]]:
    """The step's units on ``rank`` in ``ours.schedule``'s order, less those it ran ahead at the end of
    the step before (``ours_ahead``; none in a run's first step): (operations, the keys of its sends,
    the deferred weight-gradient work per linear over the step)."""
    spec = st.spec
    P, nbs, slices = spec.pp, spec.n_micro_batches, spec.token_slices
    d, s = divmod(rank, P)  # a stage's T ranks are one simulated rank
    ctx = [sum(slices[:i]) for i in range(len(slices))]
    L = st.stage_layers[s]
    last = s == P - 1
    ops: list = [Compute(st.o.step, "overhead")]
    wgrad = [0.0] * (4 * L + 1)  # per deferred linear (the output layer last), over the step
    # 1f1b: the engine computes the weight gradients its stash holds beyond P - s batch slices' units
    # (``StageEngine._bound_stash``), right after each backward; modelled by the amount of work it keeps
    limit = min(nbs, P - s) * len(slices) if spec.schedule == "1f1b" else None
    queued: list[float] = []  # each unit's deferred work, in backward order
    ran = ours_ahead(st, rank) if st.step > 0 else []  # run at the end of the step before
    sends: list = [_key(st.step, "f", d, s, b * len(slices) + i) for _, b, i in ran if not last]
    for kind, b, i in unit_order(spec.schedule, nbs, len(slices), s, P)[len(ran):]:
        u = b * len(slices) + i
        if kind == "B":
            back, deferred = _ours_backward(st, rank, u, slices[i], ctx[i], sends, wgrad)
            ops += back
            if limit is not None:
                queued.append(deferred)
                if len(queued) > limit:
                    ops.append(Flush("wgrad", keep=sum(queued[-limit:])))
            continue
        fwd, key = _ours_forward(st, rank, b, i)
        ops += fwd
        if key is not None:
            sends.append(key)
    return ops, sends, wgrad


def ours(st: _Step, rank: int, following: _Step | None = None) -> list:
    """One step of rank ``rank``; its receives were posted before (``ours_receives``), and it posts those
    of the ``following`` step (the engine's after its backward, the sync's after the sync). Under
    ``--prefetch`` the stage ran its first forwards at the end of the step before (none in the first
    step, ``st.step`` 0: the run's first), their sends waited at this step's end, and runs the
    ``following`` step's at its end, after its optimizer (``ours_ahead``)."""
    spec = st.spec
    s = rank % spec.pp
    ops, sends, wgrad = _ours_units(st, rank)
    if following is not None:
        ops += _ours_unit_receives(following, rank)
    params = st.params(st.stage_layers[s], s == 0, s == spec.pp - 1, st.tp)
    # the next step's first forwards, once the optimizer has stepped; their sends waited in that step
    nxt_ahead = [op for _, b, i in (ours_ahead(following, rank) if following is not None else [])
                 for op in _ours_forward(following, rank, b, i)[0]]
    if spec.dp == 1:
        ops.append(Flush("wgrad"))
        if sends:
            ops.append(Wait(tuple(sends)))
        return ops + st.optimizer(params) + nxt_ahead
    after = [sum(wgrad[k + 1:]) for k in range(len(wgrad))]  # work of the linears after linear k
    if spec.dp_mode == "chain_ps" or spec.system == "gpipe":
        return ops + _seed_dp(st, rank, sends, after, sum(wgrad), params) + nxt_ahead
    # the weight gradients, linear after linear (the fill drained the first linears first: what is left
    # belongs to the last ones); each bucket pushed as its last gradient is final
    sync = _Sync.of(st, rank)
    pushed = []
    for i, (_, at, _) in enumerate(sync.buckets):
        ops.append(Flush("wgrad", keep=after[at] if at >= 0 else sum(wgrad)))
        push, keys = sync.push(i)
        ops += push
        pushed += keys
    ops.append(Flush("wgrad"))
    if sends:
        ops.append(Wait(tuple(sends)))
    ops.append(Compute(st.o.dp, "overhead"))
    step, keys = sync.step()
    ops += step
    ops.append(Wait(tuple(pushed + keys), "dp"))
    if not sync.serve:
        ops += st.optimizer(params)
    if following is not None:
        ops += _Sync.of(following, rank).receives()
    return ops + nxt_ahead


CHAIN_BUCKET_BYTES = 25 * 10**6


def _seed_dp(st: _Step, rank: int, sends: list, after: list[float], wgrad: float, params: int) -> list:
    """The seed's (DT-FM's) data parallelism over NCCL, per 25 MB bucket once its last gradient is
    final, one NCCL stream (bucket after bucket): ``central_ps`` (``chain_ps``) a chain reduce to
    dp_rank 0, that rank's Adam step on the bucket, a chain broadcast of the result; ``sharded_ps`` a
    reduce-scatter, every rank's Adam step on its shard, an all-gather; ``allreduce`` a ring
    all-reduce, then every rank's optimizer. Then the pipeline's sends are waited for."""
    spec = st.spec
    d, s = divmod(rank, spec.pp)
    group = tuple(j * spec.pp + s for j in range(spec.dp))
    mode = "central_ps" if spec.dp_mode == "chain_ps" else spec.dp_mode
    ops: list = []
    for i, (n, at) in enumerate(_buckets(_grad_order(st, s == 0, s == spec.pp - 1, s), CHAIN_BUCKET_BYTES)):
        ops.append(Flush("wgrad", keep=after[at] if at >= 0 else wgrad))
        key = _key(st.step, "chain", s, i)
        if mode == "central_ps":
            ops += st.collective("reduce", group, rank, (*key, "reduce"), n * 4, "dp")
            if d == 0:
                ops += st.optimizer(n)
            ops += st.collective("broadcast", group, rank, (*key, "broadcast"), n * 4, "dp")
        elif mode == "sharded_ps":
            ops += st.collective("reduce_scatter", group, rank, (*key, "rs"), n * 4, "dp")
            ops += st.optimizer(n // spec.dp)
            ops += st.collective("allgather", group, rank, (*key, "ag"), n * 4, "dp")
        else:
            ops += st.collective("allreduce", group, rank, (*key, "ar"), n * 4, "dp")
    ops.append(Flush("wgrad"))
    if sends:
        ops.append(Wait(tuple(sends)))
    if mode == "allreduce":
        ops += st.optimizer(params)
    return ops


BUILDERS = {"torch_pipe": torch_pipe, "fairscale_fsdp": torch_pipe, "megatron": megatron, "ours": ours,
            "gpipe": ours}
# a stage's T ranks are one simulated rank, its all-reduces in closed form
TENSOR_PARALLEL = ("megatron", "ours", "gpipe")
TOKEN_PIPELINE = ("ours", "gpipe")  # ours' engine (the seed's GPipe: at one token slice)


def network_of(spec: RunSpec) -> Network:
    tp = spec.tp if spec.system in TENSOR_PARALLEL else 1
    # megatron's overlapped data parallelism: each rank's collectives on a stream of their own
    streams = spec.pp * spec.dp if spec.system == "megatron" and spec.dp > 1 and spec.overlap_grad_reduce else None
    c = spec.cluster
    if c is not None:
        matrix = None
        if c.matrix is not None:
            matrix = tuple(tuple(c.link(a, b) if a != b else None for b in range(c.nodes)) for a in range(c.nodes))
        return Network(c.inter or c.intra, "nccl", c.intra, hosts=hosts_of(spec), matrix=matrix,
                       copies=(tp,) * (spec.pp * spec.dp), gpu=True,
                       cards=cards_of(spec) if c.nics_per_node > 1 else None, streams=streams)
    per_host = spec.ranks_per_host
    if spec.system in TENSOR_PARALLEL:  # a tensor-parallel group is one simulated rank
        per_host = max(1, per_host // spec.tp)
    return Network(spec.link, spec.transport, spec.intra_link, per_host, streams=streams)


def build(spec: RunSpec, cm: ComputeModel, steps: int = 2) -> Built:
    """Programs of every simulated rank: ``steps`` steps, each framed by the timing barriers of the run
    command (none on a GPU cluster: a scenario's step is the training step alone; ours' steps there
    still begin together, as the run command's barrier starts them, at no cost); Marks ``start{k}`` /
    ``end{k}`` around step k (after the opening barrier, after the closing one). What a rank posts ahead
    of its first step (ours' receives, the first barrier's over gloo) comes first. ours' last simulated
    step is one of a run that goes on: it posts the next step's receives and, under ``--prefetch``, runs
    that step's first forwards (``ours``), as every step but a run's last does."""
    if spec.tp > 1 and spec.system not in TENSOR_PARALLEL:
        raise ValueError(f"{spec.system} has no tensor parallelism")
    net = network_of(spec)
    framed = not net.gpu
    n = spec.pp * spec.dp
    world = tuple(range(n))
    uses = [("open", k) if i % 2 == 0 else ("close", k) for k in range(steps) for i in range(2)]
    programs = []
    for r in range(n):
        st = [_Step(spec, cm, net, k) for k in range(steps + 1)]  # and the step after the last
        ops: list = _barrier_receives(net, world, r, uses[0]) if framed else []
        if spec.system in TOKEN_PIPELINE:
            ops += ours_receives(st[0], r)
        for k in range(steps):
            if framed:
                ops += _barrier(net, world, r, uses[2 * k], uses[2 * k + 1])
            elif k > 0 and spec.system in TOKEN_PIPELINE:
                ops.append(Group(("step", k), world, 0.0, "barrier"))
            ops.append(Mark(f"start{k}"))
            if spec.system in TOKEN_PIPELINE:
                ops += ours(st[k], r, st[k + 1])
            else:
                ops += BUILDERS[spec.system](st[k], r)
            if framed:
                ops += _barrier(net, world, r, uses[2 * k + 1], uses[2 * k + 2] if 2 * k + 2 < len(uses) else None)
            ops.append(Mark(f"end{k}"))
        programs.append(ops)
    if net.streams is not None:  # each rank's communication stream, step after step
        for r in range(n):
            programs.append([op for k in range(steps) for op in _MegatronDDP(_Step(spec, cm, net, k), r).stream_ops()])
    procs = [spec.tp if spec.system in TENSOR_PARALLEL else 1] * len(programs)
    return Built(programs, procs, net, timed=n)


# ---- the timing barrier (contract.rank.StepBarrier) ---------------------------------------------
def _barrier_rounds(world: tuple, r: int, use) -> list[tuple[tuple, int, tuple, int]]:
    """Per round k of the dissemination barrier: (key of the message from r - 2^k, that rank, key of
    the message to r + 2^k, that rank)."""
    n, out, k = len(world), [], 1
    while k < n:
        frm, to = world[(r - k) % n], world[(r + k) % n]
        out.append((("barrier", use, k, frm, r), frm, ("barrier", use, k, r, to), to))
        k *= 2
    return out


def _barrier_receives(net: Network, world: tuple, r: int, use) -> list:
    """Over gloo the barrier's receives of a use are posted one use ahead."""
    if net.transport != "gloo" or use is None:
        return []
    return [Recv(rk, frm, 4) for rk, frm, _, _ in _barrier_rounds(world, r, use)]


def _barrier(net: Network, world: tuple, r: int, use, next_use) -> list:
    """One use of the timing barrier: ceil(log2 n) rounds, in each a 1-element message to r + 2^k and
    one awaited from r - 2^k: one one-way delay per round. Over gloo the receive was posted one use
    ahead and this use posts the next one's (``next_use``; None: the last); over nccl each round posts
    its receive with its send."""
    ops: list = []
    for rk, frm, sk, to in _barrier_rounds(world, r, use):
        if net.transport != "gloo":
            ops.append(Recv(rk, frm, 4))
        ops += [Send(sk, to, 4), Wait((rk, sk), "barrier")]
    return ops + _barrier_receives(net, world, r, next_use)
