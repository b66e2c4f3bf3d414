"""This CPU's profile (``ours.plan.profile``) runs: the layer over the grid of slices
(with cached context), ours' slice over its grid, the head and the per-step rates (it had rotted unseen
behind a stale import); ours' engine's own cost per unit from two ranks."""
from __future__ import annotations

import pytest

from ours.plan.profile import engine_costs, grid, profile, slice_grid
from workload.compute import ENGINE_PHASES, CpuCompute
from workload.configs import get_model_config


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_profile_of_the_tiny_model_measures_every_point(model):
    """Either family's layer and ours' slice (llama's: 2 key/value heads cached, rotary positions at the
    slice's offset, SwiGLU, RMSNorm)."""
    cfg = get_model_config(model)
    prof = profile(cfg, reps=1, p2p=False, progress=False, engine=False)
    assert (prof["model"]["family"], prof["model"]["kv_heads"]) == (cfg.family, cfg.n_kv_head)
    assert [(p["b"], p["l"], p["c"]) for p in prof["layer"]] == grid(cfg.seq_len, (1,))
    assert any(p["c"] > 0 for p in prof["layer"])  # slices after cached context, as in the pipeline
    for p in prof["layer"]:
        assert p["fwd"] > 0 and p["bwd_full"] > 0 and 0 <= p["wgrad"] <= p["bwd_full"]
    assert [(p["b"], p["l"], p["c"]) for p in prof["slice"]] == slice_grid(cfg.seq_len, (1,))
    thin = min(p["l"] for p in prof["slice"] if p["c"] == 3 * cfg.seq_len // 4)
    assert thin <= cfg.seq_len // 16  # a thin slice after a long context is measured, not extrapolated
    for p in prof["slice"]:
        assert p["fwd"] > 0 and p["bwd_in"] > 0 and p["wgrad"] > 0
    assert prof["engine"] is None
    head = prof["head"]
    assert head["fwd_per_token"] > 0 and head["bwd_in_per_token"] > 0 and head["wgrad_per_token"] >= 0
    assert prof["embed_per_token"] > 0 and prof["optimizer_per_param"] > 0



@pytest.mark.multiprocess
def test_the_engines_own_cost_comes_from_two_ranks_of_ours_engine():
    cfg = get_model_config("tiny")
    prof = profile(cfg, reps=1, p2p=False, progress=False, engine=False)
    fit = engine_costs(cfg, CpuCompute(prof), layers=(1, 2), slicings=(2, 4), reps=1)
    for phase in ENGINE_PHASES:  # non-negative parts: a unit costs the engine time, never saves it
        assert all(fit[phase][k] >= 0 for k in ("unit", "layer", "scale"))
    units = {(p["rank"], p["layers"], p["k"]) for p in fit["points"] if p["phase"] == "F"}
    assert units == {(r, L, k) for r in (0, 1) for L in (1, 2) for k in (2, 4)}  # both stages, every run
    assert len([p for p in fit["points"] if p["phase"] == "B"]) == 2 * 2 * 2 * (2 + 4)  # every unit of 2 rows
    cm = CpuCompute({**prof, "engine": fit})
    assert cm.slice_cost(1, 32, 32, 2).total >= CpuCompute(prof).slice_cost(1, 32, 32, 2).total
