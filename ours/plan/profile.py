"""This machine's profile: one thread, one process, the operations a training step is made of, at a
model's shape. ``workload.compute.CpuCompute`` reads it: the CPU's compute model, for ours' planner
(``python -m ours.plan profile`` writes it where ``--n-slices auto`` finds it) and for the simulator's
calibration (``python -m predict calibrate``).

- one transformer layer of the model's family on b sequences x l tokens after c tokens of context
  (cached keys and values, of the key/value heads, as leaves that receive gradients, as in ours' token
  slices; llama's rotary positions at offset c): forward, backward with weight gradients, backward
  without (the input gradients only; weight gradients = the difference); the cost of every system's
  layer (``layer``);
- ours' engine's own layer on a token slice (``slice``: its sliced attention over a key/value state
  holding c earlier positions, its deferred-gradient linears, their weight gradients drained from the
  stash as the engine drains them), over (b, l, c) down to thin slices after long contexts: forward,
  input gradient, weight gradient; what ours' planner and the simulator's ours price a slice by;
- ours' engine's own time per unit beyond that math (``engine``): the engine run in one process on a
  stage holding the whole model (first and last), its tracer's span of each unit's forward and
  backward and its weight-gradient spans, less the slice's math, the embeddings and the head; fitted
  per phase to a part per unit and a part per layer over stages of 1 and 2 layers;
- the head (ln_f, the family's norm, + lm_head + cross-entropy) per token: forward, backward with and
  without the lm_head's weight gradient; the embeddings per token; one Adam step per parameter (as the
  runs: foreach=False);
- a gloo message between two local processes (a ping-pong), fitted to latency + bytes / bandwidth.

Every point is the minimum of a few repetitions, taken in rounds over the whole grid (contention on
a shared machine only slows a measurement down, and a slow spell falls on one round of many points).
The result is a JSON dict (``kind: ours.plan.profile``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ours.kernels import DeferredLinear, KVState, SliceAttention, WeightGrad
from ours.plan.latency import fit_comm
from ours.plan.ping_pong import ping_pong
from workload.compute import ENGINE_PHASES
from workload.configs import ModelConfig, qkv_rows
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


def slice_grid(seq_len: int, batch_slices: tuple[int, ...] = (1,)) -> list[tuple[int, int, int]]:
    """(b, l, c) of ours' slice: l over the sequence at c = 0 (as ``grid``), and thin to wide slices
    (from 16 tokens, or the sequence's 1/64, to a quarter of it) after 1/4, 1/2 and 3/4 of the sequence,
    so that a thin slice after a long context is measured, not extrapolated."""
    pts = [p for p in grid(seq_len, batch_slices) if p[2] == 0]
    step = max(8, seq_len // 16)
    thin = max(8, min(16, step // 2), -(-seq_len // 64))
    ls = sorted({l for l in (thin, 2 * thin) if l < step} | {step, 2 * step, seq_len // 4})
    for b in batch_slices:
        for c in (seq_len // 4, seq_len // 2, 3 * seq_len // 4):
            pts += [(b, l, c) for l in ls if c > 0 and l > 0 and c + l <= seq_len]
    return pts


class SliceTimer:
    """ours' engine's layer on a token slice, timed phase by phase: the shared block's math with ours'
    sliced attention (``ours.kernels.SliceAttention``) over a key/value state already holding c
    positions, and its deferred-gradient linears, whose weight gradients are then drained from their
    stash into the running sums (``WeightGrad``), as the engine runs a unit. The layer norms' parameters
    get their gradients from autograd, as in the engine."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.block = Block(cfg)
        self.grads: dict[str, WeightGrad] = {}
        for mod in self.block.modules():
            if isinstance(mod, torch.nn.Linear):
                for p in (mod.weight, mod.bias):
                    if p is not None:
                        p.requires_grad_(False)

    def _linear(self, name: str, module: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
        wg = self.grads.setdefault(name, WeightGrad(module.bias is not None))
        return DeferredLinear.apply(h, module.weight, module.bias, wg.stash)

    def once(self, b: int, l: int, c: int) -> tuple[float, float, float]:
        """(forward, input gradient, weight gradient) seconds of one unit."""
        cfg, T = self.cfg, self.cfg.seq_len
        H, H_kv = cfg.n_head, cfg.n_kv_head
        width = sum(qkv_rows(cfg))
        state = KVState()
        if c:
            with torch.no_grad():  # the earlier slices' keys and values, as their forwards left them
                SliceAttention.apply(torch.randn(b, c, width), state, 0, H, H_kv, T)
        x = torch.randn(b, l, cfg.n_embd, requires_grad=True)
        grad = torch.ones(b, l, cfg.n_embd)
        t0 = time.perf_counter()
        out = block_forward(self.block, x, lambda qkv: SliceAttention.apply(qkv, state, c, H, H_kv, T), self._linear,
                            offset=c)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        for wg in self.grads.values():
            wg.drain()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def sample(self, b: int, l: int, c: int) -> tuple[float, ...]:
        return self.once(b, l, c)

    @staticmethod
    def summary(b: int, l: int, c: int, samples: list[tuple[float, ...]]) -> dict:
        f, bi, w = (min(s[k] for s in samples) for k in range(3))
        return dict(b=b, l=l, c=c, fwd=f, bwd_in=bi, wgrad=w)


def _engine_worker(rank: int, port: int, cfg: ModelConfig, layers: tuple[int, ...], slicings: tuple[int, ...],
                   reps: int, out: str) -> None:
    """One rank of ``engine_costs``: per stage size and slicing, the least over ``reps`` steps (after one
    untimed) of each unit's forward and backward span and of the step's weight-gradient spans."""
    import torch.distributed as dist

    from contract.links import link_groups
    from ours import uniform_slices
    from ours.engine import StageEngine, pipeline_links
    from ours.trace import Tracer
    from workload.partition import build_stage, stage_specs

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    res = []
    try:
        links = link_groups(pipeline_links(2, 1), torch.device("cpu"), timeout)
        S, batch = cfg.seq_len, 2
        inputs = torch.randint(0, cfg.vocab_size, (batch, S))
        targets = torch.randint(0, cfg.vocab_size, (batch, S))
        for L in layers:
            model_cfg = cfg.with_overrides(n_layer=2 * L)
            spec = stage_specs(2 * L, 2)[rank]
            stage = build_stage(model_cfg, spec, 0, "cpu")
            for k in slicings:
                tracer = Tracer(rank, enabled=True)
                engine = StageEngine(stage, spec, slices=uniform_slices(S, k), batch_size=batch, micro_batch_size=1,
                                     device=torch.device("cpu"), rank=rank, prev_rank=None if rank == 0 else 0,
                                     next_rank=1 if rank == 0 else None, tracer=tracer, links=links)
                engine.post_ahead()
                spans: dict[str, float] = {}
                wgrad = math.inf
                for rep in range(reps + 1):
                    tracer.events.clear()
                    dist.barrier()
                    engine.step(inputs, targets, post_next=rep < reps)
                    for p in stage.parameters():
                        p.grad = None
                    if rep == 0:
                        continue
                    for e in tracer.events:
                        if e["cat"] in ("forward", "backward"):
                            spans[e["name"]] = min(spans.get(e["name"], math.inf), e["dur"] * 1e-6)
                    wgrad = min(wgrad, sum(e["dur"] for e in tracer.events if e["cat"] == "wgrad") * 1e-6)
                res.append(dict(layers=L, k=k, spans=spans, wgrad=wgrad, units=batch * k))
        Path(f"{out}.{rank}").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def engine_costs(cfg: ModelConfig, compute, layers: tuple[int, ...] = (1, 2), slicings: tuple[int, ...] = (2, 8, 16),
                 reps: int = 3) -> dict:
    """ours' engine's own time per unit beyond the math ``compute`` (a ``CpuCompute`` of the points just
    measured) prices: ours' engine (``ours.engine.StageEngine``) run as a pipeline of two stages of
    ``layers`` layers each, two local processes over gloo (as a P-2 run here: the ranks share the host),
    on a batch of two sequences (two batch slices) in K equal token slices, traced (``ours.trace``).
    Per unit and phase the least of ``reps`` steps of its span (forward: F, backward: B, on both stages;
    weight gradients: the step's wgrad spans over its units) less the slice's math (``slice_layer``),
    the first stage's embeddings and the last stage's head and loss; per phase, the residuals (a row per
    rank, stage size and slicing: its units' medians) fitted by non-negative least squares, relative to
    the math, to unit + layer x layers + scale x the slice's math (a unit's own cost, and what the
    engine's layers take beyond the isolated layer's in a two-rank run)."""
    import numpy as np
    import torch.multiprocessing as mp
    from scipy.optimize import nnls

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "engine.json")
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_engine_worker, args=(_free_port(), cfg, tuple(layers), tuple(slicings), reps, out),
                           nprocs=2, join=True, start_method=method)
        runs = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    from ours import uniform_slices

    S = cfg.seq_len
    points = []
    for rank, res in enumerate(runs):
        for run in res:
            L, slices = run["layers"], uniform_slices(S, run["k"])
            ctx = [sum(slices[:i]) for i in range(len(slices))]
            math_w = compute.head_wgrad(2 * S) if rank == 1 else 0.0
            for name, dur in run["spans"].items():
                kind, i = name[0], int(name.split(".")[-1])
                l, c = slices[i], ctx[i]
                f, bi, _ = compute.slice_layer(1, l, c, 1)
                embed = compute.embed(l) if rank == 0 else 0.0
                if kind == "F":
                    m, r = L * f, dur - L * f - embed / 3
                else:
                    head = compute.head_forward(l) + compute.head_backward_input(l) if rank == 1 else 0.0
                    m, r = L * bi, dur - L * bi - head - embed * 2 / 3
                points.append(dict(rank=rank, layers=L, k=run["k"], l=l, c=c, phase=kind, math=m, residual=r))
            math_w += 2 * sum(L * compute.slice_layer(1, l, 0, 1)[2] for l in slices)
            points.append(dict(rank=rank, layers=L, k=run["k"], phase="W", math=math_w / run["units"],
                               residual=(run["wgrad"] - math_w) / run["units"]))
    fit: dict = {"layers": list(layers), "slicings": list(slicings), "points": points}
    for phase, kind in zip(ENGINE_PHASES, "FBW"):
        # a row per rank, stage size and slicing: the medians of its units (a unit slowed by the host's
        # other work does not pull the fit), divided by its math (a thin slice's row, where a unit's own
        # cost shows, weighs as much as a wide one's)
        groups: dict[tuple, list] = {}
        for p in points:
            if p["phase"] == kind and p["math"] > 0:
                groups.setdefault((p["rank"], p["layers"], p["k"]), []).append(p)
        rows = [(key[1], statistics.median(p["math"] for p in g), statistics.median(p["residual"] for p in g))
                for key, g in groups.items()]
        A = np.array([[1.0 / m, L / m, 1.0] for L, m, _ in rows])
        y = np.array([r / m for _, m, r in rows])
        if len({L for L, _, _ in rows}) < 2:
            A[:, 1] = 0.0
        (unit, layer, scale), _ = nnls(A, y)  # each part >= 0: a unit costs the engine time, never saves it
        fit[phase] = dict(unit=float(unit), layer=float(layer), scale=float(scale))
    return fit


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

    def sample(self, b: int, l: int, c: int) -> tuple[float, ...]:
        """(forward, backward with weight gradients, forward, backward without) of two passes."""
        return (*self.once(b, l, c, True), *self.once(b, l, c, False))

    @staticmethod
    def summary(b: int, l: int, c: int, samples: list[tuple[float, ...]]) -> dict:
        fwd_t = min(min(s[0], s[2]) for s in samples)
        full_t, bin_t = min(s[1] for s in samples), min(s[3] for s in samples)
        return dict(b=b, l=l, c=c, fwd=fwd_t, bwd_full=full_t, bwd_in=min(bin_t, full_t),
                    wgrad=max(0.0, full_t - bin_t))


