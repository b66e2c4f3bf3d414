"""The GPUs of a run: what this machine has (``local_gpus``), whether a run fits them (``judge_gpus``:
one GPU per rank, and a torch build that carries each GPU's architecture), the hardware a run's
identity names, and which GPUs each torchrun agent of a single-host emulated run sees.

Everything but ``local_gpus`` is a pure function of a ``Gpus`` inventory, so that every branch is
tested on a machine without a GPU. ``local_gpus`` asks torch in a subprocess: the run command never
initialises CUDA itself (a CUDA context in the launcher would hold GPU memory for the whole run).
No torch at import: the run command judges a request before importing it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from contract import ConfigError

# Code built for these integrated parts (Jetson, Thor) runs on them alone, and theirs on nothing else
# (torch.cuda.DEVICE_REQUIREMENT in torch 2.13 excludes them from their major's range the same way).
INTEGRATED = frozenset({53, 62, 72, 87, 101})


@dataclass(frozen=True)
class Gpus:
    """The CUDA devices torch sees here (CUDA_VISIBLE_DEVICES applied), and what its build carries."""

    names: tuple[str, ...] = ()  # torch.cuda.get_device_name of each
    capabilities: tuple[tuple[int, int], ...] = ()  # torch.cuda.get_device_capability of each
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): the code the torch build carries
    torch: str = ""  # torch.__version__
    visible: tuple[str, ...] = ()  # how CUDA_VISIBLE_DEVICES names each (its entries, else "0", "1", ...)

    @property
    def count(self) -> int:
        return len(self.names)


def code_runs_on(code: str, capability: tuple[int, int]) -> bool:
    """Whether an entry of torch.cuda.get_arch_list() ("sm_80", "sm_90a", "sm_100f", "compute_90")
    runs on a GPU of ``capability``: machine code (sm_XY) on the same major at minor Y or later, an
    architecture-specific one (sm_XYa) on XY alone; PTX (compute_XY) is compiled on load for XY or
    any later GPU."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", code)
    if not m:
        return False
    kind, cc, suffix = m.group(1), int(m.group(2)), m.group(3)
    device = 10 * capability[0] + capability[1]
    if kind == "compute":
        return device >= cc
    if suffix == "a" or cc in INTEGRATED or device in INTEGRATED:
        return device == cc
    return device // 10 == cc // 10 and device >= cc


def build_runs_on(arch_list: tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether a torch build with ``arch_list`` runs on a GPU of ``capability`` (an empty list, as a
    ROCm build reports, is not judged)."""
    return not arch_list or any(code_runs_on(code, capability) for code in arch_list)


def judge_gpus(device: str, gpus: Gpus, processes: int, devices_per_process: int = 1) -> str:
    """The hardware the run's ranks on this machine use: "cpu", or "cuda:" and the GPU model (models
    joined by " + " where they differ); ConfigError (one line) where they cannot run here.

    ``device`` is the request (auto, cpu, cuda; auto takes CUDA where there is a GPU); ``processes``
    the run's processes on this machine, each using ``devices_per_process`` GPUs of its own (fairscale:
    its pipe's). Refused: CUDA asked for and absent; fewer GPUs than the processes need (NCCL refuses
    two ranks on one GPU, and sharing one would measure something else); a GPU whose architecture
    the torch build does not carry."""
    if device == "cpu" or (device == "auto" and not gpus.count):
        return "cpu"
    if not gpus.count:
        raise ConfigError("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")
    need = processes * devices_per_process
    if need > gpus.count:
        each = f" x {devices_per_process} GPUs each" if devices_per_process > 1 else ""
        raise ConfigError(f"{processes} process(es){each} need {need} GPUs, one of their own each; this machine has "
                          f"{gpus.count} ({', '.join(gpus.names)}): run fewer ranks, or --device cpu")
    for name, cap in zip(gpus.names[:need], gpus.capabilities[:need]):
        if not build_runs_on(gpus.arch_list, cap):
            raise ConfigError(f"torch {gpus.torch} carries code for {' '.join(gpus.arch_list)}, none of which runs on "
                              f"the {name} (sm_{cap[0]}{cap[1]}): install a torch build for it "
                              "(bash scripts/setup_env.sh picks one), or --device cpu")
    return "cuda:" + " + ".join(sorted(set(gpus.names[:need])))


def agent_devices(visible: tuple[str, ...], agents: int, per_agent: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of ``agents`` torchrun agents of one machine that run one rank
    each (a single-host emulated run: one agent per network namespace, so every rank has LOCAL_RANK
    0 and would take cuda:0): agent k sees GPUs k·per_agent .. (k + 1)·per_agent − 1 of ``visible``
    (``visible_entries``), as its cuda:0 ..."""
    if agents * per_agent > len(visible):  # judge_gpus refuses such a run before launch
        raise ValueError(f"{agents} agents x {per_agent} GPUs need {agents * per_agent}, {len(visible)} visible")
    return [",".join(visible[k * per_agent:(k + 1) * per_agent]) for k in range(agents)]


_INVENTORY = """
import json, torch
n = torch.cuda.device_count()
print(json.dumps(dict(names=[torch.cuda.get_device_name(i) for i in range(n)],
                      capabilities=[list(torch.cuda.get_device_capability(i)) for i in range(n)],
                      arch_list=torch.cuda.get_arch_list(), torch=torch.__version__)))
"""


def visible_entries(count: int, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """How CUDA_VISIBLE_DEVICES names the ``count`` GPUs torch sees (its entries, else their indices)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return tuple(str(i) for i in range(count))
    return tuple(e.strip() for e in value.split(",") if e.strip())[:count]


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver loaded (its device nodes or /proc entry): without one
    CUDA cannot be available, which the run command then knows without importing torch (a second and
    a half of a core before every launch)."""
    return Path("/proc/driver/nvidia").exists() or Path("/dev/nvidiactl").exists()


def local_gpus() -> Gpus:
    """This machine's GPUs as torch sees them (none where CUDA is not available)."""
    if not nvidia_driver_present():
        return Gpus()
    import torch

    if not torch.cuda.is_available():
        return Gpus()
    p = subprocess.run([sys.executable, "-c", _INVENTORY], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"CUDA is available but its GPUs cannot be read: {last}")
    d = json.loads(p.stdout.strip().splitlines()[-1])
    names = tuple(d["names"])
    return Gpus(names, tuple(tuple(c) for c in d["capabilities"]), tuple(d["arch_list"]), d["torch"],
                visible_entries(len(names)))
