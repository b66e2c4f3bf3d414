"""ours' cost of a slice (``ComputeModel.slice_cost``): the planner prices a unit by its layers' math
and the engine's own time per unit from the profile, the fill without the deferred weight gradients,
and chooses the batch split and the token slicing together; the simulator prices a unit the same way."""
from __future__ import annotations

import pytest

from ours.plan.latency import hidden_at_end, slice_times
from ours.plan.planner import plan
from predict.run_spec import Link, RunSpec
from predict.step_time import predict
from workload.compute import ENGINE_PHASES, CpuCompute, Scaled, Table3
from workload.configs import ModelConfig

SEQ = 64
MODEL = ModelConfig("synthetic", 4, 64, 4, SEQ, 128)  # 2 layers a stage at P = 2
LINK = Link(1e-4, 1e9)


def _profile(engine: tuple[float, float, float] | None = None) -> dict:
    """A layer of b (2e-5 + 1e-5 l + 2e-8 l c) forward, 1.5 x that backward, b (1e-5 + 5e-6 l) weight
    gradients, measured for every system and for ours' slices alike; ``engine``: ours' engine's own
    seconds per unit (forward, backward, weight gradients)."""
    pts = []
    for b in (1, 2):
        for l in (8, 16, 24, 32, 40, 48, 56, 64):
            for c in (0, 16, 32, 48):
                if c + l <= SEQ:
                    f, w = b * (2e-5 + 1e-5 * l + 2e-8 * l * c), b * (1e-5 + 5e-6 * l)
                    pts.append(dict(b=b, l=l, c=c, fwd=f, bwd_in=1.5 * f, wgrad=w, bwd_full=2.5 * f + w))
    prof = dict(model=dict(n_embd=64, n_head=4, seq_len=SEQ, vocab_size=128), layer=pts,
                slice=[{k: p[k] for k in ("b", "l", "c", "fwd", "bwd_in", "wgrad")} for p in pts],
                head=dict(fwd_per_token=1e-6, bwd_in_per_token=1e-6, wgrad_per_token=1e-6), embed_per_token=1e-7,
                optimizer_per_param=1e-9, p2p_fit=dict(latency=1e-4, bandwidth=1e9))
    if engine is not None:
        prof["engine"] = {k: dict(unit=u, layer=0.0, scale=0.0) for k, u in zip(ENGINE_PHASES, engine)}
    return prof


def _plan(prof: dict, *, stages: int = 2, batch: int = 1, batch_slices=None):
    return plan(CpuCompute(prof), MODEL, n_stages=stages, batch_size=batch, granularity=8, link=LINK,
                batch_slices=batch_slices)


def test_the_engines_cost_per_unit_makes_the_planner_cut_fewer_slices():
    without = _plan(_profile())
    with_cost = _plan(_profile(engine=(2e-4, 2e-4, 1e-4)))
    assert len(without.slices) >= 3 and 1 < len(with_cost.slices) < len(without.slices)
    assert with_cost.predicted_pipeline > without.predicted_pipeline


def test_one_slice_where_slicing_cannot_pay():
    assert _plan(_profile(), stages=1).slices == (SEQ,)  # one stage: nothing to fill
    # the engine's time per unit is more than the fill a second slice would save
    assert _plan(_profile(engine=(1e-3, 1e-3, 5e-4))).slices == (SEQ,)


def test_the_batch_split_and_the_token_slicing_are_chosen_together():
    """Batch 4 on 2 stages, a unit costing the engine 0.5 ms: four batch slices of one sequence already
    fill the pipeline, so splitting the batch beats cutting one batch slice of four sequences into tokens."""
    prof = _profile(engine=(2e-4, 2e-4, 1e-4))
    best = _plan(prof, batch=4)
    tokens = _plan(prof, batch=4, batch_slices=[4])
    assert (best.batch_slice, best.slices) == (1, (SEQ,))
    assert len(tokens.slices) > 1 and tokens.predicted_pipeline > best.predicted_pipeline


def test_the_fill_leaves_out_the_deferred_weight_gradients_and_keeps_the_engines_time():
    cm = CpuCompute(_profile(engine=(3e-4, 4e-4, 1e-4)))
    st = slice_times(cm, 64, 1, 16, 32, layers=2, n_stages=2, link=LINK)
    fwd, bwd, w = cm.slice_layer(1, 16, 32)
    msg = LINK.transfer(16 * 64 * 4)
    assert st.fill == pytest.approx(2 * (fwd + bwd) + 7e-4 + 2 * msg)
    assert st.backward == pytest.approx(2 * bwd + 4e-4 + msg)
    assert st.time == pytest.approx(st.fill + 2 * w + 1e-4)
    # at the step's end the last stage's deferred weight gradients hide the first stage's last wait
    assert hidden_at_end(st, 1.0, 2) == st.backward and hidden_at_end(st, 1e-6, 2) == 1e-6
    assert hidden_at_end(st, 1.0, 1) == 0.0
    # the engine's time is its own: a model scaled for a system's kernels scales the math only
    assert Scaled(cm, 2.0).slice_cost(1, 16, 32, 2).forward == pytest.approx(2 * 2 * fwd + 3e-4)


def test_the_simulator_prices_a_unit_as_the_planner():
    """One stage, two token slices: the simulated layers' forward, backward and weight gradients are the
    planner's cost of each slice (the head's weight gradient deferred with them)."""
    cm = CpuCompute(_profile(engine=(3e-4, 4e-4, 1e-4)))
    spec = RunSpec("ours", MODEL, batch_size=1, micro_batch_size=1, link=Link(1e-4, 1e9), pp=1, slices=(24, 40))
    p = predict(spec, cm, cores=2.0)
    simulated = sum(p.detail.get(k, 0.0) for k in ("forward", "backward", "wgrad"))
    planned = sum(cm.slice_cost(1, l, c, MODEL.n_layer).total for l, c in ((24, 0), (40, 24)))
    assert simulated == pytest.approx(planned + cm.head_wgrad(SEQ))


def test_a_thin_slice_after_a_long_context_is_priced_from_its_own_points():
    """The context's cost has a part per context token whatever the slice's length (the cached keys and
    values read) and one per query and context token; a fit over long slices alone would give the thin
    ones only the second. Relative least squares weighs every point alike."""
    pts = []
    for l in (8, 16, 32, 64, 128, 256):
        for c in (0, 256, 512, 768):
            extra = 2e-6 * c + 1e-8 * l * c + (1e-10 * l * l * c if l >= 128 else 0.0)  # long slices: more still
            pts.append((1, l, c, 1e-4 + 1e-5 * l + extra))
    t = Table3(tuple(pts))
    measured = 1e-4 + 1e-5 * 16 + 2e-6 * 768 + 1e-8 * 16 * 768
    assert t(1, 16, 768) == pytest.approx(measured, rel=0.05)  # an unweighted fit: 18 % under
