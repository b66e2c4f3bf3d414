"""The rank entry point, started by torchrun: python -m runners.worker RUN_DIR.

Initialises torch.distributed (nccl on CUDA, gloo on CPU), runs the system's train(config, context)
and hands its measurements (and under --verify its gradients) to rank 0, which writes
RUN_DIR/result.json (and RUN_DIR/grads-rank<R>.pt) for the launcher, on node 0 of a multi-node run.
A rank that fails writes RUN_DIR/error-rank<R>.json (status oom or error) and exits non-zero.
A replica launched as a world of its own (``runners.faults.REPLICA_ENV``: a fault-tolerant system
under --kill-replica) writes RUN_DIR/result-replica<D>.json instead, its ranks numbered as in the
whole run (replica x its size + its own rank).
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

# CUDA loads a kernel's module at its first launch by default (torch sets LAZY), and that load waits
# for the device: with a receive posted on an NCCL stream, spinning until a peer sends what it sends
# only after this rank's next kernels, the first launch of a kernel never ends (the CUDA Programming
# Guide's lazy-loading caveat for kernels that wait on each other). Every module loaded at start-up
# instead, unless the user chose.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from contract import RunConfig  # noqa: E402
from contract.groups import op_timeout  # noqa: E402
from contract.rank import Context  # noqa: E402
from runners import nccl_rules  # noqa: E402
from runners.cores import rank_cores  # noqa: E402
from runners.cuda_warmup import warm_up  # noqa: E402
from runners.faults import FIRST_STEP_ENV, REPLICA_ENV, RankHooks  # noqa: E402
from runners.hang_stacks import stacks_if_still_running  # noqa: E402
from runners.output import is_peer_failure  # noqa: E402
from contract.registry import get_system  # noqa: E402
from workload.cpu_peak import cpu_peak_tflops  # noqa: E402
from workload.flops import gpu_peak_tflops  # noqa: E402
from workload.matmul_peak import measure_matmul_tflops  # noqa: E402
from workload.training import compute_dtype  # noqa: E402


def pick_devices(requested: str, local_rank: int, devices_per_process: int = 1) -> tuple[tuple[torch.device, ...], str]:
    """This process's devices and the backend: on CUDA (nccl) GPUs local_rank·k .. local_rank·k + k − 1
    of those it sees (k = devices_per_process; the run command judged that there are enough, and gave
    each agent of a single-host emulated run its own through CUDA_VISIBLE_DEVICES); else the CPU (gloo)."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but CUDA is not available")
        first = local_rank * devices_per_process
        if first + devices_per_process > torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} needs GPUs {first}..{first + devices_per_process - 1}, "
                               f"but this process sees {torch.cuda.device_count()}")
        torch.cuda.set_device(first)
        return tuple(torch.device("cuda", first + i) for i in range(devices_per_process)), "nccl"
    return (torch.device("cpu"),), "gloo"


def peak_memory(devices: tuple[torch.device, ...]) -> dict:
    """The process's peak memory: per GPU, what tensors held at most (allocated) and what torch's
    caching allocator held at most (reserved, what the GPU had to have); and the process's peak
    resident set on the host (CPU RSS), a different quantity, kept apart."""
    gpus = [{"device": str(d), "allocated_bytes": int(torch.cuda.max_memory_allocated(d)),
             "reserved_bytes": int(torch.cuda.max_memory_reserved(d))} for d in devices if d.type == "cuda"]
    rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return {"gpu_memory": gpus, "cpu_rss_bytes": rss}


