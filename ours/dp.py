"""Data parallelism across D pipelines, within each stage's DP group (the ranks of one pp_rank), in one
round of point-to-point messages (``PointToPointSync``).

Gradients move in flattened buckets, in the order the pipeline finishes them: the engine calls
``grads_ready(params)`` as soon as those parameters' gradients are final (the weight gradients are
computed at the end of its step, one linear after another), and a bucket's push starts as soon as its
last gradient is in, overlapping the stage's remaining weight-gradient work. Each bucket is cut into
the ranges the DP ranks reduce; a replica pushes each range to the rank that reduces it, which sums
the D gradients in dp_rank order (the same sum on every rank) and averages:

- ``central_ps``: dp_rank 0 reduces every bucket, alone holds the optimizer state (an fp32 master copy
  of each bucket: Adam is elementwise, so a flat range is the same math), steps it bucket by bucket and
  sends each updated bucket back to the replicas, which receive them bucket by bucket.
- ``sharded_ps``: the same, each rank serving 1/D of every bucket.
- ``allreduce``: every rank steps its own optimizer on the averaged gradient. D = 2: each rank sends
  its whole bucket to the other and both sum (one delay); D > 2: each rank reduces 1/D of every bucket
  and sends the averaged range back (a reduce-scatter and an all-gather: two delays, ring bandwidth).

Every receive is posted a step ahead (``post_receives``): gloo sends a message only once the
receiver's notice that its receive is posted has arrived, so a receive posted late costs that message
a second network delay. A parameter server thus pays two delays (push, pull). gloo's collectives,
which this replaces, paid several (``python -m bench.network_slope``, tiny model, P-2 D-2, 20 to
80 ms one-way, before: DP sync 7.1 delays per step with reduce + broadcast for the central PS, 7.6
with reduce_scatter + all_gather for the sharded PS, 5.1 with all_reduce; 2 rank micro-benchmark at
40 ms: 2 MB all_reduce 172 ms, reduce + broadcast 211 ms, pre-posted push + pull 85 ms).

Each ordered pair of DP ranks has a process group of its own (``contract.links``), on which one rank
only sends and the other only receives, so a pending receive holds back no send (NCCL runs a pair's
operations on a group in issue order), and messages match by order (NCCL has no tags): a rank sends
a peer its pushes in bucket order, then what it sends back in bucket order, and the peer posts its
receives in that order.

Optional lossy wire precision (``wire_dtype`` bf16 or fp16, as AQ-SGD / CocktailSGD compress what
crosses a slow link): the pushed gradients and what comes back cross the network in that type; sums,
averages and the optimizer's master copy stay fp32, and every replica (the reducing rank too) applies
the same rounded values, so the replicas stay identical.

``step()`` waits for what is still in flight, steps the optimizer(s) and returns the seconds it spent
synchronising: the DP sync the step pays beyond the pipeline (pushes started inside the pipeline's
step count only as far as they are still waited for here). ``grads()`` gives the averaged gradient the
update used, on every rank (for --verify; collective).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from contract.links import Ends, posts_ahead
from ours.tp import rank_of
from ours.trace import Tracer
from workload.training import OptimizerConfig, make_optimizer

BUCKET_BYTES = 4 * 1024 * 1024  # small buckets pipeline push, reduction and what comes back


def dp_links(pp: int, dp: int, tp: int = 1) -> list[Ends]:
    """Every ordered pair of the DP ranks of each (stage, tp_rank) (``ours.tp.rank_of``: global rank =
    (dp_rank * P + stage) * T + tp_rank)."""
    return [(rank_of(a, s, t, pp, tp), rank_of(b, s, t, pp, tp))
            for s in range(pp) for t in range(tp) for a in range(dp) for b in range(dp) if a != b]


def bucket_starts(sizes: list[int], bucket_bytes: int = BUCKET_BYTES) -> list[int]:
    """Where each bucket begins in a list of tensors of ``sizes`` bytes, in order: a bucket takes tensors
    until the next would take it over ``bucket_bytes`` (a larger tensor is a bucket of its own)."""
    starts, size = [], 0
    for i, nbytes in enumerate(sizes):
        if not starts or size + nbytes > bucket_bytes:
            starts.append(i)
            size = 0
        size += nbytes
    return starts


def buckets(params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    starts = bucket_starts([p.numel() * p.element_size() for p in params], bucket_bytes)
    return [params[a:b] for a, b in zip(starts, starts[1:] + [len(params)])]


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off : off + n].view_as(t))
        off += n


def _ordered(named: list[tuple[str, torch.nn.Parameter]],
             order: list[torch.nn.Parameter] | None) -> list[torch.nn.Parameter]:
    """The parameters in the order their gradients become final (``order``), else in ``named``'s order."""
    params = [p for _, p in named]
    if order is None:
        return params
    if sorted(map(id, order)) != sorted(map(id, params)):
        raise ValueError("the gradient order must hold every parameter of the stage exactly once")
    return list(order)


