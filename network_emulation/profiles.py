"""Network profiles: named seed settings, a string parser and per-link matrices.

A profile answers one question: what does the link from host ``src`` to host ``dst`` do to a
packet? Delay is one-way (added once on the path from sender to receiver); bandwidth is the
sender's egress rate towards that destination; loss is the share of packets dropped on the way (each
packet on its own, as netem's ``loss``); jitter spreads each packet's delay uniformly over
delay ± jitter (as netem's ``delay D J``), packets keeping their order.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from .delayer import QUEUE_MAXLEN

MAX_DELAY_MS = 10_000.0  # 10 s
MAX_BANDWIDTH_GBPS = 1_000.0  # 1 Tbit/s
# What the shaping backends can emulate (checked before a run starts, ``check_emulable``): below
# 10 Mbit/s the probe's bulk transfer and gloo's rendezvous take minutes; the delayer holds at most
# QUEUE_MAXLEN packets per link, so the bytes in flight (bandwidth x delay) must fit in that many
# MTU-sized packets (netem's queue limit is sized from the same product).
MIN_EMULATED_BANDWIDTH_GBPS = 0.01
MAX_LOSS_PCT = 50.0  # beyond half the packets lost, TCP moves next to nothing
MATRIX_KEYS = ("delay_ms", "bandwidth_gbps")  # a per-link matrix file holds these, N x N each
OPTIONAL_MATRIX_KEYS = ("loss_pct", "jitter_ms")  # and may hold these (0 where absent)
MATRIX_FORMAT = ('{"delay_ms": [[...]], "bandwidth_gbps": [[...]]} (and optionally "loss_pct", "jitter_ms"), '
                 'N x N, row i: from rank i')

MAX_IN_FLIGHT_BYTES = QUEUE_MAXLEN * 1500


class ProfileError(ValueError):
    """A network profile that cannot be parsed or is out of range (one-line message)."""


@dataclass(frozen=True)
class LinkSpec:
    """Shaping of one directed link: one-way delay (ms), rate (Gbit/s), packet loss (% of packets)
    and jitter (ms: each packet's delay uniform in delay ± jitter, never below 0)."""

    delay_ms: float
    bandwidth_gbps: float
    loss_pct: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_delay(self.delay_ms)
        _check_bandwidth(self.bandwidth_gbps)
        _check_loss(self.loss_pct)
        _check_delay(self.jitter_ms, "jitter")

    @property
    def lossy(self) -> bool:
        """Whether the link drops or jitters packets (what only a packet-level emulation shows)."""
        return self.loss_pct > 0 or self.jitter_ms > 0

    @property
    def held(self) -> bool:
        """Whether a packet delayer has anything to do to the link's packets (hold, jitter or drop)."""
        return self.delay_ms > 0 or self.lossy

    def describe(self) -> dict[str, float]:
        """Delay and bandwidth; loss and jitter where set (a link without them is described as before
        they existed)."""
        return {"delay_ms": self.delay_ms, "bandwidth_gbps": self.bandwidth_gbps,
                **{k: getattr(self, k) for k in OPTIONAL_MATRIX_KEYS if getattr(self, k)}}

    def words(self) -> str:
        """The link as the run command's --network writes it."""
        extra = "".join(f" {k} {v:g}{unit}" for k, v, unit in (("loss", self.loss_pct, "%"),
                                                                ("jitter", self.jitter_ms, "ms")) if v)
        return f"delay {self.delay_ms:g}ms bandwidth {self.bandwidth_gbps:g}Gbps" + extra


@dataclass(frozen=True)
class UniformProfile:
    """Every link has the same shaping; ``link is None`` means no emulation at all."""

    name: str
    label: str
    link_spec: LinkSpec | None

    @property
    def emulated(self) -> bool:
        return self.link_spec is not None

    @property
    def uniform(self) -> bool:
        return True

    def link(self, src: int, dst: int) -> LinkSpec | None:
        return self.link_spec

    def check_hosts(self, n_hosts: int) -> None:
        """Uniform profiles fit any cluster size."""

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "label": self.label, "kind": "uniform"}
        out["link"] = self.link_spec.describe() if self.link_spec else None
        return out


