"""The program every rank runs in one training step, for each system as it really runs.

- torch_pipe (torch.distributed.pipelining): GPipe (all forwards, each receive posted right before
  its micro-batch and waited; sends waited at the end of the phase; then all backwards in micro-batch
  order), 1F1B (torch's: stage s warms up with P - s forwards; a forward's send goes out with the next
  backward's receive, a backward's send with the next forward's receive, each pair waited together),
  interleaved (Megatron's interleaved order, several chunks per rank). D > 1: FSDP2 on each stage's
  data-parallel group: every forward all-gathers each block, the first backward all-gathers them again
  (kept until the last), the last backward reduce-scatters the gradients (the stage's root parameters
  are gathered once and reduce-scattered once).
- megatron (megatron-core): 1F1B (P - s - 1 warm-up forwards, blocking sends and receives in pairs)
  or interleaved; tensor parallelism: per layer two all-reduces in the forward (after attention and
  after the MLP), two in the backward, two more in the recomputed forward; a tensor-parallel group is
  simulated as one rank (its members run in lock-step) that stands for tp processes; data parallel:
  the gradient all-reduce in finalize_model_grads.
- ours (``ours.engine``): every unit (batch slice x token slice) forward in order, receives all posted
  at the start; backward in reverse order; the last stage computes the head and loss when a unit's
  backward starts; weight gradients deferred (queued per linear), run while waiting for a gradient and
  at the end; sends waited at the end. Data parallel (``ours.dp``) in 25 MB buckets: all-reduce and
  everyone's optimizer; central PS: reduce to the server, its optimizer, broadcast; sharded PS:
  reduce-scatter, 1/D of the optimizer, all-gather.

Every step is framed like the run command times it: a barrier, the step, a closing barrier. The
simulator runs two steps and times the second (ranks enter it as the first one left them).
"""
from __future__ import annotations

from dataclasses import dataclass

from runners.predict import collectives as coll
from runners.predict.compute import ComputeModel, Overheads, stage_params
from runners.predict.engine import Compute, Defer, FillWait, Flush, Mark, Network, Recv, Send, Wait
from runners.predict.spec import RunSpec

BUCKET_BYTES = 25 * 1024 * 1024  # ours.dp.BUCKET_BYTES


@dataclass(frozen=True)
class Built:
    programs: list
    procs: list[int]
    network: Network


