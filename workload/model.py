"""A plain GPT decoder (nanoGPT-style): token + learned position embeddings, pre-LayerNorm blocks
of causal multi-head attention and a 4h GELU MLP, a final LayerNorm and an untied LM head.

The model does not know how it is split. A pipeline stage is this same module with the parts it
does not own removed (``wte``/``wpe``/``ln_f``/``lm_head`` set to None, entries of ``blocks``
deleted); ``forward`` skips what is missing, so parameter names stay those of the full model
(``blocks.<i>`` keeps the global layer index). See ``workload.partition``.

Initialisation is deterministic per parameter name (``init_weights``): a stage initialises only
the parameters it holds and still gets exactly the weights of the full model.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from workload.configs import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # rows: q, k, v (each n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v each (B, H, T, C/H)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        B, H, T, D = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(x)
        return self.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.n_embd)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:
        pos = torch.arange(pos_offset, pos_offset + idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); on a stage, whatever part of that it holds."""
        if self.wte is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.head(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch (targets are already shifted)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def init_std(name: str, cfg: ModelConfig) -> float | None:
    """The initial std of a weight by name; None for parameters initialised to constants."""
    if name.endswith(".bias"):
        return None
    if ".ln_" in name or name.startswith("ln_"):
        return None
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2's scaled residual projections
    return 0.02


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Deterministic, layout-independent initialisation: each parameter from its own name's seed."""
    for name, p in model.named_parameters():
        std = init_std(name, cfg)
        if std is None:
            value = torch.ones(p.shape) if name.endswith(".weight") else torch.zeros(p.shape)
        else:
            g = torch.Generator().manual_seed(param_seed(seed, name))
            value = torch.empty(p.shape).normal_(0.0, std, generator=g)
        p.copy_(value.to(device=p.device, dtype=p.dtype))


def build_gpt(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The full model, initialised from ``seed``, on ``device``."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    init_weights(model, cfg, seed)
    return model


def count_params(cfg: ModelConfig, include_embeddings: bool = False) -> int:
    h, L = cfg.n_embd, cfg.n_layer
    per_block = 12 * h * h + 13 * h  # qkv + proj + fc + proj weights, their biases, two LayerNorms
    n = L * per_block + 2 * h + cfg.vocab_size * h  # final LayerNorm and LM head
    if include_embeddings:
        n += cfg.vocab_size * h + cfg.seq_len * h
    return n
