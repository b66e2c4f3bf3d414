"""Data parallelism across D pipelines, within each stage's DP group (the ranks of one pp_rank).

- ``allreduce``: gradients all-reduced in flattened buckets, averaged; every rank steps its optimizer.
- ``central_ps``: dp_rank 0 of the group is the parameter server: gradients are reduced to it, it
  alone holds the optimizer state and steps, and broadcasts the updated parameters (flattened buckets).
- ``sharded_ps``: each DP rank serves 1/D of the flattened, padded parameters: reduce-scatter of the
  gradients, the shard's optimizer step (Adam is elementwise: a flat shard is the same math),
  all-gather of the parameters.

``step()`` does the synchronisation and the optimizer step and returns the seconds spent in data-parallel
synchronisation (for the parameter servers: everything from the first reduce to the parameters being
back, the server's optimizer step included, as the clients wait for it; for all-reduce: the
all-reduce only); ``grads()`` gives the averaged gradient the update used (for --verify).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workload.training import OptimizerConfig, make_optimizer

BUCKET_BYTES = 25 * 1024 * 1024


def buckets(params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    out: list[list[torch.nn.Parameter]] = []
    cur: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        out.append(cur)
    return out


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off : off + n].view_as(t))
        off += n


class LocalSync:
    """D = 1: just the optimizer."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], opt_cfg: OptimizerConfig):
        self.named = named
        self.opt = make_optimizer([p for _, p in named], opt_cfg)

    @torch.no_grad()
    def step(self) -> float:
        self.opt.step()
        return 0.0

    @torch.no_grad()
    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.named}


def _post_flat_grads(buckets, collective) -> tuple[list[torch.Tensor], list]:
    """Flatten each bucket's gradients and start ``collective`` on it (async); (flats, works)."""
    flats, works = [], []
    for bucket in buckets:  # each bucket's collective starts before the next bucket is flattened
        flats.append(_flatten([p.grad for p in bucket]))
        works.append(collective(flats[-1]))
    return flats, works


class AllReduceSync(LocalSync):
    def __init__(self, named, opt_cfg, group, dp: int):
        super().__init__(named, opt_cfg)
        self.group, self.dp = group, dp
        self.buckets = buckets([p for _, p in named])

    @torch.no_grad()
    def step(self) -> float:
        t0 = time.perf_counter()
        flats, works = _post_flat_grads(self.buckets, lambda f: dist.all_reduce(f, group=self.group, async_op=True))
        for bucket, flat, work in zip(self.buckets, flats, works):
            work.wait()
            flat.div_(self.dp)
            _unflatten_into(flat, [p.grad for p in bucket])
        dt = time.perf_counter() - t0
        self.opt.step()
        return dt


class CentralPSSync:
    def __init__(self, named, opt_cfg, group, dp: int, server: int, is_server: bool):
        self.named, self.group, self.dp, self.server, self.is_server = named, group, dp, server, is_server
        self.buckets = buckets([p for _, p in named])
        self.opt = make_optimizer([p for _, p in named], opt_cfg) if is_server else None

    @torch.no_grad()
    def step(self) -> float:
        t0 = time.perf_counter()
        flats, works = _post_flat_grads(
            self.buckets, lambda f: dist.reduce(f, dst=self.server, group=self.group, async_op=True))
        for w in works:
            w.wait()
        if self.is_server:
            for bucket, flat in zip(self.buckets, flats):
                flat.div_(self.dp)
                _unflatten_into(flat, [p.grad for p in bucket])
            self.opt.step()
            pflats = [_flatten([p.detach() for p in bucket]) for bucket in self.buckets]
        else:
            pflats = [torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                      for bucket in self.buckets]
        works = [dist.broadcast(f, src=self.server, group=self.group, async_op=True) for f in pflats]
        for bucket, f, w in zip(self.buckets, pflats, works):
            w.wait()
            if not self.is_server:
                with torch.no_grad():
                    _unflatten_into(f, [p.data for p in bucket])
        return time.perf_counter() - t0

    @torch.no_grad()
    def grads(self) -> dict[str, torch.Tensor]:
        """The averaged gradient the server used, on every rank of the group (collective)."""
        out = {}
        for bucket in self.buckets:
            if self.is_server:
                flat = _flatten([p.grad for p in bucket])
            else:
                flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            dist.broadcast(flat, src=self.server, group=self.group)
            off = 0
            names = {id(p): n for n, p in self.named}
            for p in bucket:
                out[names[id(p)]] = flat[off : off + p.numel()].view_as(p).detach().clone()
                off += p.numel()
        return out


class ShardedPSSync:
    def __init__(self, named, opt_cfg, group, dp: int, dp_rank: int):
        self.named, self.group, self.dp, self.dp_rank = named, group, dp, dp_rank
        params = [p for _, p in named]
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // dp)
        self.padded = self.shard * dp
        p0 = params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        flat[: self.numel] = _flatten([p.detach() for p in params])
        lo = dp_rank * self.shard
        self.master = torch.nn.Parameter(flat[lo : lo + self.shard].clone())
        self.opt = make_optimizer([self.master], opt_cfg)
        self.last_grad_shard: torch.Tensor | None = None

    @torch.no_grad()
    def step(self) -> float:
        t0 = time.perf_counter()
        params = [p for _, p in self.named]
        p0 = params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        flat[: self.numel] = _flatten([p.grad for p in params])
        shard = torch.empty(self.shard, dtype=p0.dtype, device=p0.device)
        dist.reduce_scatter_tensor(shard, flat, group=self.group)
        shard.div_(self.dp)
        self.master.grad = shard
        self.last_grad_shard = shard
        self.opt.step()
        full = torch.empty(self.padded, dtype=p0.dtype, device=p0.device)
        dist.all_gather_into_tensor(full, self.master.detach(), group=self.group)
        with torch.no_grad():
            _unflatten_into(full[: self.numel], [p.data for p in params])
        return time.perf_counter() - t0

    @torch.no_grad()
    def grads(self) -> dict[str, torch.Tensor]:
        """The averaged gradient the shards' updates used (all-gathered: collective)."""
        full = torch.empty(self.padded, dtype=self.master.dtype, device=self.master.device)
        dist.all_gather_into_tensor(full, self.last_grad_shard, group=self.group)
        out, off = {}, 0
        for n, p in self.named:
            out[n] = full[off : off + p.numel()].view_as(p).detach().clone()
            off += p.numel()
        return out


def make_sync(mode: str, named, opt_cfg: OptimizerConfig, *, group, dp: int, dp_rank: int, server_rank: int):
    if dp == 1:
        return LocalSync(named, opt_cfg)
    if mode == "allreduce":
        return AllReduceSync(named, opt_cfg, group, dp)
    if mode == "central_ps":
        return CentralPSSync(named, opt_cfg, group, dp, server_rank, dp_rank == 0)
    if mode == "sharded_ps":
        return ShardedPSSync(named, opt_cfg, group, dp, dp_rank)
    raise ValueError(f"unknown dp_mode {mode!r}")
