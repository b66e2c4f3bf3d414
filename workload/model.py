"""A plain decoder (nanoGPT-style), in two families (``workload.configs``):

- ``gpt``: token + learned position embeddings, pre-LayerNorm blocks of causal multi-head attention
  and a 4h GELU MLP, a final LayerNorm and an untied LM head;
- ``llama``: token embeddings, pre-RMSNorm blocks of causal grouped-query attention with rotary
  positions and a SwiGLU MLP, no biases, a final RMSNorm and an untied LM head.

Both have the same module names (``wte``, ``blocks.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2,
mlp.c_fc, mlp.c_proj}``, ``ln_f``, ``lm_head``; gpt's ``wpe``), and every system runs the same block
math (``block_forward``). The fused projections' rows:

- ``attn.c_attn``: ``[q; k; v]``: q of the ``n_head`` query heads (``n_head x head_dim`` rows, head by
  head), then k and v of the ``n_kv_head`` key/value heads (``n_kv_head x head_dim`` rows each); query
  head ``j`` attends with key/value head ``j // (n_head / n_kv_head)`` (``qkv_rows``);
- ``mlp.c_fc`` (llama): ``[gate; up]``, ``ffn_dim`` rows each; the MLP is ``c_proj(silu(gate) * up)``.

Rotary positions (llama) rotate each query and key head of the fused qkv by its token's position in
the sequence (``rotary``): a token slice [c, c + l) of a sequence is rotated at ``offset=c``, so a slice
computed after the keys of the tokens before it (cached, already rotated at their own positions)
gives exactly the whole sequence's outputs for its tokens.

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

from workload.configs import ModelConfig, count_params, qkv_rows  # noqa: F401 (without torch, in configs)


Attention = Callable[[torch.Tensor], torch.Tensor]  # fused qkv (B, T, W) -> attention output (B, T, C)
Linear = Callable[[str, nn.Linear, torch.Tensor], torch.Tensor]  # (name in the block, module, input) -> output


def split_heads(qkv: torch.Tensor, n_head: int, kv_heads: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused qkv (B, T, (H + 2 KV) D) -> q (B, H, T, D), k and v (B, KV, T, D); KV None: H."""
    kv_heads = kv_heads or n_head
    B, T, W = qkv.shape
    D = W // (n_head + 2 * kv_heads)
    q, k, v = qkv.split([n_head * D, kv_heads * D, kv_heads * D], dim=2)
    return (q.view(B, T, n_head, D).transpose(1, 2), k.view(B, T, kv_heads, D).transpose(1, 2),
            v.view(B, T, kv_heads, D).transpose(1, 2))


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def causal_attention(qkv: torch.Tensor, n_head: int, kv_heads: int | None = None) -> torch.Tensor:
    """Causal self-attention of a whole sequence: fused qkv (B, T, W) -> (B, T, C); grouped-query
    where ``kv_heads`` < ``n_head``."""
    q, k, v = split_heads(qkv, n_head, kv_heads)
    gqa = k.shape[1] != n_head
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))


