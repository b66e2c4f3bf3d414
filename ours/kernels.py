"""The two autograd Functions the token-level engine is built from, and the attention kernels under them.

``SliceAttention``: causal self-attention of one token slice of a sequence (positions [c, c+l)) over
the keys and values of positions [0, c+l), the earlier ones read from a per-sequence ``KVState``.
No mask: the slice's queries attend to the context [0, c) in one maskless pass and to the slice's own
positions in one causal pass, and the two are merged by their rows' log-sum-exp
(``context_attention_forward``): exactly the masked attention, at the cost of the unmasked and the
causal kernel (an explicit mask makes the CPU kernel read and add it for every score). Its backward
computes dq, dK[0:c+l], dV[0:c+l]; the part for the slice's own keys and values goes to its own graph
(plus what later slices already accumulated for them), the part [0, c) is accumulated into the state
for the earlier slices. Backward runs in reverse slice order, so when slice i's backward runs, every
later contribution to its keys and values is in the state: gradients are exact.

``DeferredLinear``: y = x W^T + b whose backward returns only dx and stashes (x, dy); the weight and
bias gradients are computed once per step, as one full-size product over every slice
(``weight_grads``), instead of one small product and one accumulation per slice.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class KVState:
    """The keys and values of one sequence batch (one batch slice) in one layer, for all positions
    written so far, and the gradient accumulated for them by later slices' backward passes.

    Storage is (B, T, 2, H_kv, D) — the physical layout of the k, v rows of the fused qkv projection —
    so writing a slice's k, v is one copy; attention reads (B, H_kv, t, D) views of it."""

    __slots__ = ("kv", "acc", "acc_len")

    def __init__(self):
        self.kv: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None  # gradient for positions [0, acc_len)
        self.acc_len = 0

    def write(self, kv: torch.Tensor, c: int, total_len: int) -> None:
        if self.kv is None:
            B, l, _, H, D = kv.shape
            self.kv = torch.empty(B, total_len, 2, H, D, dtype=kv.dtype, device=kv.device)
        self.kv[:, c : c + kv.shape[1]].copy_(kv)

    def keys_values(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions [start, end), each (B, H_kv, end - start, D)."""
        kv = self.kv[:, start:end]
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def release(self) -> None:
        self.kv = self.acc = None
        self.acc_len = 0


# ---- attention kernels that return their rows' log-sum-exp ---------------------------------------
# Each: ``forward(q, k, v, causal) -> (out, lse, aux)`` and ``backward(dout, q, k, v, out, lse, causal,
# aux) -> (dq, dk, dv)``, q (B, H, l, D), k and v (B, H_kv, t, D), out like q, lse (B, H, l) in the
# accumulation type (fp32; fp64 for fp64), natural log of the sum of exp(q.k / sqrt(D)) over the keys a
# row sees; ``causal``: top-left aligned (used only with t == l). The backward takes the output and the
# log-sum-exp to use rather than its own forward's: the flash-attention identities (P = exp(S - lse),
# dS = P * (dO V^T - rowsum(dO * out))) then give one part's share of the gradients of attention over a
# larger set of keys when ``out`` and ``lse`` are those of the whole set. ``aux``: what the kernel's
# own backward needs from its forward. ``native_gqa``: takes H_kv < H itself (else the heads are
# repeated for it and their gradients summed back: ``_expand_heads``, ``_sum_heads``).

class _CpuFlash:
    """torch's flash attention for CPU (fp32, fp64, bf16, fp16; H_kv dividing H)."""

    native_gqa = True
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

    def forward(self, q, k, v, causal):
        out, lse = self.fwd(q, k, v, 0.0, causal)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        return self.bwd(dout, q, k, v, out, lse, 0.0, causal)


class _CudaFlash:
    """torch's flash attention on CUDA (bf16, fp16; head size up to 256, a multiple of 8): its
    ``_scaled_dot_product_flash_attention`` ops (lse (B, H, l) fp32)."""

    native_gqa = False

    def forward(self, q, k, v, causal):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)


class _CudaEfficient:
    """torch's memory-efficient attention on CUDA (fp32, bf16, fp16): its
    ``_scaled_dot_product_efficient_attention`` ops. Its lse has the rows padded (to a multiple of 32
    in torch's kernels): the merge reads the first l, the backward gets the merged lse in a copy of
    the padded tensor (its padding as the forward left it)."""

    native_gqa = False

    def forward(self, q, k, v, causal):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                        causal)
        return out, lse[..., : q.shape[2]], (lse, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        padded, seed, offset = aux
        padded = padded.clone()
        padded[..., : q.shape[2]] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal)
        return dq, dk, dv


