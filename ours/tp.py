"""Tensor parallelism inside a stage (``--tp T``), as Megatron-LM splits a transformer layer.

Each block's linears are split over the T ranks of a stage: ``attn.c_attn`` (q of the rank's n_head / T
query heads, k and v of its n_kv_head / T key/value heads: T divides both) and ``mlp.c_fc`` (llama's:
the rank's 1/T of the gate and of the up projection) column-parallel (rows of the weight, slices of the
bias), ``attn.c_proj`` and ``mlp.c_proj`` row-parallel (columns of the weight; the bias, where the
family has one, whole, added once after the sum). The block's input reaches the column-parallel
linears through ``f`` (identity forward, all-reduce of the gradient backward), the row-parallel
linears' partial outputs leave through ``g`` (all-reduce forward, identity backward): one all-reduce
after attention and one after the MLP in forward, one for each in backward. Everything else (the
norms, the embeddings, ln_f and the row-parallel biases) is replicated on the T ranks and gets the
same gradient on each, without communication: every rank of a stage sees the same activations and
their gradients. The LM head is split by vocabulary rows (behind ``f``), and the loss computed on the
split logits (``VocabParallelCrossEntropy``, Megatron's: the max, the sum of exponentials and the
target's logit all-reduced), so no rank holds the whole logits.

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

from workload.configs import ModelConfig, qkv_rows

# each split linear of a block: the dimension of its weight split over the T ranks (0: column-parallel,
# by rows; 1: row-parallel, by columns)
SPLITS = {"attn.c_attn": 0, "mlp.c_fc": 0, "attn.c_proj": 1, "mlp.c_proj": 1}
COLUMN_PARALLEL = frozenset(n for n, dim in SPLITS.items() if dim == 0)


def rank_of(dp_rank: int, stage: int, tp_rank: int, pp: int, tp: int) -> int:
    """The global rank of (dp_rank, stage, tp_rank)."""
    return (dp_rank * pp + stage) * tp + tp_rank


def coords(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, stage, tp_rank) of a global rank (the inverse of ``rank_of``)."""
    rest, tp_rank = divmod(rank, tp)
    dp_rank, stage = divmod(rest, pp)
    return dp_rank, stage, tp_rank


def _blocks(lname: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The blocks of rows a split linear's weight is made of along its split dimension, each split by T
    on its own: c_attn's q, k and v (``qkv_rows``: whole heads of each on a rank, so T must divide the
    key/value heads), llama's c_fc gate and up, else the one dimension."""
    if lname == "attn.c_attn":
        return qkv_rows(cfg)
    if lname == "mlp.c_fc":
        return (cfg.ffn_dim,) * (2 if cfg.llama else 1)
    return (cfg.n_embd,) if lname == "attn.c_proj" else (cfg.ffn_dim,)


def split_of(name: str, cfg: ModelConfig) -> tuple[int, tuple[int, ...]] | None:
    """(dim, blocks) of a parameter split over the TP ranks, by its name in the shared model of ``cfg``:
    the dimension and the sizes of the blocks along it (``shard``); None: replicated (row-parallel
    biases included)."""
    if name == "lm_head.weight":  # by vocabulary rows
        return 0, (cfg.vocab_size,)
    for lname, dim in SPLITS.items():
        if name.endswith(f".{lname}.weight"):
            return dim, _blocks(lname, cfg)
        if name.endswith(f".{lname}.bias"):
            return (0, _blocks(lname, cfg)) if dim == 0 else None
    return None


def shard_start(n: int, tp: int, tp_rank: int) -> int:
    """Where tp_rank's part of n rows starts (``Tensor.tensor_split``'s parts: the first n % T one longer)."""
    q, r = divmod(n, tp)
    return tp_rank * q + min(tp_rank, r)


def _part(n: int, tp: int, tp_rank: int) -> int:
    """The length of tp_rank's part of n rows (``shard_start``)."""
    return shard_start(n, tp, tp_rank + 1) - shard_start(n, tp, tp_rank)


def shard(full: torch.Tensor, dim: int, blocks: tuple[int, ...], tp: int, tp_rank: int) -> torch.Tensor:
    """tp_rank's shard of ``full``: along ``dim``, made of ``blocks`` (their sizes), the tp_rank-th 1/T
    of each block (c_attn: of q, of k and of v), concatenated. A block that T does not divide (the LM
    head's vocabulary) is cut as ``tensor_split`` cuts it."""
    parts = full.split(blocks, dim)
    return torch.cat([b.tensor_split(tp, dim)[tp_rank] for b in parts], dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int, blocks: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's shard, by tp_rank (the inverse of ``shard``)."""
    tp = len(shards)
    pieces = [s.split([_part(n, tp, t) for n in blocks], dim) for t, s in enumerate(shards)]
    return torch.cat([p[j] for j in range(len(blocks)) for p in pieces], dim)


@torch.no_grad()
def shard_stage(model: nn.Module, tp: int, tp_rank: int) -> None:
    """Replace the stage's split parameters by tp_rank's shards, in place (names unchanged)."""
    if tp == 1:
        return
    for name, p in list(model.named_parameters()):
        split = split_of(name, model.config)
        if split is None:
            continue
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(shard(p.detach(), *split, tp, tp_rank)))


def gather_full(tensors: dict[str, torch.Tensor], cfg: ModelConfig, tp: int,
                group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The full tensors of a stage's parameters (or their gradients), by name: the split ones gathered
    from the T ranks of the stage (collective over ``group``: every TP rank calls it, with the same
    names in the same order), the replicated ones as they are."""
    if tp == 1:
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        split = split_of(name, cfg)
        if split is None:
            out[name] = t
            continue
        dim, blocks = split
        sizes = [sum(_part(n, tp, r) for n in blocks) for r in range(tp)]
        pad = list(t.shape)
        pad[dim] = max(sizes)  # all_gather takes equal shapes: pad the shorter parts, then cut them back
        mine = torch.zeros(pad, dtype=t.dtype, device=t.device)
        mine.narrow(dim, 0, t.shape[dim]).copy_(t)
        shards = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(shards, mine, group=group)
        out[name] = unshard([x.narrow(dim, 0, n) for x, n in zip(shards, sizes)], dim, blocks)
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
