"""Tensor parallelism inside a stage (``--tp T``), as Megatron-LM splits a transformer layer.

Each block's linears are split over the T ranks of a stage: ``attn.c_attn`` (q, k and v of the
rank's n_head / T heads) and ``mlp.c_fc`` column-parallel (rows of the weight, slices of the bias),
``attn.c_proj`` and ``mlp.c_proj`` row-parallel (columns of the weight; the bias whole, added once
after the sum). The block's input reaches the column-parallel linears through ``f`` (identity
forward, all-reduce of the gradient backward), the row-parallel linears' partial outputs leave
through ``g`` (all-reduce forward, identity backward): one all-reduce after attention and one after
the MLP in forward, one for each in backward. Everything else (LayerNorms, the embeddings, ln_f and
the row-parallel biases) is replicated on the T ranks and gets the same gradient on each, without
communication: every rank of a stage sees the same activations and their gradients. The LM head is
split by vocabulary rows (behind ``f``), and the loss computed on the split logits
(``VocabParallelCrossEntropy``, Megatron's: the max, the sum of exponentials and the target's logit
all-reduced), so no rank holds the whole logits.

The weights are the shared model's, split from the stage's full initialisation (``shard_stage``);
``gather_full`` puts a parameter's shards back together (``--verify``'s gradients, the eval's
weights). The collectives run on a process group of the stage's own (``tp_groups``).

Global rank = (dp_rank * P + stage) * T + tp_rank (``rank_of``): with T = 1 ours' order as it was; the
pipeline links join the same tp_rank of adjacent stages, DP joins the same (stage, tp_rank).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn as nn

# each split linear of a block: (dimension of the weight it is split along, interleaved parts)
# c_attn's rows are [q; k; v], each split by heads, so its shard is [q_t; k_t; v_t]
SPLITS = {"attn.c_attn": (0, 3), "mlp.c_fc": (0, 1), "attn.c_proj": (1, 1), "mlp.c_proj": (1, 1)}
COLUMN_PARALLEL = frozenset(n for n, (dim, _) in SPLITS.items() if dim == 0)


def rank_of(dp_rank: int, stage: int, tp_rank: int, pp: int, tp: int) -> int:
    """The global rank of (dp_rank, stage, tp_rank)."""
    return (dp_rank * pp + stage) * tp + tp_rank


def coords(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, stage, tp_rank) of a global rank (the inverse of ``rank_of``)."""
    rest, tp_rank = divmod(rank, tp)
    dp_rank, stage = divmod(rest, pp)
    return dp_rank, stage, tp_rank


def split_of(name: str) -> tuple[int, int] | None:
    """(dim, parts) of a parameter split over the TP ranks, by its name in the shared model; None:
    replicated (row-parallel biases included)."""
    if name == "lm_head.weight":  # by vocabulary rows
        return 0, 1
    for lname, (dim, parts) in SPLITS.items():
        if name.endswith(f".{lname}.weight"):
            return dim, parts
        if name.endswith(f".{lname}.bias"):
            return (0, parts) if dim == 0 else None
    return None


def shard_start(n: int, tp: int, tp_rank: int) -> int:
    """Where tp_rank's part of n rows starts (``Tensor.tensor_split``'s parts: the first n % T one longer)."""
    q, r = divmod(n, tp)
    return tp_rank * q + min(tp_rank, r)


def shard(full: torch.Tensor, dim: int, parts: int, tp: int, tp_rank: int) -> torch.Tensor:
    """tp_rank's shard of ``full``: along ``dim``, seen as ``parts`` equal blocks, the tp_rank-th 1/T
    of each block (c_attn: of q, of k and of v), concatenated. A block that T does not divide (the
    LM head's vocabulary) is cut as ``tensor_split`` cuts it."""
    blocks = full.chunk(parts, dim)
    return torch.cat([b.tensor_split(tp, dim)[tp_rank] for b in blocks], dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The full tensor from every rank's shard, by tp_rank (the inverse of ``shard``)."""
    pieces = [s.chunk(parts, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim) for j in range(parts)], dim)


@torch.no_grad()
def shard_stage(model: nn.Module, tp: int, tp_rank: int) -> None:
    """Replace the stage's split parameters by tp_rank's shards, in place (names unchanged)."""
    if tp == 1:
        return
    for name, p in list(model.named_parameters()):
        split = split_of(name)
        if split is None:
            continue
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(shard(p.detach(), *split, tp, tp_rank)))


def gather_full(tensors: dict[str, torch.Tensor], tp: int, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The full tensors of a stage's parameters (or their gradients), by name: the split ones gathered
    from the T ranks of the stage (collective over ``group``: every TP rank calls it, with the same
    names in the same order), the replicated ones as they are."""
    if tp == 1:
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        split = split_of(name)
        if split is None:
            out[name] = t
            continue
        dim = split[0]
        sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(tp)]
        dist.all_gather(sizes, torch.tensor([t.shape[dim]], device=t.device), group=group)
        sizes = [int(n) for n in sizes]
        pad = list(t.shape)
        pad[dim] = max(sizes)  # all_gather takes equal shapes: pad the shorter parts, then cut them back
        mine = torch.zeros(pad, dtype=t.dtype, device=t.device)
        mine.narrow(dim, 0, t.shape[dim]).copy_(t)
        shards = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(shards, mine, group=group)
        out[name] = unshard([x.narrow(dim, 0, n) for x, n in zip(shards, sizes)], *split)
    return out


def tp_groups(pp: int, tp: int, dp: int, rank: int,
              timeout: datetime.timedelta | None = None) -> dist.ProcessGroup | None:
    """The process group of this rank's stage (its T ranks) for the TP collectives; every rank creates
    every stage's group, in one order (``timeout``: each operation's). None with T = 1."""
    if tp == 1:
        return None
    mine = None
    for d in range(dp):
        for s in range(pp):
            g = dist.new_group([rank_of(d, s, t, pp, tp) for t in range(tp)], timeout=timeout)
            if coords(rank, pp, tp)[:2] == (d, s):
                mine = g
    return mine


class CopyToTP(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel linear; identity forward, the gradient summed
    over the stage's TP ranks backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the partial outputs of a row-parallel linear summed over the stage's TP ranks
    forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over the stage's TP ranks: ``logits``
    (N, V / T) float, this rank's columns [``start``, ``start`` + V / T) of the vocabulary; ``targets``
    (N,) global ids. Returns (N,) losses, the same on every rank; backward gives this rank's part of
    softmax - onehot. Megatron's ``vocab_parallel_cross_entropy``: three all-reduces forward (max, sum
    of exponentials, the target's logit), none backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup):
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(picked, group=group)
        exp.div_(total.unsqueeze(-1))  # the softmax
        ctx.save_for_backward(exp, local, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        return grad * dloss.unsqueeze(-1), None, None, None
