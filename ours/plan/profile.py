"""This machine's profile: one thread, one process, the operations a training step is made of, at a
model's shape. ``workload.compute.CpuCompute`` reads it: the CPU's compute model, for ours' planner
(``python -m ours.plan profile`` writes it where ``--n-slices auto`` finds it) and for the simulator's
calibration (``python -m predict calibrate``).

- one transformer layer of the model's family on b sequences x l tokens after c tokens of context
  (cached keys and values, of the key/value heads, as leaves that receive gradients, as in ours' token
  slices; llama's rotary positions at offset c): forward, backward with weight gradients, backward
  without (the input gradients only; weight gradients = the difference);
- the head (ln_f, the family's norm, + lm_head + cross-entropy) per token: forward, backward with and
  without the lm_head's weight gradient; the embeddings per token; one Adam step per parameter (as the
  runs: foreach=False);
- a gloo message between two local processes (a ping-pong), fitted to latency + bytes / bandwidth.

Every point is the minimum of a few repetitions (contention on a shared machine only slows a
measurement down). The result is a JSON dict (``kind: ours.plan.profile``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ours.plan.latency import fit_comm
from ours.plan.ping_pong import ping_pong
from workload.configs import ModelConfig
from workload.flops import cpu_name
from workload.model import GPT, Block, block_forward, merge_heads, norm, split_heads


def context_attention(kc: torch.Tensor, vc: torch.Tensor, n_head: int, kv_heads: int | None = None):
    """The attention of a slice after cached keys ``kc`` and values ``vc`` (b, kv_heads, c, head_dim; None:
    one per query head): its queries attend to the cache and causally to its own positions (bottom-right
    aligned), as a token pipeline's later slice does; for ``workload.model.block_forward``."""
    def attention(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(qkv, n_head, kv_heads)
        k, v = torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != n_head))

    return attention


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


def overhead_rates(cfg: ModelConfig, device: torch.device, reps: int = 3) -> dict:
    """Head + loss and embeddings per token; the optimizer (Adam, as the runs use) per parameter."""
    torch.manual_seed(0)
    h, V, L = cfg.n_embd, cfg.vocab_size, cfg.seq_len
    ln_f = norm(cfg).to(device)
    head = torch.nn.Linear(h, V, bias=False).to(device)

    def head_step():
        x = torch.randn(1, L, h, device=device, requires_grad=True)
        y = torch.randint(0, V, (1, L), device=device)
        logits = head(ln_f(x))
        F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1)).backward()
        for p in (*ln_f.parameters(), head.weight):
            p.grad = None

    embeddings = GPT(dataclasses.replace(cfg, n_layer=0)).to(device)  # wte (and gpt's wpe)

    def embed_step():
        idx = torch.randint(0, V, (1, L), device=device)
        out = embeddings.embed(idx)
        out.backward(torch.ones_like(out))
        for p in embeddings.parameters():
            p.grad = None

    block = Block(cfg).to(device)
    params = list(block.parameters()) + list(head.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=False)  # as the runs' default
    n_params = sum(p.numel() for p in params)
    t_head = _median_time(head_step, reps, 1, device)
    t_embed = _median_time(embed_step, reps, 1, device)
    t_opt = _median_time(opt.step, reps, 2, device)
    return dict(head_per_token=t_head / L, embed_per_token=t_embed / L, optimizer_per_param=t_opt / n_params,
                head_seconds=t_head, embed_seconds=t_embed, optimizer_seconds=t_opt, optimizer_params=n_params)


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


