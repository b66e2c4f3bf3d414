"""The shared model's weights in megatron-core's layout, and back.

Two steps, each invertible:

1. Names and layout, full tensors (``shared_to_megatron`` / ``megatron_to_shared``):

   | shared (workload.model)               | megatron GPTModel (local layer spec)                     |
   | ------------------------------------- | -------------------------------------------------------- |
   | wte.weight                            | embedding.word_embeddings.weight                          |
   | wpe.weight                            | embedding.position_embeddings.weight                      |
   | blocks.i.ln_1.{weight,bias}           | decoder.layers.i.input_layernorm.{weight,bias}            |
   | blocks.i.attn.c_attn.{weight,bias}    | decoder.layers.i.self_attention.linear_qkv.{weight,bias}  |
   | blocks.i.attn.c_proj.{weight,bias}    | decoder.layers.i.self_attention.linear_proj.{weight,bias} |
   | blocks.i.ln_2.{weight,bias}           | decoder.layers.i.pre_mlp_layernorm.{weight,bias}          |
   | blocks.i.mlp.c_fc.{weight,bias}       | decoder.layers.i.mlp.linear_fc1.{weight,bias}             |
   | blocks.i.mlp.c_proj.{weight,bias}     | decoder.layers.i.mlp.linear_fc2.{weight,bias}             |
   | ln_f.{weight,bias}                    | decoder.final_layernorm.{weight,bias}                     |
   | lm_head.weight                        | output_layer.weight                                       |

   ``i`` is the global layer index (megatron's ``layer_number - 1``); the llama family has the
   same names, without biases and position embeddings (its norms are RMSNorms, weight only). The
   fused QKV differs in layout: the shared ``c_attn`` rows are ``[q; k; v]`` (q of the H query
   heads, then k and v of the G key/value heads: ``workload.configs.qkv_rows``); megatron's
   ``linear_qkv`` rows are per query group ``[q of its H/G heads; k_g; v_g]``, i.e. ``(G, H/G + 2,
   head_dim)``. With G = H (gpt: one query group per head) that is ``(heads, 3, head_dim)``, the
   shared ``(3, heads, head_dim)`` with its two axes transposed. The conversion regroups the rows
   (weight and bias). The llama family's ``c_fc`` rows are ``[gate; up]``, megatron's gated
   ``linear_fc1`` the same (its MLP applies ``silu`` to the first half of the output).

2. Tensor-parallel shards (``shard`` / ``unshard``): column-parallel weights (``linear_qkv``,
   ``linear_fc1``, their biases, ``word_embeddings``, ``output_layer``) split along dim 0,
   row-parallel weights (``linear_proj.weight``, ``linear_fc2.weight``) along dim 1; everything
   else (norms, row-parallel biases, position embeddings) is replicated on every TP rank.
   Because ``linear_qkv`` is grouped by query group, a contiguous dim-0 split gives each rank
   whole groups (T dividing G), as megatron's ColumnParallelLinear expects. A gated
   ``linear_fc1`` is split as two blocks: rank t holds ``[gate_t; up_t]`` (megatron's MLP chunks
   its own output shard in two).

Within a model chunk (pipeline stage, or virtual stage) megatron numbers layers locally
(``decoder.layers.<local>``); ``chunk_name`` / ``global_name`` translate with the chunk's
first global layer. Which layers a chunk holds: equal splits, or ``--layers-per-stage``'s counts as
megatron-core's ``pipeline_model_parallel_layout`` (``layer_layout``).
"""
from __future__ import annotations

import re

import torch

_LAYER_MAP = {
    "ln_1": "input_layernorm",
    "attn.c_attn": "self_attention.linear_qkv",
    "attn.c_proj": "self_attention.linear_proj",
    "ln_2": "pre_mlp_layernorm",
    "mlp.c_fc": "mlp.linear_fc1",
    "mlp.c_proj": "mlp.linear_fc2",
}
_LAYER_MAP_BACK = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP = {
    "wte.weight": "embedding.word_embeddings.weight",
    "wpe.weight": "embedding.position_embeddings.weight",
    "ln_f.weight": "decoder.final_layernorm.weight",
    "ln_f.bias": "decoder.final_layernorm.bias",
    "lm_head.weight": "output_layer.weight",
}
_TOP_MAP_BACK = {v: k for k, v in _TOP_MAP.items()}

_SHARED_LAYER = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)$")
_MEGATRON_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")

# dim along which a parameter is split across tensor-parallel ranks (absent: replicated)
_TP_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc2.weight": 1,
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
}


