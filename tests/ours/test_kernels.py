"""Quick in-process unit tests of ours' building blocks: the attention over a slice's context and its own
positions (two passes merged by their log-sum-exp) against plain masked attention, the sliced attention
Function against plain full causal attention, and a single-stage engine step against the shared model's
autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ours.engine import StageEngine
from ours.kernels import (MATH, DeferredLinear, KVState, SliceAttention, WeightGrad, context_attention_backward,
                          context_attention_forward)
from ours.trace import Tracer
from workload.configs import ModelConfig, get_model_config
from workload.model import build_gpt, lm_loss
from workload.partition import stage_specs


def _full_attention(qkv: torch.Tensor, H: int) -> torch.Tensor:
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def _check_sliced_against_full(qkv: torch.Tensor, H: int, slices, atol: float) -> KVState:
    """SliceAttention slice by slice (backward in reverse slice order, as the engine runs it) gives
    the outputs and the qkv gradient of full causal attention; returns the KV state it used."""
    B, T, C3 = qkv.shape
    gout = torch.randn(B, T, C3 // 3, dtype=qkv.dtype)
    ref = _full_attention(qkv, H)
    ref.backward(gout)
    ref_grad, qkv.grad = qkv.grad, None

    state, outs, c = KVState(), [], 0
    for l in slices:
        outs.append((c, l, SliceAttention.apply(qkv[:, c : c + l], state, c, H, H, T)))
        c += l
    torch.testing.assert_close(torch.cat([o for _, _, o in outs], dim=1), ref.detach(), rtol=0, atol=atol)
    for c, l, o in reversed(outs):
        o.backward(gout[:, c : c + l])
    torch.testing.assert_close(qkv.grad, ref_grad, rtol=0, atol=atol)
    return state


@pytest.mark.parametrize("slices", [(24,), (8, 8, 8), (10, 9, 5), (1, 22, 1)])
def test_slice_attention_matches_full_attention(slices):
    torch.manual_seed(0)
    qkv = torch.randn(2, sum(slices), 3 * 32, dtype=torch.float64, requires_grad=True)
    state = _check_sliced_against_full(qkv, 4, slices, atol=1e-10)
    assert state.kv is None  # slice 0's backward released the sequence's state


def test_slice_attention_float32_flash_path():
    """The fp32 CPU path (the flash kernel, maskless over the context and causal over the slice), as the
    engine runs it."""
    torch.manual_seed(1)
    qkv = torch.randn(1, 64, 3 * 64, requires_grad=True)
    _check_sliced_against_full(qkv, 4, (20, 28, 16), atol=1e-5)


# (context c, slice length l): the first slice, contexts shorter, longer and much longer than the slice,
# a context of one position, a slice of one row
CASES = [(0, 24), (16, 16), (40, 24), (64, 8), (1, 31), (100, 28), (33, 1)]
HALF_AND_FP32 = [torch.float32, torch.bfloat16, torch.float16]


def _masked_attention(q, k, v, c, dout):
    """The plain masked attention of queries [c, c + l) over keys [0, c + l) (bottom-right causal mask,
    grouped heads repeated), by autograd: out, dq, dk, dv."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(c)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _context_attention(q, k, v, c, dout, kernel=None):
    """ours: the maskless pass over [0, c) and the causal pass over [c, c + l), merged; out, dq, dk, dv."""
    ctx = (k[:, :, :c], v[:, :, :c]) if c else (None, None)
    own = (k[:, :, c:], v[:, :, c:])
    out, lse, aux = context_attention_forward(q, *ctx, *own, kernel=kernel)
    dq, dk_ctx, dv_ctx, dk, dv = context_attention_backward(dout, q, *ctx, *own, out, lse, aux)
    if c:
        dk, dv = torch.cat([dk_ctx, dk], dim=2), torch.cat([dv_ctx, dv], dim=2)
    return out, dq, dk, dv


