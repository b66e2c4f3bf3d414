"""python -m predict validate-seed: every cell of the seed's tables a scenario, the calibration cells named
and never scored; TeraPipe's headline pair; the seed's stack's stalls reproducible from their cells."""
from __future__ import annotations

from pathlib import Path

import pytest

from predict.scenario import load, predict_scenario
from predict.seed_tables import (CALIBRATION, OOM, allowed_growth, calibration_cells, cells, consistency_floor,
                                 sensitivity, sensitivity_markdown, validate)
from predict.stacks import STACKS, stacks

SCENARIOS = Path(__file__).resolve().parents[2] / "predict" / "scenarios"


@pytest.fixture(scope="module")
def result():
    return validate()


def test_every_cell_is_a_scenario_and_calibration_cells_are_not_scored(result):
    rows = {r["name"]: r for r in result["rows"]}
    assert len(rows) == len(cells()) == 68
    for name in CALIBRATION.values():
        assert rows[name]["calibration"] and not rows[name]["scored"]
    unsure = [r for r in rows.values() if r["unsure"]]
    assert len(unsure) == 2 and not any(r["scored"] for r in unsure)
    # the six-node fp16 T-8 columns: shown with their reason, not scored (their mb2 cells are the ?? ones)
    contradicted = [r for r in rows.values() if r["contradicted"] and not r["unsure"]]
    assert len(contradicted) == 4 and not any(r["scored"] for r in contradicted)
    assert all(" fp16 " in r["name"] and r["name"].endswith(" T-8") for r in contradicted)
    s = result["summary"]
    assert s["scored"] == sum(isinstance(r["seed"], float) for r in rows.values()) - 2 - 4 - len(CALIBRATION)
    assert s["oom_cells"] == 10 and s["ok_predicted_oom"] == 0
    assert s["oom_predicted"] >= 8  # at least 80 % of the seed's Fail (OOM) cells
    # the optimizers the seed's scripts ran: DT-FM's GPipe and torch's Pipe plain SGD, Megatron's FusedSGD
    expected = {"gpipe": "sgd", "torch_pipe": "sgd", "megatron": "sgd_momentum"}
    assert all(c.load().config.optimizer.kind == expected[c.load().system] for c in cells())


def test_the_stack_is_what_its_calibration_cells_give():
    """The seed's stack's committed stall shares reproduce their one calibration cell per precision (what
    ``validate-seed --calibrate`` fits, ``predict.stacks.fit_share``), which the stack names; the V100's
    kernels are DeepBench's, not fitted on a step."""
    stalls = stacks()["seed-p3-2022"]["stalls"]
    for precision, cell in calibration_cells().items():
        assert stalls[f"V100 SXM2 {precision}"]["cell"].startswith(CALIBRATION[precision] + " (")
        res = predict_scenario(cell.load())
        assert res["step_time_s"] == pytest.approx(cell.seed, rel=2e-3)
        assert res["parts"]["stalls"] > 0 and cell.load().device.kernels


def test_terapipes_175b_speedup_over_gpipe(result):
    """GPT-3 175B on 48 p3.16xlarge, T-8 P-48, batch 2 (TeraPipe's setting): the paper measured 5.0x;
    validate-seed reports the pair as the scenario files predict it."""
    gpipe = predict_scenario(load(SCENARIOS / "terapipe-175b-t8-p48-gpipe.toml"))
    ours = predict_scenario(load(SCENARIOS / "terapipe-175b-t8-p48-ours.toml"))
    speedup = gpipe["step_time_s"] / ours["step_time_s"]
    assert 3.75 <= speedup <= 6.25, speedup
    assert ours["n_slices"] > 1
    reported = result["terapipe"][0]
    assert reported["layout"] == "T-8 P-48" and reported["speedup"] == pytest.approx(speedup)
    assert reported["slices"] == ours["slices"]


def test_each_8gpu_node_tables_fastest_layout_is_named_measured_and_predicted(result):
    """validate-seed names, per Megatron table, the layout of the cell the seed measured fastest and of the
    cell predicted fastest (among the cells that ran and the seed does not doubt), and counts the rights."""
    fastest = result["fastest"]
    assert len(fastest) == 4 == result["summary"]["fastest_layout_tables"]
    for table, f in fastest.items():
        ran = [r for r in result["rows"] if r["table"] == table and isinstance(r["seed"], float) and not r["unsure"]]
        assert f["seed_s"] == min(r["seed"] for r in ran)
        assert f["predicted_s"] == min(r["predicted"] for r in ran if r["predicted"] != OOM)
        assert f["seed_cell"].endswith(" " + f["seed"]) and f["predicted_cell"].endswith(" " + f["predicted"])
        assert f["right"] == (f["seed"] == f["predicted"])
    assert result["summary"]["fastest_layout_right"] == sum(f["right"] for f in fastest.values())