def measure_grids(timers: dict, grids: dict, rounds: int, bar=None) -> dict:
    """Every grid's points (``grids``: name -> (b, l, c) points, ``timers``: name -> its timer), round by
    round: each point once a round, the layer's and the slice's at the same (b, l, c) next to each other,
    the order reversed every other round, a first round untimed (allocations); each quantity the least
    over the rounds. A slow spell of a shared host then falls on one round of many points, not on every
    repetition of a few (which would bend the table, e.g. a context term from points slowed unlike
    their c = 0 neighbours)."""
    jobs = sorted((pt, name) for name, pts in grids.items() for pt in pts)
    samples: dict = {job: [] for job in jobs}
    for r in range(max(1, rounds) + 1):
        for pt, name in (jobs if r % 2 == 0 else jobs[::-1]):
            s = timers[name].sample(*pt)
            if r:
                samples[pt, name].append(s)
            if bar:
                bar.update()
    return {name: [timers[name].summary(*pt, samples[pt, name]) for pt in pts] for name, pts in grids.items()}


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
            progress: bool = True, engine: bool = True) -> dict:
    """This machine's profile at ``cfg``'s shape (the module docstring); ``p2p`` / ``engine``: also the
    gloo ping-pong and ours' engine's own cost per unit (two local processes each)."""
    from workload.compute import CpuCompute

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        timer, slicer = LayerTimer(cfg), SliceTimer(cfg)
        pts, spts = grid(cfg.seq_len, batch_slices), slice_grid(cfg.seq_len, batch_slices)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=(max(1, reps) + 1) * (len(pts) + len(spts)) + 3, desc=f"profile {cfg.name}", unit="pt")
        measured = measure_grids({"layer": timer, "slice": slicer}, {"layer": pts, "slice": spts}, reps, bar)
        layer, sliced = measured["layer"], measured["slice"]
        head = head_rates(cfg, reps)
        rates = overhead_rates(cfg, torch.device("cpu"), reps)
        if bar:
            bar.update()
        math = CpuCompute(dict(layer=layer, slice=sliced, head=head, embed_per_token=rates["embed_per_token"],
                               model=dict(vocab_size=cfg.vocab_size)))
        engine_fit = engine_costs(cfg, math, reps=reps) if engine else None
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
        layer=layer, slice=sliced, engine=engine_fit, head=head, embed_per_token=rates["embed_per_token"],
        optimizer_per_param=rates["optimizer_per_param"], p2p=p2p_points, p2p_fit=fit_p2p(p2p_points),
        seconds=time.perf_counter() - started)
