"""The token-level pipeline engine (TeraPipe) of one stage.

A stage applies the parameters of its part of the shared GPT (``workload.model``) with its own
functional forward, the same math token slice by token slice: embeddings with the slice's position
offset on the first stage; per layer ln_1 -> c_attn -> attention over the cached keys and values of
the sequence -> c_proj -> residual -> ln_2 -> c_fc -> gelu -> c_proj -> residual; ln_f, lm_head and the
loss (sum over the slice's tokens / tokens of the replica batch) on the last stage.

One step: the batch is cut into batch slices (micro_batch_size rows) x token slices; every
(batch slice, token slice) unit runs forward in order — receiving its input activations from the
previous stage, sending its output to the next — then backward in reverse order. Activations and
their gradients move with asynchronous point-to-point operations posted early; sends are waited
for only at the end of the step. Linear weight gradients are computed once per step after the
stage's last backward (while the previous stage is still in its backward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ours.kernels import DeferredLinear, KVState, MaskCache, SliceAttention, weight_grads
from ours.trace import Tracer
from workload.model import GPT
from workload.partition import StageSpec
from workload.training import autocast

_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class StageEngine:
    def __init__(self, model: GPT, spec: StageSpec, *, slices: tuple[int, ...], batch_size: int, micro_batch_size: int,
                 device: torch.device, rank: int, prev_rank: int | None, next_rank: int | None, tracer: Tracer,
                 mixed_precision: bool = False, recompute: bool = False):
        cfg = model.config
        self.model, self.spec, self.device, self.rank = model, spec, device, rank
        self.C, self.H, self.T, self.V = cfg.n_embd, cfg.n_head, cfg.seq_len, cfg.vocab_size
        self.slices = [(sum(slices[:i]), slices[i]) for i in range(len(slices))]
        self.batch_size, self.mb = batch_size, micro_batch_size
        self.nb = batch_size // micro_batch_size
        self.prev, self.next = prev_rank, next_rank
        self.tracer = tracer
        self.mixed = mixed_precision
        self.recompute = recompute
        self.masks = MaskCache()
        self.low_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.blocks = list(model.blocks.values())
        # deferred-gradient linears: (weight param, bias param or None, stash)
        self.linears: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter | None, list]] = {}
        for i, blk in model.blocks.items():
            for lname in _LINEARS:
                mod = blk.get_submodule(lname)
                self.linears[f"blocks.{i}.{lname}"] = (mod.weight, mod.bias, [])
        if spec.is_last:
            self.linears["lm_head"] = (model.lm_head.weight, None, [])
        self._w: dict[str, tuple[torch.Tensor, torch.Tensor | None, list]] = {}
        self.loss_scale = 1.0  # dynamic loss scaling (fp16 on CUDA) sets it

    # ---- the functional forward -------------------------------------------------------------
    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w, b, stash = self._w[name]
        return DeferredLinear.apply(x, w, b, stash)

    def _layer(self, idx: str, blk, x: torch.Tensor, state: KVState, c: int) -> torch.Tensor:
        C = self.C
        h = F.layer_norm(x, (C,), blk.ln_1.weight, blk.ln_1.bias)
        qkv = self._lin(f"blocks.{idx}.attn.c_attn", h)
        y = SliceAttention.apply(qkv, state, c, self.H, self.T)
        x = x + self._lin(f"blocks.{idx}.attn.c_proj", y)
        h = F.layer_norm(x, (C,), blk.ln_2.weight, blk.ln_2.bias)
        f = F.gelu(self._lin(f"blocks.{idx}.mlp.c_fc", h))
        return x + self._lin(f"blocks.{idx}.mlp.c_proj", f)

    def _forward_unit(self, x: torch.Tensor, states: list[KVState], c: int) -> torch.Tensor:
        for (idx, blk), state in zip(self.model.blocks.items(), states):
            if self.recompute:
                x = checkpoint(self._layer, idx, blk, x, state, c, use_reentrant=False)
            else:
                x = self._layer(idx, blk, x, state, c)
        return x

    def _prepare_weights(self) -> None:
        """The weights the linears apply this step (detached: their gradients are computed by
        ``weight_grads``); cast once per step to the low precision under mixed precision."""
        self._w = {}
        for name, (w, b, stash) in self.linears.items():
            w = w.detach()
            b = b.detach() if b is not None else None
            if self.mixed:
                w = w.to(self.low_dtype)
                b = b.to(self.low_dtype) if b is not None else None
            self._w[name] = (w, b, stash)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the replica batch; leaves every parameter's gradient in .grad.
        Returns the replica's mean loss (a 0-dim tensor) on the last stage, else None."""
        spec, tr, mb, C = self.spec, self.tracer, self.mb, self.C
        self._prepare_weights()
        units = [(b, i) for b in range(self.nb) for i in range(len(self.slices))]
        n_tokens = self.batch_size * self.T
        states = [[KVState(self.masks) for _ in self.blocks] for _ in range(self.nb)]
        sends: list = []
        # forward receives, all posted at once
        recvs = {}
        if not spec.is_first:
            for u, (b, i) in enumerate(units):
                buf = torch.empty(mb, self.slices[i][1], C, device=self.device)
                recvs[u] = (buf, dist.irecv(buf, self.prev, tag=u))
        saved: list = [None] * len(units)
        total = torch.zeros((), device=self.device) if spec.is_last else None
        for u, (b, i) in enumerate(units):
            c, l = self.slices[i]
            x_in = None
            if spec.is_first:
                x = None
            else:
                buf, work = recvs.pop(u)
                with tr.span("recv", f"recv f{b}.{i}"):
                    work.wait()
                x_in = buf.requires_grad_()
            with tr.span("forward", f"F{b}.{i}"):
                with autocast(self.device, self.mixed):
                    if spec.is_first:
                        rows = slice(b * mb, (b + 1) * mb)
                        idx = inputs[rows, c : c + l]
                        x = F.embedding(idx, self.model.wte.weight) + self.model.wpe.weight[c : c + l]
                    else:
                        x = x_in
                    x = self._forward_unit(x, states[b], c)
                    if spec.is_last:
                        h = F.layer_norm(x, (C,), self.model.ln_f.weight, self.model.ln_f.bias)
                        logits = self._lin("lm_head", h)
                        tgt = targets[b * mb : (b + 1) * mb, c : c + l]
                        loss = F.cross_entropy(logits.reshape(-1, self.V).float(), tgt.reshape(-1), reduction="sum") / n_tokens
                        total += loss.detach()
                        saved[u] = (x_in, loss)
                    else:
                        saved[u] = (x_in, x)
            if not spec.is_last:
                with tr.span("send", f"send f{b}.{i}"):
                    out = x.detach()
                    if out.dtype != torch.float32:
                        out = out.float()
                    sends.append((out, dist.isend(out.contiguous(), self.next, tag=u)))
        # backward receives
        grecvs = {}
        if not spec.is_last:
            for u in reversed(range(len(units))):
                b, i = units[u]
                buf = torch.empty(mb, self.slices[i][1], C, device=self.device)
                grecvs[u] = (buf, dist.irecv(buf, self.next, tag=u))
        for u in reversed(range(len(units))):
            b, i = units[u]
            x_in, y = saved[u]
            saved[u] = None
            if spec.is_last:
                with tr.span("backward", f"B{b}.{i}"):
                    (y * self.loss_scale if self.loss_scale != 1.0 else y).backward()
            else:
                buf, work = grecvs.pop(u)
                with tr.span("recv", f"recv b{b}.{i}"):
                    work.wait()
                with tr.span("backward", f"B{b}.{i}"):
                    y.backward(buf)
            del y
            if not spec.is_first:
                with tr.span("send", f"send b{b}.{i}"):
                    g = x_in.grad
                    if g.dtype != torch.float32:
                        g = g.float()
                    sends.append((g, dist.isend(g.contiguous(), self.prev, tag=u)))
            del x_in
        with tr.span("wgrad", "weight grads"):
            for name, (w, b, stash) in self.linears.items():
                dW, db = weight_grads(stash, b is not None)
                w.grad = dW if dW.dtype == w.dtype else dW.to(w.dtype)
                if b is not None:
                    b.grad = db if db.dtype == b.dtype else db.to(b.dtype)
        self._w = {}
        with tr.span("send", "wait sends"):
            for _, work in sends:
                work.wait()
        return total
