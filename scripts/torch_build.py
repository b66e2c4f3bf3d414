"""The torch a machine can run, for scripts/setup_env.sh (standard library only: it runs before any
venv exists, from the repository root).

    python3 -m scripts.torch_build choose        # on a host with NVIDIA GPUs: the CUDA build of torch
                                                 # TORCH_VERSION its driver and GPUs run (cu126, ...),
                                                 # or one line saying why none does (exit 1)
    .venv/bin/python -m scripts.torch_build check   # the venv's torch is in the supported range (else exit 1)
    .venv/bin/python -m scripts.torch_build missing # the pinned requirements (pyproject.toml, the test
                                                    # extra too) not installed at any version, one a line

The supported torch range: from 2.9, the first torch with every pipeline schedule the suite runs
(ScheduleDualPipeV came in 2.9, pytorch#159591; ScheduleZBVZeroBubble in 2.6, pytorch#138444;
ScheduleInterleavedZeroBubble in 2.5), up to 2.13, the pinned one (CPU, and CI). Versions in between
are used as found (``setup_env.sh --use-system-torch``), not tested here.
"""
from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from runners.devices import code_runs_on

TORCH_VERSION = "2.13.0"  # pyproject.toml's pin
OLDEST, NEWEST = (2, 9), (2, 13)
INDEX = "https://download.pytorch.org/whl/"
# torch 2.13's CUDA builds: the CUDA version each needs of the driver, and the GPU code it carries per
# host architecture (torch.cuda.PYTORCH_RELEASES_CODE_CC in torch 2.13; tests/test_install.py holds
# this table to it). CUDA 12.6's is the last with sm_70 (V100, the seed's p3.2xlarge).
BUILDS: dict[str, tuple[tuple[int, int], dict[str, tuple[int, ...]]]] = {
    "cu126": ((12, 6), {"x86_64": (50, 60, 70, 75, 80, 86, 90), "aarch64": (80, 90)}),
    "cu129": ((12, 9), {"x86_64": (75, 80, 86, 90, 100, 120), "aarch64": (80, 90, 100, 120)}),
    "cu130": ((13, 0), {"x86_64": (75, 80, 86, 90, 100, 120), "aarch64": (80, 90, 100, 110, 120)}),
    "cu132": ((13, 2), {"x86_64": (75, 80, 86, 90, 100, 120), "aarch64": (80, 90, 100, 110, 120)}),
}


class NoBuild(Exception):
    """No torch build fits this machine; the message is one line for the user."""


def choose_build(capabilities: list[tuple[int, int]], driver_cuda: tuple[int, int], machine: str = "x86_64") -> str:
    """The build to install: of those whose GPU code runs on every GPU, the newest CUDA the driver
    supports (a build needs a driver of its CUDA version or later)."""
    arch = "aarch64" if machine.lower() in ("aarch64", "arm64") else "x86_64"
    fits = [name for name, (_, codes) in BUILDS.items()
            if all(any(code_runs_on(f"sm_{c}", cap) for c in codes.get(arch, ())) for cap in capabilities)]
    if not fits:
        caps = ", ".join(f"sm_{a}{b}" for a, b in sorted(set(capabilities)))
        raise NoBuild(f"no CUDA build of torch {TORCH_VERSION} carries code for {caps} ({arch}): "
                      "install a torch that does and use --use-system-torch")
    runnable = [name for name in fits if BUILDS[name][0] <= driver_cuda]
    if not runnable:
        oldest = min(fits, key=lambda n: BUILDS[n][0])
        need = ".".join(map(str, BUILDS[oldest][0]))
        have = ".".join(map(str, driver_cuda))
        raise NoBuild(f"the NVIDIA driver supports CUDA {have}, torch {TORCH_VERSION} for these GPUs needs {need} "
                      f"({oldest}): update the driver, or install a torch it runs and use --use-system-torch")
    return max(runnable, key=lambda n: BUILDS[n][0])


def read_nvidia_smi() -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(each GPU's compute capability, the CUDA version the driver supports), from nvidia-smi."""
    caps = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=60)
    header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header.stdout)
    capabilities = [tuple(int(x) for x in line.strip().split(".")) for line in caps.stdout.splitlines()
                    if re.fullmatch(r"\d+\.\d+", line.strip())]
    if caps.returncode != 0 or not capabilities or not found:
        raise NoBuild("nvidia-smi does not tell the GPUs' compute capability or the driver's CUDA version "
                      "(a driver older than 510?): install torch yourself and use --use-system-torch")
    return capabilities, (int(found.group(1)), int(found.group(2)))


def torch_in_range(version: str) -> str | None:
    """Why this torch version cannot run the suite (None: it can)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        return f"torch {version}: not a version"
    have = (int(m.group(1)), int(m.group(2)))
    if have < OLDEST:
        return (f"torch {version} is older than {OLDEST[0]}.{OLDEST[1]}, the first with every pipeline schedule the "
                "suite runs (ScheduleDualPipeV)")
    if have > NEWEST:
        return f"torch {version} is newer than {NEWEST[0]}.{NEWEST[1]}, the newest the suite was run with"
    return None


def requirements(pyproject: Path) -> list[str]:
    """The pinned requirements of pyproject.toml, the test extra's too."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [*project["dependencies"], *project.get("optional-dependencies", {}).get("test", [])]


def missing(reqs: list[str]) -> list[str]:
    """Of ``reqs`` (``name==version``), those not installed at any version here (torch never listed)."""
    out = []
    for req in reqs:
        name = re.split(r"[=<>!~ ;\[]", req, maxsplit=1)[0]
        if name == "torch":
            continue
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(req)
    return out


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "choose"
    if what == "choose":
        try:
            caps, driver = read_nvidia_smi()
            print(choose_build(caps, driver, platform.machine()))
        except NoBuild as e:
            print(f"setup: {e}", file=sys.stderr)
            return 1
        return 0
    if what == "check":
        import torch

        why = torch_in_range(torch.__version__)
        if why and not why.startswith(f"torch {torch.__version__} is newer"):
            print(f"setup: {why}", file=sys.stderr)
            return 1
        print(f"setup: torch {torch.__version__}" + (f" (note: {why})" if why else ""), file=sys.stderr)
        return 0
    if what == "missing":
        for req in missing(requirements(Path(__file__).resolve().parents[1] / "pyproject.toml")):
            print(req)
        return 0
    print("usage: python -m scripts.torch_build [choose|check|missing]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
