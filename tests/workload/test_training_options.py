"""Today's training options in the compute and memory models: sequence parallelism, selective recompute,
fp8 GEMMs, an MLP of its own width (``ffn_hidden``)."""
from __future__ import annotations

import pytest

from workload.compute import LINEAR_OPS, DeviceError, GpuCompute, find_device
from workload.configs import get_model_config
from workload.memory import layer_activations, rank_memory

XL = get_model_config("gpt3-xl")
L8 = get_model_config("llama3-8b")
H100 = find_device("H100 SXM")


def _ops(g: GpuCompute, kind: str, tp: int = 2) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, t, _ in g.layer_ops(kind, 1, 2048, 0, tp):
        out[name] = out.get(name, 0.0) + t
    return out


@pytest.mark.parametrize("model", [XL, L8], ids=["gpt", "llama"])
def test_fp8_speeds_the_linear_gemms_only(model):
    """fp8 on an H100: every linear GEMM of a layer faster (forward, input and weight gradients), every
    other operation (attention, norms, activations, the head, the embeddings, the optimizer) as in bf16."""
    bf16 = GpuCompute(H100, model, "bf16")
    fp8 = GpuCompute(H100, model, "bf16", gemm_precision="fp8")
    for kind in ("forward", "backward_input", "wgrad"):
        a, b = _ops(bf16, kind), _ops(fp8, kind)
        assert a.keys() == b.keys()
        for name in a:
            if name in LINEAR_OPS:
                assert b[name] < a[name], (kind, name)
            else:
                assert b[name] == a[name], (kind, name)
    assert {n for kind in ("forward", "backward_input", "wgrad") for n in _ops(bf16, kind)} & LINEAR_OPS == LINEAR_OPS
    assert fp8.head_forward(2048, 2) == bf16.head_forward(2048, 2) and fp8.embed(2048) == bf16.embed(2048)
    assert fp8.optimizer(10**8) == bf16.optimizer(10**8)
    assert fp8.attention_forward(1, 2048, 0, 2) == bf16.attention_forward(1, 2048, 0, 2)
    # a large GEMM runs near the fp8 peak's share: about twice bf16's speed
    assert bf16.linear(8192, 8192, 8192) / fp8.linear(8192, 8192, 8192) == pytest.approx(2.0, rel=0.02)


def test_fp8_only_where_the_part_has_it_and_inside_a_half_precision():
    with pytest.raises(DeviceError, match="no fp8 GEMMs"):
        GpuCompute(find_device("A100 SXM4 80GB"), XL, "bf16", gemm_precision="fp8")
    with pytest.raises(DeviceError, match="not fp32"):
        GpuCompute(H100, XL, "fp32", gemm_precision="fp8")


def test_sequence_parallelism_splits_the_norms_work_and_activations():
    """The norms and residual adds of a layer see 1/tp of the tokens (their time over tp, the GEMMs and
    attention as they were); a layer keeps every activation but attention's over tp: Korthikanti et
    al.'s 34 s b h / t against 10 s b h + 24 s b h / t (a = 2, dropout)."""
    plain, sp = GpuCompute(H100, XL, "bf16"), GpuCompute(H100, XL, "bf16", sequence_parallel=True)
    for kind in ("forward", "backward_input"):
        a, b = _ops(plain, kind, tp=4), _ops(sp, kind, tp=4)
        for name in a:
            if name.startswith(("ln_", "residual")):
                assert b[name] < a[name] / 2, (kind, name)
            else:
                assert b[name] == a[name], (kind, name)
    s, b, h, t = 2048, 1, XL.n_embd, 4
    core = 4 * XL.n_head * s * b / t  # fused attention's log-sum-exp, split by heads either way
    assert layer_activations(XL, b, s, 2, t, "flash", True) == pytest.approx(s * b * h * (10 + 24 / t) + core)
    assert layer_activations(XL, b, s, 2, t, "flash", True, sequence_parallel=True) == \
        pytest.approx(s * b * h * 34 / t + core)


def test_selective_recompute_runs_the_attention_core_again_and_keeps_none_of_its_activations():
    """Selective recompute: the attention core's forward alone again (less than the layer's forward),
    its s^2 activations not kept (materialised attention: Korthikanti et al.'s 5 a s / h term gone),
    everything else kept; full recompute keeps only each layer's input."""
    g = GpuCompute(find_device("V100 SXM2 16GB"), XL, "fp16", "materialized")
    assert 0 < g.attention_forward(1, 2048, 0, 2) < g.layer_forward(1, 2048, 0, 2)
    s, b, n = 2048, 1, XL.n_head
    keep = layer_activations(XL, b, s, 2, 1, "materialized", True)
    sel = layer_activations(XL, b, s, 2, 1, "materialized", True, selective=True)
    assert keep - sel == pytest.approx(5 * n * s * s * b)
    mem = {gran: rank_memory(XL, system="megatron", tp=1, pp=2, dp=1, micro_batch=1, n_micro=8, precision="fp16",
                             recompute=gran is not None, schedule="1f1b", attention="materialized", dropout=True,
                             recompute_granularity=gran or "full").activations
           for gran in (None, "selective", "full")}
    assert mem["full"] < mem["selective"] < mem[None]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_ffn_hidden_sets_the_mlps_time_and_memory_in_proportion(family):
    """The MLP twice as wide: its GEMMs twice the time (large shapes, the same tile use), the
    activations it keeps twice (GELU's or SwiGLU's inputs and the down projection's), the rest as it
    was."""
    model = XL if family == "gpt" else L8
    wide = model.with_overrides(ffn_hidden=2 * model.ffn_dim)
    a, b = _ops(GpuCompute(H100, model, "bf16"), "forward", 1), _ops(GpuCompute(H100, wide, "bf16"), "forward", 1)
    for name in ("fc", "fc proj"):
        assert b[name] / a[name] == pytest.approx(2.0, rel=0.05), name
    for name in ("qkv", "proj", "ln_1", "attention"):
        assert b[name] == a[name]
    s, per_ffn = 2048, 3 if family == "llama" else 2  # elements kept per ffn column and token (a = 2)
    grow = layer_activations(wide, 1, s, 2, 1, "flash", False) - layer_activations(model, 1, s, 2, 1, "flash", False)
    assert grow == pytest.approx(s * 2 * per_ffn * model.ffn_dim)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_blocks_parameters_are_the_models_whatever_the_mlps_width(family):
    """``block_params`` (what the memory model, the FLOP count and every program's sizes take) counts the
    parameters the model file builds, an MLP of any width included."""
    import torch

    from workload.configs import block_params
    from workload.model import GPT

    base = get_model_config("tiny" if family == "gpt" else "llama-tiny")
    for ffn in (None, 3 * base.n_embd):
        cfg = base.with_overrides(ffn_hidden=ffn)
        with torch.device("meta"):
            block = GPT(cfg).blocks["0"]
        assert sum(p.numel() for p in block.parameters()) == block_params(cfg), ffn
