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


LLAMA = get_model_config("llama-tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=16, vocab_size=128)


def test_llama_qkv_is_grouped_by_query_group_and_round_trips():
    """megatron's linear_qkv per query group: [q of its n_head / kv_heads heads; k_g; v_g]."""
    sd = {k: v.detach().clone() for k, v in build_gpt(LLAMA, seed=3).state_dict().items()}
    H, G, d = LLAMA.n_head, LLAMA.n_kv_head, LLAMA.head_dim
    meg = conv.shared_to_megatron(sd, H, G)
    assert "embedding.position_embeddings.weight" not in meg and "decoder.final_layernorm.weight" in meg
    w = sd["blocks.0.attn.c_attn.weight"]
    q, k, v = w.split([H * d, G * d, G * d])
    mw = meg["decoder.layers.0.self_attention.linear_qkv.weight"].view(G, H // G + 2, d, -1)
    for g in range(G):
        for j in range(H // G):
            assert torch.equal(mw[g, j], q[(g * H // G + j) * d:(g * H // G + j + 1) * d])
        assert torch.equal(mw[g, H // G], k[g * d:(g + 1) * d]) and torch.equal(mw[g, H // G + 1], v[g * d:(g + 1) * d])
    back = conv.megatron_to_shared(meg, H, G)
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in sd)


def test_llama_tp_shards_whole_query_groups_and_gate_and_up_each():
    sd = {k: v.detach().clone() for k, v in build_gpt(LLAMA, seed=3).state_dict().items()}
    meg = conv.shared_to_megatron(sd, LLAMA.n_head, LLAMA.n_kv_head)
    tp = 2
    for name, t in meg.items():
        shards = [conv.shard(name, t, tp, r, gated=True) for r in range(tp)]
        assert torch.equal(conv.unshard(name, shards, gated=True), t), name
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = meg[fc1].chunk(2)
    for r in range(tp):  # rank r: [gate_r; up_r], the halves megatron's MLP chunks its output shard into
        expected = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        assert torch.equal(conv.shard(fc1, meg[fc1], tp, r, gated=True), expected)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(conv.shard(qkv, meg[qkv], tp, 1), meg[qkv].chunk(tp)[1])  # query group 1 whole
