"""One rank of the forced-overflow check, started by torchrun (2 ranks, gloo): each system of argv[2:]
(torch_pipe, ours) trains P-2 under --precision fp16 for 3 steps through its own ``train``, and at
step 1 an inf is written into one gradient of the FIRST stage only (rank 0), just before the loss
scaler judges the step. Per step and rank it records the loss scale the step ran with, whether the
rank's parameters changed, and the scale afterwards; rank 0 writes {system: {rank: [...]}} to the JSON
file argv[1]. Every stage must skip step 1 and halve its scale, and step normally before and after.
"""
import json
import sys

import torch
import torch.distributed as dist

from contract import RunConfig
from contract.rank import Context
from workload.configs import ModelConfig

MODEL = ModelConfig("overflow", 2, 32, 4, seq_len=16, vocab_size=64)
FORCED_STEP, FORCED_RANK = 1, 0


def _params(opt_or_params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in opt_or_params]


def patch_torch_pipe(log: list, rank: int) -> None:
    """Wrap the shared scaler torch_pipe uses: force the overflow, record what each step did."""
    from workload.shared_scaler import SharedGradScaler

    step, update = SharedGradScaler.step, SharedGradScaler.update

    def forced_step(self, optimizer, *args, **kwargs):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len(log) == FORCED_STEP and rank == FORCED_RANK:
            params[0].grad.view(-1)[0] = float("inf")
        before = _params(params)
        scale = self.get_scale()
        out = step(self, optimizer, *args, **kwargs)
        log.append({"scale": scale, "stepped": any(not torch.equal(a, p) for a, p in zip(before, params))})
        return out

    def recorded_update(self, *args, **kwargs):
        update(self, *args, **kwargs)
        log[-1]["scale_after"] = self.get_scale()

    SharedGradScaler.step, SharedGradScaler.update = forced_step, recorded_update


def patch_ours(log: list, rank: int) -> None:
    """Wrap ours' loss scaler likewise (it judges the step before the optimizer)."""
    import ours.train

    check = ours.train._LossScaler.check_and_unscale

    def forced_check(self, params):
        if len(log) == FORCED_STEP and rank == FORCED_RANK:
            params[0].grad.view(-1)[0] = float("inf")
        log.append({"scale": self.scale, "params": params, "before": _params(params)})
        ok = check(self, params)
        log[-1]["scale_after"] = self.scale
        return ok

    ours.train._LossScaler.check_and_unscale = forced_check


def train(system: str, rank: int, world: int) -> list[dict]:
    from contract.registry import get_system

    spec = get_system(system)
    options = spec.options(**({"schedule": "1f1b"} if system == "torch_pipe" else {"n_slices": 2}))
    cfg = RunConfig(system=system, model=MODEL, batch_size=2, micro_batch_size=1, pp=2, steps=3, warmup=0,
                    precision="fp16", options=options)
    ctx = Context(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo", config=cfg)
    log: list[dict] = []
    (patch_torch_pipe if system == "torch_pipe" else patch_ours)(log, rank)
    m = spec.load()(cfg, ctx)
    if system == "ours":  # ours steps its optimizer after the check: compare the parameters now
        for i, entry in enumerate(log):
            after = log[i + 1]["before"] if i + 1 < len(log) else _params(entry["params"])
            entry["stepped"] = any(not torch.equal(a, b) for a, b in zip(entry.pop("before"), after))
        for entry in log:
            entry.pop("params")
    log.append({"losses": m.losses})
    return log


def main() -> None:
    out, systems = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for system in systems:
        log = train(system, rank, world)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(log, gathered, dst=0)
        result[system] = gathered
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
