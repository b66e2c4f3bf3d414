"""python -m predict validate-published: Megatron-LM's published tables (the development set beyond the
seed) as scenarios with their provenance, published throughputs turned into steps by their own formulas,
one calibration cell per GPU and precision named and never scored."""
from __future__ import annotations

import pytest

from predict.published import CALIBRATION, README_2020, cells, flops_mcore, flops_sc21, validate
from predict.stacks import stacks


def test_every_cell_is_a_scenario_with_its_source_and_what_it_assumes():
    cs = cells()
    assert len(cs) == 31 and len({c.name for c in cs}) == 31
    for c in cs:
        sc = c.load()
        assert sc.system == "megatron" and sc.stack in stacks() and "@" in c.source and c.assumed
        assert sc.config.tp * sc.config.pp * sc.config.dp <= sc.cluster.gpus
    assert set(CALIBRATION.values()) <= {c.name for c in cs}


def test_a_published_throughput_becomes_a_step_by_its_own_formula():
    """SC'21's 1T row: 163 TFLOP/s a GPU on 3,072 A100 (the paper's F = 96 B s l h^2 (...)); Megatron-Core's
    1.7B row: 408.8 TFLOP/s a GPU on 48 H100 at 41 % of 989 TFLOP/s (model FLOPs)."""
    by = {c.name: c for c in cells()}
    t1 = by["megatron-sc21 1T T-8 P-64 D-6"]
    assert t1.published == pytest.approx(flops_sc21(3072, 2048, 128, 25600, 51200) / (163e12 * 3072))
    assert t1.published == pytest.approx(102.6, abs=0.1)
    h = by["mcore-h100 1.7B T-1 P-1 D-48"]
    assert flops_mcore(192, 4096, 24, 2048, 131072) / h.published / 48 / 989.4e12 == pytest.approx(0.413, abs=1e-3)


def test_the_2020_tables_validate_with_their_calibration_cells_named_and_not_scored():
    res = validate(select="megatron-2020")
    rows = {r["name"]: r for r in res["rows"]}
    assert len(rows) == 12 and all(r["source"] == README_2020 for r in rows.values())
    for name in CALIBRATION.values():
        if name in rows:
            assert rows[name]["calibration"] and not rows[name]["scored"]
            assert rows[name]["error"] == pytest.approx(0.0, abs=5e-3) or rows[name]["error"] > 0  # a stall >= 0
    assert res["gpus"]["V100 SXM2 32GB"]["scored"] == 3
    assert all(r["scored"] == (not r["calibration"]) for r in rows.values())
    assert res["gpus"]["A100 SXM4 40GB"]["median"] < 0.15  # the bar per GPU type
