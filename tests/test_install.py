"""The install: on GPU machines (scripts/setup_env.sh, scripts/torch_build.py) without a GPU, which
CUDA build of torch fits a driver and its GPUs, the supported torch range, what --use-system-torch
still installs; and the package itself, built as a wheel and installed (not editable) into a fresh
virtual environment, whose command runs from another directory, its ranks too."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

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


def _package_files() -> list[str]:
    """Every file of the tree (``_tree``) in the packages pyproject.toml installs, and its top-level modules."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = tuple(pattern.rstrip("*") + "/" for pattern in config["packages"]["find"]["include"])
    return [f for f in _tree() if f.startswith(tops)] + [f"{m}.py" for m in config["py-modules"]]


def _tree() -> list[str]:
    """The checkout's files as git sees them: tracked, or new and not ignored (a change not yet committed)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [f for f in listed if (REPO / f).is_file()]


@pytest.mark.multiprocess
def test_the_wheel_installs_and_its_command_runs_from_another_directory(tmp_path):
    """pip builds a wheel of the tracked tree holding every file the packages read beside themselves;
    installed without its dependencies into a fresh virtual environment that sees the project's
    (torch and the rest: nothing is downloaded), and never the checkout, its ``pipebench`` predicts a
    shipped scenario by name and runs the reference through torchrun from another directory, with a
    --data path relative to that directory."""
    tree, wheels, venv, elsewhere = (tmp_path / n for n in ("tree", "wheels", "venv", "elsewhere"))
    for name in _tree():  # a copy: building writes build/ and *.egg-info beside the sources
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(tree)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("pipebench-*.whl"))
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    package_files = _package_files()
    assert {"workload/devices/h100-sxm.json", "predict/scenarios/two-sites.json", "sweeps/local.toml",
            "pipebench.py"} <= set(package_files)
    assert [f for f in package_files if f not in in_wheel] == []

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the project's dependencies as a plain path: its .pth files (the editable install's) are not read
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere.mkdir()
    (elsewhere / "corpus.txt").write_text("a few words of text to train the tiny model on. " * 200)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}

    def pipebench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "pipebench"), *args], cwd=elsewhere, capture_output=True,
                              text=True, timeout=300, env=env)

    where = subprocess.run([python, "-c", "import runners.worker, predict, pipebench, report, sys; print(runners."
                            "worker.__file__, predict.__file__, pipebench.__file__, report.__file__, *sys.path, "
                            "sep='\\n')"], cwd=elsewhere, capture_output=True, text=True, env=env, check=True).stdout
    where = where.split("\n")
    assert all(Path(p).is_relative_to(site) for p in where[:4]) and str(REPO) not in where[4:], where

    scenario = pipebench("predict", "scenario", "seed-gpipe-default", "--json")
    assert scenario.returncode == 0, scenario.stderr
    assert json.loads(scenario.stdout)["step_time_s"] > 0

    run = pipebench("run", "--system", "reference", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1",
                    "--steps", "2", "--warmup", "1", "--data", "corpus.txt", "--out", "X.jsonl")
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads((elsewhere / "X.jsonl").read_text())
    assert record["status"] == "ok" and record["config"]["data"] == "corpus.txt" and len(record["losses"]) == 3
    assert record["environment"]["git_commit"] is None  # the run command's code is not the checkout's
    assert sorted(p.name for p in elsewhere.iterdir()) == ["X.jsonl", "corpus.txt"]
