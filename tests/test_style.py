"""The house's shape limits that ruff does not check: no function of the suite over 80 lines."""
from __future__ import annotations

import ast

from tests.conftest import REPO

PACKAGES = ("baselines", "bench", "contract", "network_emulation", "ours", "predict", "reporting", "runners", "sweeps",
            "tools", "workload")
MAX_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    for script in ("report.py", "pipebench.py"):
        for node in ast.walk(ast.parse((REPO / script).read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_LINES:
                long.append(f"{script}:{node.lineno} {node.name}")
    assert (REPO / "ours").is_dir() and not long, long
