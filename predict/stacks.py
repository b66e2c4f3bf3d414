"""Stacks: what a whole training step adds beyond its kernels on one software stack and its machines,
as named terms with their sources (``predict/stacks.json``).

A device file models kernels from kernel benchmarks (``workload/devices``: GEMMs at their shapes,
memory-bound operations at the bandwidth, a kernel's fixed cost and the host's time to issue it). A
published or measured training step also carries what no kernel benchmark sees: the framework's and
the scripts' own work between kernels, synchronisations, stalls. A scenario names its stack
(``[predict] stack``); the stack gives, per GPU part and precision, that time as a share of the step's
modelled math (``stalls``), set from one named cell (``cell``, never scored) by
``pipebench predict validate-seed --calibrate`` or ``validate-published --calibrate``, or a documented
number. A prediction shows it as a part of its own (``stalls``). Without a stack, kernels only.
"""
from __future__ import annotations

import json
from pathlib import Path

STACKS = Path(__file__).resolve().parent / "stacks.json"


class StackError(ValueError):
    """A stack that is not known or not well formed (one line)."""


def stacks() -> dict[str, dict]:
    return json.loads(STACKS.read_text())


def check(name: str) -> None:
    known = stacks()
    if name not in known:
        raise StackError(f"unknown stack {name!r} (known: {', '.join(known)})")


def term_key(part: str, precision: str) -> str:
    """How a stack names one GPU part's precision: "V100 SXM2 fp16"."""
    return f"{part} {precision}"


def stall_share(name: str | None, part: str, precision: str) -> float:
    """The share of the modelled math that ``name``'s runs spend beyond it on ``part`` in ``precision``
    (0 without a stack, or where the stack sets none)."""
    if name is None:
        return 0.0
    check(name)
    term = stacks()[name].get("stalls", {}).get(term_key(part, precision))
    return float(term["share"]) if term else 0.0


def calibration_cells(name: str) -> dict[str, str]:
    """{GPU part and precision: the cell its stalls were set from} of a stack."""
    check(name)
    return {k: v["cell"] for k, v in stacks()[name].get("stalls", {}).items() if v.get("cell")}


def write_share(name: str, part: str, precision: str, share: float, cell: str, how: str) -> None:
    """Set one stall share of a stack in ``predict/stacks.json`` (a calibration)."""
    data = stacks()
    data[name].setdefault("stalls", {})[term_key(part, precision)] = dict(share=round(share, 4), cell=cell,
                                                                          fitted_by=how)
    STACKS.write_text(json.dumps(data, indent=1) + "\n")


def fit_share(predict_step, measured: float, hi: float = 20.0, tol: float = 1e-4) -> float:
    """The stall share at which ``predict_step(share)`` (the simulated step) takes ``measured`` seconds,
    by bisection over [0, hi]; 0 where the kernels alone already take at least that long (a stall is
    never negative)."""
    if predict_step(0.0) >= measured:
        return 0.0
    if predict_step(hi) < measured:
        raise ValueError(f"even a stall share of {hi:g} predicts below {measured:.2f} s")
    lo = 0.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if predict_step(mid) > measured:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
