"""The rank entry point, started by torchrun: python -m runners.worker RUN_DIR.

Initialises torch.distributed (nccl on CUDA, gloo on CPU), runs the system's train(config, context)
and hands its measurements to rank 0, which writes RUN_DIR/result.json for the launcher. A rank that
fails writes RUN_DIR/error-rank<R>.json (status oom or error) and exits non-zero.
"""
from __future__ import annotations

import datetime
import json
import os
import resource
import socket
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

# Die with the torchrun agent, whatever way it dies (before the seconds of importing torch).
from runners.lifetime import die_with_parent_now  # noqa: E402

die_with_parent_now()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from contract import RunConfig  # noqa: E402
from contract.rank import Context  # noqa: E402
from runners.cores import rank_cores  # noqa: E402
from runners.output import is_peer_failure  # noqa: E402
from contract.registry import get_system  # noqa: E402
from workload.cpu_peak import cpu_peak_tflops  # noqa: E402
from workload.flops import gpu_peak_tflops, measure_matmul_tflops  # noqa: E402


def pick_device(requested: str, local_rank: int, devices_per_process: int = 1) -> tuple[torch.device, str]:
    """This rank's (first) device and the backend: nccl on CUDA, gloo on CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but CUDA is not available")
        index = local_rank * devices_per_process
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    return torch.device("cpu"), "gloo"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS of this rank


def hardware_peak(device: torch.device, cfg: RunConfig) -> tuple[float, str, str]:
    """(peak TFLOP/s, where it came from, device name)."""
    precision = ("fp16" if device.type == "cuda" else "bf16") if cfg.mixed_precision else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision)
        if peak is not None:
            return peak, f"table:{precision}", name
    else:
        name = "cpu"
    dtype = torch.float32 if precision == "fp32" else (torch.float16 if device.type == "cuda" else torch.bfloat16)
    if device.type == "cpu":  # the model's own GEMMs on one thread, kept per host (workload.cpu_peak)
        return (*cpu_peak_tflops(cfg.model, cfg.micro_batch_size, dtype), name)
    return measure_matmul_tflops(device, dtype), f"measured-matmul:{precision}", name


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)  # CPU: DefaultCPUAllocator


def main(run_dir: Path) -> int:
    config = json.loads((run_dir / "config.json").read_text())
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ["WORLD_SIZE"])
    try:
        spec = get_system(config["system"])
        cfg = RunConfig.from_dict(config, spec.options)
        device, backend = pick_device(cfg.device, local_rank, spec.devices_per_process(cfg))
        if device.type == "cpu":
            torch.set_num_threads(1)  # one thread per rank: ranks share few cores
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(60.0, cfg.timeout)))
        torch.manual_seed(cfg.seed)
        peak, peak_source, device_name = hardware_peak(device, cfg)
        barrier_group = dist.new_group(list(range(world))) if world > 1 else None  # the timing barrier's own
        ctx = Context(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend, config=cfg,
                      barrier_group=barrier_group)
        m = spec.load()(cfg, ctx)
        m.peak_memory_bytes = peak_memory_bytes(device)
        if m.grads is not None:
            torch.save({k: v.detach().float().cpu() for k, v in m.grads.items()}, run_dir / f"grads-rank{rank}.pt")
        summary = {k: v for k, v in asdict(m).items() if k != "grads"}
        summary.update(rank=rank, hostname=socket.gethostname(), device=str(device), device_name=device_name,
                       backend=backend, peak_tflops=peak, peak_source=peak_source, **rank_cores(torch.get_num_threads()))
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(summary, gathered, dst=0)
        if rank == 0:
            tmp = run_dir / "result.json.tmp"
            tmp.write_text(json.dumps({"ranks": gathered}))
            tmp.rename(run_dir / "result.json")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # recorded for the launcher, then the rank dies and torchrun stops the rest
        status = "oom" if is_oom(exc) else "error"
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        peer = is_peer_failure(text)
        (run_dir / f"error-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "status": status, "error": text, "peer_failure": peer, "time": time.time(),
             "traceback": traceback.format_exc()}))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip teardown that could hang on peers


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