def test_the_allowed_growth_is_the_bubbles():
    assert allowed_growth(42, 1, 1, 3) == 1.0  # no pipeline: the same work at every micro-batch
    assert allowed_growth(42, 2, 1, 2) == pytest.approx(44 / 43)  # 42 + 1 micro-batch times against 21 + 1 of twice
    assert allowed_growth(64, 8, 1, 4) == pytest.approx((64 + 28) / (64 + 7))


def test_the_consistency_floor_binds_every_model_whose_step_grows_with_the_micro_batch_only_by_its_bubble(result):
    """Each floor is what the best pair of predictions (the larger micro-batch's at most g times the
    smaller's) misses by: checked against a grid of such pairs, and reached by x = 2ab / (b + g a); where a
    calibration cell is pinned, the other cell's least error. The contradicted T-8 pair is listed, not
    scored; the scored floor is the summary's."""
    floor = consistency_floor()
    assert all(f["larger_s"] > f["growth"] * f["smaller_s"] and f["growth"] >= 1.0 for f in floor)
    assert all(f["growth"] == 1.0 for f in floor if f["layout"] == "T-8")
    t8 = next(f for f in floor if f["smaller_s"] == 9.19 and f["larger_s"] == 20.68)
    assert not t8["scored"] and t8["floor"] == pytest.approx(0.385, abs=1e-3)
    top = max((f for f in floor if f["scored"]), key=lambda f: f["floor"])
    assert (top["layout"], top["smaller_s"], top["larger_s"]) == ("T-4 P-2", 5.25, 12.45)
    assert top["smaller"] == CALIBRATION["fp16"] and top["floor"] == pytest.approx(0.569, abs=1e-3)
    assert result["summary"]["floor"] == top["floor"]
    assert result["summary"]["floor_any_calibration"] == pytest.approx(0.397, abs=1e-3)
    for f in floor:
        a, b, g = f["smaller_s"], f["larger_s"], f["growth"]
        x = 2 * a * b / (b + g * a)
        assert max(abs(x - a) / a, abs(g * x - b) / b) == pytest.approx(f["any_calibration"])
        if f["how"] == "smaller pinned by calibration":
            assert abs(g * a - b) / b == pytest.approx(f["floor"])  # the larger's best, the smaller exact
        for i in range(60):
            p_small = a * (0.5 + i / 40)
            for j in range(60):
                p_large = min(g * p_small, a * (0.5 + j / 20))  # at most g times the smaller's
                assert max(abs(p_small - a) / a, abs(p_large - b) / b) >= f["any_calibration"] - 1e-12


@pytest.mark.extended
def test_the_calibration_sensitivity_refits_on_each_candidate_and_reproduces_the_committed_choice(result):
    other = "megatron 6-node fp16 recompute mb3 P-8"
    rows = sensitivity({"fp16": [CALIBRATION["fp16"], other], "fp32": ["gpipe dp4 d5-2g"]})
    committed, moved, slower = rows
    # the central PS at 5 ms / 2 Gbit/s: its kernels and messages alone are predicted slower than measured
    assert slower["share"] == 0.0 and not slower["committed"]
    assert "stall share" in sensitivity_markdown(rows)
    assert committed["committed"] and not moved["committed"]
    assert committed["median"] == pytest.approx(result["summary"]["median_error"], rel=1e-3)
    assert committed["largest"] == pytest.approx(result["summary"]["largest_error"], rel=1e-3)
    # the P-8 cell is slower for its work than T-4 P-2's: a larger stall share fits it
    assert moved["share"] > committed["share"]
    assert moved["precision_median"] != committed["precision_median"]


def test_six_nodes_against_one_divides_the_same_layout_and_micro_batch(result):
    from predict.seed_tables import MEGATRON_1NODE_FP32, MEGATRON_6NODE

    scale = result["scale"]
    assert {(r["micro_batch"], r["layout"]) for r in scale} == {(mb, lay) for mb in (1, 2) for lay in
                                                                 ("T-8", "P-8", "T-4 P-2", "T-2 P-4")}
    rows = {r["name"]: r for r in result["rows"]}
    for r in scale:
        mb, lay = r["micro_batch"], r["layout"]
        assert r["seed"] == pytest.approx(MEGATRON_6NODE["fp32", True][mb][lay] / MEGATRON_1NODE_FP32[mb][lay])
        assert r["predicted"] == pytest.approx(rows[f"megatron 6-node fp32 recompute mb{mb} {lay}"]["predicted"]
                                               / rows[f"megatron 1-node fp32 recompute mb{mb} {lay}"]["predicted"])


def test_validate_seed_refuses_calibrate_with_sensitivity_before_writing_anything(capsys):
    """--calibrate writes the stack; --sensitivity refits on other cells without writing: asked together,
    one line and exit 2, the stacks and device files untouched."""
    from predict.__main__ import main
    from workload.compute import DEVICES

    before = {p: p.read_bytes() for p in [*DEVICES.glob("v100-*.json"), STACKS]}
    assert main(["validate-seed", "--calibrate", "--sensitivity"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m predict validate-seed: error: give --calibrate or --sensitivity, not both"]
    assert {p: p.read_bytes() for p in [*DEVICES.glob("v100-*.json"), STACKS]} == before
