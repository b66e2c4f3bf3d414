"""The suite's command, ``pipebench run | sweep | report | predict | plan``: a console script over each
module's own ``main``, installed by pyproject.toml; ``python -m ...`` keeps working beside it."""
from __future__ import annotations

import argparse
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


MODES = {"run", "sweep", "scenario", "records", "probe", "validate", "validate-seed", "calibrate", "plan-check",
         "validate-published", "fit-kernels", "compare"}


def _status(argv: list[str]) -> int:
    """pipebench's exit status for ``argv``, whether its command returns it or exits (argparse's --help)."""
    try:
        return pipebench.main(argv)
    except SystemExit as exc:
        return exc.code


def _subcommands(parser) -> dict:
    """A parser's subcommands by name (argparse keeps them in its one subparsers action)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_predict_help_lists_every_mode_and_an_unknown_one_is_refused_naming_them(capsys):
    """#53: predict --help hid sweep and the one-run mode, and 'predict scenaro x' fell through to the run
    parser; #54 item 18: 'predict sweep --help' said 'no such sweep file: --help'."""
    from predict.__main__ import build_parser

    assert set(_subcommands(build_parser())) == MODES
    assert _status(["predict", "--help"]) == 0
    listed = capsys.readouterr().out.split("positional arguments:")[1].split("options:")[0]
    assert {line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line.split()} >= MODES
    assert _status(["predict", "scenaro", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipebench predict: error: argument MODE: invalid choice: 'scenaro' (choose from ")
    assert len(err.splitlines()) == 1 and all(f"'{mode}'" in err for mode in MODES), err
    for mode in MODES:
        assert _status(["predict", mode, "--help"]) == 0, mode
        assert capsys.readouterr().out.startswith(f"usage: pipebench predict {mode} "), mode


def _parsers():
    """Every command's parser and subcommand parser: run, sweep, predict's modes, plan's."""
    from ours.plan.__main__ import build_parser as plan
    from predict.__main__ import build_parser as predict, run_parser
    from runners.request import build_parser as run
    from report import parser as report
    from runners.sweep.__main__ import build_parser as sweep

    yield run()
    yield sweep()
    yield report()
    yield run_parser()
    for top in (predict(), plan()):
        yield top
        yield from _subcommands(top).values()


def test_every_flag_of_every_command_shows_its_default():
    """#53: run --help showed no default of --steps or --warmup; plan's --reps and others had no help."""
    count = 0
    for parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            nothing = action.default is None or action.default is False or action.default == []  # no value to show
            if not action.option_strings or nothing or action.default is argparse.SUPPRESS or action.nargs == 0:
                continue
            count += 1
            said = formatter._get_help_string(action)
            assert said and "default" in said, f"{parser.prog} {action.option_strings[0]}: {said!r}"
    assert count > 40
    out = subprocess.run([sys.executable, "-m", "pipebench", "run", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    assert "measured steps (default: 10)" in out and "warm-up steps, not timed (default: 2)" in out


def test_plan_help_is_whole():
    """#53: plan --help stopped mid-sentence ('... optimal slicing and layout, on the')."""
    from ours.plan.__main__ import build_parser

    help_text = build_parser().format_help()
    assert "on the one compute model (``workload.compute``)." in help_text
    assert "P is the pipeline's stages and K its token slices" in help_text


# a concept -> its one name, then its old names; every command that takes it accepts all of them
CONCEPTS = {"n_layer": ("--num-layers", "--n-layer"), "seq_len": ("--seq-length", "--seq-len"),
            "device_file": ("--device-file", "--gpu")}


def test_one_name_per_concept_across_commands_old_names_kept():
    """#53: --n-layer / --num-layers, --seq-len / --seq-length, --gpu / --device-file drifted between run,
    predict and plan; the run command's name is now every command's, the old ones aliases for one release."""
    seen = {name: 0 for name in CONCEPTS}
    for parser in _parsers():
        for action in parser._actions:
            name = "device_file" if action.dest == "gpu" else action.dest
            if name in CONCEPTS and action.option_strings:
                seen[name] += 1
                assert tuple(action.option_strings) == CONCEPTS[name], (parser.prog, action.option_strings)
                assert "kept for one release" in action.help, (parser.prog, action.help)
    assert seen == {"n_layer": 5, "seq_len": 5, "device_file": 4}  # run, predict run, plan's three; 2 + 2