class _Step:
    """Builds one rank's operations for one step of ``spec``; ``tag`` makes message keys unique."""

    def __init__(self, spec: RunSpec, cm: ComputeModel, network: Network, step: int):
        self.spec, self.cm, self.net, self.step = spec, cm, network, step
        self.o: Overheads = cm.overheads(spec.system)
        m = spec.model
        self.h, self.seq = m.n_embd, m.seq_len
        self.V = spec.virtual_pp
        self.n_chunks = spec.pp * spec.virtual_pp
        self.layers = m.n_layer // self.n_chunks  # per model chunk
        self.tp = spec.tp if spec.system == "megatron" else 1
        self.width = spec.head_classes  # None: the vocabulary

    def params(self, layers: int, first: bool, last: bool, tp: int = 1) -> int:
        return stage_params(self.spec.model, layers, first, last, tp, self.width)

    # ---- the math of one stage chunk on one micro-batch -------------------------------------
    def forward(self, chunk: int, b: int, l: int, c: int) -> list:
        """Ops of a chunk's forward on b x l tokens after c (first chunk: embeddings; the last chunk of
        the baselines also runs the head and the loss here)."""
        cm, tp, L = self.cm, self.tp, self.layers
        ops = [Compute(self.o.per_unit(L) / 2, "overhead")]
        if chunk == 0:
            ops.append(Compute(cm.embed(b * l) / 3, "embed"))
        ops += self._layers("forward", L, b, l, c)
        if chunk == self.n_chunks - 1 and self.spec.system != "ours":
            ops.append(Compute(cm.head_forward(b * l, tp, self.width), "head"))
            ops += self._tp_comm(b * l, "head")
        return ops

    def backward(self, chunk: int, b: int, l: int, c: int) -> list:
        cm, tp, L = self.cm, self.tp, self.layers
        ops = [Compute(self.o.per_unit(L) / 2, "overhead")]
        if chunk == self.n_chunks - 1:
            if self.spec.system == "ours":
                ops.append(Compute(cm.head_forward(b * l, 1, self.width), "head"))
            ops.append(Compute(cm.head_backward_input(b * l, tp, self.width) + cm.head_wgrad(b * l, tp, self.width),
                               "head"))
            ops += self._tp_comm(b * l, "head")
        if self.spec.recompute:
            ops += self._layers("recompute", L, b, l, c)
        ops += self._layers("backward", L, b, l, c)
        if chunk == 0:
            ops.append(Compute(cm.embed(b * l) * 2 / 3, "embed"))
        return ops

    def _layers(self, kind: str, L: int, b: int, l: int, c: int) -> list:
        cm, tp = self.cm, self.tp
        if kind == "backward":
            t = cm.layer_backward_input(b, l, c, tp) + cm.layer_wgrad(b, l, tp)
        else:
            t = cm.layer_forward(b, l, c, tp)
        if tp == 1:
            return [Compute(L * t, kind)]
        ops = []
        for _ in range(L):  # two all-reduces per layer, each after half of the layer's math
            for _half in range(2):
                ops.append(Compute(t / 2, kind))
                ops += self._tp_comm(b * l, kind)
        return ops

    def _tp_comm(self, tokens: int, what: str) -> list:
        """One tensor-parallel all-reduce of b*l*h activations, in closed form (the group is one
        simulated rank)."""
        if self.tp == 1 or what == "head":
            return []
        nbytes = tokens * self.h * self.spec.activation_bytes
        link = self.net.intra_link or self.net.link
        if self.net.transport == "gloo":  # gloo's ring: a receive-posted handshake per step
            a = 2 * link.latency
            t = 2 * (self.tp - 1) * (a + nbytes / (self.tp * link.bandwidth))
        else:
            t = coll.closed_form("allreduce", self.tp, nbytes, link)
        return [Compute(t, "tp_comm")]

    def optimizer(self, params: int) -> list:
        return [Compute(self.cm.optimizer(params), "optimizer")]

    def act_bytes(self, b: int, l: int) -> int:
        return b * l * self.h * self.spec.activation_bytes


def _key(step: int, *parts) -> tuple:
    return (step, *parts)


# ---- torch_pipe ------------------------------------------------------------------------------------
def _fsdp_sizes(spec: RunSpec, s: int) -> tuple[int, int]:
    """(bytes of one block's parameters, bytes of the stage's root parameters)."""
    h, m = spec.model.n_embd, spec.model
    block = (12 * h * h + 13 * h) * 4
    root = 0
    if s == 0:
        root += (m.vocab_size * h + m.seq_len * h) * 4
    if s == spec.pp - 1:
        root += (2 * h + (spec.head_classes or m.vocab_size) * h) * 4
    return block, root


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
        self.block_bytes, self.root_bytes = _fsdp_sizes(spec, self.s)
        self.fsdp = spec.dp > 1

    def fk(self, i: int, src: int) -> tuple:  # activation of micro-batch i leaving stage src
        return _key(self.st.step, "f", self.d, src, i)

    def bk(self, i: int, src: int) -> tuple:  # gradient of micro-batch i leaving stage src
        return _key(self.st.step, "b", self.d, src, i)

    def _coll(self, op: str, tag: tuple, nbytes: int) -> list:
        st = self.st
        return coll.collective(st.net.transport, op, self.group, self.rank, _key(st.step, "fsdp", self.s, *tag),
                               nbytes, st.net.link, "fsdp")

    def fwd(self, i: int) -> list:
        st, out = self.st, []
        if self.fsdp:
            if i == 0 and self.root_bytes:
                out += self._coll("allgather", ("root",), self.root_bytes)
            for j in range(st.layers):
                out += self._coll("allgather", ("f", i, j), self.block_bytes)
        return out + st.forward(self.s, st.spec.micro_batch_size, st.seq, 0)

    def bwd(self, i: int) -> list:
        st, out = self.st, []
        if self.fsdp and i == 0:
            for j in range(st.layers):
                out += self._coll("allgather", ("b", j), self.block_bytes)
        out += st.backward(self.s, st.spec.micro_batch_size, st.seq, 0)
        if self.fsdp and i == self.m - 1:
            for j in range(st.layers):
                out += self._coll("reduce_scatter", ("rs", j), self.block_bytes)
            if self.root_bytes:
                out += self._coll("reduce_scatter", ("rs", "root"), self.root_bytes)
        return out


