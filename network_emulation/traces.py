"""Links that change while a run goes on: a trace of settings in time, applied to one link, several,
or every link of the run's network profile.

A trace file (JSON)::

    {"links": "all",                                # or [[src, dst], ...]: those directed links only
     "points": [{"at_s": 10, "bandwidth_gbps": 0.5},  # from 10 s on, half the bandwidth
                {"at_s": 20, "bandwidth_gbps": 1}]}   # from 20 s on, the whole of it again

Each point sets, from ``at_s`` seconds after the run's first step began, any of ``delay_ms``,
``bandwidth_gbps``, ``loss_pct`` and ``jitter_ms`` of the links it names (the link's other settings
stay as they were); points come in time order. Before the first point the links are as the profile
says. Under a trace the links are shaped as a per-link matrix (a uniform profile as the matrix it
amounts to), each link changing on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .profiles import (OPTIONAL_MATRIX_KEYS, LinkSpec, MatrixProfile, Profile, ProfileError, UniformProfile,
                       check_emulable, read_json)

FIELDS = ("delay_ms", "bandwidth_gbps", "loss_pct", "jitter_ms")  # what a point may set
TRACE_KEYS = ("links", "points")
MAX_TRACE_S = 7 * 24 * 3600.0
TRACE_FORMAT = '{"links": "all" | [[src, dst], ...], "points": [{"at_s": S, "bandwidth_gbps": B, ...}, ...]}'


@dataclass(frozen=True)
class TracePoint:
    """From ``at_s`` seconds after the first step began: the settings it changes (a subset of FIELDS)."""

    at_s: float
    changes: tuple[tuple[str, float], ...]

    def apply(self, link: LinkSpec) -> LinkSpec:
        return replace(link, **dict(self.changes))

    def describe(self) -> dict[str, float]:
        return {"at_s": self.at_s, **dict(self.changes)}


@dataclass(frozen=True)
class Trace:
    """A trace: the links it changes (None: every link) and its points in time order."""

    name: str
    links: tuple[tuple[int, int], ...] | None
    points: tuple[TracePoint, ...]

    def contents(self) -> dict[str, Any]:
        """The trace as its file holds it (what a run that reads the file runs under)."""
        return {"links": "all" if self.links is None else [list(l) for l in self.links],
                "points": [p.describe() for p in self.points]}

    def start(self, profile: Profile, n_hosts: int) -> MatrixProfile:
        """The profile the run starts under: ``profile`` as a per-link matrix (a uniform one too), so
        that each link's rate is an htb class of its own, which changes in place (tbf, which shapes a
        uniform profile, drops what it has queued when its rate changes)."""
        return as_matrix(profile, n_hosts) if isinstance(profile, UniformProfile) else profile

    def timeline(self, profile: Profile, n_hosts: int) -> list[tuple[TracePoint, MatrixProfile]]:
        """Each point with the profile the links have from then on; ProfileError if the trace does
        not fit the run (a link outside its hosts, a setting out of range or not emulable)."""
        if not profile.emulated:
            raise ProfileError("a trace changes emulated links: give --network a profile (not none)")
        current = self.start(profile, n_hosts)
        for src, dst in self.links or ():
            if not (0 <= src < n_hosts and 0 <= dst < n_hosts and src != dst):
                raise ProfileError(f"trace {self.name}: link [{src}, {dst}] is not a link between the run's "
                                   f"{n_hosts} hosts")
        out = []
        for point in self.points:
            current = _changed(current, point, self.links, n_hosts)
            check_emulable(current)
            out.append((point, current))
        return out


def as_matrix(profile: UniformProfile, n_hosts: int) -> MatrixProfile:
    """A uniform profile as the per-link matrix of ``n_hosts`` hosts that it amounts to."""
    link = profile.link_spec
    assert link is not None

    def full(value: float) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(0.0 if i == j else value for j in range(n_hosts)) for i in range(n_hosts))

    optional = {k: full(getattr(link, k)) for k in OPTIONAL_MATRIX_KEYS if getattr(link, k)}
    return MatrixProfile(profile.name, profile.label, full(link.delay_ms), full(link.bandwidth_gbps), **optional)


def _changed(profile: MatrixProfile, point: TracePoint, links: tuple[tuple[int, int], ...] | None,
             n_hosts: int) -> MatrixProfile:
    """``profile`` with ``point`` applied to ``links`` (None: every link)."""
    targets = set(links) if links is not None else {(i, j) for i in range(n_hosts) for j in range(n_hosts) if i != j}
    grids = {k: [list(r) for r in (getattr(profile, k) or [[0.0] * n_hosts for _ in range(n_hosts)])] for k in FIELDS}
    for i, j in targets:
        link = point.apply(profile.link(i, j))  # type: ignore[arg-type]
        for k in FIELDS:
            grids[k][i][j] = getattr(link, k)
    frozen = {k: tuple(tuple(r) for r in g) for k, g in grids.items()}
    return MatrixProfile(profile.name, profile.label, **frozen)


def load_trace(path: str | Path) -> Trace:
    """A trace from its JSON file (``TRACE_FORMAT``); ProfileError (one line) if it is not one."""
    return trace_from(read_json(path, "trace"), name=Path(path).stem)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{what} must be a number, got {value!r}")
    return float(value)


def trace_from(data: Any, name: str = "trace") -> Trace:
    """A Trace from a trace file's contents (``TRACE_FORMAT``)."""
    if not isinstance(data, dict) or set(data) != set(TRACE_KEYS):
        raise ProfileError(f"trace {name}: expected {TRACE_FORMAT}")
    links = data["links"]
    if links == "all":
        pairs = None
    elif (isinstance(links, list) and links
          and all(isinstance(l, list) and len(l) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in l)
                  for l in links)):
        pairs = tuple(sorted({(l[0], l[1]) for l in links}))
    else:
        raise ProfileError(f"trace {name}: 'links' must be \"all\" or a list of [src, dst] host pairs")
    points = data["points"]
    if not isinstance(points, list) or not points:
        raise ProfileError(f"trace {name}: 'points' must be a non-empty list of {{\"at_s\": S, ...}}")
    out: list[TracePoint] = []
    for k, point in enumerate(points):
        where = f"trace {name}: point {k + 1}"
        if not isinstance(point, dict) or "at_s" not in point:
            raise ProfileError(f"{where}: must be an object with 'at_s' and some of {', '.join(FIELDS)}")
        unknown = sorted(set(point) - {"at_s", *FIELDS})
        if unknown:
            raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)} (a point sets {', '.join(FIELDS)})")
        at = _number(point["at_s"], f"{where}: at_s")
        if not 0 <= at <= MAX_TRACE_S or (out and at <= out[-1].at_s):
            raise ProfileError(f"{where}: at_s {at:g} must be within 0..{MAX_TRACE_S:g} s and after the point before")
        changes = tuple((f, _number(point[f], f"{where}: {f}")) for f in FIELDS if f in point)
        if not changes:
            raise ProfileError(f"{where}: changes nothing (give some of {', '.join(FIELDS)})")
        out.append(TracePoint(at, changes))
    return Trace(name, pairs, tuple(out))


