"""A run's faults as a request: the flags, their judgement before launching, the run's identity."""
from __future__ import annotations

import json

import pytest

from contract import ConfigError
from contract.faults import killed, replica_ranks, straggler
from runners.request import Placement, judge, parse_request
from tests.conftest import TINY

OURS = ["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1", "--steps", "4"]
DILOCO = ["--system", "diloco", *TINY, "--dp", "3", "--batch-size", "1", "--micro-batch-size", "1", "--steps", "16"]


def test_faults_parse_to_one_form_and_join_the_identity():
    cfg, _ = parse_request([*OURS, "--slow-rank", " 1 : 2.0 ", "--kill-replica", "1@3"])
    assert (cfg.slow_rank, cfg.kill_replica) == ("1:2", "1@3")
    assert straggler(cfg) == (1, 2.0) and killed(cfg) == (1, 3)
    plain, _ = parse_request(OURS)
    assert "slow_rank" not in json.loads(plain.key()) and "rejoin" not in json.loads(plain.key())  # as before
    key = json.loads(cfg.key())
    assert key["slow_rank"] == "1:2" and key["kill_replica"] == "1@3"


def test_the_ranks_of_a_replica():
    cfg, _ = parse_request([*DILOCO, "--pp", "2", "--kill-replica", "2@10"])
    assert replica_ranks(cfg, 2, 6) == [4, 5]
    cfg, _ = parse_request([*OURS, "--kill-replica", "1@3"])
    assert replica_ranks(cfg, 1, 2) == [1]  # --dp 1: the rank itself


@pytest.mark.parametrize("args,message", [
    ([*OURS, "--slow-rank", "2:2"], r"--slow-rank 2:2: the run has ranks 0..1"),
    ([*OURS, "--kill-replica", "1@6"], r"the step must be within 1..5 \(the run takes 6 steps"),
    ([*OURS, "--kill-replica", "2@3"], r"the run has ranks 0..1"),
    ([*OURS, "--kill-replica", "1@3", "--rejoin"], r"--rejoin: ours is synchronous"),
    ([*OURS, "--rejoin"], r"--rejoin restarts the replica --kill-replica ends"),
    ([*DILOCO, "--kill-replica", "3@10"], r"the run has replicas 0..2"),
    ([*DILOCO, "--dp", "1", "--kill-replica", "0@10"], r"--dp 1 leaves none"),
    ([*DILOCO, "--kill-replica", "2@10", "--verify"], r"follows no reference"),
])
def test_faults_that_do_not_fit_the_run_are_refused(args, message):
    cfg, spec = parse_request(args)
    with pytest.raises(ConfigError, match=message):
        judge(cfg, spec)


@pytest.mark.parametrize("flag,value", [("--slow-rank", "1:1"), ("--slow-rank", "1"), ("--slow-rank", "1:500"),
                                        ("--kill-replica", "1"), ("--kill-replica", "a@3")])
def test_malformed_fault_flags_are_one_line_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_request([*OURS, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


def test_a_trace_is_judged_with_the_run(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"links": [[0, 3]], "points": [{"at_s": 1, "delay_ms": 5}]}))
    cfg, spec = parse_request([*OURS, "--network", "d10-1g", "--network-trace", str(trace)])
    with pytest.raises(ConfigError, match="not a link between the run's 2 hosts"):
        judge(cfg, spec)
    trace.write_text(json.dumps({"links": "all", "points": [{"at_s": 1, "bandwidth_gbps": 0.5}]}))
    cfg, spec = parse_request([*OURS, "--network", "d10-1g", "--network-trace", str(trace)])
    judge(cfg, spec)
    assert cfg.network_trace_contents["points"] == [{"at_s": 1.0, "bandwidth_gbps": 0.5}]
    assert json.loads(cfg.key())["network_trace"] == cfg.identity()["network_trace"]  # by its contents' digest
    with pytest.raises(ConfigError, match="give --network a profile"):
        judge(*parse_request([*OURS, "--network-trace", str(trace)]))
    with pytest.raises(ConfigError, match="on a cluster of nodes it is not applied"):
        judge(cfg, spec, Placement(nnodes=2, node_rank=0, rdzv_endpoint="h:1"))


def test_a_killed_replica_in_words_says_whether_it_rejoined():
    """Issue #54 item 10: the report said 'rejoins' from the request, where the replica never ran a step
    again; it now says what the record says happened."""
    from contract.faults import alive_per_step, words

    config = {"kill_replica": "1@3", "rejoin": True}
    killed_life = {"steps": [0, 2], "ended": "killed after 3 steps"}
    rejoined = {"replicas": [{"replica": 0, "lives": [{"steps": [0, 11], "ended": "finished"}]},
                             {"replica": 1, "lives": [killed_life, {"steps": [4, 11], "ended": "finished",
                                                                    "rejoined": True}]}]}
    assert words(config, rejoined) == "replica 1 killed after 3 steps, rejoined at step 5 (ran steps 5-12)"
    assert alive_per_step(rejoined, range(2, 6)) == [2, 1, 2, 2]
    late = {"replicas": [rejoined["replicas"][0], {"replica": 1, "lives": [killed_life, {
        "steps": None, "ended": "did not rejoin: the others had finished before it joined them", "rejoined": False}]}]}
    assert words(config, late) == ("replica 1 killed after 3 steps, did not rejoin (did not rejoin: the others had "
                                   "finished before it joined them)")
    assert words({"kill_replica": "1@3"}) == "replica 1 killed after 3 steps"
