"""The shared GPT <-> megatron-core weight conversion (names, fused-QKV layout, TP shards)."""
from __future__ import annotations

import torch

from baselines.megatron import convert as conv
from workload.configs import get_model_config
from workload.model import build_gpt

CFG = get_model_config("tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=16, vocab_size=128)


def shared_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_gpt(CFG, seed=3).state_dict().items()}


def test_round_trip_is_exact():
    sd = shared_state()
    meg = conv.shared_to_megatron(sd, CFG.n_head)
    assert "embedding.word_embeddings.weight" in meg and "output_layer.weight" in meg
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in meg
    back = conv.megatron_to_shared(meg, CFG.n_head)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_qkv_is_per_head_interleaved():
    sd = shared_state()
    h, H = CFG.n_embd, CFG.n_head
    d = h // H
    w = sd["blocks.0.attn.c_attn.weight"]
    b = sd["blocks.0.attn.c_attn.bias"] + torch.arange(3 * h, dtype=torch.float32)  # distinguishable rows
    sd["blocks.0.attn.c_attn.bias"] = b
    meg = conv.shared_to_megatron(sd, H)
    mw = meg["decoder.layers.0.self_attention.linear_qkv.weight"].view(H, 3, d, h)
    mb = meg["decoder.layers.0.self_attention.linear_qkv.bias"].view(H, 3, d)
    q, k, v = w.split(h)
    for head in range(H):
        rows = slice(head * d, (head + 1) * d)
        for j, part in enumerate((q, k, v)):
            assert torch.equal(mw[head, j], part[rows])
        assert torch.equal(mb[head, 1], b[h:2 * h][rows])


def test_tp_shards_round_trip_and_split_whole_heads():
    meg = conv.shared_to_megatron(shared_state(), CFG.n_head)
    tp = 2
    for name, t in meg.items():
        shards = [conv.shard(name, t, tp, r) for r in range(tp)]
        assert torch.equal(conv.unshard(name, shards), t), name
        dim = conv.tp_dim(name)
        if dim is not None:
            assert shards[0].shape[dim] * tp == t.shape[dim]
    assert conv.tp_dim("decoder.layers.0.self_attention.linear_proj.weight") == 1
    assert conv.tp_dim("decoder.layers.0.self_attention.linear_proj.bias") is None
    assert conv.tp_dim("embedding.position_embeddings.weight") is None
    # rank 0's QKV shard holds heads 0..H/tp-1 complete (q, k and v of each)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, H = CFG.n_embd // CFG.n_head, CFG.n_head
    assert torch.equal(conv.shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, tp, 0),
                       qkv.view(H, 3 * d, -1)[: H // tp].reshape(-1, qkv.shape[1]))


def test_chunk_local_names():
    assert conv.chunk_name("decoder.layers.5.mlp.linear_fc1.weight", 4) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert conv.global_name("decoder.layers.1.mlp.linear_fc1.weight", 4) == "decoder.layers.5.mlp.linear_fc1.weight"
    assert conv.global_name("output_layer.weight", 4) == "output_layer.weight"
