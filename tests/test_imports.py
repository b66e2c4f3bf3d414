"""The suite's import graph, every module of every package (module level and inside functions): no
cycle anywhere, and the layers (``LAYERS``): the workload imports nothing of the suite, the contract
only the workload, a system only the contract, the workload and its own package, the report (the
command ``report`` and its package ``reporting``) only the contract and the workload, the harness
(``runners``) never the simulator, the benchmarks, the report or the tools; the tools (``tools``: the
GPU check, the verification spread, rehearsals, virtual nodes) stand above the harness, and nothing of
the suite but themselves imports them (nor the command, ``pipebench``, which runs the modules' mains);
and every name imported from the suite exists."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from contract.registry import systems

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "workload", "runners", "baselines", "ours", "network_emulation", "predict", "bench", "tools",
            "reporting")
# part -> (what its modules may import, or None: anything but what the second set names)
LAYERS: dict[str, tuple[set[str] | None, set[str]]] = {
    "workload": ({"workload"}, set()),
    "contract": ({"contract", "workload"}, set()),
    "network_emulation": ({"network_emulation"}, set()),
    "report": ({"report", "reporting", "contract", "workload"}, set()),  # the command over the package
    "reporting": ({"reporting", "contract", "workload"}, set()),
    "runners": (None, {"predict", "bench", "report", "reporting", "tools"}),  # a run never calls the simulator
}
# parts every other part keeps clear of: only they themselves import them (the tests aside)
TOP = ("tools", "pipebench")


def suite_modules() -> dict[str, Path]:
    mods = {"report": REPO / "report.py", "pipebench": REPO / "pipebench.py"}
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
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
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


def system_packages() -> list[str]:
    """The package of every registered system (its spec module's): baselines.torch_pipe, ours, ..."""
    return sorted({spec.train.partition(":")[0].rpartition(".")[0] or spec.train for spec in systems().values()})


def _part(module: str, parts: list[str]) -> str | None:
    return next((p for p in sorted(parts, key=len, reverse=True) if module == p or module.startswith(p + ".")), None)


def layering_violations(g: dict[str, set[str]], system_pkgs: list[str]) -> list[str]:
    """'<module> imports <module>' for every import (direct or through others) that crosses a layer."""
    bad = []
    for name in sorted(g):
        reached = closure(g, name) - {name}
        system = _part(name, system_pkgs)
        if system is not None:
            # its own package, and that of any system it is declared inside (diloco, in ours/diloco/,
            # runs ours' pipeline engine)
            allowed = [system, *(p for p in system_pkgs if system.startswith(p + ".")), "contract", "workload"]
            bad += [f"{name} imports {m}" for m in sorted(reached) if _part(m, allowed) is None]
            continue
        bad += [f"{name} imports {m}" for m in sorted(reached)
                if m.split(".")[0] in TOP and m.split(".")[0] != name.split(".")[0]]
        rule = LAYERS.get(name.split(".")[0])
        if rule is None:
            continue
        allowed, forbidden = rule
        bad += [f"{name} imports {m}" for m in sorted(reached)
                if (allowed is not None and m.split(".")[0] not in allowed) or m.split(".")[0] in forbidden]
    return bad


def test_no_import_cycle_in_the_suite():
    assert cycles(graph()) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_keeps_to_its_layer():
    g = graph()
    assert system_packages() == ["baselines.fairscale_fsdp", "baselines.megatron", "baselines.reference",
                                 "baselines.torch_pipe", "ours", "ours.diloco"]
    assert {m.split(".")[0] for m in g} >= set(PACKAGES) | {"report", "pipebench"}
    assert g["report"] <= {m for m in g if m.split(".")[0] in ("reporting", "contract")}  # a command over the package
    assert layering_violations(g, system_packages()) == []


def test_the_layering_fails_on_the_wrong_way_imports_the_house_removed():
    g, systems_ = graph(), system_packages()
    # a system that launched run commands (ours/plan/evaluate.py imported runners.invoke)
    evaluate = {**g, "ours.plan.evaluate": {"runners.invoke"}}
    assert "ours.plan.evaluate imports runners.invoke" in layering_violations(evaluate, systems_)
    # the simulator inside the harness importing the report, which imported the harness's registry
    predict = {**g, "runners.predict.__main__": {"report"}, "runners.registry": {"contract"},
               "report": g["report"] | {"runners.registry"}}
    found = layering_violations(predict, systems_)
    assert "runners.predict.__main__ imports report" in found and "report imports runners.registry" in found
    # the report's package reaching for the harness's record (the report reads records, never makes them)
    package = {**g, "reporting.frame": g["reporting.frame"] | {"runners.record"}}
    assert "reporting.frame imports runners.record" in layering_violations(package, systems_)
    # and the run command calling the simulator
    run = {**g, "runners.run": g["runners.run"] | {"predict.this_machine"}}
    assert "runners.run imports predict.this_machine" in layering_violations(run, systems_)
    # the harness, or the simulator, reaching for a tool (the rehearsal lived in runners/)
    tool = {**g, "runners.sweep.__main__": g["runners.sweep.__main__"] | {"tools.rehearse"},
            "predict.gloo_stall": g["predict.gloo_stall"] | {"tools.nodes"}}
    found = layering_violations(tool, systems_)
    assert "runners.sweep.__main__ imports tools.rehearse" in found
    assert "predict.gloo_stall imports tools.nodes" in found


def test_every_name_imported_from_the_suite_exists():
    # in a process of its own: importing the baselines' training code loads their frameworks
    code = "import json; from tests.test_imports import unresolved_imports; print(json.dumps(unresolved_imports()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_run_command_launches_without_importing_torch():
    """torch costs the run command a second and a half of a core before every launch (the ranks and
    torchrun import their own): on a machine without an NVIDIA driver it judges the request, picks the
    devices, launches and builds the record without it. Only --verify (the reference) and a GPU need it."""
    from runners.devices import nvidia_driver_present

    if nvidia_driver_present():
        pytest.skip("a GPU machine: the run command imports torch to read its GPUs")
    code = ("import sys, pipebench, runners.run, runners.launcher, runners.record, runners.sweep\n"
            "from runners.devices import local_gpus\n"
            "from runners.record import host_environment\n"
            "assert local_gpus().count == 0 and host_environment()['torch_version']\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
