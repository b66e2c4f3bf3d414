"""The shared GPT's weights in megatron-core's layout, and back.

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

   ``i`` is the global layer index (megatron's ``layer_number - 1``). The fused QKV differs in
   layout: the shared ``c_attn`` rows are ``[q; k; v]`` (each ``n_embd`` rows, heads inside), i.e.
   ``(3, heads, head_dim)``; megatron's ``linear_qkv`` rows are per head ``[q_h; k_h; v_h]``, i.e.
   ``(heads, 3, head_dim)`` (one query group per head: plain multi-head attention). The
   conversion transposes those two axes (weight and bias).

2. Tensor-parallel shards (``shard`` / ``unshard``): column-parallel weights (``linear_qkv``,
   ``linear_fc1``, their biases, ``word_embeddings``, ``output_layer``) split along dim 0,
   row-parallel weights (``linear_proj.weight``, ``linear_fc2.weight``) along dim 1; everything
   else (LayerNorms, row-parallel biases, position embeddings) is replicated on every TP rank.
   Because ``linear_qkv`` is per-head interleaved, a contiguous dim-0 split gives each rank whole
   heads, as megatron's ColumnParallelLinear expects.

Within a model chunk (pipeline stage, or virtual stage) megatron numbers layers locally
(``decoder.layers.<local>``); ``chunk_name`` / ``global_name`` translate with the chunk's
first global layer.
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


def _qkv_to_megatron(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """rows (3, heads, head_dim) -> (heads, 3, head_dim)."""
    rest = t.shape[1:]
    return t.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def _qkv_to_shared(t: torch.Tensor, n_head: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def shared_to_megatron(sd: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """Shared state dict (full tensors) -> megatron names and layout (full tensors, global layers)."""
    return {megatron_name(k): _qkv_to_megatron(v, n_head) if _is_qkv(k) else v for k, v in sd.items()}


def megatron_to_shared(sd: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """The inverse of shared_to_megatron (works for gradients as for weights)."""
    return {shared_name(k): _qkv_to_shared(v, n_head) if _is_qkv(k) else v for k, v in sd.items()}


def tp_dim(megatron: str) -> int | None:
    """The dimension a megatron parameter is split along by tensor parallelism, None if replicated."""
    for suffix, dim in _TP_DIM.items():
        if megatron.endswith(suffix):
            return dim
    return None


def shard(megatron: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    dim = tp_dim(megatron)
    if dim is None or tp == 1:
        return t
    if t.shape[dim] % tp:
        raise ValueError(f"{megatron}: size {t.shape[dim]} along dim {dim} does not divide by tp {tp}")
    return t.chunk(tp, dim=dim)[rank].contiguous()


def unshard(megatron: str, shards: list[torch.Tensor]) -> torch.Tensor:
    dim = tp_dim(megatron)
    if dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=dim)


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
