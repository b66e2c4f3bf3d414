"""Collectives (and point-to-point operations) take tensors on the run's device: NCCL refuses a CPU
tensor ("No backend type associated with device type cpu"). On CPU over gloo every tensor is on the run's device, so
neither the runs nor ``--p2p-semantics nccl`` can see a tensor made without one: ``ours``' ``--n-slices auto``
all-reduced a CPU float on the first GPU it met (tools.gpu_check on an H100). This reads the sources instead: a
collective whose tensor is made by a torch factory without ``device=`` (in the call, or in the assignment to the name it
is given) fails here, on a laptop."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
               "isend", "irecv", "send", "recv"}  # NCCL's point-to-point takes CUDA tensors too
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "zeros_like", "ones_like", "empty_like"}
SOURCES = ("ours", "baselines", "contract", "workload", "runners/worker.py")
GLOO_ONLY = {"ours/plan/ping_pong.py"}  # a gloo process group of its own (the planner's CPU link timing)


def _is_collective(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and isinstance(f.value, ast.Name) \
        and f.value.id in ("dist", "torch.distributed")


def _hostless(node: ast.expr) -> bool:
    """A torch factory call without ``device=`` (``*_like`` keep their argument's device: fine)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
            and not node.func.attr.endswith("_like") and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch" and not any(k.arg == "device" for k in node.keywords))


def offenders(source: str, name: str) -> list[str]:
    """'file:line call' for every collective given a tensor made without a device."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made = {t.id: a.value for a in ast.walk(fn) if isinstance(a, ast.Assign) for t in a.targets
                if isinstance(t, ast.Name)}
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and _is_collective(call) and call.args:
                arg = call.args[0]
                value = made.get(arg.id) if isinstance(arg, ast.Name) else arg
                if value is not None and _hostless(value):
                    found.append(f"{name}:{call.lineno} {ast.unparse(call)}")
    return list(dict.fromkeys(found))  # a nested function is walked with its outer one too


def test_the_lint_sees_a_host_tensor():
    bad = "def f():\n    took = torch.tensor([1.0], dtype=torch.float64)\n    dist.all_reduce(took)\n"
    good = ("def f(d):\n    took = torch.tensor([1.0], device=d)\n    dist.all_reduce(took)\n"
            "    dist.all_reduce(torch.zeros_like(took))\n")
    assert offenders(bad, "x.py") == ["x.py:3 dist.all_reduce(took)"]
    assert offenders(good, "x.py") == []


def test_every_collective_takes_a_tensor_on_the_run_device():
    found = []
    for name in SOURCES:
        path = REPO / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if "cpu_shim" in f.name or str(f.relative_to(REPO)) in GLOO_ONLY:  # CPU only
                continue
            found += offenders(f.read_text(), str(Path(f).relative_to(REPO)))
    assert not found, "collectives given a tensor made without device= (NCCL refuses CPU tensors):\n" + "\n".join(found)