class _Readiness:
    """Per bucket, how many of its parameters' gradients are not final yet in this step; buckets are
    released in index order (the order their messages are matched in), each once it and every
    bucket before it is complete."""

    def __init__(self, bucket_params: list[list[torch.nn.Parameter]]):
        self._bucket_of = {id(p): i for i, ps in enumerate(bucket_params) for p in ps}
        self._sizes = [len(ps) for ps in bucket_params]
        self.reset()

    def reset(self) -> None:
        self._pending = list(self._sizes)
        self._next = 0  # the first bucket not released yet

    def _release(self) -> list[int]:
        done = []
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            done.append(self._next)
            self._next += 1
        return done

    def ready(self, params: list[torch.nn.Parameter]) -> list[int]:
        """Mark these parameters' gradients final; the buckets released now."""
        for p in params:
            self._pending[self._bucket_of[id(p)]] -= 1
        return self._release()

    def rest(self) -> list[int]:
        """The buckets not released yet, now taken as complete (nobody reported them)."""
        self._pending = [0] * len(self._pending)
        return self._release()


class LocalSync:
    """D = 1: just the optimizer."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], opt_cfg: OptimizerConfig):
        self.named = named
        self.opt = make_optimizer([p for _, p in named], opt_cfg)

    def grads_ready(self, params: list[torch.nn.Parameter]) -> None:
        """Called by the pipeline when these parameters' gradients are final for this step."""

    def post_receives(self) -> None:
        """Post the receives of the coming step's sync (nothing to receive here)."""

    def post_ahead(self) -> None:
        """As ``post_receives``, a step ahead where that helps (nothing to receive here)."""

    @torch.no_grad()
    def step(self) -> float:
        self.opt.step()
        return 0.0

    @torch.no_grad()
    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.named}


@dataclass(frozen=True)
class _Bucket:
    params: tuple[torch.nn.Parameter, ...]
    numel: int
    ranges: tuple[tuple[int, int], ...]  # the [lo, hi) of the flat bucket each dp_rank reduces


