"""The llama family (``workload.configs``, ``workload.model``): its shapes and counts, its block's math
(rotary positions at a token slice's offset, grouped-query attention, SwiGLU), and what the compute
and memory models make of it; the gpt family's numbers as they were."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contract import ConfigError, RunConfig
from contract.registry import get_system
from workload.compute import GpuCompute, find_device, stage_params
from workload.configs import MODEL_CONFIGS, count_params, get_model_config
from workload.cpu_peak import model_ops
from workload.flops import flops_per_token
from workload.memory import layer_activations
from workload.model import Block, block_forward, build_gpt, causal_attention, merge_heads, rotary, split_heads
from workload.partition import build_stage, fragment_names, stage_specs

LLAMA = get_model_config("llama-tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=128)


def test_the_llama_shapes_and_their_parameter_counts():
    l8, l70 = MODEL_CONFIGS["llama3-8b"], MODEL_CONFIGS["llama3-70b"]
    assert (l8.n_layer, l8.n_embd, l8.n_head, l8.n_kv_head, l8.ffn_dim, l8.vocab_size, l8.seq_len, l8.rope_theta) == \
        (32, 4096, 32, 8, 14336, 128256, 8192, 500000.0)
    assert (l70.n_layer, l70.n_embd, l70.n_head, l70.n_kv_head, l70.ffn_dim) == (80, 8192, 64, 8, 28672)
    # Meta's model cards: 8.03 B and 70.6 B parameters
    assert round(count_params(l8, include_embeddings=True) / 1e9, 2) == 8.03
    assert round(count_params(l70, include_embeddings=True) / 1e9, 1) == 70.6
    small = MODEL_CONFIGS["llama-cpu-small"]
    assert (small.n_layer, small.n_embd, small.n_head, small.n_kv_head, small.seq_len) == (4, 512, 8, 2, 1024)
    assert small.ffn_dim == 1536 and MODEL_CONFIGS["llama-tiny"].ffn_dim == 512  # 2/3 of 4h, up to a multiple of 256
    assert MODEL_CONFIGS["gpt3-xl"].ffn_dim == 4 * 2048 and MODEL_CONFIGS["gpt3-xl"].n_kv_head == 16


def test_the_model_has_what_the_counts_say_and_no_biases():
    model = build_gpt(LLAMA, seed=0)
    names = dict(model.named_parameters())
    assert not [n for n in names if n.endswith(".bias")] and "wpe.weight" not in names
    assert isinstance(model.blocks["0"].ln_1, torch.nn.RMSNorm) and isinstance(model.ln_f, torch.nn.RMSNorm)
    assert names["blocks.0.attn.c_attn.weight"].shape == ((4 + 2 * 2) * 16, 64)  # q of 4 heads, k and v of 2
    assert names["blocks.0.mlp.c_fc.weight"].shape == (2 * 256, 64) and LLAMA.ffn_dim == 256  # [gate; up]
    assert sum(p.numel() for n, p in names.items() if not n.startswith("wte")) == count_params(LLAMA)
    assert sum(p.numel() for p in names.values()) == count_params(LLAMA, include_embeddings=True)
    assert flops_per_token(LLAMA) == 6 * count_params(LLAMA) + 12 * LLAMA.n_layer * LLAMA.n_embd * LLAMA.seq_len
    # the step's GEMMs and attention (the CPU peak's operations) carry the model FLOPs the count has
    ops = model_ops(LLAMA, micro_batch=2)
    assert sum(op.flops * op.count for op in ops) == pytest.approx(flops_per_token(LLAMA) * 2 * LLAMA.seq_len, rel=0.02)


def test_stages_compose_to_the_full_model_and_fragments_cover_it():
    full = build_gpt(LLAMA, seed=0)
    x = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len))
    h = x
    for spec in stage_specs(LLAMA.n_layer, 2):
        h = build_stage(LLAMA, spec, 0, "cpu")(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)
    names = fragment_names(LLAMA, 2, 2)
    assert sorted(n for f in names for n in f) == sorted(n for n, _ in full.named_parameters())


def _sliced(block: Block, x: torch.Tensor, cut: int) -> torch.Tensor:
    """The block on tokens [0, cut) and then [cut, T) of x, the second slice attending to the keys and
    values of the first (as the first computed them: rotated at their own positions) and its own."""
    cache = {}

    def attention(qkv: torch.Tensor, first: bool) -> torch.Tensor:
        q, k, v = split_heads(qkv, block.attn.n_head, block.attn.kv_heads)
        if first:
            cache.update(k=k, v=v)
            return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
        l, c = q.shape[2], cache["k"].shape[2]
        mask = torch.ones(l, c + l, dtype=torch.bool).tril(diagonal=c)  # position c + i sees keys [0, c + i]
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))

    head = block_forward(block, x[:, :cut], attention=lambda qkv: attention(qkv, True), offset=0)
    tail = block_forward(block, x[:, cut:], attention=lambda qkv: attention(qkv, False), offset=cut)
    return torch.cat([head, tail], dim=1)


@pytest.mark.parametrize("cut", [1, 13, 31])
def test_a_token_slice_at_its_offset_gives_the_whole_sequences_outputs(cut):
    block = build_gpt(LLAMA, seed=1).blocks["0"]
    x = torch.randn(2, LLAMA.seq_len, LLAMA.n_embd, generator=torch.Generator().manual_seed(cut))
    torch.testing.assert_close(_sliced(block, x, cut), block(x), rtol=1e-5, atol=1e-5)
    # the slice's positions are what makes it so: the second slice rotated as if it began the sequence differs
    wrong = block_forward(block, x[:, cut:], attention=None, offset=0)
    assert not torch.allclose(wrong[:, -1], block(x)[:, -1], atol=1e-3)


def test_rotary_turns_each_query_and_key_head_by_its_position_and_leaves_values():
    D, group, theta = 8, 2, 10000.0
    qkv = torch.randn(1, 5, (2 + 2 * 1) * D)  # 2 query heads, 1 key/value head
    out = rotary(qkv, D, group, theta, offset=3)
    torch.testing.assert_close(out[..., -D:], qkv[..., -D:], rtol=0, atol=0)  # the value head untouched
    # head 0 of position 2 (absolute 5): the pair (x_i, x_{i + D/2}) turned by 5 theta^(-2i/D)
    x, y = qkv[0, 2, :D], out[0, 2, :D]
    angle = 5 * theta ** (-torch.arange(0, D, 2).float() / D)
    a, b = x[: D // 2], x[D // 2 :]
    torch.testing.assert_close(y, torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()]))
    # a rotation keeps norms, and query-key products depend on the distance only
    torch.testing.assert_close(out.view(1, 5, 4, D).norm(dim=-1), qkv.view(1, 5, 4, D).norm(dim=-1))
    shifted = rotary(qkv, D, group, theta, offset=10)
    q, k = out[0, :, :D], out[0, :, 2 * D : 3 * D]
    qs, ks = shifted[0, :, :D], shifted[0, :, 2 * D : 3 * D]
    torch.testing.assert_close(q @ k.T, qs @ ks.T, rtol=1e-4, atol=1e-4)


def test_grouped_query_attention_shares_each_key_value_head_with_its_group():
    qkv = torch.randn(2, 7, (4 + 2 * 2) * 8)
    q, k, v = split_heads(qkv, 4, 2)
    assert q.shape == (2, 4, 7, 8) and k.shape == v.shape == (2, 2, 7, 8)
    # query heads 0, 1 use key/value head 0; 2, 3 head 1
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(causal_attention(qkv, 4, 2), merge_heads(expected))


def test_the_compute_and_memory_models_know_the_family():
    l8 = MODEL_CONFIGS["llama3-8b"]
    g = GpuCompute(find_device("H100 SXM"), l8, "bf16")
    T = 2 * 4096
    for tp in (1, 8):
        ops = {name: t for name, t, _ in g.layer_ops("forward", 2, 4096, 0, tp)}
        # q of 32 heads, k and v of 8, 128 wide each; gate and up fused, then down; rotary and SwiGLU between
        assert ops["qkv"] == g.gemm(T, (4096 + 2 * 1024) / tp, 4096)
        assert ops["fc"] == g.gemm(T, 2 * 14336 / tp, 4096) and ops["fc proj"] == g.gemm(T, 4096, 14336 / tp)
        assert "rotary" in ops and "swiglu" in ops and "gelu" not in ops
    wgrad = [name for name, _, _ in g.layer_ops("wgrad", 2, 4096, 0)]
    assert wgrad == ["qkv wgrad", "proj wgrad", "fc wgrad", "fc proj wgrad"]  # no biases
    mha = l8.with_overrides(kv_heads=32)
    assert GpuCompute(find_device("H100 SXM"), mha, "bf16").layer_forward(2, 4096, 0) > g.layer_forward(2, 4096, 0)
    # every stage's parameters add up to the model's
    assert sum(stage_params(l8, 8, s == 0, s == 3) for s in range(4)) == count_params(l8, include_embeddings=True)
    # activations: q, k, v by their heads and the MLP's three matrices' inputs (gpt: 12 h wide in all)
    s, b, h = 4096, 1, 4096
    for tp in (1, 8):
        kept = s * b * h * 2 * (4 + (2 + 2 * 8 / 32 + 3 * 14336 / 4096) / tp) + 4 * 32 * s * b / tp
        assert layer_activations(l8, b, s, 2, tp, "flash", False) == pytest.approx(kept)
        assert layer_activations(mha, b, s, 2, tp, "flash", False) > layer_activations(l8, b, s, 2, tp, "flash", False)
    xl = MODEL_CONFIGS["gpt3-xl"]
    assert layer_activations(xl, 1, 2048, 2, 2, "flash", False) == 2048 * 2048 * 2 * (4 + 12 / 2) + 4 * 16 * 2048 / 2


def test_a_run_judges_the_familys_fields_before_launch():
    def check(system: str, model, **layout):
        spec = get_system(system)
        options = spec.options()
        spec.validate(RunConfig(system=system, model=model, batch_size=2, micro_batch_size=1, options=options,
                                **layout))

    check("reference", LLAMA)
    check("megatron", LLAMA, tp=2)
    with pytest.raises(ConfigError, match="^megatron splits the key/value heads over --tp 4: --kv-heads 2 must"):
        check("megatron", LLAMA.with_overrides(n_head=8), tp=4)
    check("ours", LLAMA, pp=2, tp=2)
    check("diloco", LLAMA, pp=2, dp=2)  # diloco's pipeline is ours'
    with pytest.raises(ConfigError, match="^ours splits the key/value heads over --tp 4: --kv-heads 2 must"):
        check("ours", LLAMA.with_overrides(n_head=8), tp=4)
    with pytest.raises(ConfigError, match="grouped-query attention is the llama family's"):
        check("reference", get_model_config("tiny").with_overrides(kv_heads=2))
    with pytest.raises(ConfigError, match="--kv-heads 3 must divide --num-heads 4"):
        check("reference", LLAMA.with_overrides(kv_heads=3))


def test_a_gpt_runs_identity_is_as_it_was_and_a_llamas_names_its_family():
    gpt = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    assert set(gpt.identity()["model"]) == {"name", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size"}
    llama = RunConfig(system="reference", model=LLAMA, batch_size=2, micro_batch_size=1)
    assert llama.identity()["model"]["family"] == "llama" and llama.identity()["model"]["kv_heads"] == 2
    assert RunConfig.from_dict(llama.to_dict()) == llama