def _rename(name: str, top: dict, layer: re.Pattern, parts: dict, blocks: str, what: str) -> str:
    """``name`` in the other model's words: a top-level name by ``top``, a layer's by ``parts``."""
    if name in top:
        return top[name]
    m = layer.match(name)
    if not m or m.group(2) not in parts:
        raise KeyError(f"no {what} name for {name!r}")
    return f"{blocks}.{m.group(1)}.{parts[m.group(2)]}.{m.group(3)}"


def megatron_name(shared: str) -> str:
    return _rename(shared, _TOP_MAP, _SHARED_LAYER, _LAYER_MAP, "decoder.layers", "megatron")


def shared_name(megatron: str) -> str:
    return _rename(megatron, _TOP_MAP_BACK, _MEGATRON_LAYER, _LAYER_MAP_BACK, "blocks", "shared")


def _is_qkv(name: str) -> bool:
    return ".c_attn." in name or ".linear_qkv." in name


def _qkv_to_megatron(t: torch.Tensor, n_head: int, kv_heads: int) -> torch.Tensor:
    """rows [q (H heads); k (G heads); v (G heads)] -> per query group [q of its H/G heads; k_g; v_g]."""
    d = t.shape[0] // (n_head + 2 * kv_heads)
    q, k, v = t.split([n_head * d, kv_heads * d, kv_heads * d])
    groups = [x.reshape(kv_heads, -1, *t.shape[1:]) for x in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(t.shape).contiguous()


def _qkv_to_shared(t: torch.Tensor, n_head: int, kv_heads: int) -> torch.Tensor:
    d = t.shape[0] // (n_head + 2 * kv_heads)
    grouped = t.reshape(kv_heads, -1, *t.shape[1:])
    q, k, v = grouped.split([n_head // kv_heads * d, d, d], dim=1)
    return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)]).contiguous()


def shared_to_megatron(sd: dict[str, torch.Tensor], n_head: int, kv_heads: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """Shared state dict (full tensors) -> megatron names and layout (full tensors, global layers);
    ``kv_heads`` None: one per query head."""
    g = kv_heads or n_head
    return {megatron_name(k): _qkv_to_megatron(v, n_head, g) if _is_qkv(k) else v for k, v in sd.items()}


def megatron_to_shared(sd: dict[str, torch.Tensor], n_head: int, kv_heads: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """The inverse of shared_to_megatron (works for gradients as for weights)."""
    g = kv_heads or n_head
    return {shared_name(k): _qkv_to_shared(v, n_head, g) if _is_qkv(k) else v for k, v in sd.items()}


def tp_dim(megatron: str) -> int | None:
    """The dimension a megatron parameter is split along by tensor parallelism, None if replicated."""
    for suffix, dim in _TP_DIM.items():
        if megatron.endswith(suffix):
            return dim
    return None


def _blocks(megatron: str, gated: bool) -> int:
    """The blocks a parameter's rows hold that tensor parallelism splits each: a gated linear_fc1's
    two ([gate; up]), one otherwise."""
    return 2 if gated and ".linear_fc1." in megatron else 1


def shard(megatron: str, t: torch.Tensor, tp: int, rank: int, gated: bool = False) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``t``; ``gated``: the MLP's linear_fc1 holds [gate; up], each split."""
    dim = tp_dim(megatron)
    if dim is None or tp == 1:
        return t
    parts = t.chunk(_blocks(megatron, gated), dim=dim)
    if any(p.shape[dim] % tp for p in parts):
        raise ValueError(f"{megatron}: size {t.shape[dim]} along dim {dim} does not divide by tp {tp}")
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim).contiguous()


def unshard(megatron: str, shards: list[torch.Tensor], gated: bool = False) -> torch.Tensor:
    """The full tensor from every TP rank's shard (the inverse of ``shard``)."""
    dim = tp_dim(megatron)
    if dim is None or len(shards) == 1:
        return shards[0]
    n = _blocks(megatron, gated)
    pieces = [s.chunk(n, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim=dim) for j in range(n)], dim=dim)


def chunk_name(megatron: str, first_layer: int) -> str:
    """Global megatron name -> the name inside a chunk whose first layer is global first_layer."""
    m = _MEGATRON_LAYER.match(megatron)
    if not m:
        return megatron
    return f"decoder.layers.{int(m.group(1)) - first_layer}.{m.group(2)}.{m.group(3)}"


def global_name(local: str, first_layer: int) -> str:
    m = _MEGATRON_LAYER.match(local)
    if not m:
        return local
    return f"decoder.layers.{int(m.group(1)) + first_layer}.{m.group(2)}.{m.group(3)}"


def layer_layout(counts: tuple[int, ...]) -> list[list[str]]:
    """megatron-core's ``pipeline_model_parallel_layout`` of these layer counts per stage (model chunk),
    in model order: the embedding before the first stage's layers, the loss after the last's."""
    layout = [["decoder"] * n for n in counts]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout
