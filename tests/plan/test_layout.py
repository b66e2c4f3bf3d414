"""ours.plan.layout: T, P and the slicing chosen from the links, on the device file's compute model."""
from __future__ import annotations

import json
import math
import re

import pytest

from ours.plan.__main__ import main
from contract.links import Link
from ours.plan.layout import Cluster, parse_link, plan_layout, why
from workload.compute import gpu_compute
from workload.configs import get_model_config

XL = get_model_config("gpt3-xl")
V100 = gpu_compute("V100 SXM2 16GB", XL, "fp32")


def test_tensor_parallel_inside_a_fast_node_pipeline_between_slow_nodes():
    node = plan_layout(XL, Cluster(8, gpus_per_node=8, intra=parse_link("5us,300GB/s")), V100, batch_size=8,
                       recompute=True)
    slow = plan_layout(XL, Cluster(12, gpus_per_node=1, inter=parse_link("10ms,1Gbps")), V100, batch_size=8,
                       recompute=True)
    assert {(c.tp, c.pp) for c in node} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert (slow[0].tp, slow[0].pp) == (1, 12)  # an all-reduce over 10 ms links costs more than it saves
    assert slow[0].tp_comm == 0 and all(c.tp_comm > c.compute for c in slow[1:])
    fast = {(c.tp, c.pp): c for c in node}
    assert fast[8, 1].tp_comm < fast[8, 1].compute  # on the node's links the all-reduces cost little
    for c in node + slow:
        assert sum(c.slices) == XL.seq_len and math.isfinite(c.step)
        assert c.step == pytest.approx(c.compute + c.tp_comm + c.p2p + c.bubble)


def test_a_per_link_matrix_is_the_tiers_it_describes_and_a_layout_that_does_not_fit_is_last():
    # two nodes of two devices: 5 us / 300 GB/s inside, 10 ms / 1 Gbit/s between
    fast, slow = [0.005, 2400.0], [10.0, 1.0]
    pick = [[fast if i // 2 == j // 2 else slow for j in range(4)] for i in range(4)]
    matrix = {"delay_ms": [[p[0] for p in row] for row in pick],
              "bandwidth_gbps": [[p[1] for p in row] for row in pick]}
    tiers = Cluster(4, gpus_per_node=2, intra=Link(5e-6, 300e9), inter=Link(10e-3, 1e9 / 8))
    a = plan_layout(XL, Cluster.from_matrix(matrix), V100, batch_size=8, recompute=True)
    b = plan_layout(XL, tiers, V100, batch_size=8, recompute=True)
    assert [(c.tp, c.pp, c.slices, c.step) for c in a] == [(c.tp, c.pp, c.slices, pytest.approx(c.step)) for c in b]
    assert (a[0].tp, a[0].pp) == (2, 2)  # TP inside each node, the pipeline between them
    big = gpu_compute("V100 SXM2 16GB", get_model_config("gpt3-13b"), "fp32")
    one = plan_layout(get_model_config("gpt3-13b"), Cluster(1), big, batch_size=8)
    assert not one[0].fits and "does not fit" in why(one[0]) and math.isinf(one[0].step)


def test_parse_link_and_the_command(capsys):
    assert parse_link("10ms,1Gbps") == Link(0.01, 1.25e8)
    fast = parse_link("5us,300GB/s")
    assert fast.latency == pytest.approx(5e-6) and fast.bandwidth == pytest.approx(3e11)
    for bad in ("10ms", "10ms,0Gbps", "-1ms,1Gbps", "nanms,infGbps", "10,1", "fast"):
        with pytest.raises(ValueError):
            parse_link(bad)
    assert main(["layout", "--model", "gpt3-xl", "--devices", "12", "--inter", "10ms,1Gbps", "--batch-size", "8",
                 "--recompute"]) == 0
    out = capsys.readouterr().out
    assert "chosen: T-1 P-12" in out and "| T-2 P-6" in out
    assert "--scenario FILE writes the chosen layout" in out
    assert main(["layout", "--model", "gpt3-175b", "--devices", "8", "--gpus-per-node", "8", "--intra",
                 "5us,300GB/s", "--batch-size", "8"]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and refused.err.count("\n") == 1  # one line, no table of layouts that cannot run
    assert "no layout of gpt3-175b on 8 devices fits the 15.2 GiB a " in refused.err
    assert main(["layout", "--model", "gpt3-xl", "--devices", "8", "--gpus-per-node", "8", "--intra", "5us,300GB/s",
                 "--batch-size", "8", "--gpu", "nonesuch"]) == 2
    assert "no device file for 'nonesuch'" in capsys.readouterr().err


def test_solve_charges_the_links_it_is_given_and_asks_for_the_tensor_parallel_ones(capsys, tmp_path):
    """solve --tp T charged no all-reduce (more T always looked faster) and no stage-to-stage message."""
    base = ["solve", "--model", "gpt3-xl", "--device-file", "H100 SXM", "--precision", "bf16", "--pp", "4",
            "--batch-size", "8", "--micro-batch-size", "1"]
    assert main([*base, "--tp", "2"]) == 2
    assert "--tp 2 needs --tp-link" in capsys.readouterr().err

    def pipeline(*flags) -> float:
        out = tmp_path / "plan.json"
        assert main([*base, *flags, "--out", str(out)]) == 0
        capsys.readouterr()
        return json.loads(out.read_text())["predicted_pipeline"]

    alone = pipeline()
    nvlink, slow = pipeline("--tp", "2", "--tp-link", "5us,300GB/s"), pipeline("--tp", "2", "--tp-link", "50us,10GB/s")
    assert nvlink < alone < slow   # halving each GPU's work pays over NVLink, not over 10 GB/s
    assert pipeline("--link", "10ms,1Gbps") > 2 * alone


def test_layout_writes_its_choice_as_a_scenario_for_the_simulators_whole_step(capsys, tmp_path):
    """layout's step (TeraPipe's formula, no optimizer) and predict scenario's of the same run differed by
    27-36 % with nothing to say so; now the column says what it is and the choice can be simulated."""
    from predict.scenario import load, predict_scenario

    path = tmp_path / "chosen.toml"
    args = ["layout", "--model", "gpt3-xl", "--devices", "8", "--gpus-per-node", "8", "--intra", "5us,300GB/s",
            "--device-file", "H100 SXM", "--precision", "bf16", "--batch-size", "8"]
    assert main([*args, "--scenario", str(path)]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"chosen: T-(\d+) P-(\d+), K=\d+ token slices \(.*\), predicted pipeline ([\d.]+) s", out)
    assert chosen and f"pipebench predict scenario {path}" in out
    res = predict_scenario(load(path))
    assert res["layout"] == f"T-{chosen[1]} P-{chosen[2]} D-1" and res["status"] == "ok"
    assert res["parts"]["optimizer"] > 0 and res["step_time_s"] > 0
    assert main([*args[:4], "12", *args[5:], "--inter", "1ms,10Gbps", "--scenario", str(path)]) == 2
    assert "--scenario: a scenario is of whole nodes" in capsys.readouterr().err
