"""Measure what the latency model needs, on this device, with one thread.

- One transformer layer, forward + backward, on a slice of b sequences and l tokens after c tokens
  of context: the slice's queries attend to the cached keys/values of the context plus its own
  (causal, bottom-right aligned), and the cached keys/values are leaves that receive gradients, as
  in the token pipeline. Every l at the granularity with c = 0; a coarser (l, c) grid with c > 0.
- Point-to-point latency against message size: two gloo processes, send/recv ping-pong (one way =
  round trip / 2), under whatever network emulation is active.
- The per-step work outside the pipeline: head + loss per token, embeddings per token, the
  optimizer per parameter.

Each point is the minimum (``--stat median`` for the median) of a few repetitions after a warm-up:
on a machine shared with other work, contention only ever slows a measurement down; the fit also
drops outliers, and ``fit`` can merge several profiles (the fastest of each point).

The profile is a JSON dict: device, model shape, torch version, and lists of measurements.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ours.plan.ping_pong import ping_pong
from workload.configs import ModelConfig
from workload.flops import cpu_name
from workload.model import Block, block_forward, merge_heads, split_heads


@dataclass(frozen=True)
class ProfileGrid:
    batch_slices: tuple[int, ...] = (1, 2)
    granularity: int = 8  # c = 0: every l at this granularity
    context_step: int = 128  # c > 0: l and c multiples of this, c + l <= seq_len
    reps: int = 2  # cpu-small, b in (1, 2): about 2.5 min on an idle core
    stat: str = "min"  # of the reps: min (robust to bursts of contention on a shared machine) or median
    warmup: int = 0  # per point, after one warm-up of the whole bench
    p2p_sizes: tuple[int, ...] = tuple(2 ** k for k in range(10, 24, 2))  # 1 KiB .. 4 MiB
    p2p_reps: int = 10
    p2p: bool = True

    @staticmethod
    def quick(batch_slices: tuple[int, ...] = (1,), seq_len: int = 1024) -> "ProfileGrid":
        g = max(8, seq_len // 16)
        return ProfileGrid(batch_slices=batch_slices, granularity=g, context_step=max(g, seq_len // 4), reps=2,
                           warmup=0, p2p_sizes=tuple(2 ** k for k in range(10, 23, 4)), p2p_reps=5)


def context_attention(kc: torch.Tensor, vc: torch.Tensor, n_head: int):
    """The attention of a slice after cached keys ``kc`` and values ``vc`` (b, heads, c, head_dim): its
    queries attend to the cache and causally to its own positions (bottom-right aligned), as a token
    pipeline's later slice does; for ``workload.model.block_forward``."""
    def attention(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(qkv, n_head)
        k, v = torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    return attention


class LayerBench:
    """One Block and the tensors of a slice; ``time(b, l, c)`` is one forward + backward."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = torch.device(device)
        self.block = Block(cfg).to(self.device)

    def run(self, b: int, l: int, c: int, weight_grads: bool = True) -> None:
        cfg, dev = self.cfg, self.device
        for p in self.block.parameters():
            p.requires_grad_(weight_grads)
        H, D = cfg.n_head, cfg.head_dim
        x = torch.randn(b, l, cfg.n_embd, device=dev, requires_grad=True)
        attention = None  # c = 0: the block's own causal attention
        if c > 0:  # the slice attends to c cached positions, leaves that receive gradients (as in the pipeline)
            kc = torch.randn(b, H, c, D, device=dev, requires_grad=True)
            vc = torch.randn(b, H, c, D, device=dev, requires_grad=True)
            attention = context_attention(kc, vc, H)
        out = block_forward(self.block, x, attention)
        out.backward(torch.ones_like(out))
        for p in self.block.parameters():
            p.grad = None

    def time(self, b: int, l: int, c: int, reps: int, warmup: int, weight_grads: bool = True,
             stat: str = "min") -> float:
        return _median_time(lambda: self.run(b, l, c, weight_grads), reps, warmup, self.device, stat)

    def fill_factor(self, reps: int = 3) -> tuple[float, list[dict]]:
        """The share of a slice's forward + backward that is not weight gradients: the token
        pipeline computes weight gradients once per step after the last backward, so the fill and
        drain of the pipeline, (K - 1) * max t_i, are made of forward + input-gradient work only."""
        pts = []
        L = self.cfg.seq_len
        for l in sorted({max(8, L // 8), max(8, L // 4), max(8, L // 2)}):
            full = self.time(1, l, 0, reps, 1)
            nowg = self.time(1, l, 0, reps, 1, weight_grads=False)
            pts.append(dict(l=l, full=full, no_weight_grads=nowg))
        return statistics.median(p["no_weight_grads"] / p["full"] for p in pts), pts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, reps: int, warmup: int, device: torch.device, stat: str = "median") -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(max(1, reps)):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times) if stat == "min" else statistics.median(times)


def layer_grid(seq_len: int, grid: ProfileGrid) -> list[tuple[int, int, int]]:
    pts = []
    for b in grid.batch_slices:
        ls = list(range(grid.granularity, seq_len + 1, grid.granularity))
        if not ls or ls[-1] != seq_len:
            ls.append(seq_len)
        pts += [(b, l, 0) for l in ls]
        st = grid.context_step
        for c in range(st, seq_len, st):
            for l in range(st, seq_len - c + 1, st):
                pts.append((b, l, c))
    return pts


def overhead_rates(cfg: ModelConfig, device: torch.device, reps: int = 3) -> dict:
    """Head + loss and embeddings per token; the optimizer (Adam, as the runs use) per parameter."""
    torch.manual_seed(0)
    h, V, L = cfg.n_embd, cfg.vocab_size, cfg.seq_len
    ln_f = torch.nn.LayerNorm(h).to(device)
    head = torch.nn.Linear(h, V, bias=False).to(device)

    def head_step():
        x = torch.randn(1, L, h, device=device, requires_grad=True)
        y = torch.randint(0, V, (1, L), device=device)
        logits = head(ln_f(x))
        F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1)).backward()
        ln_f.weight.grad = ln_f.bias.grad = head.weight.grad = None

    wte = torch.nn.Embedding(V, h).to(device)
    wpe = torch.nn.Embedding(L, h).to(device)

    def embed_step():
        idx = torch.randint(0, V, (1, L), device=device)
        out = wte(idx) + wpe(torch.arange(L, device=device))
        out.backward(torch.ones_like(out))
        wte.weight.grad = wpe.weight.grad = None

    block = Block(cfg).to(device)
    params = list(block.parameters()) + list(head.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=False)  # as the runs' default
    n_params = sum(p.numel() for p in params)
    t_head = _median_time(head_step, reps, 1, device)
    t_embed = _median_time(embed_step, reps, 1, device)
    t_opt = _median_time(opt.step, reps, 2, device)
    fill, fill_pts = LayerBench(cfg, device).fill_factor(reps)
    return dict(head_per_token=t_head / L, embed_per_token=t_embed / L, optimizer_per_param=t_opt / n_params,
                fill_factor=fill, fill_points=fill_pts, head_seconds=t_head, embed_seconds=t_embed,
                optimizer_seconds=t_opt, optimizer_params=n_params)


# --- point-to-point ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2p_worker(rank: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    res = []
    try:
        for nbytes in sizes:
            times = [t / 2 for t in ping_pong(rank, nbytes, reps, barrier=True)]  # one way
            res.append(dict(bytes=max(1, nbytes // 4) * 4, t=statistics.median(times), t_min=min(times)))
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def measure_p2p(sizes: list[int], reps: int) -> list[dict]:
    """One-way time per message size between two local gloo processes (ping-pong / 2)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p2p.json")
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: no second torch import
        mp.start_processes(_p2p_worker, args=(_free_port(), list(sizes), reps, out), nprocs=2, join=True,
                           start_method=method)
        return json.loads(Path(out).read_text())


# --- the whole profile ------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def profile(cfg: ModelConfig, grid: ProfileGrid = ProfileGrid(), device: torch.device | str = "cpu",
            progress: bool = True, threads: int = 1) -> dict:
    device = torch.device(device)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bench = LayerBench(cfg, device)
        pts = layer_grid(cfg.seq_len, grid)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(pts) + (len(grid.p2p_sizes) if grid.p2p else 0) + 1, desc="profile", unit="pt")
        started = time.perf_counter()
        bench.time(max(grid.batch_slices), min(cfg.seq_len, 256), 0, 1, 2)  # warm the allocator and kernels
        layer = []
        order = random.Random(0).sample(range(len(pts)), len(pts))  # spread drifting load over the grid
        for i in order:
            b, l, c = pts[i]
            layer.append(dict(b=b, l=l, c=c, t=bench.time(b, l, c, grid.reps, grid.warmup, stat=grid.stat)))
            if bar:
                bar.update()
        errors = {}
        try:  # a failure here must not lose the layer measurements
            overhead = overhead_rates(cfg, device)
        except Exception as exc:  # noqa: BLE001
            overhead, errors["overhead"] = {}, f"{type(exc).__name__}: {exc}"
        if bar:
            bar.update()
        p2p = []
        if grid.p2p:
            try:
                p2p = measure_p2p(list(grid.p2p_sizes), grid.p2p_reps)
            except Exception as exc:  # noqa: BLE001
                errors["p2p"] = f"{type(exc).__name__}: {exc}"
            if bar:
                bar.update(len(grid.p2p_sizes))
        if bar:
            bar.close()
    finally:
        torch.set_num_threads(prev_threads)
    return dict(
        kind="ours.plan.profile",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device.type, device_name=device_name(device), torch=torch.__version__, threads=threads,
        hostname=socket.gethostname(),
        model=dict(name=cfg.name, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, seq_len=cfg.seq_len,
                   vocab_size=cfg.vocab_size),
        granularity=grid.granularity, grid=dict(batch_slices=list(grid.batch_slices), context_step=grid.context_step,
                                                reps=grid.reps, warmup=grid.warmup, stat=grid.stat),
        layer=sorted(layer, key=lambda p: (p["b"], p["c"], p["l"])), p2p=p2p, overhead=overhead, errors=errors,
                seconds=time.perf_counter() - started,
    )