def rotary_angles(offset: int, length: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """(length, head_dim) angles of positions [offset, offset + length): position x theta^(-2i/D) for
    i < D/2, repeated for the second half (the halves rotate together: ``rotary``). In fp32, as
    megatron-core's RotaryEmbedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    pos = torch.arange(length, dtype=torch.float32, device=device) + offset
    freqs = torch.outer(pos, inv_freq)
    return torch.cat((freqs, freqs), dim=-1)


def rotary(qkv: torch.Tensor, head_dim: int, group: int, theta: float, offset: int = 0) -> torch.Tensor:
    """The fused qkv (B, T, W) with its query and key heads rotated by their tokens' positions
    [offset, offset + T) (RoPE, the halves convention: x -> x cos + (-x2, x1) sin); values as they are.
    ``group``: query heads per key/value head, from which the heads the qkv holds follow (all of them,
    or a tensor-parallel rank's share): W / head_dim heads, of which 1 / (group + 2) are values."""
    B, T, W = qkv.shape
    heads = W // head_dim
    n_v = heads // (group + 2)
    x = qkv.reshape(B, T, heads, head_dim)
    qk, v = x[:, :, : heads - n_v], x[:, :, heads - n_v :]
    angles = rotary_angles(offset, T, head_dim, theta, qkv.device)[:, None, :]  # (T, 1, D)
    cos, sin = angles.cos().to(qkv.dtype), angles.sin().to(qkv.dtype)
    x1, x2 = qk.chunk(2, dim=-1)
    qk = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((qk, v), dim=2).view(B, T, W)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[gate; up] (.., 2F) -> silu(gate) * up (.., F)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _apply(name: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def block_forward(block: "Block", x: torch.Tensor, attention: Attention | None = None,
                  linear: Linear = _apply, offset: int = 0) -> torch.Tensor:
    """The transformer block's math, written once: x + c_proj(attention(c_attn(ln_1(x)))), then
    x + c_proj(act(c_fc(ln_2(x)))), act GELU (gpt) or SwiGLU (llama); llama's query and key heads
    rotated (``rotary``) at the positions [offset, offset + T) of the tokens x holds before attention
    sees them. Every system runs it: the model's ``Block``, ours' engine (its token-sliced attention
    plugged in as ``attention``, over the qkv of the slice and the cached keys and values of the
    slices before it, its deferred-gradient linears as ``linear``, called with the linear's name in
    the block: "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"; a slice at ``offset``) and
    the planner's layer profile (attention over cached keys and values)."""
    attn, mlp = block.attn, block.mlp
    if attention is None:
        attention = partial(causal_attention, n_head=attn.n_head, kv_heads=attn.kv_heads)
    qkv = linear("attn.c_attn", attn.c_attn, block.ln_1(x))
    if attn.rope_theta is not None:
        qkv = rotary(qkv, attn.head_dim, attn.n_head // attn.kv_heads, attn.rope_theta, offset)
    x = x + linear("attn.c_proj", attn.c_proj, attention(qkv))
    h = linear("mlp.c_fc", mlp.c_fc, block.ln_2(x))
    h = swiglu(h) if mlp.gated else F.gelu(h)
    return x + linear("mlp.c_proj", mlp.c_proj, h)


def norm(cfg: ModelConfig) -> nn.Module:
    """The family's normalisation: RMSNorm (llama) or LayerNorm (gpt)."""
    return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps) if cfg.llama else nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)


class CausalSelfAttention(nn.Module):
    """The attention's parameters: the fused q, k, v projection (rows q, k, v: ``qkv_rows``) and the
    output projection; llama's rotary base (None: gpt, no rotation)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.rope_theta = cfg.rope_theta if cfg.llama else None
        self.c_attn = nn.Linear(cfg.n_embd, sum(qkv_rows(cfg)), bias=not cfg.llama)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=not cfg.llama)


class MLP(nn.Module):
    """GELU's c_fc and c_proj (gpt), or SwiGLU's (llama): c_fc the gate and up projections fused
    (rows [gate; up]), c_proj the down projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.llama
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_dim * (2 if self.gated else 1), bias=not cfg.llama)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.n_embd, bias=not cfg.llama)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self, x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe: nn.Embedding | None = None if cfg.llama else nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.Module | None = norm(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:
        """Token ids (B, T) at positions [pos_offset, pos_offset + T) -> (B, T, C): the token embeddings,
        plus gpt's learned positions (llama's positions are rotations inside attention)."""
        if self.wpe is None:
            return self.wte(idx)
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


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """In-place initialisers (``normal_``, ``uniform_``, ``fill_``, ...) on meta tensors skipped: a meta
    tensor holds no values, and there they run through torch's Python references, whose first call
    imports ``torch._dynamo`` (seconds of every process that builds a model). Everything else passes."""
    INIT = frozenset({"normal_", "uniform_", "zero_", "fill_", "erfinv_", "mul_", "add_", "clamp_",
                      "copy_", "bernoulli_", "exponential_", "random_", "trunc_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.INIT:  # torch.nn.init's take ``tensor=``; Tensor's methods self
            t = args[0] if args else kwargs.get("tensor")
            if getattr(t, "is_meta", False):
                return t
        return func(*args, **kwargs)


def meta_gpt(cfg: ModelConfig) -> GPT:
    """The model's modules on the meta device (shapes and names, no storage, no initialisation): what a
    stage, an evaluation or a names-only walk starts from, then ``to_empty`` and ``init_weights``."""
    with torch.device("meta"), _NoInitOnMeta():
        return GPT(cfg)


def build_gpt(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The full model, initialised from ``seed``, on ``device``."""
    model = meta_gpt(cfg)
    model.to_empty(device=device)
    init_weights(model, cfg, seed)
    return model
