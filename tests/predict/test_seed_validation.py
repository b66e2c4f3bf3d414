"""python -m predict validate-seed: every cell of the seed's tables a scenario, the calibration cells named
and never scored; TeraPipe's headline pair; the V100's calibration reproducible from its cells."""
from __future__ import annotations

from pathlib import Path

import pytest

from predict.scenario import load, predict_scenario
from predict.seed_tables import CALIBRATION, OOM, calibration_cells, cells, validate
from workload.compute import find_device

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
    s = result["summary"]
    assert s["scored"] == sum(isinstance(r["seed"], float) for r in rows.values()) - 2 - len(CALIBRATION)
    assert s["oom_cells"] == 10 and s["ok_predicted_oom"] == 0
    assert s["oom_predicted"] >= 8  # at least 80 % of the seed's Fail (OOM) cells


def test_the_device_file_is_what_its_calibration_cells_give():
    """The V100's committed GEMM efficiencies reproduce their one calibration cell per precision (what
    ``validate-seed --calibrate`` fits, ``predict.fitting.fit_efficiency``), which the file names."""
    dev = find_device("V100 SXM2 16GB")
    for precision, cell in calibration_cells().items():
        assert CALIBRATION[precision] in dev.calibrated_on[precision]
        res = predict_scenario(cell.load())
        assert res["step_time_s"] == pytest.approx(cell.seed, rel=2e-3)


def test_the_one_node_fp32_table_ranks_its_fastest_layout_first(result):
    one_node = [r for r in result["rows"] if r["table"].startswith("Megatron, one p3.16xlarge")
                and isinstance(r["seed"], float) and r["predicted"] != OOM]
    fastest_seed = min(one_node, key=lambda r: r["seed"])
    fastest_pred = min(one_node, key=lambda r: r["predicted"])
    assert fastest_pred["name"] == fastest_seed["name"]


def test_terapipes_175b_speedup_over_gpipe():
    """GPT-3 175B on 48 p3.16xlarge, T-8 P-48, batch 2 (TeraPipe's setting): the paper measured 5.0x."""
    gpipe = predict_scenario(load(SCENARIOS / "terapipe-175b-t8-p48-gpipe.toml"))
    ours = predict_scenario(load(SCENARIOS / "terapipe-175b-t8-p48-ours.toml"))
    speedup = gpipe["step_time_s"] / ours["step_time_s"]
    assert 3.75 <= speedup <= 6.25, speedup
    assert ours["n_slices"] > 1
