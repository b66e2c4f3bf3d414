"""The single-process reference of ``--verify``, kept by what it depends on.

Every verified run trains the reference beside it: the same model, seed, data, global batch and steps
on one process. Many runs share one reference (a system's layouts, every system of a sweep), and its
result (each step's loss, each parameter's gradient) is a function of the reference's config and of
the code that computes it, nothing else. So a reference that ran is kept under a key of both:

- the reference's config (``RunConfig.identity()``: the volatile fields left out) and the device it
  runs on (a CUDA device's name too: another GPU sums in another order);
- the torch version, and a hash of every source file the reference's training goes through
  (``workload/``, ``contract/``, ``baselines/reference/``, ``runners/worker.py``): a change to any of
  them is another key, never a stale result.

Where: ``$PIPEBENCH_CACHE`` (default ``$XDG_CACHE_HOME/pipebench``, else ``~/.cache/pipebench``),
``references/<key>.pt``; ``PIPEBENCH_REFERENCE_CACHE=0`` turns it off. A file that cannot be read is
ignored (and replaced by the next run); files are written whole (a temporary file renamed), so
concurrent runs never read half a file. Only an ``ok`` reference is kept.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from contract import RunConfig
from workload.cache import cache_dir

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("workload", "contract", "baselines/reference", "runners/worker.py")


def enabled() -> bool:
    return os.environ.get("PIPEBENCH_REFERENCE_CACHE", "1") not in ("0", "off", "no", "false")


def source_digest(root: Path = REPO, sources: tuple[str, ...] = SOURCES) -> str:
    """sha256 over the path and content of every .py file under ``sources`` (sorted)."""
    h = hashlib.sha256()
    for name in sources:
        p = root / name
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def device_identity(cfg: RunConfig) -> str:
    """What the reference runs on: the run's resolved hardware (RunConfig.hardware), else this
    machine's default device kind."""
    if cfg.hardware:
        return cfg.hardware
    return "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"


def key(ref: RunConfig, root: Path = REPO) -> str:
    parts = dict(config=ref.identity(), device=device_identity(ref), torch=torch.__version__,
                 sources=source_digest(root))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def entry(ref: RunConfig) -> Path | None:
    """The file that keeps ``ref``'s result (present or not), or None when the cache is off."""
    return cache_dir() / "references" / f"{key(ref)}.pt" if enabled() else None


def load(path: Path | None) -> tuple[list[dict], dict[str, torch.Tensor]] | None:
    """(ranks, grads) kept at ``path`` (an ``entry``), or None."""
    if path is None:
        return None
    try:
        kept = torch.load(path, weights_only=True)
        return kept["ranks"], kept["grads"]
    except Exception:  # missing, half-written by a crashed run, another format: a miss
        return None


def store(path: Path | None, ranks: list[dict], grads: dict[str, torch.Tensor]) -> None:
    """Keep an ok reference's result at ``path`` (an ``entry``); a cache that cannot be written is no
    error (the next run trains the reference again)."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(ranks=ranks, grads=grads), tmp)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