@dataclass(frozen=True)
class MatrixProfile:
    """Per-link shaping: ``delay_ms[i][j]``, ``bandwidth_gbps[i][j]`` and, where given,
    ``loss_pct[i][j]`` and ``jitter_ms[i][j]`` for i -> j (diagonal ignored)."""

    name: str
    label: str
    delay_ms: tuple[tuple[float, ...], ...]
    bandwidth_gbps: tuple[tuple[float, ...], ...]
    loss_pct: tuple[tuple[float, ...], ...] | None = None
    jitter_ms: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.delay_ms)
        if n < 2:
            raise ProfileError(f"matrix profile needs at least 2 hosts, got {n}")
        for what in (*MATRIX_KEYS, *OPTIONAL_MATRIX_KEYS):
            m = getattr(self, what)
            if m is not None and (len(m) != n or any(len(row) != n for row in m)):
                raise ProfileError(f"matrix profile: {what} must be {n}x{n} like delay_ms")
        for i in range(n):
            for j in range(n):
                if i != j:
                    self.link(i, j)  # validates

    @property
    def n_hosts(self) -> int:
        return len(self.delay_ms)

    @property
    def emulated(self) -> bool:
        return True

    @property
    def uniform(self) -> bool:
        return False

    def link(self, src: int, dst: int) -> LinkSpec | None:
        if src == dst:
            return None
        loss = self.loss_pct[src][dst] if self.loss_pct is not None else 0.0
        jitter = self.jitter_ms[src][dst] if self.jitter_ms is not None else 0.0
        return LinkSpec(self.delay_ms[src][dst], self.bandwidth_gbps[src][dst], loss, jitter)

    def check_hosts(self, n_hosts: int) -> None:
        if n_hosts != self.n_hosts:
            raise ProfileError(f"matrix profile {self.name!r} is {self.n_hosts}x{self.n_hosts}, "
                               f"cluster has {n_hosts} hosts")

    def contents(self) -> dict[str, list[list[float]]]:
        """The matrix as its file holds it: what a run that reads the file runs under."""
        return {k: [list(r) for r in getattr(self, k)] for k in (*MATRIX_KEYS, *OPTIONAL_MATRIX_KEYS)
                if getattr(self, k) is not None}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "kind": "matrix", **self.contents()}


Profile = Union[UniformProfile, MatrixProfile]


def _check_delay(d: float, what: str = "delay") -> None:
    if not isinstance(d, (int, float)) or isinstance(d, bool) or math.isnan(d) or math.isinf(d):
        raise ProfileError(f"{what} must be a finite number of ms, got {d!r}")
    if d < 0:
        raise ProfileError(f"{what} must not be negative, got {d:g} ms")
    if d > MAX_DELAY_MS:
        raise ProfileError(f"{what} {d:g} ms is absurd (limit {MAX_DELAY_MS:g} ms)")


def _check_loss(p: float) -> None:
    if not isinstance(p, (int, float)) or isinstance(p, bool) or math.isnan(p) or math.isinf(p):
        raise ProfileError(f"loss must be a finite percentage, got {p!r}")
    if not 0 <= p <= MAX_LOSS_PCT:
        raise ProfileError(f"loss {p:g} % is out of range (0 to {MAX_LOSS_PCT:g} % of packets)")


def _check_bandwidth(b: float) -> None:
    if not isinstance(b, (int, float)) or isinstance(b, bool) or math.isnan(b) or math.isinf(b):
        raise ProfileError(f"bandwidth must be a finite number of Gbit/s, got {b!r}")
    if b <= 0:
        raise ProfileError(f"bandwidth must be positive, got {b:g} Gbit/s")
    if b > MAX_BANDWIDTH_GBPS:
        raise ProfileError(f"bandwidth {b:g} Gbit/s is absurd (limit {MAX_BANDWIDTH_GBPS:g} Gbit/s)")


def _uniform(name: str, label: str, delay_ms: float, gbps: float) -> UniformProfile:
    return UniformProfile(name, label, LinkSpec(delay_ms, gbps))


# The five settings of the seed's tables (label text kept verbatim for reports), plus "none".
PROFILES: dict[str, UniformProfile] = {
    p.name: p
    for p in (
        UniformProfile("none", "none (no emulation)", None),
        _uniform("default", "default (about 0.1ms; up to 10Gbps)", 0.1, 10.0),
        _uniform("d1-5g", "delay 1ms  bandwidth 5Gbps", 1.0, 5.0),
        _uniform("d5-2g", "delay 5ms  bandwidth 2Gbps", 5.0, 2.0),
        _uniform("d10-1g", "delay 10ms  bandwidth 1Gbps", 10.0, 1.0),
        _uniform("d50-1g", "delay 50ms  bandwidth 1Gbps", 50.0, 1.0),
    )
}
SEED_PROFILES: tuple[str, ...] = ("default", "d1-5g", "d5-2g", "d10-1g", "d50-1g")

