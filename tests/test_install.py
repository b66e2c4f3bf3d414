"""The install on GPU machines (scripts/setup_env.sh, scripts/torch_build.py) without a GPU: which
CUDA build of torch fits a driver and its GPUs, the supported torch range, what --use-system-torch
still installs."""
from __future__ import annotations

import subprocess

import pytest
import torch

from scripts import torch_build
from scripts.torch_build import BUILDS, NoBuild, choose_build, missing, requirements, torch_in_range
from tests.conftest import REPO


@pytest.mark.parametrize("capabilities, driver, machine, build", [
    ([(9, 0)], (13, 0), "x86_64", "cu130"),  # an H100 with a CUDA 13.0 driver (the device machine's)
    ([(9, 0)], (12, 9), "x86_64", "cu129"),
    ([(9, 0), (9, 0)], (13, 2), "x86_64", "cu132"),
    ([(7, 0)], (13, 0), "x86_64", "cu126"),  # a V100: only CUDA 12.6's build still has sm_70
    ([(8, 6), (8, 9)], (12, 8), "x86_64", "cu126"),  # A10G and L4 (8.9 runs sm_86 code): a 12.8 driver
    ([(12, 0)], (12, 9), "x86_64", "cu129"),  # Blackwell workstations: from CUDA 12.9
    ([(9, 0)], (13, 0), "aarch64", "cu130"),  # GH200
])
def test_the_build_a_driver_and_its_gpus_run(capabilities, driver, machine, build):
    assert choose_build(capabilities, driver, machine) == build


def test_no_build_is_said_in_one_line():
    with pytest.raises(NoBuild, match="driver supports CUDA 12.4, torch 2.13.0 for these GPUs needs 12.6 .cu126."):
        choose_build([(7, 0)], (12, 4))
    with pytest.raises(NoBuild, match="needs 12.9"):
        choose_build([(12, 0)], (12, 6))
    with pytest.raises(NoBuild, match="carries code for sm_70 .aarch64."):
        choose_build([(7, 0)], (13, 0), "aarch64")
    with pytest.raises(NoBuild, match="sm_70, sm_120"):
        choose_build([(7, 0), (12, 0)], (13, 2))  # no one build has both


@pytest.mark.skipif(not hasattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC") or not torch.__version__.startswith("2.13"),
                    reason="the table is torch 2.13's own")
def test_the_builds_are_torch_2_13s_own():
    own = torch.cuda.PYTORCH_RELEASES_CODE_CC
    assert {f"cu{v.replace('.', '')}" for v in own} == set(BUILDS)
    for version, by_arch in own.items():
        need, codes = BUILDS[f"cu{version.replace('.', '')}"]
        assert need == tuple(int(x) for x in version.split("."))
        assert {arch: set(c) for arch, c in codes.items()} == {arch: set(c) for arch, c in by_arch.items()}


def test_the_supported_torch_range():
    assert "older than 2.9" in torch_in_range("2.8.0+cu128") and "ScheduleDualPipeV" in torch_in_range("2.8.0")
    assert torch_in_range("2.9.1+cu128") is None and torch_in_range("2.11.0+cu130") is None
    assert torch_in_range(torch.__version__) is None  # the pinned one
    assert "newer than 2.13" in torch_in_range("2.14.0")


def test_what_system_torch_still_needs():
    pins = requirements(REPO / "pyproject.toml")
    assert "torch==2.13.0" in pins and any(p.startswith("pytest==") for p in pins)
    assert missing(["torch==2.0.0", "pytest==1.0",
                    "no-such-package-pipebench==1.0"]) == ["no-such-package-pipebench==1.0"]


def test_setup_env_judges_its_arguments_first():
    bad = subprocess.run(["bash", "scripts/setup_env.sh", "--bogus"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "setup: unknown argument --bogus (see --help)"
    usage = subprocess.run(["bash", "scripts/setup_env.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 0 and "--use-system-torch" in usage.stdout and "--wheels DIR" in usage.stdout
    assert torch_build.main(["nonsense"]) == 2
