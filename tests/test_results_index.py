"""results/ holds what the suite wrote, each file named once in results/README.md's index (a row's first
cell: `folder/name.ext`, then `.ext` or `-suffix.ext` for files of the same stem, or a name in the same
folder), and nothing the code reads as an input."""
from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO


def indexed() -> list[str]:
    names = []
    for line in (REPO / "results" / "README.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = stem = ""
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if token[0] in ".-":
                names.append(f"{folder}{stem}{token}")
                continue
            if "/" in token:
                folder, token = token.rsplit("/", 1)[0] + "/", token.rsplit("/", 1)[1]
            stem = token.split(".")[0]
            names.append(folder + token)
    return names


def test_every_file_under_results_sits_once_in_its_index():
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True).stdout.split()
    files = sorted(f.removeprefix("results/") for f in tracked if f != "results/README.md")
    names = indexed()
    assert sorted(set(names)) == sorted(names), "a file named twice"
    assert sorted(names) == files


def test_no_code_reads_its_inputs_from_results(monkeypatch):
    """The inputs (the simulator's calibration, this CPU's profiles for ours' planner, the device files) live
    beside the code that reads them; outside the tests a path into results/ is a place to write, a records
    file a command is pointed at by default, or a report a docstring cites."""
    from ours.plan.auto import profile_dir
    from predict.this_machine import CALIBRATIONS
    from workload.compute import DEVICES

    monkeypatch.delenv("OURS_PLAN_DIR", raising=False)
    assert CALIBRATIONS.is_relative_to(REPO / "predict") and profile_dir().is_relative_to(REPO / "ours" / "plan")
    assert DEVICES.is_relative_to(REPO / "workload")
    code = subprocess.run(["git", "grep", "-n", "-E", r"results/(predict|plan)|\"results\"", "--", "*.py", "*.sh",
                           ":!tests"], cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    allowed = ("git log --follow -- results/predict/NOTE.md",
               'REPORTS = Path(__file__).resolve().parents[1] / "results" / "predict"',
               "--name N: results/predict/N)", "another name: results/predict/NAME.{md,json}",
               "the check is kept as results/predict/NAME.{md,json}",
               'default="results/plan/cpu-small-p2-evaluation.json"', 'default=["results"]',
               'REPO / "results" / "measured-here"', '"results", f".cluster-',
               'Path("results") / "plan" / f"eval-')  # the planner's evaluation: where it writes
    assert [line for line in code if not any(a in line for a in allowed)] == []