def hardware_peak(devices: tuple[torch.device, ...], cfg: RunConfig) -> tuple[float, str, str]:
    """(peak TFLOP/s of one device, where it came from, device name): a GPU's from the table of
    datasheet peaks (workload.flops) where it lists the model, else measured by a matmul on each of
    the process's GPUs (the mean); on CPU the model's own GEMMs measured on one thread. A measurement's memory is given
    back and the peak memory statistics start afresh."""
    device = devices[0]
    precision = cfg.precision  # the dtype the run's matmuls compute in
    dtype = compute_dtype(precision)
    if device.type != "cuda":  # the model's own GEMMs on one thread, kept per host (workload.cpu_peak)
        return (*cpu_peak_tflops(cfg.model, cfg.micro_batch_size, dtype), "cpu")
    name = torch.cuda.get_device_name(device)
    peak = gpu_peak_tflops(name, precision)
    if peak is not None:
        return peak, f"table:{precision}", name
    measured = [measure_matmul_tflops(d, dtype) for d in devices]
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    return sum(measured) / len(measured), f"measured-matmul:{precision}", name


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)  # CPU: DefaultCPUAllocator


def main(run_dir: Path) -> int:
    config = json.loads((run_dir / "config.json").read_text())
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ["WORLD_SIZE"])
    replica = int(os.environ[REPLICA_ENV]) if REPLICA_ENV in os.environ else None  # a replica's own world
    run_rank = rank if replica is None else replica * world + rank
    try:
        spec = get_system(config["system"])
        cfg = RunConfig.from_dict(config, spec.options)
        hooks = RankHooks.of(cfg, run_dir, run_rank, spec.processes(cfg), (cfg.hardware or "").startswith("cuda"),
                             replica)
        stacks = stacks_if_still_running(cfg.timeout, rank)  # a hang's stacks, before anything ends it
        devices, backend = pick_devices(cfg.device, local_rank, spec.devices_per_process(cfg))
        device = devices[0]
        if device.type == "cpu":
            torch.set_num_threads(1)  # one thread per rank: ranks share few cores
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=op_timeout(backend, cfg.timeout)))
        if cfg.p2p_semantics == "nccl":  # gloo under NCCL's rules (a no-op where the backend is NCCL)
            nccl_rules.install(rank, device, run_dir)
        warm_up(devices, (compute_dtype(cfg.precision),))  # CUDA's handles before any receive is posted
        peak, peak_source, device_name = hardware_peak(devices, cfg)
        torch.manual_seed(cfg.seed)
        ctx = Context(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend, config=cfg,
                      devices=devices, hooks=hooks, replica=replica,
                      first_step=int(os.environ.get(FIRST_STEP_ENV, 0)))
        m = spec.load()(cfg, ctx)
        if cfg.verify:  # every rank's gradients to rank 0, whose run directory the launcher reads (on node 0)
            mine = {k: v.detach().float().cpu() for k, v in m.grads.items()} if m.grads is not None else None
            every: list | None = [None] * world if rank == 0 else None
            dist.gather_object(mine, every, dst=0)
            for r, grads in enumerate(every or []):
                if grads is not None:
                    torch.save(grads, run_dir / f"grads-rank{r}.pt")
        summary = {k: v for k, v in asdict(m).items() if k != "grads"}
        summary.update(rank=run_rank, hostname=socket.gethostname(), device=str(device),
                       devices=[str(d) for d in devices],
                       device_name=device_name, backend=backend, peak_tflops=peak, peak_source=peak_source,
                       **peak_memory(devices), **rank_cores(torch.get_num_threads()))
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(summary, gathered, dst=0)
        if rank == 0:
            name = "result.json" if replica is None else f"result-replica{replica}.json"
            tmp = run_dir / f"{name}.tmp"
            tmp.write_text(json.dumps({"ranks": gathered}))
            tmp.rename(run_dir / name)
        dist.barrier()
        dist.destroy_process_group()
        stacks.cancel()
        return 0
    except BaseException as exc:  # recorded for the launcher, then the rank dies and torchrun stops the rest
        status = "oom" if is_oom(exc) else "error"
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        peer = is_peer_failure(text)
        (run_dir / f"error-rank{run_rank}.json").write_text(json.dumps(
            {"rank": run_rank, "status": status, "error": text, "peer_failure": peer, "time": time.time(),
             "traceback": traceback.format_exc()}))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip teardown that could hang on peers


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