def bucket_ranges(n: int, dp: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Which part of an n-element bucket each dp_rank reduces: ``central`` dp_rank 0 all of it,
    ``sharded`` 1/D each, ``replicated`` every rank all of it."""
    if layout == "central":
        return ((0, n),) + ((n, n),) * (dp - 1)
    if layout == "sharded":
        s = -(-n // dp)
        return tuple((min(j * s, n), min((j + 1) * s, n)) for j in range(dp))
    if layout == "replicated":
        return ((0, n),) * dp
    raise ValueError(f"unknown layout {layout!r}")


class PointToPointSync:
    """Data parallelism in one round, point to point (see the module docstring).

    Each bucket is cut into the ranges the DP ranks reduce (``layout``). A replica pushes each range
    of a complete bucket to the rank that reduces it; that rank adds the D gradients in dp_rank order
    (the same sum everywhere), averages, and then, with ``serve`` (a parameter server), steps the
    optimizer of its range on an fp32 master copy and sends the updated parameters back; without,
    sends the averaged gradient back, and every rank steps its own full optimizer. With the
    ``replicated`` layout every rank reduces every bucket, and nothing is sent back.
    ``ranks[j]``: the global rank of dp_rank j in ``group`` (the stage's DP group: ``grads``'
    collectives); ``links``: the process group of each ordered pair of them (``contract.links``)."""

    def __init__(self, named, opt_cfg: OptimizerConfig, *, group, links: Mapping[Ends, dist.ProcessGroup],
                 ranks: list[int], dp_rank: int, layout: str, serve: bool,
                 order: list[torch.nn.Parameter] | None = None, wire_dtype: torch.dtype = torch.float32,
                 bucket_bytes: int = BUCKET_BYTES, tracer: Tracer | None = None):
        self.named, self.group, self.ranks, self.dp_rank = named, group, list(ranks), dp_rank
        self.links = dict(links)
        self.tracer = tracer or Tracer(dp_rank, enabled=False)
        self.dp, self.layout, self.serve, self.wire_dtype = len(ranks), layout, serve, wire_dtype
        self.peers = [j for j in range(self.dp) if j != dp_rank]
        self.buckets = [_Bucket(tuple(ps), n, bucket_ranges(n, self.dp, layout))
                        for ps in buckets(_ordered(named, order), bucket_bytes) for n in [sum(p.numel() for p in ps)]]
        self.readiness = _Readiness([list(b.params) for b in self.buckets])
        dev = named[0][1].device
        self._grad = [torch.empty(b.numel, dtype=torch.float32, device=dev) for b in self.buckets]
        self._back = [torch.empty(b.numel, dtype=wire_dtype, device=dev) for b in self.buckets]  # what comes back
        self._grads_in = [{j: torch.empty(b.ranges[dp_rank][1] - b.ranges[dp_rank][0], dtype=wire_dtype, device=dev)
                           for j in self.peers} for b in self.buckets]
        self._masters: list[torch.nn.Parameter | None] = []
        self._opts: list[torch.optim.Optimizer | None] = []
        for b in self.buckets:
            lo, hi = b.ranges[dp_rank]
            master = None
            if serve and hi > lo:
                master = torch.nn.Parameter(_flatten([p.detach() for p in b.params])[lo:hi].float().clone())
            self._masters.append(master)
            self._opts.append(make_optimizer([master], opt_cfg) if master is not None else None)
        self.opt = None if serve else make_optimizer([p for _, p in named], opt_cfg)
        self._pushed: list[torch.Tensor | None] = [None] * len(self.buckets)  # each bucket's gradient as pushed
        self._last_grad: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._recvs: dict | None = None
        self._sends: list[tuple[torch.Tensor, object]] = []

    def _own(self, i: int) -> tuple[int, int]:
        return self.buckets[i].ranges[self.dp_rank]

    def _returned(self, i: int, j: int) -> bool:
        """Does peer j send this rank its reduced range of bucket i?"""
        lo, hi = self.buckets[i].ranges[j]
        return hi > lo and self.buckets[i].ranges[self.dp_rank] != (0, self.buckets[i].numel)

    def _link(self, src: int, dst: int) -> dist.ProcessGroup:
        """The process group of the link from dp_rank src to dp_rank dst."""
        return self.links[self.ranks[src], self.ranks[dst]]

    def post_receives(self) -> None:
        """Post every receive of the coming step's sync, in the order each peer sends: its pushes of
        the ranges this rank reduces, bucket by bucket, then what it sends back of its own."""
        if self._recvs is not None:
            return
        recvs = {}
        me = self.dp_rank
        for i in range(len(self.buckets)):
            lo, hi = self._own(i)
            for j in self.peers:
                if hi > lo:
                    recvs["grad", i, j] = dist.irecv(self._grads_in[i][j], self.ranks[j], group=self._link(j, me))
        for i, b in enumerate(self.buckets):
            for j in self.peers:
                if self._returned(i, j):
                    jlo, jhi = b.ranges[j]
                    recvs["back", i, j] = dist.irecv(self._back[i][jlo:jhi], self.ranks[j], group=self._link(j, me))
        self._recvs = recvs

    def post_ahead(self) -> None:
        """``post_receives`` a step ahead where receives are posted ahead (``contract.links.posts_ahead``:
        gloo); on CUDA ``step`` posts them."""
        if self._grad and posts_ahead(self._grad[0].device):
            self.post_receives()

    def grads_ready(self, params: list[torch.nn.Parameter]) -> None:
        for i in self.readiness.ready(params):
            self._push(i)

    @torch.no_grad()
    def _push(self, i: int) -> None:
        """Flatten bucket i's gradient; send each peer the range it reduces."""
        with self.tracer.span("dp", f"push b{i}"):
            self._push_bucket(i)

    def _push_bucket(self, i: int) -> None:
        b, flat = self.buckets[i], self._grad[i]
        torch.cat([p.grad.reshape(-1) for p in b.params], out=flat)
        wire = self._pushed[i] = flat.to(self.wire_dtype)
        for j in self.peers:
            jlo, jhi = b.ranges[j]
            if jhi > jlo:
                self._sends.append((wire, dist.isend(wire[jlo:jhi], self.ranks[j], group=self._link(self.dp_rank, j))))

    @torch.no_grad()
    def _reduce(self, i: int, recvs: dict) -> None:
        """Average the D gradients of this rank's range of bucket i (in dp_rank order); as a server,
        step the range's optimizer; put the result in the range of ``_back[i]`` and send it to
        every peer that does not reduce it itself."""
        b = self.buckets[i]
        lo, hi = self._own(i)
        acc = torch.zeros(hi - lo, dtype=torch.float32, device=self._grad[i].device)
        # its own gradient as it is (may still be on its way to peers: read only); where every rank reduces
        # the whole bucket, as pushed (rounded to the wire type like the peers'), so all get the same sum
        own = self._pushed[i] if self.layout == "replicated" else self._grad[i]
        for j in range(self.dp):
            if j == self.dp_rank:
                acc.add_(own[lo:hi])
            else:
                with self.tracer.span("dp", f"wait push b{i} from {j}"):
                    recvs.pop(("grad", i, j)).wait()
                acc.add_(self._grads_in[i][j])
        acc.div_(self.dp)
        self._last_grad[i] = acc
        out = self._back[i][lo:hi]
        if self.serve:
            master = self._masters[i]
            master.grad = acc
            self._opts[i].step()
            master.grad = None
            out.copy_(master)  # rounded to the wire type: what every replica applies
        else:
            out.copy_(acc)
        for j in self.peers:
            if b.ranges[j] != (0, b.numel):
                self._sends.append((out, dist.isend(out, self.ranks[j], group=self._link(self.dp_rank, j))))

    @torch.no_grad()
    def step(self) -> float:
        t0 = time.perf_counter()
        self.post_receives()  # no-op when posted a step ahead
        for i in self.readiness.rest():
            self._push(i)
        recvs, self._recvs = self._recvs, None
        for i in range(len(self.buckets)):  # reduce every range this rank serves before waiting for any other
            if self._own(i)[1] > self._own(i)[0]:
                self._reduce(i, recvs)
        for i, b in enumerate(self.buckets):  # what the peers send back, bucket by bucket
            for j in self.peers:
                if self._returned(i, j):
                    with self.tracer.span("dp", f"wait back b{i} from {j}"):
                        recvs.pop(("back", i, j)).wait()
            back = self._back[i].float()
            _unflatten_into(back, [p.data if self.serve else p.grad for p in b.params])
        with self.tracer.span("dp", "wait dp sends"):
            for _, work in self._sends:
                work.wait()
        self._sends = []
        self.readiness.reset()
        dt = time.perf_counter() - t0
        if self.opt is not None:
            self.opt.step()
        return dt

    @torch.no_grad()
    def grads(self) -> dict[str, torch.Tensor]:
        """The averaged gradient the update used, on every rank of the group (collective)."""
        names = {id(p): n for n, p in self.named}
        out = {}
        for i, b in enumerate(self.buckets):
            full = torch.empty(b.numel, dtype=torch.float32, device=self._grad[i].device)
            for j, (lo, hi) in enumerate(b.ranges):
                if hi == lo:
                    continue
                if self.layout == "replicated":  # every rank reduced the whole bucket
                    full.copy_(self._last_grad[i])
                    break
                piece = (self._last_grad[i].clone() if j == self.dp_rank
                         else torch.empty(hi - lo, dtype=full.dtype, device=full.device))
                dist.broadcast(piece, src=self.ranks[j], group=self.group)
                full[lo:hi] = piece
            off = 0
            for p in b.params:
                out[names[id(p)]] = full[off : off + p.numel()].view_as(p).clone()
                off += p.numel()
        return out


def make_sync(mode: str, named, opt_cfg: OptimizerConfig, *, group, dp: int, dp_rank: int, ranks: list[int],
              links: Mapping[Ends, dist.ProcessGroup] | None = None, order: list[torch.nn.Parameter] | None = None,
              wire_dtype: torch.dtype = torch.float32, tracer: Tracer | None = None):
    """The DP sync of one stage. ``ranks``: the global ranks of the stage's DP group, by dp_rank;
    ``links``: a process group per ordered pair of them (``dp_links``); ``order``: the parameters in
    the order the pipeline reports their gradients final."""
    if dp == 1:
        return LocalSync(named, opt_cfg)
    common = dict(group=group, links=links or {}, ranks=ranks, dp_rank=dp_rank, order=order, wire_dtype=wire_dtype,
                  tracer=tracer)
    return PointToPointSync(named, opt_cfg, layout=layout_of(mode, dp), serve=mode != "allreduce", **common)


def layout_of(mode: str, dp: int) -> str:
    """The bucket layout (``bucket_ranges``) of a DP mode: the parameter servers' ``central`` and
    ``sharded``; all-reduce a direct exchange (``replicated``) at D = 2, else ``sharded``."""
    layouts = {"central_ps": "central", "sharded_ps": "sharded", "allreduce": "replicated" if dp == 2 else "sharded"}
    if mode not in layouts:
        raise ValueError(f"unknown dp_mode {mode!r}")
    return layouts[mode]
