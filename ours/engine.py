"""The token-level pipeline engine (TeraPipe) of one stage.

A stage applies its part of the shared model (``workload.model``, either family) token slice by token
slice: the embeddings with the slice's position offset on the first stage (gpt's learned positions);
every layer through the shared ``block_forward`` at the slice's offset (llama's rotary positions), with
the slice's attention over the sequence's cached keys and values (``SliceAttention``; grouped-query:
the cache holds the key/value heads only) and deferred-gradient linears (``DeferredLinear``; llama's
without biases) plugged in; ln_f (LayerNorm or RMSNorm), lm_head and
the loss (sum over the slice's tokens / tokens of the replica batch) on the last stage, computed at
the start of the unit's backward (see ``_head_loss``).

One step: the batch is cut into batch slices (micro_batch_size rows) x token slices; each
(batch slice, token slice) unit runs forward — receiving its input activations from the previous
stage, sending its output to the next — and later backward, in the order ``ours.schedule`` gives
(``1f1b`` over batch slices by default; ``gpipe``: every forward, then every backward). Activations and
their gradients move with asynchronous point-to-point operations, one message per unit and
direction, each direction of a link on a process group of its own (``contract.links``: activations
from stage s to s + 1, their gradients from s + 1 to s), where they match by order, as NCCL matches
them (no tags): a stage receives a link's units in the order its neighbour sends them (forwards in
unit order, backwards in the schedule's order, the same on every stage). Every receive of a step
is posted a step ahead (``post_receives``): gloo sends a message only once the receiver's notice
that its receive is posted has reached the sender, so a receive posted as the step starts costs the
first message a second network delay; on a group that carries one direction only, a pending
receive holds back no send (under NCCL a pair's operations on a group run one at a time, in issue
order). Sends are waited for only at the end of the step. Linear weight gradients are deferred:
computed while the stage waits for a message, and what is left once per step after the stage's last
backward (while the previous stage is still in its backward); ``grads_ready`` is told as each
parameter's gradient becomes final, so data parallelism can start moving it (``ours.dp``).

``wire_dtype`` (default fp32): the type activations and their gradients cross the network in; bf16
or fp16 is lossy (compute stays in the stage's own precision).

``precision`` (``workload.training``): under bf16 / fp16 the units run under that autocast, the
linears apply the weights cast once per step to the half type, and each weight gradient is summed
over the units in fp32 (``WeightGrad``). fp16's loss scale is set by the caller (``loss_scale``): the
last stage scales each unit's loss by it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from contract.links import Ends, posts_ahead
from ours.kernels import DeferredLinear, KVState, SliceAttention, WeightGrad
from ours.schedule import unit_order
from ours.tp import COLUMN_PARALLEL, CopyToTP, ReduceFromTP, VocabParallelCrossEntropy, rank_of, shard_start
from ours.trace import Tracer
from workload.model import GPT, block_forward
from workload.partition import StageSpec
from workload.training import autocast, compute_dtype

_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def pipeline_links(pp: int, dp: int, tp: int = 1) -> list[Ends]:
    """Every link of the D x T pipelines of P stages (``ours.tp.rank_of``: global rank =
    (dp_rank * P + stage) * T + tp_rank), both ways: stage s to s + 1 (activations), s + 1 to s
    (their gradients), between ranks of the same tp_rank."""
    return [link for d in range(dp) for t in range(tp) for s in range(pp - 1)
            for a, b in [(rank_of(d, s, t, pp, tp), rank_of(d, s + 1, t, pp, tp))] for link in ((a, b), (b, a))]


class _Arrivals:
    """Tells whether posted receives have arrived without blocking the main thread.

    gloo's ``Work.is_completed()`` of a receive stays False until ``wait()`` is called, so a helper
    thread waits on the receives in the order they will be consumed (``wait`` releases the GIL) and
    marks each one arrived. The main thread then waits on the marks only, never on the works (two
    threads must not wait on one work)."""

    def __init__(self, works: list):
        self._events = {u: threading.Event() for u, _ in works}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(works,), daemon=True)
        self._thread.start()

    def _run(self, works: list) -> None:
        for u, work in works:
            try:
                if self._error is None:
                    work.wait()
            except BaseException as exc:  # handed to the main thread
                self._error = exc
            finally:
                self._events[u].set()

    def arrived(self, u: int) -> bool:
        return self._events[u].is_set()

    def wait(self, u: int) -> None:
        self._events[u].wait()
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        self._thread.join()


@dataclass
class _Step:
    """One step in progress on a stage: its inputs, receives, per-row KV states, saved activations,
    sends to wait for, the loss so far (last stage) and how far through ``StageEngine.order`` it is."""
    inputs: torch.Tensor
    recvs: dict
    grecvs: dict
    arrivals: tuple
    states: list
    saved: list
    sends: list
    total: torch.Tensor | None
    pos: int = 0


class StageEngine:
    def __init__(self, model: GPT, spec: StageSpec, *, slices: tuple[int, ...], batch_size: int, micro_batch_size: int,
                 device: torch.device, rank: int, prev_rank: int | None, next_rank: int | None, tracer: Tracer,
                 precision: str = "fp32", recompute: bool = False, wire_dtype: torch.dtype = torch.float32,
                 schedule: str = "1f1b", grads_ready: Callable[[list[torch.nn.Parameter]], None] | None = None,
                 links: Mapping[Ends, dist.ProcessGroup] | None = None, tp: int = 1,
                 tp_rank: int = 0, tp_group: dist.ProcessGroup | None = None):
        cfg = model.config
        self.model, self.spec, self.device, self.rank = model, spec, device, rank
        # H: the heads this rank computes (its 1/tp of them: ``ours.tp``, the model's linears and LM head
        # split by ``shard_stage``); the TP collectives run on ``tp_group``
        self.C, self.H, self.T, self.V = cfg.n_embd, cfg.n_head // tp, cfg.seq_len, cfg.vocab_size
        self.H_kv = cfg.n_kv_head // tp  # the key/value heads it computes and caches (grouped-query: fewer)
        self.tp_group, self.tp_rank = (tp_group if tp > 1 else None), tp_rank
        self.slices = [(sum(slices[:i]), slices[i]) for i in range(len(slices))]
        self.batch_size, self.mb = batch_size, micro_batch_size
        self.nb = batch_size // micro_batch_size
        # (batch slice, token slice) of every unit, in forward order
        self.units = [(b, i) for b in range(self.nb) for i in range(len(slices))]
        # (F|B, unit) in the order this stage runs them; a unit's index is its position in forward order
        self.order = [(kind, b * len(slices) + i)
                      for kind, b, i in unit_order(schedule, self.nb, len(slices), spec.index, spec.n_stages)]
        # 1f1b bounds what a stage holds: the weight-gradient stash (each linear's input and output
        # gradient per unit, as large as the activations) keeps at most the units of P - s batch slices;
        # gpipe defers every weight gradient to the waits and the step's end
        held = min(self.nb, spec.n_stages - spec.index)
        self.stash_limit = held * len(slices) if schedule == "1f1b" else None
        self.prev, self.next = prev_rank, next_rank
        self.links = dict(links or {})  # (source, destination) -> the process group of that link's direction
        self.tracer = tracer
        self.precision = precision
        self.recompute = recompute
        self.low_dtype = compute_dtype(precision)
        self.blocks = list(model.blocks.values())
        # deferred-gradient linears: (weight param, bias param or None, stash)
        self.linears: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter | None, WeightGrad]] = {}
        for i, blk in model.blocks.items():
            for lname in _LINEARS:
                mod = blk.get_submodule(lname)
                self.linears[f"blocks.{i}.{lname}"] = (mod.weight, mod.bias, WeightGrad(mod.bias is not None))
        if spec.is_last:
            self.linears["lm_head"] = (model.lm_head.weight, None, WeightGrad(False))
        self._w: dict[str, tuple[torch.Tensor, torch.Tensor | None, list]] = {}
        deferred = {id(p) for w, b, _ in self.linears.values() for p in (w, b) if p is not None}
        self._autograd_params = [p for p in model.parameters() if id(p) not in deferred]
        self.wire_dtype = wire_dtype
        self.grads_ready = grads_ready  # called with each group of parameters whose gradient is final
        self._posted: tuple[dict, dict] | None = None  # the coming step's (forward, backward) receives
        self._pending: _Step | None = None  # the next step, its first forwards run ahead (``prefetch``)
        self.loss_scale = 1.0  # fp16's dynamic loss scaling sets it

    # ---- the functional forward -------------------------------------------------------------
    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w, b, wg = self._w[name]
        return DeferredLinear.apply(x, w, b, wg.stash)

    def _block_lin(self, name: str, lname: str, x: torch.Tensor) -> torch.Tensor:
        """A block's linear ``lname`` ("attn.c_attn", ...): under tensor parallelism column-parallel
        behind f, or row-parallel followed by g and then its bias, if the family has one (``ours.tp``);
        the bias's gradient is the sum of the output gradient either way (``WeightGrad``)."""
        if self.tp_group is None:
            return self._lin(name, x)
        if lname in COLUMN_PARALLEL:
            return self._lin(name, CopyToTP.apply(x, self.tp_group))
        w, b, wg = self._w[name]
        y = ReduceFromTP.apply(DeferredLinear.apply(x, w, None, wg.stash), self.tp_group)
        return y if b is None else y + b

    def _layer(self, idx: str, blk, x: torch.Tensor, state: KVState, c: int) -> torch.Tensor:
        """One layer on token slice [c, c + len): the shared block at the slice's offset (llama's rotary
        positions), with the slice's attention over the sequence's cached keys and values and the
        stage's deferred-gradient linears."""
        return block_forward(blk, x, attention=lambda qkv: SliceAttention.apply(qkv, state, c, self.H, self.H_kv,
                                                                                self.T),
                             linear=lambda name, module, h: self._block_lin(f"blocks.{idx}.{name}", name, h),
                             offset=c)

    def _forward_unit(self, x: torch.Tensor, states: list[KVState], c: int) -> torch.Tensor:
        for (idx, blk), state in zip(self.model.blocks.items(), states):
            if self.recompute:
                x = checkpoint(self._layer, idx, blk, x, state, c, use_reentrant=False)
            else:
                x = self._layer(idx, blk, x, state, c)
        return x

    def _head_loss(self, x: torch.Tensor, targets: torch.Tensor, b: int, i: int) -> torch.Tensor:
        """Last stage: ln_f -> lm_head -> the unit's share of the loss (sum over its tokens / tokens
        of the replica batch). Computed when the unit's backward starts, not in its forward: nothing
        downstream waits for it, so the forward phase (which the previous stage's first gradient
        waits on) gets shorter, and a unit's logits live only during its own backward."""
        c, l = self.slices[i]
        with autocast(self.device, self.precision):
            h = self.model.ln_f(x)
            tgt = targets[b * self.mb : (b + 1) * self.mb, c : c + l]
            if self.tp_group is not None:  # the head split by vocabulary (ours.tp)
                logits = self._lin("lm_head", CopyToTP.apply(h, self.tp_group))
                tp = dist.get_world_size(self.tp_group)
                losses = VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                                         shard_start(self.V, tp, self.tp_rank), self.tp_group)
                return losses.sum() / (self.batch_size * self.T)
            logits = self._lin("lm_head", h)
            return F.cross_entropy(logits.reshape(-1, self.V).float(), tgt.reshape(-1),
                                   reduction="sum") / (self.batch_size * self.T)

    def _prepare_weights(self) -> None:
        """The weights the linears apply this step (detached: their gradients are computed by
        ``WeightGrad``); cast once per step to the half type under bf16 / fp16."""
        self._w = {}
        for name, (w, b, wg) in self.linears.items():
            w = w.detach()
            b = b.detach() if b is not None else None
            if self.low_dtype != torch.float32:
                w = w.to(self.low_dtype)
                b = b.to(self.low_dtype) if b is not None else None
            self._w[name] = (w, b, wg)

    def _wait_filling(self, work, arrivals: "_Arrivals | None", u: int, name: str) -> None:
        """Wait for a receive; meanwhile, accumulate pending weight gradients (fills the bubble)."""
        if arrivals is None:
            with self.tracer.span("recv", name):
                work.wait()
            return
        wgs = [wg for _, _, wg in self.linears.values()]
        while not arrivals.arrived(u):
            pending = next((wg for wg in wgs if wg.stash), None)
            if pending is None:
                break
            with self.tracer.span("wgrad", "wgrad (fill)"):
                pending.drain(1)
        with self.tracer.span("recv", name):
            arrivals.wait(u)

    def _bound_stash(self) -> None:
        """Compute the weight gradients a linear's stash holds beyond ``stash_limit`` units (the newest
        first: the unit just through its backward, whose tensors are still in cache)."""
        if self.stash_limit is None:
            return
        for _, _, wg in self.linears.values():
            extra = len(wg.stash) - self.stash_limit
            if extra > 0:
                with self.tracer.span("wgrad", "wgrad (bound)"):
                    wg.drain(extra)

    # ---- one step ----------------------------------------------------------------------------
    def grad_order(self) -> list[torch.nn.Parameter]:
        """The stage's parameters in the order ``grads_ready`` reports their gradients final in a step:
        those autograd accumulates (layer norms, embeddings) at the end of the last backward, then each
        linear's weight and bias as its deferred gradient is computed."""
        return self._autograd_params + [p for w, b, _ in self.linears.values() for p in (w, b) if p is not None]

    def post_receives(self) -> None:
        """Post every receive of the coming step: the activations of each unit from the previous stage
        and their gradients from the next, each link's in the order they will be consumed."""
        if self._posted is not None:
            return
        units = self.units
        fwd, bwd = {}, {}
        for kind, u in self.order:
            src = self.prev if kind == "F" else self.next
            if src is None:
                continue
            buf = torch.empty(self.mb, self.slices[units[u][1]][1], self.C, dtype=self.wire_dtype, device=self.device)
            (fwd if kind == "F" else bwd)[u] = (buf, dist.irecv(buf, src, group=self.links[src, self.rank]))
        self._posted = (fwd, bwd)

    def post_ahead(self) -> None:
        """Post the coming step's receives now where receives are posted ahead (``contract.links.posts_ahead``:
        gloo); on CUDA the step posts its own when it begins (``post_receives``)."""
        if posts_ahead(self.device):
            self.post_receives()

    def _send(self, t: torch.Tensor, dst: int, sends: list) -> None:
        out = t.detach().to(self.wire_dtype).contiguous()  # gloo: contiguous CPU tensors
        sends.append((out, dist.isend(out, dst, group=self.links[self.rank, dst])))

    def _report(self, params: list[torch.nn.Parameter]) -> None:
        if self.grads_ready is not None and params:
            self.grads_ready(params)

    def _begin(self, inputs: torch.Tensor) -> _Step:
        """A step's state, its receives taken from those posted."""
        self._prepare_weights()
        self.post_receives()  # no-op when the previous step posted them
        (recvs, grecvs), self._posted = self._posted, None
        # gloo: helper threads tell which receives have arrived, so waits can compute weight gradients
        # (see _Arrivals), each stream in the order it is consumed
        arrivals: tuple = (None, None)
        if self.device.type == "cpu":
            arrivals = tuple(_Arrivals([(u, work) for u, (_, work) in posted.items()]) if posted else None
                             for posted in (recvs, grecvs))
        return _Step(inputs=inputs, recvs=recvs, grecvs=grecvs, arrivals=arrivals,
                     states=[[KVState() for _ in self.blocks] for _ in range(self.nb)],
                     saved=[None] * len(self.units), sends=[],
                     total=torch.zeros((), device=self.device) if self.spec.is_last else None)

    def prefetch(self, inputs: torch.Tensor, n_units: int) -> None:
        """Run the next step's first ``n_units`` forwards now (``ours.schedule.ahead``: none on the last
        stage, never beyond the stage's first backward), with the weights this step's optimizer has just
        made; ``step`` goes on from there. A later stage receives their inputs from the previous stage's
        prefetch of the same step, so the next stage gets its first input while this step's drain still
        runs on the stages after it, instead of waiting for it when the next step begins (the pipeline's
        fill). Call only once every weight of the stage is final for the next step and its gradients
        are released: the forwards run ahead are part of what the stage holds at its peak in the next
        step (the first units of its order), so the stage's peak memory stays the step's own.

        The timing: they run inside this step's timed window (``contract.rank.run_steps``) and are the
        next step's work, so in steady state each window holds one step's work (its own less what ran
        ahead in the previous window, plus the same forwards of the next step); the first step after
        the warm-up had its forwards run in the last warm-up window, the run's last step runs none."""
        if self.spec.is_last or n_units <= 0 or self._pending is not None:
            return
        lead = next((k for k, (kind, _) in enumerate(self.order) if kind != "F"), len(self.order))
        with self.tracer.span("prefetch", "next step's first forwards"):
            st = self._begin(inputs)
            self._run(st, None, min(n_units, lead))
        self._pending = st

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, post_next: bool = False) -> torch.Tensor | None:
        """Forward and backward of the replica batch; leaves every parameter's gradient in .grad.
        Returns the replica's mean loss (a 0-dim tensor) on the last stage, else None. ``post_next``:
        another step follows, whose receives are posted before this one returns (``post_ahead``)."""
        st, self._pending = self._pending, None
        if st is None:
            st = self._begin(inputs)
        elif not torch.equal(st.inputs, inputs):
            raise RuntimeError("ours: the step's inputs are not those its first forwards were prefetched with")
        self._run(st, targets, len(self.order))
        for a in st.arrivals:
            if a is not None:
                a.join()
        if post_next:
            self.post_ahead()
        tr = self.tracer
        with tr.span("wgrad", "weight grads"):
            self._report(self._autograd_params)
            for w, bias, wg in self.linears.values():
                dW, db = wg.finish()
                w.grad = dW if dW.dtype == w.dtype else dW.to(w.dtype)
                if bias is not None:
                    bias.grad = db if db.dtype == bias.dtype else db.to(bias.dtype)
                self._report([w] if bias is None else [w, bias])
        self._w = {}
        with tr.span("send", "wait sends"):
            for _, work in st.sends:
                work.wait()
        return st.total

    def _run(self, st: _Step, targets: torch.Tensor | None, stop: int) -> None:
        """Run the stage's actions (``self.order``) from where ``st`` is up to ``stop``."""
        spec, tr, units = self.spec, self.tracer, self.units
        for kind, u in self.order[st.pos:stop]:
            b, i = units[u]
            if kind == "F":
                x_in = None
                if not spec.is_first:
                    buf, work = st.recvs.pop(u)
                    self._wait_filling(work, st.arrivals[0], u, f"recv f{b}.{i}")
                    x_in = buf.float().requires_grad_()
                with tr.span("forward", f"F{b}.{i}"):
                    x = self._forward(x_in, st.inputs, st.states[b], b, i)
                    st.saved[u] = (x_in, x)
                if not spec.is_last:
                    with tr.span("send", f"send f{b}.{i}"):
                        self._send(x, self.next, st.sends)
                continue
            x_in, y = st.saved[u]
            st.saved[u] = None
            if spec.is_last:
                with tr.span("backward", f"B{b}.{i}"):
                    loss = self._head_loss(y, targets, b, i)
                    st.total += loss.detach()
                    (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
                del loss
            else:
                buf, work = st.grecvs.pop(u)
                self._wait_filling(work, st.arrivals[1], u, f"recv b{b}.{i}")
                with tr.span("backward", f"B{b}.{i}"):
                    y.backward(buf.to(y.dtype))
            del y
            if not spec.is_first:
                with tr.span("send", f"send b{b}.{i}"):
                    self._send(x_in.grad, self.prev, st.sends)
            del x_in
            self._bound_stash()
        st.pos = stop

    def _forward(self, x_in: torch.Tensor | None, inputs: torch.Tensor, states: list[KVState], b: int,
                 i: int) -> torch.Tensor:
        """Unit (b, i)'s forward through the stage: the embeddings on the first stage, then its layers."""
        c, l = self.slices[i]
        with autocast(self.device, self.precision):
            if self.spec.is_first:
                idx = inputs[b * self.mb : (b + 1) * self.mb, c : c + l]
                x = self.model.embed(idx, pos_offset=c)
            else:
                x = x_in
            return self._forward_unit(x, states, c)
