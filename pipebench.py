"""pipebench: one command over the suite's modules.

    pipebench run ...       train one system and record one run        (python -m runners.run)
    pipebench sweep ...     run a sweep file, then its report         (python -m runners.sweep)
    pipebench report ...    records to tables and plots              (python report.py)
    pipebench predict ...   a run's step time without running it     (python -m predict)
    pipebench plan ...      ours' latency model, slicing and layout   (python -m ours.plan)

Each subcommand is the module's own ``main(argv, prog)`` with the rest of the arguments (``pipebench run
--help``) and its name as typed (``prog="pipebench run"``): its usage and its errors name ``pipebench
run``, as ``python -m runners.run`` names itself. A subcommand's module is imported only when it runs:
``pipebench run`` launches without torch, as ``python -m runners.run`` does.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module whose main it runs, one line on what it does)
COMMANDS = {
    "run": ("runners.run", "train one system on the shared GPT workload and record one run"),
    "sweep": ("runners.sweep.__main__", "run every run of a sweep file (TOML), then its report"),
    "report": ("report", "turn run records into tables and plots"),
    "predict": ("predict.__main__", "a run's step time without running it; the simulator's calibration"),
    "plan": ("ours.plan.__main__", "ours' latency model, slicing planner and layout chooser"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: pipebench {" + ",".join(COMMANDS) + "} ...\n\n" + __doc__.split("\n\n")[0] + "\n\nsubcommands:\n"
            + "\n".join(lines) + "\n\npipebench COMMAND --help: that command's options\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pipebench: error: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[name][0]).main(rest, prog=f"pipebench {name}")


if __name__ == "__main__":
    sys.exit(main())
