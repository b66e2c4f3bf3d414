"""The two autograd Functions the token-level engine is built from.

``SliceAttention``: causal self-attention of one token slice of a sequence (positions [c, c+l)) over
the keys and values of positions [0, c+l), the earlier ones read from a per-sequence ``KVState``.
Its backward computes dq, dK[0:c+l], dV[0:c+l]; the part for the slice's own keys and values goes to
its own graph (plus what later slices already accumulated for them), the part [0, c) is accumulated
into the state for the earlier slices. Backward runs in reverse slice order, so when slice i's
backward runs, every later contribution to its keys and values is in the state: gradients are exact.

``DeferredLinear``: y = x W^T + b whose backward returns only dx and stashes (x, dy); the weight and
bias gradients are computed once per step, as one full-size product over every slice
(``weight_grads``), instead of one small product and one accumulation per slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_flash_fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class KVState:
    """The keys and values of one sequence batch (one batch slice) in one layer, for all positions
    written so far, and the gradient accumulated for them by later slices' backward passes.

    Storage is (B, T, 2, H, D) — the physical layout of the k, v rows of the fused qkv projection —
    so writing a slice's k, v is one copy; attention reads (B, H, t, D) views of it."""

    __slots__ = ("kv", "acc", "acc_len", "masks")

    def __init__(self, masks: "MaskCache"):
        self.kv: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None  # gradient for positions [0, acc_len)
        self.acc_len = 0
        self.masks = masks

    def write(self, kv: torch.Tensor, c: int, total_len: int) -> None:
        if self.kv is None:
            B, l, _, H, D = kv.shape
            self.kv = torch.empty(B, total_len, 2, H, D, dtype=kv.dtype, device=kv.device)
        self.kv[:, c : c + kv.shape[1]].copy_(kv)

    def keys_values(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv[:, :end]
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def release(self) -> None:
        self.kv = self.acc = None
        self.acc_len = 0


class MaskCache:
    """Additive bottom-right-aligned causal masks (l, c+l), by (c, l, dtype, device): query row r
    (position c+r) sees keys [0, c+r]."""

    def __init__(self):
        self._masks: dict = {}

    def get(self, c: int, l: int, dtype: torch.dtype, device: torch.device, additive: bool = True) -> torch.Tensor:
        key = (c, l, dtype, device, additive)
        m = self._masks.get(key)
        if m is None:
            allowed = torch.ones(l, c + l, dtype=torch.bool, device=device).tril(c)
            m = allowed if not additive else (torch.zeros(l, c + l, dtype=dtype, device=device)
                                              .masked_fill(~allowed, float("-inf")))
            self._masks[key] = m
        return m


def _use_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _flash_fwd is not None


def _attn_forward(q, k, v, c, masks: MaskCache):
    """out (B, H, l, D) and what backward needs."""
    l = q.shape[2]
    if _use_flash(q):
        mask = None if c == 0 else masks.get(c, l, q.dtype, q.device)
        out, lse = _flash_fwd(q, k, v, 0.0, c == 0, attn_mask=mask)
        return out, lse
    mask = None if c == 0 else masks.get(c, l, q.dtype, q.device, additive=False)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c == 0)
    return out, None


def _attn_backward(dout, q, k, v, out, lse, c, masks: MaskCache):
    l = q.shape[2]
    if lse is not None:
        mask = None if c == 0 else masks.get(c, l, q.dtype, q.device)
        return _flash_bwd(dout, q, k, v, out, lse, 0.0, c == 0, attn_mask=mask)
    mask = None if c == 0 else masks.get(c, l, q.dtype, q.device, additive=False)
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=c == 0)
    return torch.autograd.grad(o, (qd, kd, vd), dout)