class _Math:
    """Plain matrix products in the accumulation type (fp32; fp64 for fp64): any device and type."""

    native_gqa = False

    @staticmethod
    def _scores(q, k, causal, acc):
        s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
        if causal:
            l, t = s.shape[-2:]
            s.masked_fill_(torch.ones(l, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, causal):
        acc = torch.promote_types(q.dtype, torch.float32)
        s = self._scores(q, k, causal, acc)
        lse = s.logsumexp(-1)
        return torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v.to(acc)).to(q.dtype), lse, None

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        acc = torch.promote_types(q.dtype, torch.float32)
        p = self._scores(q, k, causal, acc).sub_(lse.unsqueeze(-1)).exp_()
        do = dout.to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p.mul_(torch.matmul(do, v.to(acc).transpose(-1, -2)).sub_(delta)).mul_(1.0 / math.sqrt(q.shape[-1]))
        dq = torch.matmul(ds, k.to(acc))
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH = _CpuFlash(), _CudaFlash(), _CudaEfficient(), _Math()


def attention_kernel(q: torch.Tensor):
    """The kernel for queries like ``q``: flash for CPU; on CUDA flash for bf16 / fp16 (head size a
    multiple of 8 up to 256), memory-efficient attention for fp32 and other half shapes; else the plain
    products."""
    if q.device.type == "cpu" and CPU_FLASH.fwd is not None:
        return CPU_FLASH
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
            return CUDA_FLASH
        if half or q.dtype == torch.float32:
            return CUDA_EFFICIENT
    return MATH


def _expand_heads(kernel, t: torch.Tensor, H: int) -> torch.Tensor:
    """Keys or values (B, H_kv, t, D) as the kernel takes them for H query heads."""
    g = H // t.shape[1]
    return t if g == 1 or kernel.native_gqa else t.repeat_interleave(g, dim=1)