def _inputs(c, l, H, H_kv, D, device="cpu", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, l, D, generator=g, dtype=torch.float64) * scale
    k, v = (torch.randn(2, H_kv, c + l, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.to(device) for t in (q, k, v, torch.randn(2, H, l, D, generator=g, dtype=torch.float64))]


def _max_errors(got, exact) -> list[float]:
    return [float((a.double() - e).abs().max()) for a, e in zip(got, exact)]


def _check_against_masked(dtype, H_kv, device="cpu", kernel=None, cases=CASES, scale=1.0) -> list[float]:
    """At every (c, l): ours' output and gradients in ``dtype`` are as far from the exact values (the masked
    attention in fp64) as three times the masked attention's own in ``dtype`` (plus one epsilon of the
    type: errors of a few roundings of values of order one): the merge rounds the output once more, dq
    is the sum of two rounded parts. fp32 at unit scale also within 1e-5 of the exact values
    (scaled scores lose what fp32 inputs' rounding costs them, the masked attention alike). Returns the
    largest error of each of out, dq, dk, dv."""
    worst = [0.0] * 4
    for c, l in cases:
        q, k, v, dout = _inputs(c, l, 4, H_kv, 32, device, scale, seed=c * 131 + l)
        exact = _masked_attention(q, k, v, c, dout)
        low = [t.to(dtype) for t in (q, k, v, dout)]
        ref = _max_errors(_masked_attention(*low[:3], c, low[3]), exact)
        got = _max_errors(_context_attention(*low[:3], c, low[3], kernel=kernel), exact)
        for name, e, r in zip(("out", "dq", "dk", "dv"), got, ref):
            assert e <= 3 * r + torch.finfo(dtype).eps, \
                f"{dtype} c={c} l={l} {name}: error {e:.2e}, the masked attention's {r:.2e}"
            if dtype == torch.float32 and scale == 1.0:
                assert e <= 1e-5, f"fp32 c={c} l={l} {name}: error {e:.2e}"
        worst = [max(w, e) for w, e in zip(worst, got)]
    return worst


@pytest.mark.parametrize("H_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", HALF_AND_FP32, ids=str)
def test_context_attention_equals_masked_attention(dtype, H_kv):
    """On CPU (the flash kernel for CPU, grouped key / value heads passed to it as they are)."""
    _check_against_masked(dtype, H_kv)


@pytest.mark.parametrize("H_kv", [4, 2], ids=["mha", "gqa"])
def test_context_attention_merge_exact_in_float64(H_kv):
    """The merge and both backward passes, on the plain-products kernel in fp64 (the code every kernel
    shares, also CUDA's, whose kernels take no grouped heads: repeated, their gradients summed back)."""
    for c, l in CASES[:5]:
        q, k, v, dout = _inputs(c, l, 4, H_kv, 16, seed=c + l)
        for got, exact in zip(_context_attention(q, k, v, c, dout, kernel=MATH), _masked_attention(q, k, v, c, dout)):
            torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)


