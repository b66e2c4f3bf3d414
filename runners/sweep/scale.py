"""A sweep scaled down to fit one small machine, with the same plan: the cluster rehearsal's sweep.

``scale_down(data)`` takes a sweep file's contents (the TOML as a dict) and returns a new one in
which every run keeps its system, options, layout, micro-batch size, network setting and its
placement hint, and the number of layers (so that every layout still divides the model), while the
model becomes the ``tiny`` family with a narrow hidden size and a short sequence, the batch shrinks,
and the steps and timeout are cut. The seed's GPT-3 XL cluster sweep becomes 24 layers of hidden 64
with sequence 64 and batch 16 per pipeline: P-12 is still 12 nodes x 1 rank with 2 layers each, and
every micro-batch size of the Megatron table (1 to 16) still divides the batch.

``python -m runners.sweep FILE --scale-down`` (and ``run_all.sh --rehearse``) plan the scaled sweep
through the same code as the full one.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from runners.sweep.plan import parse_layout
from workload.configs import MODEL_CONFIGS

MODEL = "tiny"
HIDDEN = 64
SEQ_LENGTH = 64
VOCAB = 512
BATCH_DIVISOR = 4  # 64 per pipeline becomes 16
MAX_STEPS = 3
MAX_WARMUP = 1
TIMEOUT_S = 600
MAX_HEADS = 16  # head dimension at least HIDDEN / MAX_HEADS = 4


def _heads(heads: int | None, tp_degrees: set[int]) -> int:
    """The largest head count <= MAX_HEADS that divides HIDDEN and every tensor-parallel degree's
    need (heads divisible by T), preferring the original count when it fits."""
    fits = isinstance(heads, int) and heads <= MAX_HEADS and HIDDEN % heads == 0
    if fits and all(heads % t == 0 for t in tp_degrees):
        return heads
    for h in range(MAX_HEADS, 0, -1):
        if HIDDEN % h == 0 and all(h % t == 0 for t in tp_degrees):
            return h
    return 1


def _micro_batch_sizes(exp: dict[str, Any], fixed: dict[str, Any]) -> set[int]:
    sizes: set[int] = set()
    for where in (exp, *[s for s in exp.get("systems", []) if isinstance(s, dict)]):
        if isinstance(where.get("micro_batch_sizes"), list):
            sizes |= {m for m in where["micro_batch_sizes"] if isinstance(m, int) and m > 0}
    for where in (exp, fixed):
        if isinstance(where.get("micro_batch_size"), int) and where["micro_batch_size"] > 0:
            sizes.add(where["micro_batch_size"])
    return sizes


def _tp_degrees(exp: dict[str, Any]) -> set[int]:
    layouts = list(exp.get("layouts", []))
    for s in exp.get("systems", []):
        if isinstance(s, dict):
            layouts += list(s.get("layouts", []))
    degrees = set()
    for lay in layouts:
        try:
            degrees.add(parse_layout(lay, "scale")["tp"])
        except ValueError:  # a bad layout is reported when the scaled sweep is planned
            continue
    return degrees


def scaled_batch(batch: int, micro_batch_sizes: set[int]) -> int:
    """``batch / BATCH_DIVISOR``, raised to a multiple of every micro-batch size (and at least the
    largest), so that every micro-batch size of the sweep still divides it."""
    step = math.lcm(*micro_batch_sizes) if micro_batch_sizes else 1
    target = max(1, batch // BATCH_DIVISOR, max(micro_batch_sizes, default=1))
    return -(-target // step) * step


def scale_down(data: dict[str, Any]) -> dict[str, Any]:
    """The scaled-down sweep (a new dict; ``data`` is not changed). See the module's docstring.
    Each experiment gets the scaled settings of its own (they override [fixed])."""
    out = copy.deepcopy(data)
    if "experiment" in out:
        fixed, experiments = out.get("fixed", {}), out["experiment"]
    else:  # the file itself is one experiment
        fixed, experiments = out.get("fixed", {}), [out]
    if not isinstance(fixed, dict) or not isinstance(experiments, list):
        return out  # malformed: the planner reports it
    out["name"] = f"{data.get('name', 'sweep')}-scaled"
    out["description"] = f"scaled down to one machine: {data.get('description', '')}".strip()
    for exp in experiments:
        if isinstance(exp, dict):
            exp.update(_scaled_settings({**fixed, **exp}, exp, fixed))
    return out


def _each(value: Any, scale: Callable[[int | float], int | float]) -> Any:
    """``scale`` applied to a number, or to every number of a list (a list setting is a sweep axis);
    anything else is left for the planner to judge."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(value):
        return scale(value)
    if isinstance(value, list) and value and all(number(v) for v in value):
        return list(dict.fromkeys(scale(v) for v in value))
    return value


def _scaled_settings(merged: dict[str, Any], exp: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    model = MODEL_CONFIGS.get(merged.get("model")) if isinstance(merged.get("model"), str) else None
    layers = merged.get("num_layers", model.n_layer if model else None)
    heads = merged.get("num_heads", model.n_head if model else None)
    new: dict[str, Any] = {"model": MODEL, "hidden_size": HIDDEN, "num_heads": _heads(heads, _tp_degrees(exp)),
                           "seq_length": SEQ_LENGTH, "vocab_size": VOCAB}
    if layers is not None:
        new["num_layers"] = layers
    sizes = _micro_batch_sizes(exp, fixed)
    for key, scale in (("batch_size", lambda b: scaled_batch(int(b), sizes)), ("steps", lambda n: min(n, MAX_STEPS)),
                       ("warmup", lambda w: min(w, MAX_WARMUP)), ("timeout", lambda t: min(t, TIMEOUT_S))):
        if key in merged:
            new[key] = _each(merged[key], scale)
    return new