def _sum_heads(dt: torch.Tensor, H_kv: int) -> torch.Tensor:
    """A gradient over repeated key / value heads (B, H, t, D) summed back to (B, H_kv, t, D)."""
    B, H, t, D = dt.shape
    return dt if H == H_kv else dt.view(B, H_kv, H // H_kv, t, D).sum(2)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention outputs of the same queries (B, H, l, D) over disjoint sets of keys, with their rows'
    log-sum-exp, -> the output over the union (in the inputs' type, laid out (B, l, H, D) so that merging
    the heads is a view) and its log-sum-exp: out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), as
    w1 o1 + w2 o2 with w = e^(lse_i - lse), lse = log(e^lse1 + e^lse2), in fp32 (fp64 for fp64)."""
    acc = torch.promote_types(o1.dtype, torch.float32)
    lse1, lse2 = lse1.to(acc), lse2.to(acc)
    lse = torch.logaddexp(lse1, lse2)
    B, H, l, D = o1.shape
    out = torch.empty(B, l, H, D, dtype=acc, device=o1.device).transpose(1, 2)
    torch.mul(o1, (lse1 - lse).exp_().unsqueeze(-1), out=out)
    out.addcmul_(o2, (lse2 - lse).exp_().unsqueeze(-1))
    return out.to(o1.dtype), lse


def context_attention_forward(q: torch.Tensor, k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None,
                              k_own: torch.Tensor, v_own: torch.Tensor, kernel=None):
    """Queries q (B, H, l, D) of positions [c, c + l) over the context's keys and values [0, c)
    (``k_ctx``, ``v_ctx`` (B, H_kv, c, D); None when c = 0) and causally over their own (``k_own``,
    ``v_own`` (B, H_kv, l, D)): -> (out (B, H, l, D), lse, aux) for ``context_attention_backward``.
    ``kernel``: one of the kernels above (default ``attention_kernel(q)``)."""
    kern = kernel or attention_kernel(q)
    H = q.shape[1]
    o2, lse2, aux2 = kern.forward(q, _expand_heads(kern, k_own, H), _expand_heads(kern, v_own, H), True)
    if k_ctx is None:
        return o2, lse2, (kern, None, aux2)
    o1, lse1, aux1 = kern.forward(q, _expand_heads(kern, k_ctx, H), _expand_heads(kern, v_ctx, H), False)
    out, lse = merge_attention(o1, lse1, o2, lse2)
    return out, lse, (kern, aux1, aux2)


def context_attention_backward(dout: torch.Tensor, q: torch.Tensor, k_ctx: torch.Tensor | None,
                               v_ctx: torch.Tensor | None, k_own: torch.Tensor, v_own: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, aux):
    """-> dq, dk_ctx, dv_ctx (None when c = 0), dk_own, dv_own: each part's backward with the merged
    output and log-sum-exp (the identities above), dq their sum."""
    kern, aux1, aux2 = aux
    H, H_kv = q.shape[1], k_own.shape[1]

    def part(k, v, causal, aux_part):
        dq, dk, dv = kern.backward(dout, q, _expand_heads(kern, k, H), _expand_heads(kern, v, H), out, lse, causal,
                                   aux_part)
        return dq, _sum_heads(dk, H_kv), _sum_heads(dv, H_kv)

    dq, dk_own, dv_own = part(k_own, v_own, True, aux2)
    if k_ctx is None:
        return dq, None, None, dk_own, dv_own
    dq_ctx, dk_ctx, dv_ctx = part(k_ctx, v_ctx, False, aux1)
    return dq.add_(dq_ctx), dk_ctx, dv_ctx, dk_own, dv_own


class SliceAttention(torch.autograd.Function):
    """qkv (B, l, (H + 2 H_kv) D) of token slice [c, c+l), rows [q; k; v] as ``workload.configs.qkv_rows``
    lays them out (H query heads, then the H_kv key and the H_kv value heads; each group of H / H_kv query
    heads shares a key/value head) -> attention output (B, l, H D), heads merged. The state keeps the
    H_kv heads only; the gradient of a shared key or value is summed over its group's query heads."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, state: KVState, c: int, n_head: int, kv_heads: int, total_len: int):
        B, l, W = qkv.shape
        D = W // (n_head + 2 * kv_heads)
        state.write(qkv[..., n_head * D :].view(B, l, 2, kv_heads, D), c, total_len)
        q = qkv[..., : n_head * D].view(B, l, n_head, D).transpose(1, 2)
        k_ctx, v_ctx = state.keys_values(0, c) if c else (None, None)
        out, lse, ctx.aux = context_attention_forward(q, k_ctx, v_ctx, *state.keys_values(c, c + l))
        ctx.save_for_backward(qkv, out, lse)
        ctx.state, ctx.c, ctx.heads = state, c, (n_head, kv_heads)
        return out.transpose(1, 2).reshape(B, l, n_head * D)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        qkv, out, lse = ctx.saved_tensors
        state, c, (H, H_kv) = ctx.state, ctx.c, ctx.heads
        B, l, W = qkv.shape
        D = W // (H + 2 * H_kv)
        q = qkv[..., : H * D].view(B, l, H, D).transpose(1, 2)
        k_ctx, v_ctx = state.keys_values(0, c) if c else (None, None)
        dout = dy.reshape(B, l, H, D).transpose(1, 2)
        if dout.dtype != q.dtype:
            dout = dout.to(q.dtype)
        dq, dk_ctx, dv_ctx, dk, dv = context_attention_backward(dout, q, k_ctx, v_ctx, *state.keys_values(c, c + l),
                                                                out, lse, ctx.aux)
        ctx.aux = None
        dqkv = torch.empty(B, l, W, dtype=qkv.dtype, device=qkv.device)
        dqkv[..., : H * D].view(B, l, H, D).copy_(dq.transpose(1, 2))
        dkv = dqkv[..., H * D :].view(B, l, 2, H_kv, D)
        dkv[:, :, 0].copy_(dk.transpose(1, 2))
        dkv[:, :, 1].copy_(dv.transpose(1, 2))
        if state.acc_len > c:  # later slices' contributions to this slice's keys and values
            dkv.add_(state.acc[:, c : c + l])
        if c > 0:
            if state.acc is None:  # the first backward (the last slice) covers every earlier position
                state.acc = torch.empty(B, c, 2, H_kv, D, dtype=dk_ctx.dtype, device=dk_ctx.device)
                state.acc[:, :, 0].copy_(dk_ctx.transpose(1, 2))
                state.acc[:, :, 1].copy_(dv_ctx.transpose(1, 2))
                state.acc_len = c
            else:
                state.acc[:, :c, 0].add_(dk_ctx.transpose(1, 2))
                state.acc[:, :c, 1].add_(dv_ctx.transpose(1, 2))
        else:
            state.release()  # slice 0 is the last to need this sequence's state
        return dqkv, None, None, None, None, None


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