def test_context_attention_merge_is_stable_for_large_scores():
    """Scores in the hundreds (e^lse far outside fp32's range): the merge works with differences of lse."""
    _check_against_masked(torch.float32, 4, cases=[(40, 24), (100, 28)], scale=60.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", HALF_AND_FP32, ids=str)
def test_context_attention_equals_masked_attention_on_cuda(dtype):
    """CUDA's kernels (flash for bf16 / fp16, memory-efficient for fp32; grouped heads repeated)."""
    for H_kv in (4, 2):
        _check_against_masked(dtype, H_kv, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_slice_attention_half_precision(dtype):
    """SliceAttention slice by slice in bf16 / fp16: output and qkv gradient as far from full causal
    attention in fp64 as three times full causal attention in the same type (the context's key / value
    gradients summed over later slices in that type, as the engine keeps them)."""
    torch.manual_seed(5)
    slices, H = (10, 30, 20, 36), 4
    qkv = torch.randn(2, sum(slices), 3 * 4 * 32, dtype=torch.float64)
    gout = torch.randn(2, sum(slices), 4 * 32, dtype=torch.float64)

    def full(x):
        x = x.detach().requires_grad_()
        out = _full_attention(x, H)
        out.backward(gout.to(x.dtype))
        return out.detach(), x.grad

    def sliced(x):
        x = x.detach().requires_grad_()
        state, outs, c = KVState(), [], 0
        for l in slices:
            outs.append((c, l, SliceAttention.apply(x[:, c : c + l], state, c, H, H, x.shape[1])))
            c += l
        for c, l, o in reversed(outs):
            o.backward(gout[:, c : c + l].to(x.dtype))
        return torch.cat([o for _, _, o in outs], dim=1).detach(), x.grad

    exact = full(qkv)
    for e, r in zip(_max_errors(sliced(qkv.to(dtype)), exact), _max_errors(full(qkv.to(dtype)), exact)):
        assert e <= 3 * r, (e, r)


def test_deferred_linear_weight_grads():
    torch.manual_seed(2)
    w = torch.randn(6, 5, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    wg = WeightGrad(True)
    for part in x.split([3, 4], dim=1):
        DeferredLinear.apply(part, w, b, wg.stash).pow(2).sum().backward()
    dW, db = wg.finish()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    F.linear(xr, wr, br).pow(2).sum().backward()
    torch.testing.assert_close(dW, wr.grad)
    torch.testing.assert_close(db, br.grad)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_weight_grads_are_summed_in_fp32(half):
    """Each unit's product in the half type, the sum over units in fp32: under fp16's loss scale a sum
    can pass fp16's largest value (65504) where no unit does, and a half accumulator would round
    every partial sum. 16 units whose dW are about 2^12 each: fp16 would overflow to inf."""
    torch.manual_seed(4)
    x = torch.full((16, 8, 4), 2.0**3)
    dy = torch.full((16, 8, 3), 2.0**6)
    wg = WeightGrad(True)
    for u in range(16):
        wg.stash.append((x[u].to(half), dy[u].to(half)))
    dW, db = wg.finish()
    assert dW.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dW, torch.full((3, 4), 16 * 8 * 2.0**9))  # 2^16: past fp16's range
    torch.testing.assert_close(db, torch.full((3,), 16 * 8 * 2.0**6))
    # summed in fp32, the rounding is that of each unit's product (random values, 256 units): about
    # 1-3 eps of a unit's largest product here, where a half accumulator is off by 14-24
    xs, dys = torch.randn(256, 2, 16, 4), torch.randn(256, 2, 16, 3)
    wg = WeightGrad(False)
    for x, dy in zip(xs, dys):
        wg.stash.append((x.to(half), dy.to(half)))
    dW, _ = wg.finish()
    flat = [(dy.reshape(-1, 3).to(half).double(), x.reshape(-1, 4).to(half).double()) for x, dy in zip(xs, dys)]
    exact = sum(dy.t() @ x for dy, x in flat)
    unit = max(float((dy.t() @ x).abs().max()) for dy, x in flat)
    assert float((dW.double() - exact).abs().max()) <= 6 * torch.finfo(half).eps * unit


CFG = ModelConfig("unit", n_layer=2, n_embd=32, n_head=4, seq_len=24, vocab_size=64)


def _engine(model, slices, batch, mb, **kwargs) -> StageEngine:
    """A single-stage engine over the whole model."""
    return StageEngine(model, stage_specs(model.config.n_layer, 1)[0], slices=slices, batch_size=batch,
                       micro_batch_size=mb, device=torch.device("cpu"), rank=0, prev_rank=None, next_rank=None,
                       tracer=Tracer(0, False), **kwargs)


def _engine_vs_model(slices, batch, mb, *, recompute=False, mixed=False, schedule="1f1b", engine_hook=None, cfg=CFG):
    torch.manual_seed(3)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    ref = build_gpt(cfg, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        ref_loss = sum(lm_loss(ref(xc), yc) for xc, yc in zip(x.split(mb), y.split(mb))) / (batch // mb)
    ref_loss.backward()
    model = build_gpt(cfg, 0)
    eng = _engine(model, slices, batch, mb, precision="bf16" if mixed else "fp32", recompute=recompute,
                  schedule=schedule)
    if engine_hook is not None:
        engine_hook(eng)
    loss = eng.step(x, y)
    return ref, ref_loss, model, loss


@pytest.mark.parametrize("slices,batch,mb,recompute", [((24,), 2, 1, False), ((6, 6, 6, 6), 4, 2, False),
                                                       ((10, 8, 6), 2, 2, True)])
def test_engine_step_matches_model(slices, batch, mb, recompute):
    ref, ref_loss, model, loss = _engine_vs_model(slices, batch, mb, recompute=recompute)
    assert abs(float(loss) - float(ref_loss.detach())) < 1e-6
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert not p.grad.requires_grad, name  # plain gradients, no graph kept alive
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule,bound", [("1f1b", 3), ("gpipe", None)])
def test_engine_bounds_the_weight_gradient_stash(schedule, bound):
    """1f1b: after each backward a linear's stash holds at most P - s batch slices' units (one stage:
    one batch slice of 3 token slices); gpipe keeps every unit's until the step's end. Same gradients."""
    peak = []

    def watch(eng):
        bound_stash = eng._bound_stash

        def bounded():
            bound_stash()
            peak.append(max(len(wg.stash) for _, _, wg in eng.linears.values()))
        eng._bound_stash = bounded

    ref, ref_loss, model, loss = _engine_vs_model((8, 8, 8), 4, 1, schedule=schedule, engine_hook=watch)
    assert len(peak) == 4 * 3  # one call per backward
    assert max(peak) == (bound if bound is not None else 4 * 3)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=0, atol=1e-6, msg=name)


def test_engine_mixed_precision_close_to_model():
    ref, ref_loss, model, loss = _engine_vs_model((8, 8, 8), 2, 1, mixed=True)
    assert abs(float(loss) - float(ref_loss.detach())) < 2e-2
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        g, r = p.grad, ref_grads[name].grad
        assert float((g - r).norm()) <= 0.1 * float(r.norm()) + 1e-4, name


LLAMA = get_model_config("llama-tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=128)
"""tests/runners/test_verify.py's llama-tiny: rotary positions, 4 query heads sharing 2 key/value heads, SwiGLU,
RMSNorm, no biases."""


def test_llama_slices_give_the_whole_sequences_outputs():
    """Each token slice through the engine's layers (rotated at the slice's offset, attending to the keys
    and values cached by the slices before it, 2 heads of them) gives the whole sequence's hidden states
    for its tokens (fp64: exact up to rounding)."""
    model = build_gpt(LLAMA, 0).double()
    x = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model.embed(x)
        for blk in model.blocks.values():
            whole = blk(whole)
        eng = _engine(model, (5, 16, 11), 2, 2)
        eng._prepare_weights()
        states = [KVState() for _ in model.blocks]
        for i, (c, l) in enumerate(eng.slices):
            out = eng._forward(None, x, states, 0, i)
            torch.testing.assert_close(out, whole[:, c : c + l], rtol=0, atol=1e-12)
        assert states[0].kv.shape == (2, LLAMA.seq_len, 2, 2, LLAMA.head_dim)  # k and v of the 2 key/value heads


@pytest.mark.parametrize("slices,recompute", [((5, 16, 11), False), ((8, 8, 8, 8), True)])
def test_llama_engine_step_matches_model(slices, recompute):
    """A step over token slices gives the whole sequence's loss and every gradient: the rotary offset, the
    grouped key/value cache (its heads' gradients summed over their query heads and over the later slices),
    the linears without biases and the RMSNorms."""
    ref, ref_loss, model, loss = _engine_vs_model(slices, 2, 1, recompute=recompute, cfg=LLAMA)
    assert abs(float(loss) - float(ref_loss.detach())) < 1e-6
    ref_grads = dict(ref.named_parameters())
    assert not any(n.endswith(".bias") for n in ref_grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=0, atol=1e-6, msg=name)
