"""``--n-slices auto``: the optimal token slicing of a run, from a cached fitted latency model.

Where the fitted model comes from, first found wins:
1. the file named by ``$OURS_PLAN_MODEL``;
2. ``<plan dir>/<key>.json`` (written by ``python -m ours.plan fit``), the plan dir being
   ``$OURS_PLAN_DIR`` or ``results/plan`` under the repository;
3. ``<plan dir>/<key>-quick.json`` (an earlier quick fit);
4. a quick profile + fit now (a few seconds, coarse grid, no communication term), saved as 3 so
   that later runs on the same shape and device reuse it.
The key names the device kind and the layer shape (hidden, heads, sequence, vocabulary).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ours.plan.latency import LatencyModel, fit
from ours.plan.planner import plan
from workload.configs import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def plan_dir() -> Path:
    return Path(os.environ.get("OURS_PLAN_DIR") or REPO / "results" / "plan")


def cache_key(model: ModelConfig, device) -> str:
    kind = str(device).split(":")[0]  # a torch.device or "cpu" / "cuda"
    return f"{kind}-h{model.n_embd}-a{model.n_head}-s{model.seq_len}-v{model.vocab_size}"


def cached_model_path(model: ModelConfig, device) -> Path | None:
    explicit = os.environ.get("OURS_PLAN_MODEL")
    if explicit:
        return Path(explicit)
    d, key = plan_dir(), cache_key(model, device)
    for name in (f"{key}.json", f"{key}-quick.json"):
        if (d / name).exists():
            return d / name
    return None


def default_granularity(seq_len: int) -> int:
    """8 tokens, coarser for sequences beyond 2048 tokens (at most 256 positions)."""
    return max(8, -(-seq_len // 256))


def quick_model(model: ModelConfig, device, batch_slices: tuple[int, ...] = (1,)) -> LatencyModel:
    from ours.plan.profile import ProfileGrid, profile

    grid = ProfileGrid.quick(batch_slices=batch_slices, seq_len=model.seq_len)
    grid = ProfileGrid(**{**grid.__dict__, "p2p": False})
    import torch

    with torch.random.fork_rng(devices=[]):  # leave the caller's random state untouched
        prof = profile(model, grid, device, progress=False)
    return fit(prof)


def load_or_fit(model: ModelConfig, device, batch_slices: tuple[int, ...] = (1,),
                save: bool = True) -> LatencyModel:
    path = cached_model_path(model, device)
    if path is not None:
        return LatencyModel.load(path)
    print(f"[ours.plan] no fitted latency model for {cache_key(model, device)}: quick profile", file=sys.stderr,
          flush=True)
    lm = quick_model(model, device, batch_slices)
    if save:
        try:
            lm.save(plan_dir() / f"{cache_key(model, device)}-quick.json")
        except OSError as exc:
            print(f"[ours.plan] could not cache the quick fit: {exc}", file=sys.stderr)
    return lm


def auto_slicing(config, device) -> tuple[int, ...]:
    """The optimal token slicing (lengths summing to the sequence length) for ``config``: K =
    config.pp stages, batch slice = config.micro_batch_size. Deterministic given the fitted model."""
    m = config.model
    b = config.micro_batch_size
    lm = load_or_fit(m, device, batch_slices=(b,))
    p = plan(lm, n_layer=m.n_layer, n_stages=config.pp, batch_size=config.batch_size, seq_len=m.seq_len,
             granularity=default_granularity(m.seq_len), batch_slices=[b])
    assert sum(p.slices) == m.seq_len
    return tuple(int(x) for x in p.slices)
