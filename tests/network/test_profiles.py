"""Profile names, the string parser, matrix files and validation."""
from __future__ import annotations

import json
import math

import pytest

from network_emulation import (PROFILES, SEED_PROFILES, MatrixProfile, ProfileError, load_matrix, parse_profile)
from network_emulation.profiles import describe_setting, link_classes, slowest


def test_seed_profiles_and_labels() -> None:
    assert SEED_PROFILES == ("default", "d1-5g", "d5-2g", "d10-1g", "d50-1g")
    expected = {"default": (0.1, 10.0), "d1-5g": (1, 5), "d5-2g": (5, 2), "d10-1g": (10, 1), "d50-1g": (50, 1)}
    for name, (d, b) in expected.items():
        link = PROFILES[name].link(0, 1)
        assert link is not None and (link.delay_ms, link.bandwidth_gbps) == (d, b)
    assert PROFILES["default"].label == "default (about 0.1ms; up to 10Gbps)"
    assert not PROFILES["none"].emulated and PROFILES["none"].link(0, 1) is None


@pytest.mark.parametrize("text,delay,gbps", [
    ("delay 10ms bandwidth 1Gbps", 10, 1),
    ("delay 1ms  bandwidth 5Gbps", 1, 5),          # the seed table's double space
    ("DELAY 500us BANDWIDTH 100Mbps", 0.5, 0.1),
    ("delay 0.05s bandwidth 2500kbps", 50, 0.0025),
    ("bandwidth 1e9bps delay 2ms", 2, 1),
    ("delay 0ms bandwidth 1gbps", 0, 1),
    ("delay 10000ms bandwidth 1000Gbps", 10000, 1000),  # the limits themselves are fine
])
def test_parse_good(text: str, delay: float, gbps: float) -> None:
    link = parse_profile(text).link(0, 1)
    assert link is not None
    assert math.isclose(link.delay_ms, delay) and math.isclose(link.bandwidth_gbps, gbps)


def test_parse_names_and_labels() -> None:
    assert parse_profile("d10-1g") is PROFILES["d10-1g"]
    assert parse_profile(" D50-1G ") is PROFILES["d50-1g"]
    assert parse_profile("default (about 0.1ms; up to 10Gbps)") is PROFILES["default"]
    assert parse_profile("delay 5ms  bandwidth 2Gbps") is PROFILES["d5-2g"]
    assert parse_profile("none") is PROFILES["none"]
    assert parse_profile("delay 10ms bandwidth 1Gbps").name == "d10-1g"


@pytest.mark.parametrize("text", [
    "", "   ", "fast", "delay 10ms", "bandwidth 1Gbps", "delay 10 bandwidth 1Gbps", "delay 10ms bandwidth 1GB",
    "delay -1ms bandwidth 1Gbps", "delay 10ms bandwidth 0Gbps", "delay 10ms bandwidth -3Mbps",
    "delay nan ms bandwidth 1Gbps", "delay 10ms bandwidth inf Gbps", "delay 11s bandwidth 1Gbps",
    "delay 10ms bandwidth 2000Gbps", "delay 10ms bandwidth 1Gbps jitter -2ms", "delay 10xs bandwidth 1Gbps",
    "delay 10ms bandwidth 1Gbps loss 1", "delay 10ms bandwidth 1Gbps loss 51%",
    "delay 10ms bandwidth 1Gbps loss 1% loss 2%",
])
def test_parse_bad(text: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(text)
    assert isinstance(e.value, ValueError)
    assert "\n" not in str(e.value) and str(e.value)


def test_matrix_file(tmp_path) -> None:
    f = tmp_path / "hetero.json"
    f.write_text(json.dumps({"delay_ms": [[0, 1, 5], [1, 0, 10], [5, 10, 0]],
                             "bandwidth_gbps": [[0, 5, 2], [5, 0, 1], [2, 1, 0]]}))
    p = parse_profile(str(f))
    assert isinstance(p, MatrixProfile) and p.n_hosts == 3 and not p.uniform
    assert p.link(1, 2).delay_ms == 10 and p.link(0, 2).bandwidth_gbps == 2  # type: ignore[union-attr]
    assert p.link(1, 1) is None
    assert p.describe()["delay_ms"][2] == [5, 10, 0]
    p.check_hosts(3)
    with pytest.raises(ProfileError):
        p.check_hosts(4)


@pytest.mark.parametrize("content", [
    "not json",
    json.dumps({"delay_ms": [[0, 1], [1, 0]]}),
    json.dumps({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 1, 1], [1, 0, 1]]}),
    json.dumps({"delay_ms": [[0, 1, 2], [1, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]}),
    json.dumps({"delay_ms": [[0]], "bandwidth_gbps": [[0]]}),
    json.dumps({"delay_ms": [[0, -1], [1, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]}),
    json.dumps({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 0], [1, 0]]}),
    json.dumps({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 1], [5000, 0]]}),
    json.dumps({"delay_ms": [[0, "1"], [1, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]}),
    '{"delay_ms": [[0, NaN], [1, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]}',
])
def test_matrix_bad(tmp_path, content: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ProfileError) as e:
        load_matrix(f)
    assert "\n" not in str(e.value)


def test_matrix_missing_file(tmp_path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        parse_profile(str(tmp_path / "nope.json"))


TWO_REGIONS = {  # DT-FM's Oregon-Virginia link between two regions of two hosts each
    "delay_ms": [[0 if i == j else 0.1 if i // 2 == j // 2 else 67 for j in range(4)] for i in range(4)],
    "bandwidth_gbps": [[0 if i == j else 10 if i // 2 == j // 2 else 0.79 for j in range(4)] for i in range(4)]}


def test_the_kinds_of_link_of_a_matrix_and_its_setting() -> None:
    """Issue #31, item 4: a heterogeneous matrix was described (and probed) by its link 0 -> 1 alone."""
    m = parse_profile("two-region.json", TWO_REGIONS)  # contents as a request read them: the file is not read
    classes = link_classes(m)
    assert [(i, j, link.delay_ms, link.bandwidth_gbps) for i, j, link in classes] == [(0, 1, 0.1, 10), (0, 2, 67, 0.79)]
    assert slowest(classes)[:2] == (0, 2)
    setting = describe_setting("two-region.json", TWO_REGIONS)
    assert setting == {"label": "two-region.json (4 hosts, 0.1-67 ms, 0.79-10 Gbit/s)", "delay_ms": 67,
                       "bandwidth_gbps": 0.79, "slowest_link": [0, 2], "link_classes": 2, "uniform": False}
    assert [c[:2] for c in link_classes(parse_profile("d10-1g"))] == [(0, 1)]
    assert not link_classes(parse_profile("none"))
    assert describe_setting("d10-1g") == {"label": "delay 10ms  bandwidth 1Gbps", "delay_ms": 10.0,
                                          "bandwidth_gbps": 1.0}