def torch_pipe(st: _Step, rank: int) -> list:
    spec = st.spec
    if spec.schedule == "interleaved":
        return _interleaved(st, rank, *divmod(rank, spec.pp))
    p = _Stage(st, rank)
    ops = [Compute(st.o.step, "overhead")]
    ops += _gpipe(p) if spec.schedule == "gpipe" else _torch_1f1b(p)
    params = st.params(st.layers, p.first, p.last)
    return ops + st.optimizer(params // spec.dp if p.fsdp else params)


def _gpipe(p: _Stage) -> list:
    """torch's ScheduleGPipe: each receive posted and waited right before its micro-batch; a phase's
    sends waited at its end."""
    ops, sends = [], []
    for i in range(p.m):
        if not p.first:
            ops += [Recv(p.fk(i, p.s - 1), p.prev, p.nb), Wait((p.fk(i, p.s - 1),))]
        ops += p.fwd(i)
        if not p.last:
            ops.append(Send(p.fk(i, p.s), p.nxt, p.nb))
            sends.append(p.fk(i, p.s))
    if sends:
        ops.append(Wait(tuple(sends)))
    sends = []
    for i in range(p.m):
        if not p.last:
            ops += [Recv(p.bk(i, p.s + 1), p.nxt, p.nb), Wait((p.bk(i, p.s + 1),))]
        ops += p.bwd(i)
        if not p.first:
            ops.append(Send(p.bk(i, p.s), p.prev, p.nb))
            sends.append(p.bk(i, p.s))
    if sends:
        ops.append(Wait(tuple(sends)))
    return ops


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
        recvs = [p.bk(bi, p.s + 1)] if not p.last else []
        ops += [Send(k, p.nxt, p.nb) for k in fwd_sends] + [Recv(k, p.nxt, p.nb) for k in recvs]
        if fwd_sends or recvs:
            ops.append(Wait(tuple(fwd_sends + recvs)))
        ops += p.bwd(bi)
        bwd_sends = [p.bk(bi, p.s)] if not p.first else []
        bi += 1
        if fi == p.m:
            break
        recvs = [p.fk(fi, p.s - 1)] if not p.first else []
        ops += [Send(k, p.prev, p.nb) for k in bwd_sends] + [Recv(k, p.prev, p.nb) for k in recvs]
        if bwd_sends or recvs:
            ops.append(Wait(tuple(bwd_sends + recvs)))
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


# ---- interleaved (Megatron's order; also used for torch's Interleaved1F1B) -------------------------
def _interleaved(st: _Step, rank: int, d: int, s: int) -> list:
    """Megatron's interleaved 1F1B on rank s with V chunks: the k-th forward runs chunk (k // P) % V of
    micro-batch (k // (P V)) P + k % P; warm-up (P - s - 1) 2 + (V - 1) P forwards. Receives are posted
    right before their use and waited; sends are waited at the end of the step (Megatron pairs each
    send with the next receive instead; the difference is a send's completion, which a receiver that
    posted early makes immediate)."""
    spec = st.spec
    P, V, m = spec.pp, spec.virtual_pp, spec.n_micro_batches
    mb, seq = spec.micro_batch_size, st.seq
    nb = st.act_bytes(mb, seq)
    total = m * V
    warm = min(total, (P - s - 1) * 2 + (V - 1) * P)
    base = d * P  # simulated rank of stage 0 in this pipeline
    ops: list = [Compute(st.o.step, "overhead")]
    pending: list = []

    def ident(k: int, forward: bool) -> tuple[int, int]:
        v = (k // P) % V
        if not forward:
            v = V - 1 - v
        return v, (k // (P * V)) * P + k % P

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
    layers = st.layers * V
    return ops + st.optimizer(st.params(layers, s == 0, s == P - 1))


# ---- megatron ------------------------------------------------------------------------------------
def megatron(st: _Step, rank: int) -> list:
    spec = st.spec
    P, D, m = spec.pp, spec.dp, spec.n_micro_batches
    d, s = divmod(rank, P)
    if spec.schedule == "interleaved":
        ops = _interleaved(st, rank, d, s)
        opt = ops.pop()
    else:
        mb, seq = spec.micro_batch_size, st.seq
        nb = st.act_bytes(mb, seq)
        prev, nxt = rank - 1, rank + 1
        fk = lambda i, src: _key(st.step, "f", d, src, i)
        bk = lambda i, src: _key(st.step, "b", d, src, i)
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
        opt = st.optimizer(st.params(st.layers, s == 0, s == P - 1, st.tp))[0]
    if D > 1:
        dp_group = tuple(k * P + s for k in range(D))
        grads = st.params(st.layers * st.V, s == 0, s == P - 1, st.tp) * 4  # fp32 grad buffers
        ops += coll.collective(st.net.transport, "allreduce", dp_group, rank, _key(st.step, "dp", s), grads,
                               st.net.link, "dp")
    return ops + [opt]


# ---- ours ----------------------------------------------------------------------------------------
def _buckets(nbytes: int) -> list[int]:
    """Bucket sizes of ours.dp.buckets, approximately: 25 MB each, the rest in the last."""
    out = []
    while nbytes > BUCKET_BYTES:
        out.append(BUCKET_BYTES)
        nbytes -= BUCKET_BYTES
    return out + [nbytes]


def ours(st: _Step, rank: int) -> list:
    spec, cm = st.spec, st.cm
    P, D = spec.pp, spec.dp
    d, s = divmod(rank, P)
    mb = spec.micro_batch_size
    nbs = spec.n_micro_batches
    slices = spec.token_slices
    ctx = [sum(slices[:i]) for i in range(len(slices))]
    units = [(b, i) for b in range(nbs) for i in range(len(slices))]
    L = st.layers
    first, last = s == 0, s == P - 1
    prev, nxt = rank - 1, rank + 1
    ops: list = [Compute(st.o.step, "overhead")]
    if not first:
        for u, (_, i) in enumerate(units):
            ops.append(Recv(_key(st.step, "f", d, s - 1, u), prev, st.act_bytes(mb, slices[i])))
    sends = []
    for u, (_, i) in enumerate(units):
        l, c = slices[i], ctx[i]
        if not first:
            ops.append(Wait((_key(st.step, "f", d, s - 1, u),)))
        ops += st.forward(s, mb, l, c)
        if not last:
            key = _key(st.step, "f", d, s, u)
            ops.append(Send(key, nxt, st.act_bytes(mb, l)))
            sends.append(key)
    if not last:
        for u in reversed(range(len(units))):
            i = units[u][1]
            ops.append(Recv(_key(st.step, "b", d, s + 1, u), nxt, st.act_bytes(mb, slices[i])))
    for u in reversed(range(len(units))):
        l, c = slices[units[u][1]], ctx[units[u][1]]
        if not last:
            ops.append(FillWait(_key(st.step, "b", d, s + 1, u), "wgrad"))
        ops.append(Compute(st.o.per_unit(L) / 2, "overhead"))
        if last:
            ops.append(Compute(cm.head_forward(mb * l, 1, st.width) + cm.head_backward_input(mb * l, 1, st.width),
                               "head"))
        if spec.recompute:
            ops.append(Compute(L * cm.layer_forward(mb, l, c), "recompute"))
        ops.append(Compute(L * cm.layer_backward_input(mb, l, c), "backward"))
        if first:
            ops.append(Compute(cm.embed(mb * l) * 2 / 3, "embed"))
        chunks = [cm.layer_wgrad(mb, l) / 4] * (4 * L)  # one per linear (ours drains one stash entry at a time)
        if last:
            chunks.append(cm.head_wgrad(mb * l, 1, st.width))
        ops.append(Defer(tuple(chunks)))
        if not first:
            key = _key(st.step, "b", d, s, u)
            ops.append(Send(key, prev, st.act_bytes(mb, l)))
            sends.append(key)
    ops.append(Flush("wgrad"))
    if sends:
        ops.append(Wait(tuple(sends)))
    params = st.params(L, first, last)
    if D == 1:
        return ops + st.optimizer(params)
    ops.append(Compute(st.o.dp, "overhead"))
    group = tuple(k * P + s for k in range(D))
    server = s  # dp_rank 0 of the stage's group
    tr, link = st.net.transport, st.net.link
    buckets = _buckets(params * 4)
    tag = lambda what, j: _key(st.step, "dp", s, what, j)
    if spec.dp_mode == "allreduce":
        for j, nbytes in enumerate(buckets):
            ops += coll.collective(tr, "allreduce", group, rank, tag("ar", j), nbytes, link, "dp")
        return ops + st.optimizer(params)
    if spec.dp_mode == "central_ps":
        for j, nbytes in enumerate(buckets):
            ops += coll.collective(tr, "reduce", group, rank, tag("reduce", j), nbytes, link, "dp", root=server)
        if rank == server:
            ops += st.optimizer(params)
        for j, nbytes in enumerate(buckets):
            ops += coll.collective(tr, "broadcast", group, rank, tag("bcast", j), nbytes, link, "dp", root=server)
        return ops
    padded = -(-params // D) * D * 4
    ops += coll.collective(tr, "reduce_scatter", group, rank, tag("rs", 0), padded, link, "dp")
    ops += st.optimizer(-(-params // D))
    ops += coll.collective(tr, "allgather", group, rank, tag("ag", 0), padded, link, "dp")
    return ops


BUILDERS = {"torch_pipe": torch_pipe, "megatron": megatron, "ours": ours}


def network_of(spec: RunSpec) -> Network:
    per_host = spec.ranks_per_host
    if spec.system == "megatron":  # a tensor-parallel group is one simulated rank
        per_host = max(1, per_host // spec.tp)
    return Network(spec.link, spec.transport, spec.intra_link, per_host)


def build(spec: RunSpec, cm: ComputeModel, steps: int = 2) -> Built:
    """Programs of every simulated rank: ``steps`` steps, each framed by the timing barriers; Marks
    ``start{k}`` / ``end{k}`` around step k (after the opening barrier, after the closing one)."""
    if spec.tp > 1 and spec.system != "megatron":
        raise ValueError(f"{spec.system} has no tensor parallelism")
    net = network_of(spec)
    n = spec.pp * spec.dp
    world = tuple(range(n))
    programs = []
    for r in range(n):
        ops: list = []
        for k in range(steps):
            st = _Step(spec, cm, net, k)
            ops += _barrier(net, world, r, ("open", k))
            ops.append(Mark(f"start{k}"))
            ops += BUILDERS[spec.system](st, r)
            ops += _barrier(net, world, r, ("close", k))
            ops.append(Mark(f"end{k}"))
        programs.append(ops)
    procs = [spec.tp if spec.system == "megatron" else 1] * n
    return Built(programs, procs, net)


def _barrier(net: Network, world: tuple, r: int, tag) -> list:
    return coll.collective(net.transport, "barrier", world, r, ("barrier", tag), 0, net.link, "barrier")
