"""Loss, jitter and traces without a cluster: parsing, the delayer's verdicts, a trace's timeline."""
from __future__ import annotations

import json
import random

import pytest

from network_emulation import ProfileError, matrix_profile, parse_profile
from network_emulation.delayer import Queue, parse_queue, queue_arg
from network_emulation.netem import host_shaping_argv
from network_emulation.profiles import describe_setting
from network_emulation.traces import load_trace, trace_from

HALVES = {"links": "all", "points": [{"at_s": 10, "bandwidth_gbps": 0.5}, {"at_s": 20, "bandwidth_gbps": 1}]}


def test_loss_and_jitter_parse_and_describe() -> None:
    p = parse_profile("delay 50ms bandwidth 1Gbps loss 0.5% jitter 5ms")
    link = p.link(0, 1)
    assert (link.delay_ms, link.bandwidth_gbps, link.loss_pct, link.jitter_ms) == (50, 1, 0.5, 5)
    assert p.name == "d50-1g-loss0.5-jitter5"
    assert link.describe() == {"delay_ms": 50, "bandwidth_gbps": 1, "loss_pct": 0.5, "jitter_ms": 5}
    assert parse_profile("d10-1g").link(0, 1).describe() == {"delay_ms": 10, "bandwidth_gbps": 1}  # as before
    assert describe_setting("delay 10ms bandwidth 1Gbps loss 1%")["loss_pct"] == 1
    assert "loss_pct" not in describe_setting("d10-1g")
    # netem gets them as its own arguments: delay D J, loss L%
    argv = host_shaping_argv(p, 0, "eth0", [], "netem")[0]
    assert argv[argv.index("delay"):argv.index("rate")] == ["delay", "50ms", "5ms", "loss", "0.5%"]


def test_matrix_loss_and_jitter_are_optional_and_checked() -> None:
    m = matrix_profile({"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[0, 1], [1, 0]], "loss_pct": [[0, 2], [0, 0]]})
    assert m.link(0, 1).loss_pct == 2 and m.link(1, 0).loss_pct == 0 and m.link(0, 1).jitter_ms == 0
    assert "jitter_ms" not in m.contents() and m.contents()["loss_pct"] == [[0, 2], [0, 0]]
    with pytest.raises(ProfileError, match="loss 80 % is out of range"):
        matrix_profile({"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[0, 1], [1, 0]],
                        "loss_pct": [[0, 80], [0, 0]]})
    with pytest.raises(ProfileError, match="jitter_ms must be 2x2"):
        matrix_profile({"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[0, 1], [1, 0]], "jitter_ms": [[0]]})


def test_delayer_drops_at_the_rate_and_keeps_the_order() -> None:
    rng = random.Random(1)
    lossy = Queue(10, loss_pct=1)
    kept = [lossy.arrive(t * 1e-4, rng) for t in range(20000)]
    assert lossy.seen == 20000 and 150 <= lossy.dropped <= 250 and kept.count(None) == lossy.dropped
    jittery = Queue(10, jitter_ms=5)
    due = [jittery.arrive(t * 1e-3, rng) for t in range(2000)]
    assert due == sorted(due)  # never before the packet ahead of it: no reordering
    assert min(d - t * 1e-3 for t, d in enumerate(due)) >= 0.005 - 1e-9
    held = [d - t * 1e-3 for t, d in enumerate(due)]
    assert 0.0095 < sum(held) / len(held) < 0.0145  # 10 ms on average, pushed up by the order kept
    assert parse_queue(queue_arg(3, 10, 2, 0.5))[0] == 3
    link = parse_queue(queue_arg(3, 10, 2, 0.5))[1]
    assert (link.delay, link.jitter, link.loss) == (0.01, 0.002, 0.005)
    assert queue_arg(0, 10) == "0:10"  # what a link without loss or jitter always was


def test_a_trace_changes_the_links_it_names(tmp_path) -> None:
    f = tmp_path / "halves.json"
    f.write_text(json.dumps(HALVES))
    trace = load_trace(f)
    assert trace.contents() == {"links": "all", "points": [{"at_s": 10.0, "bandwidth_gbps": 0.5},
                                                           {"at_s": 20.0, "bandwidth_gbps": 1.0}]}
    steps = trace.timeline(parse_profile("delay 10ms bandwidth 1Gbps loss 1%"), 3)
    assert [(p.at_s, prof.link(2, 0).bandwidth_gbps, prof.link(2, 0).loss_pct) for p, prof in steps] == [
        (10, 0.5, 1), (20, 1, 1)]
    one = trace_from({"links": [[0, 1]], "points": [{"at_s": 1, "delay_ms": 40, "loss_pct": 2}]})
    (_, prof), = one.timeline(parse_profile("d10-1g"), 2)
    assert (prof.link(0, 1).delay_ms, prof.link(0, 1).loss_pct) == (40, 2)
    assert (prof.link(1, 0).delay_ms, prof.link(1, 0).loss_pct) == (10, 0)  # the other direction as it was


@pytest.mark.parametrize("data,message", [
    ({"links": "all"}, "expected"),
    ({"links": "some", "points": [{"at_s": 1, "delay_ms": 1}]}, "'links' must be"),
    ({"links": "all", "points": []}, "non-empty list"),
    ({"links": "all", "points": [{"delay_ms": 1}]}, "with 'at_s'"),
    ({"links": "all", "points": [{"at_s": 1, "speed": 1}]}, "unknown key"),
    ({"links": "all", "points": [{"at_s": 1}]}, "changes nothing"),
    ({"links": "all", "points": [{"at_s": 2, "delay_ms": 1}, {"at_s": 1, "delay_ms": 2}]}, "after the point before"),
    ({"links": "all", "points": [{"at_s": 1, "bandwidth_gbps": "fast"}]}, "must be a number"),
])
def test_bad_traces_are_refused(data, message) -> None:
    with pytest.raises(ProfileError, match=message):
        trace_from(data)


def test_a_trace_must_fit_the_run() -> None:
    with pytest.raises(ProfileError, match="not a link between the run's 2 hosts"):
        trace_from({"links": [[0, 2]], "points": [{"at_s": 1, "delay_ms": 1}]}).timeline(parse_profile("d10-1g"), 2)
    with pytest.raises(ProfileError, match="loss 70 % is out of range"):
        trace_from({"links": "all", "points": [{"at_s": 1, "loss_pct": 70}]}).timeline(parse_profile("d10-1g"), 2)
    with pytest.raises(ProfileError, match="give --network a profile"):
        trace_from(HALVES).timeline(parse_profile("none"), 2)
    with pytest.raises(ProfileError, match="below what the emulation can do"):
        trace_from({"links": "all", "points": [{"at_s": 1, "bandwidth_gbps": 0.001}]}).timeline(
            parse_profile("d10-1g"), 2)
