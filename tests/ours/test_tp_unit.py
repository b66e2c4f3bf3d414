"""ours.tp without ranks: the rank layout and the shards of the shared model's linears."""
from __future__ import annotations

import pytest
import torch

from ours.dp import dp_links
from ours.engine import pipeline_links
from ours.tp import coords, rank_of, shard, shard_start, split_of, unshard
from workload.configs import ModelConfig
from workload.model import build_gpt


def test_rank_layout_round_trips_and_keeps_t1_order():
    pp, tp, dp = 3, 2, 2
    ranks = [rank_of(d, p, t, pp, tp) for d in range(dp) for p in range(pp) for t in range(tp)]
    assert ranks == list(range(pp * tp * dp))
    assert all(rank_of(*coords(r, pp, tp), pp, tp) == r for r in ranks)
    assert ([rank_of(d, p, 0, pp, 1) for d in range(dp) for p in range(pp)]
            == [d * pp + p for d in range(dp) for p in range(pp)])
    assert pipeline_links(2, 1, 2) == [(0, 2), (2, 0), (1, 3), (3, 1)]  # same tp_rank of adjacent stages
    assert sorted(dp_links(1, 2, 2)) == [(0, 2), (1, 3), (2, 0), (3, 1)]  # same (stage, tp_rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_are_the_heads_and_columns_megatron_splits(tp):
    cfg = ModelConfig("t", 1, 32, 4, 8, 16)
    model = build_gpt(cfg, seed=0)
    params = dict(model.named_parameters())
    for name, full in params.items():
        split = split_of(name, cfg)
        if split is None:
            assert not name.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight")), name
            continue
        shards = [shard(full, *split, tp, t) for t in range(tp)]
        assert torch.equal(unshard(shards, *split), full), name
    # c_attn's shard holds q, k and v of the rank's heads: its attention is that of those heads
    x = torch.randn(2, 8, 32)
    qkv = model.blocks["0"].attn.c_attn(x)
    w = shard(params["blocks.0.attn.c_attn.weight"], 0, (32, 32, 32), tp, 1)
    b = shard(params["blocks.0.attn.c_attn.bias"], 0, (32, 32, 32), tp, 1)
    D = 32 // tp
    part = torch.nn.functional.linear(x, w, b)
    for j in range(3):  # q, k, v
        assert torch.allclose(part[..., j * D:(j + 1) * D], qkv[..., j * 32 + D:j * 32 + 2 * D], atol=1e-6)
    assert split_of("blocks.0.attn.c_proj.bias", cfg) is None and split_of("blocks.0.mlp.c_fc.bias", cfg) == (0, (128,))


def test_llama_shards_split_q_k_v_by_their_own_heads_and_gate_and_up_by_halves():
    """Grouped-query attention: q (4 heads) and k, v (2 heads each) are split by T on their own, so a
    rank holds whole query heads with the key/value head they share; c_fc's gate and up each by T."""
    cfg = ModelConfig("t", 1, 32, 4, 8, 16, family="llama", kv_heads=2, ffn_hidden=24)
    model = build_gpt(cfg, seed=0)
    params = dict(model.named_parameters())
    tp, D = 2, 8
    assert split_of("blocks.0.attn.c_attn.weight", cfg) == (0, (32, 16, 16))
    assert split_of("blocks.0.mlp.c_fc.weight", cfg) == (0, (24, 24))
    for name, full in params.items():
        split = split_of(name, cfg)
        if split is not None:
            assert torch.equal(unshard([shard(full, *split, tp, t) for t in range(tp)], *split), full), name
    qkv = params["blocks.0.attn.c_attn.weight"]
    mine = shard(qkv, 0, (32, 16, 16), tp, 1)  # q heads 2, 3; k head 1; v head 1
    assert torch.equal(mine, torch.cat([qkv[2 * D:4 * D], qkv[32 + D:32 + 2 * D], qkv[48 + D:48 + 2 * D]]))
    fc = params["blocks.0.mlp.c_fc.weight"]
    assert torch.equal(shard(fc, 0, (24, 24), tp, 0), torch.cat([fc[:12], fc[24:36]]))


def test_uneven_vocabulary_shards_round_trip():
    full = torch.randn(11, 4)
    shards = [shard(full, 0, (11,), 3, t) for t in range(3)]
    assert [s.shape[0] for s in shards] == [4, 4, 3] and [shard_start(11, 3, t) for t in range(3)] == [0, 4, 8]
    assert torch.equal(unshard(shards, 0, (11,)), full)
    assert split_of("lm_head.weight", ModelConfig("t", 1, 4, 1, 8, 11)) == (0, (11,))