_DELAY_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_RATE_UNITS = {"bps": 1e-9, "kbps": 1e-6, "mbps": 1e-3, "gbps": 1.0}
_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan|inf)"
_DELAY_RE = re.compile(rf"delay\s*{_NUM}\s*(us|ms|s)\b")
_RATE_RE = re.compile(rf"bandwidth\s*{_NUM}\s*(bps|kbps|mbps|gbps)\b")
_LOSS_RE = re.compile(rf"loss\s*{_NUM}\s*%")
_JITTER_RE = re.compile(rf"jitter\s*{_NUM}\s*(us|ms|s)\b")


def _norm(text: str) -> str:
    return " ".join(text.strip().lower().split())


def link_classes(profile: Profile) -> list[tuple[int, int, LinkSpec]]:
    """The profile's distinct links, each with the first host pair (src, dst) that has it, in host
    order: one for a uniform profile (0 -> 1), one per kind of link of a matrix (e.g. two for two
    regions: inside one, between them); none without emulation."""
    n = profile.n_hosts if isinstance(profile, MatrixProfile) else 2
    seen: dict[LinkSpec, tuple[int, int]] = {}
    for i in range(n):
        for j in range(n):
            link = profile.link(i, j) if i != j else None
            if link is not None and link not in seen:
                seen[link] = (i, j)
    return [(i, j, link) for link, (i, j) in seen.items()]


def slowest(links: list[tuple[int, int, LinkSpec]]) -> tuple[int, int, LinkSpec]:
    """The slowest of ``link_classes``: the longest delay, then the least bandwidth, then the most loss
    and jitter."""
    return max(links, key=lambda c: (c[2].delay_ms, -c[2].bandwidth_gbps, c[2].loss_pct, c[2].jitter_ms))


def _span(values: list[float], unit: str) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:g} {unit}" if lo == hi else f"{lo:g}-{hi:g} {unit}"


def describe_setting(text: str, contents: dict | None = None) -> dict[str, Any]:
    """A network setting in words and numbers, as a run record keeps it for the report: its label and
    its link (delay_ms and bandwidth_gbps; None without emulation; loss_pct and jitter_ms where the
    link has them, for a matrix the most any of its links has); for a per-link matrix (its
    ``contents`` as the run read them), a label that says what the matrix holds, its slowest link
    and the pair that has it, how many kinds of link it has and whether they are all one. A setting
    that does not parse is described by its text alone."""
    try:
        profile = parse_profile(text, contents)
    except ProfileError:
        return {"label": text, "delay_ms": None, "bandwidth_gbps": None}
    classes = link_classes(profile)
    if not classes:
        return {"label": profile.label, "delay_ms": None, "bandwidth_gbps": None}
    src, dst, link = slowest(classes)
    out = {"label": profile.label, "delay_ms": link.delay_ms, "bandwidth_gbps": link.bandwidth_gbps}
    for what in OPTIONAL_MATRIX_KEYS:
        most = max(getattr(c[2], what) for c in classes)
        if most:
            out[what] = most
    if isinstance(profile, MatrixProfile):
        delays = [c[2].delay_ms for c in classes]
        rates = [c[2].bandwidth_gbps for c in classes]
        out.update(label=f"{profile.label} ({profile.n_hosts} hosts, {_span(delays, 'ms')}, {_span(rates, 'Gbit/s')})",
                   slowest_link=[src, dst], link_classes=len(classes), uniform=len(classes) == 1)
    return out


def parse_profile(text: str, contents: dict | None = None) -> Profile:
    """Parse a profile: a short name (``d10-1g``), a seed label, ``none``,
    ``"delay 10ms bandwidth 1Gbps"`` (units us/ms/s, bps/Kbps/Mbps/Gbps, any case),
    or the path of a JSON matrix file (``{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}``).
    ``contents``: the matrix file's contents as read before (a run is judged, run and recorded under
    the matrix its request read, never the file as it is later); the file is not read again.
    """
    if contents is not None:
        return matrix_profile(contents, name=Path(text.strip()).stem, label=text.strip())
    if not isinstance(text, str) or not text.strip():
        raise ProfileError("empty network profile")
    key = _norm(text)
    if key in PROFILES:
        return PROFILES[key]
    for p in PROFILES.values():
        if key == _norm(p.label):
            return p
    if text.strip().endswith(".json"):
        return load_matrix(text.strip())
    if Path(text.strip()).is_file():
        raise ProfileError(f"{text.strip()!r} is a file, and a per-link matrix is read from a JSON file named *.json "
                           f"({MATRIX_FORMAT})")
    d, r, loss, jitter = (rx.search(key) for rx in (_DELAY_RE, _RATE_RE, _LOSS_RE, _JITTER_RE))
    rest = key
    for rx in (_DELAY_RE, _RATE_RE, _LOSS_RE, _JITTER_RE):
        rest = rx.sub("", rest, count=1)
    if d is None or r is None or rest.strip(" ,;"):
        raise ProfileError(
            f"cannot parse network profile {text.strip()!r}: expected e.g. 'delay 10ms bandwidth 1Gbps' (and "
            f"optionally 'loss 0.5%', 'jitter 2ms') or one of {', '.join(PROFILES)}"
        )
    link = LinkSpec(float(d.group(1)) * _DELAY_UNITS[d.group(2)], float(r.group(1)) * _RATE_UNITS[r.group(2)],
                    float(loss.group(1)) if loss else 0.0,
                    float(jitter.group(1)) * _DELAY_UNITS[jitter.group(2)] if jitter else 0.0)
    return UniformProfile(name=_short_name(link), label=text.strip(), link_spec=link)


