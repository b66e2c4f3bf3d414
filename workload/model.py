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
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from workload.configs import ModelConfig, count_params  # noqa: F401 (count_params: without torch, in configs)


Attention = Callable[[torch.Tensor], torch.Tensor]  # fused qkv (B, T, 3C) -> attention output (B, T, C)
Linear = Callable[[str, nn.Linear, torch.Tensor], torch.Tensor]  # (name in the block, module, input) -> output


def split_heads(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused qkv (B, T, 3C) -> q, k, v each (B, H, T, C/H)."""
    B, T, C3 = qkv.shape
    return tuple(t.view(B, T, n_head, C3 // 3 // n_head).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2))


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def causal_attention(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Causal multi-head self-attention of a whole sequence: fused qkv (B, T, 3C) -> (B, T, C)."""
    q, k, v = split_heads(qkv, n_head)
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _apply(name: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def block_forward(block: "Block", x: torch.Tensor, attention: Attention | None = None,
                  linear: Linear = _apply) -> torch.Tensor:
    """The transformer block's math, written once: x + c_proj(attention(c_attn(ln_1(x)))), then
    x + c_proj(gelu(c_fc(ln_2(x)))). Every system runs it: the model's ``Block``, ours' engine (its
    token-sliced attention plugged in as ``attention``, its deferred-gradient linears as ``linear``,
    called with the linear's name in the block: "attn.c_attn", "attn.c_proj", "mlp.c_fc",
    "mlp.c_proj") and the planner's layer profile (attention over cached keys and values)."""
    attn, mlp = block.attn, block.mlp
    if attention is None:
        attention = partial(causal_attention, n_head=attn.n_head)
    y = attention(linear("attn.c_attn", attn.c_attn, block.ln_1(x)))
    x = x + linear("attn.c_proj", attn.c_proj, y)
    h = F.gelu(linear("mlp.c_fc", mlp.c_fc, block.ln_2(x)))
    return x + linear("mlp.c_proj", mlp.c_proj, h)


class CausalSelfAttention(nn.Module):
    """The attention's parameters: the fused q, k, v projection (rows q, k, v) and the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self, x)


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
