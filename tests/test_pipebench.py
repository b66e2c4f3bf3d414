"""The suite's command, ``pipebench run | sweep | report | predict | plan``: a console script over each
module's own ``main``, installed by pyproject.toml; ``python -m ...`` keeps working beside it."""
from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib

import pipebench
from tests.conftest import REPO


def test_the_console_script_is_pipebench_main():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pipebench": "pipebench:main"}


def test_help_lists_every_subcommand_and_each_runs_its_modules_main():
    out = subprocess.run([sys.executable, "-m", "pipebench", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pipebench {run,sweep,report,predict,plan}")
    for name, (module, what) in pipebench.COMMANDS.items():
        assert f"  {name}" in out.stdout and what in out.stdout
        assert callable(importlib.import_module(module).main), module


def test_a_subcommand_is_its_module_with_the_rest_of_the_arguments(capsys, tmp_path):
    assert pipebench.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "pipebench report: error: no such file or directory" in capsys.readouterr().err
    assert pipebench.main(["predict", "--system", "fairscale_fsdp", "--model", "tiny", "--batch-size", "2",
                           "--micro-batch-size", "1"]) == 2


def test_no_or_an_unknown_subcommand_is_one_line_and_exit_2(capsys):
    assert pipebench.main([]) == 2 and capsys.readouterr().err.startswith("usage: pipebench")
    assert pipebench.main(["train"]) == 2
    assert capsys.readouterr().err == ("pipebench: error: unknown command 'train' "
                                       "(choose from run, sweep, report, predict, plan)\n")
