"""Deterministic token batches: identical for every system and layout.

Step ``k`` of a run always sees the same global batch (a function of the seed and k only); data
parallel replica ``d`` of ``D`` takes rows ``[d·B, (d+1)·B)`` of it, where B is the batch per replica.
Text (a file, or a built-in corpus of ``workload.corpus``, as ``workload.tokens`` tokenizes it) is
trained on from its training split only; ``heldout_batch`` is the eval's fixed batch from the
held-out split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workload.tokens import heldout_starts, read_tokens


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
    """Where the batches come from: synthetic (``text_path`` None), a user's text file, or a built-in
    corpus by name (``workload.corpus.BUILTIN``), in the tokens of ``tokenizer`` (``workload.tokens``:
    bytes, or a BPE of vocab_size tokens), held as uint8 or uint16 (memory-mapped), int64 only a
    batch's rows."""

    seq_len: int
    vocab_size: int
    seed: int = 0
    text_path: str | None = None
    tokenizer: str = "byte"

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        if self.text_path is None:
            return synthetic_tokens(self.seed, step, rows, self.seq_len, self.vocab_size)
        tokens = self._tokens("train")
        g = torch.Generator().manual_seed(self.seed * 7919 + step + 1)
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (rows,), generator=g)
        return self._windows(tokens, starts.tolist())

    def heldout_batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The eval's inputs and targets, each (rows, seq_len), the same for every step, seed and
        system of a data source: for text, ``rows`` windows of the held-out split at evenly spaced
        starts; for synthetic tokens, rows of a step no run trains on (2**40)."""
        if self.text_path is None:
            full = synthetic_tokens(0, HELDOUT_STEP, rows, self.seq_len, self.vocab_size)
        else:
            tokens = self._tokens("heldout")
            full = self._windows(tokens, heldout_starts(len(tokens), self.seq_len, rows))
        return full[:, :-1].contiguous(), full[:, 1:].contiguous()

    def _tokens(self, split: str) -> np.ndarray:
        tokens = getattr(read_tokens(self.text_path, self.tokenizer, self.vocab_size), split)
        if len(tokens) < self.seq_len + 2:
            raise ValueError(f"{self.text_path}: {split} split of {len(tokens)} tokens, need more than "
                             f"{self.seq_len + 1}")
        return tokens

    def _windows(self, tokens: np.ndarray, starts: list[int]) -> torch.Tensor:
        """(len(starts), seq_len + 1) int64 rows of ``tokens`` from ``starts``."""
        return torch.from_numpy(np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64))

    def replica_batch(self, step: int, batch_size: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len), for data-parallel replica dp_rank."""
        rows = self.global_batch(step, batch_size * dp)[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


HELDOUT_STEP = 1 << 40  # the synthetic eval batch's step: beyond any run's steps
