"""Quick in-process unit tests of ours' building blocks: the sliced attention Function against plain
full causal attention, and a single-stage engine step against the shared model's autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ours.engine import StageEngine
from ours.kernels import DeferredLinear, KVState, MaskCache, SliceAttention, WeightGrad
from ours.trace import Tracer
from workload.configs import ModelConfig
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

    state, outs, c = KVState(MaskCache()), [], 0
    for l in slices:
        outs.append((c, l, SliceAttention.apply(qkv[:, c : c + l], state, c, H, T)))
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
    """The fp32 CPU path (the flash kernel with a bottom-right causal mask), as the engine runs it."""
    torch.manual_seed(1)
    qkv = torch.randn(1, 64, 3 * 64, requires_grad=True)
    _check_sliced_against_full(qkv, 4, (20, 28, 16), atol=1e-5)


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


CFG = ModelConfig("unit", n_layer=2, n_embd=32, n_head=4, seq_len=24, vocab_size=64)


def _engine_vs_model(slices, batch, mb, *, recompute=False, mixed=False, schedule="1f1b", engine_hook=None):
    torch.manual_seed(3)
    x = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len))
    y = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len))
    ref = build_gpt(CFG, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        ref_loss = sum(lm_loss(ref(xc), yc) for xc, yc in zip(x.split(mb), y.split(mb))) / (batch // mb)
    ref_loss.backward()
    model = build_gpt(CFG, 0)
    eng = StageEngine(model, stage_specs(CFG.n_layer, 1)[0], slices=slices, batch_size=batch, micro_batch_size=mb,
                      device=torch.device("cpu"), rank=0, prev_rank=None, next_rank=None, tracer=Tracer(0, False),
                      precision="bf16" if mixed else "fp32", recompute=recompute, schedule=schedule)
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