def grid(seq_len: int, batch_slices: tuple[int, ...] = (1,)) -> list[tuple[int, int, int]]:
    """(b, l, c): l over the sequence at c = 0 (fine at the small end, where slicing lives), and a
    coarse set of slices after 1/4, 1/2 and 3/4 of the sequence."""
    step = max(8, seq_len // 16)
    ls = sorted({l for l in (8, 16, 32) if l < step} | set(range(step, seq_len + 1, step)) | {seq_len})
    pts = [(b, l, 0) for b in batch_slices for l in ls]
    for b in batch_slices:
        for c in (seq_len // 4, seq_len // 2, 3 * seq_len // 4):
            for l in sorted({step, 2 * step, seq_len // 4}):
                if c > 0 and c + l <= seq_len:
                    pts.append((b, l, c))
    return pts


class LayerTimer:
    """One Block with the shared model's layer math, timed phase by phase."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.block = Block(cfg)

    def once(self, b: int, l: int, c: int, weight_grads: bool) -> tuple[float, float]:
        """(forward seconds, backward seconds) of one pass."""
        cfg, blk = self.cfg, self.block
        for p in blk.parameters():
            p.requires_grad_(weight_grads)
        H, H_kv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        x = torch.randn(b, l, cfg.n_embd, requires_grad=True)
        kc = torch.randn(b, H_kv, c, D, requires_grad=True) if c else None
        vc = torch.randn(b, H_kv, c, D, requires_grad=True) if c else None
        grad = torch.ones(b, l, cfg.n_embd)
        # c > 0: the slice attends to c cached positions, leaves that receive gradients (as in the pipeline)
        attention = context_attention(kc, vc, H, H_kv) if c else None
        t0 = time.perf_counter()
        out = block_forward(blk, x, attention, offset=c)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        for p in blk.parameters():
            p.grad = None
        return t1 - t0, t2 - t1

    def point(self, b: int, l: int, c: int, reps: int) -> dict:
        self.once(b, l, c, True)
        fwd, full, bin_ = [], [], []
        for _ in range(reps):
            f, bw = self.once(b, l, c, True)
            fwd.append(f)
            full.append(bw)
            f2, bw2 = self.once(b, l, c, False)
            fwd.append(f2)
            bin_.append(bw2)
        fwd_t, full_t, bin_t = min(fwd), min(full), min(bin_)
        return dict(b=b, l=l, c=c, fwd=fwd_t, bwd_full=full_t, bwd_in=min(bin_t, full_t),
                    wgrad=max(0.0, full_t - bin_t))


def head_rates(cfg: ModelConfig, reps: int = 3, tokens: int | None = None) -> dict:
    """Per token: head forward, backward with and without the lm_head weight gradient."""
    torch.manual_seed(0)
    h, V = cfg.n_embd, cfg.vocab_size
    n = tokens or cfg.seq_len
    ln_f = norm(cfg)
    head = torch.nn.Linear(h, V, bias=False)

    def once(weight_grads: bool) -> tuple[float, float]:
        for p in (*ln_f.parameters(), *head.parameters()):
            p.requires_grad_(weight_grads)
        x = torch.randn(1, n, h, requires_grad=True)
        y = torch.randint(0, V, (1, n))
        t0 = time.perf_counter()
        loss = F.cross_entropy(head(ln_f(x)).reshape(-1, V).float(), y.reshape(-1), reduction="sum")
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for p in (*ln_f.parameters(), head.weight):
            p.grad = None
        return t1 - t0, t2 - t1

    once(True)
    full = [once(True) for _ in range(reps)]
    nowg = [once(False) for _ in range(reps)]
    fwd = min(min(f for f, _ in full), min(f for f, _ in nowg))
    b_full, b_in = min(b for _, b in full), min(b for _, b in nowg)
    return dict(fwd_per_token=fwd / n, bwd_in_per_token=min(b_in, b_full) / n,
                wgrad_per_token=max(0.0, b_full - b_in) / n)


def fit_p2p(points: list[dict]) -> dict:
    """latency + bytes / bandwidth by least squares over the ping-pong's one-way times."""

    if not points:
        return {}
    a, bw = fit_comm([p["bytes"] for p in points], [p["t"] for p in points])
    return dict(latency=a, bandwidth=bw if bw != float("inf") else 1e12)


def profile(cfg: ModelConfig, batch_slices: tuple[int, ...] = (1,), reps: int = 3, p2p: bool = True,
            progress: bool = True) -> dict:
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        timer = LayerTimer(cfg)
        pts = grid(cfg.seq_len, batch_slices)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(pts) + 2, desc=f"profile {cfg.name}", unit="pt")
        layer = []
        for b, l, c in pts:
            layer.append(timer.point(b, l, c, reps))
            if bar:
                bar.update()
        head = head_rates(cfg, reps)
        rates = overhead_rates(cfg, torch.device("cpu"), reps)
        if bar:
            bar.update()
        p2p_points = measure_p2p([2 ** k for k in range(10, 23, 3)], 8) if p2p else []
        if bar:
            bar.update()
            bar.close()
    finally:
        torch.set_num_threads(prev_threads)
    return dict(
        kind="ours.plan.profile",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hostname=socket.gethostname(), cpu=cpu_name(), torch=torch.__version__,
        threads=1, model=dict(name=cfg.name, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                               seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, family=cfg.family,
                               kv_heads=cfg.n_kv_head, ffn_hidden=cfg.ffn_dim),
        layer=layer, head=head, embed_per_token=rates["embed_per_token"],
        optimizer_per_param=rates["optimizer_per_param"], p2p=p2p_points, p2p_fit=fit_p2p(p2p_points),
        seconds=time.perf_counter() - started)