class TracePlayer:
    """Plays a trace on a running cluster (``VirtualCluster(..., changing=True)``), in a thread of its
    own: waits until ``mark`` exists (the run's time 0: its first step began), then reshapes the
    cluster at each point's time. ``stop`` ends it and returns what was applied when: per point its
    ``at_s``, the offset it took effect at (``applied_s``) and its settings; a point the run ended
    before is left out."""

    def __init__(self, cluster, timeline: list[tuple[TracePoint, Profile]], mark: Path, poll_s: float = 0.01):
        import threading

        self.cluster, self.timeline, self.mark, self.poll_s = cluster, timeline, mark, poll_s
        self.applied: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._play, daemon=True, name="trace")

    def start(self) -> TracePlayer:
        self._thread.start()
        return self

    def _play(self) -> None:
        import time

        while not self.mark.exists():
            if self._stop.wait(self.poll_s):
                return
        zero = time.monotonic()
        for point, profile in self.timeline:
            if self._stop.wait(max(0.0, zero + point.at_s - time.monotonic())):
                return
            try:
                self.cluster.reshape(profile)
            except Exception as exc:  # the run goes on under the links as they were; the record says why
                self.applied.append({**point.describe(), "error": str(exc).splitlines()[0][:300]})
                return
            self.applied.append({**point.describe(), "applied_s": round(time.monotonic() - zero, 4)})

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.applied
