"""The measured schedule: each rank's spans (forward, backward, send, recv, sync, ...) as a Chrome trace.

When tracing is off, ``span`` returns one shared no-op context manager, so a disabled tracer costs a
method call per span. Timestamps come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock
for every process of a host); rank 0 gathers every rank's spans and writes one Perfetto/Chrome JSON file.

``Tracer.to_profiler`` (off by default; ``bench.breakdown`` turns it on in its ranks) makes every span,
traced or not, also a range ``ours::KIND`` in torch's profiler, so that the profiler's operations can
be told apart by the engine's phase they ran in.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import torch.distributed as dist

_NULL = contextlib.nullcontext()


class _Span:
    __slots__ = ("tracer", "kind", "name", "args", "start")

    def __init__(self, tracer: "Tracer", kind: str, name: str, args: dict | None):
        self.tracer, self.kind, self.name, self.args = tracer, kind, name, args

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.tracer.add(self.kind, self.name, self.start, time.perf_counter(), self.args)
        return False


class _Both:
    """A span that is also a range in torch's profiler."""

    __slots__ = ("span", "range")

    def __init__(self, span, kind: str):
        from torch.profiler import record_function  # only where a profiler is asked for

        self.span, self.range = span, record_function(f"ours::{kind}")

    def __enter__(self):
        self.range.__enter__()
        self.span.__enter__()
        return self

    def __exit__(self, *exc):
        self.span.__exit__(*exc)
        return self.range.__exit__(*exc)


class Tracer:
    to_profiler = False  # every span also a range ours::KIND in torch's profiler (class-wide)

    def __init__(self, rank: int, enabled: bool):
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict] = []

    def span(self, kind: str, name: str = "", args: dict | None = None):
        span = _Span(self, kind, name or kind, args) if self.enabled else _NULL
        return _Both(span, kind) if self.to_profiler else span

    def add(self, kind: str, name: str, start: float, end: float, args: dict | None = None) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "cat": kind, "ph": "X", "ts": start * 1e6, "dur": max(0.0, (end - start) * 1e6),
              "pid": self.rank, "tid": kind}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def write(self, path: str, world_size: int) -> None:
        """Collective: every rank calls it; rank 0 writes the file."""
        gathered: list | None = [None] * world_size if self.rank == 0 else None
        dist.gather_object(self.events, gathered, dst=0)
        if self.rank != 0:
            return
        events: list[dict] = []
        for r in range(world_size):
            events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        for evs in gathered:
            events.extend(evs or [])
        if events:
            t0 = min(e["ts"] for e in events if e["ph"] == "X") if any(e["ph"] == "X" for e in events) else 0.0
            for e in events:
                if e["ph"] == "X":
                    e["ts"] -= t0
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
