"""This CPU's profile (``ours.plan.profile``) runs: the layer over the grid of slices
(with cached context), the head and the per-step rates; it had rotted unseen behind a stale import."""
from __future__ import annotations

import pytest

from ours.plan.profile import grid, profile
from workload.configs import get_model_config


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_profile_of_the_tiny_model_measures_every_point(model):
    """Either family's layer (llama's: 2 key/value heads cached, rotary positions, SwiGLU, RMSNorm)."""
    cfg = get_model_config(model)
    prof = profile(cfg, reps=1, p2p=False, progress=False)
    assert (prof["model"]["family"], prof["model"]["kv_heads"]) == (cfg.family, cfg.n_kv_head)
    assert [(p["b"], p["l"], p["c"]) for p in prof["layer"]] == grid(cfg.seq_len, (1,))
    assert any(p["c"] > 0 for p in prof["layer"])  # slices after cached context, as in the pipeline
    for p in prof["layer"]:
        assert p["fwd"] > 0 and p["bwd_full"] > 0 and 0 <= p["wgrad"] <= p["bwd_full"]
    head = prof["head"]
    assert head["fwd_per_token"] > 0 and head["bwd_in_per_token"] > 0 and head["wgrad_per_token"] >= 0
    assert prof["embed_per_token"] > 0 and prof["optimizer_per_param"] > 0

