"""The suite's import graph: no cycle anywhere; the contract imports only itself and workload/;
each system's training code imports only the contract, workload/ and its own package."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

from runners.registry import systems

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "workload", "runners", "baselines", "ours", "network_emulation")


def suite_modules() -> dict[str, Path]:
    mods = {"report": REPO / "report.py", "quality_report": REPO / "quality_report.py"}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path):
    """(module, names) of every import statement in ``name``'s file (module level or inside functions),
    relative imports resolved; ``import a.b`` gives ("a.b", ())."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The suite modules ``name`` imports (module level or inside functions)."""
    found: set[str] = set()
    for base, names in _imports(name, path):
        found.add(base)
        found |= {f"{base}.{n}" for n in names}  # "from pkg import submodule"
    # a module's own packages are initialised before it runs: importing from them is not an edge
    ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
    return {m for m in found if m in mods and m != name and m not in ancestors}


def unresolved_imports() -> list[str]:
    """Imports of suite modules anywhere in the suite (module level or inside a function, which runs only
    when called) where the module does not import, or has no such name or submodule."""
    mods = suite_modules()
    bad = []
    for name, path in sorted(mods.items()):
        for base, names in _imports(name, path):
            if base not in mods:
                continue
            try:
                module = importlib.import_module(base)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                bad.append(f"{name}: import {base}: {exc!r}")
                continue
            bad += [f"{name}: {base} has no {n}" for n in names if not hasattr(module, n) and f"{base}.{n}" not in mods]
    return bad


def graph() -> dict[str, set[str]]:
    mods = suite_modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def closure(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g[m]
    return seen


def test_no_import_cycle_in_the_suite():
    assert cycles(graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_contract_imports_only_itself_and_the_workload():
    g = graph()
    for name in (m for m in g if m.split(".")[0] == "contract"):
        assert {m.split(".")[0] for m in closure(g, name)} <= {"contract", "workload"}, name


def test_systems_import_only_the_contract_the_workload_and_themselves():
    # a system's own package: its training module's package, and the package of any system it is
    # declared inside (diloco, in ours/diloco/, runs ours' pipeline engine)
    g = graph()
    packages = {spec.train.partition(":")[0].rpartition(".")[0] or spec.train.partition(":")[0]
                for spec in systems().values()}
    for spec in systems().values():
        module = spec.train.partition(":")[0]
        own = module.rpartition(".")[0] or module
        allowed = ("contract", "workload", own, *(p for p in packages if own.startswith(p + ".")))
        bad = sorted(m for m in closure(g, module) if not any(m == a or m.startswith(a + ".") for a in allowed))
        assert not bad, f"{spec.name}'s training code imports {bad}"


def test_every_name_imported_from_the_suite_exists():
    # in a process of its own: importing the baselines' training code loads their frameworks
    code = "import json; from tests.test_imports import unresolved_imports; print(json.dumps(unresolved_imports()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