class SliceAttention(torch.autograd.Function):
    """qkv (B, l, 3C) of token slice [c, c+l) -> attention output (B, l, C), heads merged."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, state: KVState, c: int, n_head: int, total_len: int):
        B, l, C3 = qkv.shape
        C = C3 // 3
        x = qkv.view(B, l, 3, n_head, C // n_head)
        state.write(x[:, :, 1:], c, total_len)
        q = x[:, :, 0].transpose(1, 2)
        k, v = state.keys_values(c + l)
        out, lse = _attn_forward(q, k, v, c, state.masks)
        if lse is None:
            ctx.save_for_backward(qkv, out)
        else:
            ctx.save_for_backward(qkv, out, lse)
        ctx.state, ctx.c, ctx.n_head = state, c, n_head
        return out.transpose(1, 2).reshape(B, l, C)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        saved = ctx.saved_tensors
        qkv, out = saved[0], saved[1]
        lse = saved[2] if len(saved) > 2 else None
        state, c, H = ctx.state, ctx.c, ctx.n_head
        B, l, C3 = qkv.shape
        C = C3 // 3
        D = C // H
        q = qkv.view(B, l, 3, H, D)[:, :, 0].transpose(1, 2)
        k, v = state.keys_values(c + l)
        dout = dy.reshape(B, l, H, D).transpose(1, 2)
        if dout.dtype != q.dtype:
            dout = dout.to(q.dtype)
        dq, dk, dv = _attn_backward(dout, q, k, v, out, lse, c, state.masks)
        dqkv = torch.empty(B, l, 3, H, D, dtype=qkv.dtype, device=qkv.device)
        dqkv[:, :, 0].copy_(dq.transpose(1, 2))
        dqkv[:, :, 1].copy_(dk[:, :, c:].transpose(1, 2))
        dqkv[:, :, 2].copy_(dv[:, :, c:].transpose(1, 2))
        if state.acc_len > c:  # later slices' contributions to this slice's keys and values
            dqkv[:, :, 1:].add_(state.acc[:, c : c + l])
        if c > 0:
            if state.acc is None:  # the first backward (the last slice) covers every earlier position
                state.acc = torch.empty(B, c, 2, H, D, dtype=dk.dtype, device=dk.device)
                state.acc[:, :, 0].copy_(dk[:, :, :c].transpose(1, 2))
                state.acc[:, :, 1].copy_(dv[:, :, :c].transpose(1, 2))
                state.acc_len = c
            else:
                state.acc[:, :c, 0].add_(dk[:, :, :c].transpose(1, 2))
                state.acc[:, :c, 1].add_(dv[:, :, :c].transpose(1, 2))
        else:
            state.release()  # slice 0 is the last to need this sequence's state
        return dqkv.view(B, l, C3), None, None, None, None


class DeferredLinear(torch.autograd.Function):
    """y = x W^T + b; backward returns dx only and stashes (x, dy) for ``weight_grads``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stash: list):
        ctx.save_for_backward(x, w)
        ctx.stash = stash
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        if dy.dtype != w.dtype:
            dy = dy.to(w.dtype)
        ctx.stash.append((x, dy))
        return dy.matmul(w), None, None, None


class WeightGrad:
    """The weight (and bias) gradient of one DeferredLinear, accumulated from its stash in fp32.
    fp32 units: in place (``addmm_``: no concatenation copy, no per-slice gradient tensor). Half
    precision units (bf16 / fp16 policies): each unit's product in the half type (as autocast computes
    a micro-batch's weight gradient), summed in fp32 (as autograd accumulates fp32 weights' gradients):
    a half accumulator would round every partial sum, and under fp16's loss scale of 2^16 a sum over many
    units can overflow where each unit does not. ``drain`` may run at any time (e.g. while the stage
    waits for a message); ``finish`` drains what is left and returns dW, db (fp32)."""

    __slots__ = ("stash", "with_bias", "dW", "db")

    def __init__(self, with_bias: bool):
        self.stash: list = []
        self.with_bias = with_bias
        self.dW = self.db = None

    @torch.no_grad()
    def drain(self, limit: int | None = None) -> int:
        n = 0
        while self.stash and (limit is None or n < limit):
            x, dy = self.stash.pop()
            x = x.reshape(-1, x.shape[-1])
            dy = dy.reshape(-1, dy.shape[-1])
            if x.dtype != dy.dtype:
                x = x.to(dy.dtype)
            if dy.dtype not in (torch.float16, torch.bfloat16):
                if self.dW is None:
                    self.dW = dy.t().mm(x)
                    if self.with_bias:
                        self.db = dy.sum(0)
                else:
                    self.dW.addmm_(dy.t(), x)
                    if self.with_bias:
                        self.db.add_(dy.sum(0))
            else:
                dW = dy.t().mm(x)
                db = dy.sum(0, dtype=torch.float32) if self.with_bias else None
                if self.dW is None:
                    self.dW = dW.float()
                    self.db = db
                else:
                    self.dW.add_(dW)
                    if self.with_bias:
                        self.db.add_(db)
            n += 1
        return n

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.drain()
        dW, db = self.dW, self.db
        self.dW = self.db = None
        return dW, db