def _short_name(link: LinkSpec) -> str:
    gbps = link.bandwidth_gbps
    rate = f"{gbps:g}g" if gbps >= 1 else f"{gbps * 1000:g}m"
    return f"d{link.delay_ms:g}-{rate}" + "".join(f"-{k}{v:g}" for k, v in (("loss", link.loss_pct),
                                                                            ("jitter", link.jitter_ms)) if v)


def read_json(path: str | Path, what: str) -> Any:
    """The contents of the JSON file ``path`` (a matrix profile, a trace: ``what``); ProfileError (one
    line) if it cannot be read or is not JSON."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except OSError as e:
        raise ProfileError(f"cannot read {what} {str(p)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{what} {str(p)!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                           f"{e.start})") from None


def load_matrix(path: str | Path) -> MatrixProfile:
    """Load a per-link matrix profile from a JSON file (N x N, as DT-FM's heterogeneous scenarios)."""
    return matrix_profile(read_json(path, "matrix profile"), name=Path(path).stem, label=str(path))


def matrix_profile(data: Any, name: str = "matrix", label: str = "matrix") -> MatrixProfile:
    """Build a MatrixProfile from ``{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}``, with
    ``loss_pct`` and ``jitter_ms`` optional (no other key)."""
    if not isinstance(data, dict) or "delay_ms" not in data or "bandwidth_gbps" not in data:
        raise ProfileError("matrix profile must be an object with 'delay_ms' and 'bandwidth_gbps'")
    unknown = sorted(set(data) - set(MATRIX_KEYS) - set(OPTIONAL_MATRIX_KEYS))
    if unknown:
        raise ProfileError(f"matrix profile: unknown key(s) {', '.join(map(repr, unknown))}; a matrix has "
                           f"{' and '.join(MATRIX_KEYS)}, and optionally {' and '.join(OPTIONAL_MATRIX_KEYS)}")

    def rows(key: str) -> tuple[tuple[float, ...], ...]:
        m = data[key]
        if not isinstance(m, list) or not all(isinstance(r, list) for r in m):
            raise ProfileError(f"matrix profile: {key} must be a list of lists")
        out = []
        for r in m:
            for v in r:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ProfileError(f"matrix profile: {key} holds a non-number {v!r}")
            out.append(tuple(float(v) for v in r))
        return tuple(out)

    optional = {k: rows(k) for k in OPTIONAL_MATRIX_KEYS if k in data}
    return MatrixProfile(name=name, label=label, delay_ms=rows("delay_ms"), bandwidth_gbps=rows("bandwidth_gbps"),
                         **optional)


def check_emulable(profile: Profile) -> None:
    """Raise ProfileError if the shaping backends cannot emulate every link of ``profile``."""
    n = profile.n_hosts if isinstance(profile, MatrixProfile) else 2
    links = {profile.link(i, j) for i in range(n) for j in range(n) if i != j} - {None}
    for link in links:
        if link.bandwidth_gbps < MIN_EMULATED_BANDWIDTH_GBPS:
            raise ProfileError(f"bandwidth {link.bandwidth_gbps * 1e3:g} Mbit/s is below what the emulation can do "
                               f"(at least {MIN_EMULATED_BANDWIDTH_GBPS * 1e3:g} Mbit/s)")
        in_flight = link.bandwidth_gbps * 1e9 / 8 * link.delay_ms / 1e3
        if in_flight > MAX_IN_FLIGHT_BYTES:
            raise ProfileError(f"delay {link.delay_ms:g} ms at {link.bandwidth_gbps:g} Gbit/s keeps "
                               f"{in_flight / 2**20:.0f} MiB in flight, more than the emulation holds "
                               f"({MAX_IN_FLIGHT_BYTES / 2**20:.0f} MiB): lower the delay or the bandwidth")

