"""Deterministic token batches: identical for every system and layout.

Step ``k`` of a run always sees the same global batch (a function of the seed and k only); data
parallel replica ``d`` of ``D`` takes rows ``[d·B, (d+1)·B)`` of it, where B is the batch per replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


def synthetic_tokens(seed: int, step: int, rows: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """(rows, seq_len + 1) token ids: each row repeats a random pattern of random period (4..64),
    so that a model can learn something (an induction task) and the loss falls."""
    g = torch.Generator().manual_seed(seed * 7919 + step + 1)
    base = torch.randint(0, vocab_size, (rows, 64), generator=g)
    periods = torch.randint(4, 65, (rows, 1), generator=g)
    idx = torch.arange(seq_len + 1).unsqueeze(0) % periods
    return base.gather(1, idx)


@dataclass(frozen=True)
class TokenSource:
    """Where the batches come from: synthetic (``text_path`` None) or a user's text file, byte-level:
    token id = byte value (needs vocab_size >= 256)."""

    seq_len: int
    vocab_size: int
    seed: int = 0
    text_path: str | None = None

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        if self.text_path is None:
            return synthetic_tokens(self.seed, step, rows, self.seq_len, self.vocab_size)
        tokens = _map_text(self.text_path)
        if len(tokens) < self.seq_len + 2:
            raise ValueError(f"{self.text_path}: {len(tokens)} bytes, need more than {self.seq_len + 1}")
        g = torch.Generator().manual_seed(self.seed * 7919 + step + 1)
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (rows,), generator=g)
        return torch.from_numpy(np.stack([tokens[s : s + self.seq_len + 1] for s in starts.tolist()])).long()

    def replica_batch(self, step: int, batch_size: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len), for data-parallel replica dp_rank."""
        rows = self.global_batch(step, batch_size * dp)[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@lru_cache(maxsize=2)
def _map_text(path: str) -> np.ndarray:
    """The file's byte tokens, memory-mapped (uint8, read-only): a rank holds only the pages its batches
    touch, and every rank on a host shares them through the page cache; only a batch's rows become
    int64."""
    return np.memmap(path, dtype=np.uint8, mode="r")
