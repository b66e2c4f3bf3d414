"""One rank of the lossy-wire comparison, started by torchrun (P-2 D-2, 4 ranks, gloo).

For each DP mode, one training step (pipeline + DP sync + optimizer) of a fresh stage with the fp32
wire and with a lossy wire (argv[2]) on the same data; rank 0 writes, per mode, the largest loss
difference and the relative error (max abs difference / max abs value, per tensor) of the averaged
gradients and of the parameters after the update (SGD: its update is linear in the gradient), and the largest
difference between the DP replicas' parameters (must be 0), to the JSON file argv[1].
"""
import json
import sys

import torch
import torch.distributed as dist

from contract.links import link_groups
from ours.dp import dp_links, make_sync
from ours.engine import StageEngine, pipeline_links
from ours.trace import Tracer
from workload.configs import ModelConfig, OptimizerConfig
from workload.data import TokenSource
from workload.partition import build_stage, stage_specs

PP, DP = 2, 2
CFG = ModelConfig("wire", 4, 64, 4, seq_len=32, vocab_size=128)


def one_step(mode: str, wire: torch.dtype, group, links, dp_rank: int, pp_rank: int) -> dict:
    spec = stage_specs(CFG.n_layer, PP)[pp_rank]
    model = build_stage(CFG, spec, seed=0, device="cpu")
    rank = dist.get_rank()
    engine = StageEngine(model, spec, slices=(12, 12, 8), batch_size=2, micro_batch_size=1, device=torch.device("cpu"),
                         rank=rank, prev_rank=None if spec.is_first else rank - 1,
                         next_rank=None if spec.is_last else rank + 1, tracer=Tracer(rank, False), wire_dtype=wire,
                         links=links)
    named = list(model.named_parameters())
    sync = make_sync(mode, named, OptimizerConfig(kind="sgd", lr=1e-2), group=group, dp=DP, dp_rank=dp_rank,
                     ranks=[d * PP + pp_rank for d in range(DP)], links=links, order=engine.grad_order(),
                     wire_dtype=wire)
    engine.grads_ready = sync.grads_ready
    sync.post_receives()
    inputs, targets = TokenSource(CFG.seq_len, CFG.vocab_size, seed=0).replica_batch(0, 2, dp_rank, DP)
    loss = engine.step(inputs, targets)
    sync.step()
    grads = sync.grads()
    # the replicas must hold the same parameters (bitwise), whatever the wire
    mine = torch.cat([p.detach().reshape(-1) for _, p in named])
    peers = [torch.empty_like(mine) for _ in range(DP)]
    dist.all_gather(peers, mine, group=group)
    replica_diff = max(float((q - mine).abs().max()) for q in peers)
    dist.barrier()
    return {"loss": None if loss is None else float(loss), "grads": grads,
            "params": {n: p.detach().clone() for n, p in named},
            "replica_diff": replica_diff}


def main() -> None:
    out, lossy = sys.argv[1], getattr(torch, sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, pp_rank = divmod(rank, PP)
    group = None
    for s in range(PP):
        g = dist.new_group([d * PP + s for d in range(DP)])
        if s == pp_rank:
            group = g
    links = link_groups(pipeline_links(PP, DP) + dp_links(PP, DP), torch.device("cpu"))
    result = {}
    for mode in ("allreduce", "central_ps", "sharded_ps"):
        exact, low = (one_step(mode, w, group, links, dp_rank, pp_rank) for w in (torch.float32, lossy))

        def rel(key: str) -> float:
            return max(float((low[key][n] - exact[key][n]).abs().max() / exact[key][n].abs().max().clamp_min(1e-12))
                       for n in exact[key])

        mine = {"loss": None if exact["loss"] is None else abs(low["loss"] - exact["loss"]),
                "grad_rel": rel("grads"), "param_rel": rel("params"), "loss_value": exact["loss"],
                "replica_diff": max(exact["replica_diff"], low["replica_diff"])}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            result[mode] = {
                "loss_diff": max(g["loss"] for g in gathered if g["loss"] is not None),
                "loss": max(g["loss_value"] for g in gathered if g["loss_value"] is not None),
                "grad_rel": max(g["grad_rel"] for g in gathered),
                "param_rel": max(g["param_rel"] for g in gathered),
                "replica_diff": max(g["replica_diff"] for g in gathered)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
