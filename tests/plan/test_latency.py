"""The fit recovers known coefficients from synthetic, noisy profiles; the model round-trips as JSON."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ours.plan.latency import LatencyModel, fit, fit_comm

TRUE = dict(alpha=2e-6, beta=3e-6, gamma=4e-8, delta=5e-4)
COMM = dict(a=3e-4, bw=2e8)


def t0(b, l):
    return b * (1e-3 + 2e-4 * l + 3e-8 * l * l) + 2e-3


def synthetic_profile(noise=0.005, seed=0, seq_len=512, g=8, step=64):
    rng = np.random.default_rng(seed)
    def jitter():
        return 1 + noise * rng.standard_normal()

    layer = []
    for b in (1, 2):
        for l in range(g, seq_len + 1, g):
            layer.append(dict(b=b, l=l, c=0, t=t0(b, l) * jitter()))
        for c in range(step, seq_len, step):
            for l in range(step, seq_len - c + 1, step):
                t = t0(b, l) + TRUE["alpha"] * b * l + TRUE["beta"] * b * c + TRUE["gamma"] * b * l * c + TRUE["delta"]
                layer.append(dict(b=b, l=l, c=c, t=t * jitter()))
    sizes = [2 ** k for k in range(10, 24, 2)]
    p2p = [dict(bytes=s, t=(COMM["a"] + s / COMM["bw"]) * jitter()) for s in sizes]
    return dict(kind="ours.plan.profile", device="cpu", torch="x", threads=1, granularity=g,
                model=dict(name="syn", n_layer=4, n_embd=64, n_head=4, seq_len=seq_len, vocab_size=128),
                layer=layer, p2p=p2p, overhead=dict(head_per_token=1e-6, optimizer_per_param=1e-9))


def test_fit_exact_without_noise():
    lm = fit(synthetic_profile(noise=0.0))
    for k, v in TRUE.items():
        assert getattr(lm, k) == pytest.approx(v, rel=1e-6, abs=1e-12), k
    assert lm.comm_latency == pytest.approx(COMM["a"], rel=1e-6)
    assert lm.comm_bandwidth == pytest.approx(COMM["bw"], rel=1e-6)
    f = lm.meta["fit"]
    assert f["context_holdout"]["r2"] > 0.999999 and f["context_holdout"]["mape"] < 1e-6
    assert f["t0_interp"]["mape"] < 1e-3  # the quadratic term, interpolated linearly over 2g


def test_fit_recovers_coefficients_with_noise():
    lm = fit(synthetic_profile(noise=0.002, seed=1))
    # 0.2 % noise on t is ~4 % on the residual t - t0; alpha (collinear with t0's slope) is the loosest
    for k, rel in dict(alpha=0.4, beta=0.15, gamma=0.15, delta=0.15).items():
        assert getattr(lm, k) == pytest.approx(TRUE[k], rel=rel), k
    # and the model predicts held-out points to about the noise level
    f = lm.meta["fit"]
    assert f["context_holdout"]["mape"] < 0.02 and f["context_holdout"]["r2"] > 0.99
    assert lm.comm_latency == pytest.approx(COMM["a"], rel=0.1)
    assert lm.comm_bandwidth == pytest.approx(COMM["bw"], rel=0.05)
    # predictions of the whole t(b, l, c) agree with the truth within 2 %
    for b, l, c in [(1, 64, 256), (2, 128, 128), (1, 8, 0), (2, 512, 0), (1, 200, 100)]:
        true = t0(b, l) + (TRUE["alpha"] * b * l + TRUE["beta"] * b * c + TRUE["gamma"] * b * l * c + TRUE["delta"]
                           if c else 0.0)
        assert float(lm.layer_time(b, l, c)) == pytest.approx(true, rel=0.02)


def test_unprofiled_batch_slice_is_interpolated():
    lm = fit(synthetic_profile(noise=0.0))
    assert float(lm.t0_of(3, 64)) == pytest.approx(t0(3, 64), rel=1e-9)  # t0 is linear in b here
    assert float(lm.t0_of(4, 100)) == pytest.approx(t0(4, 100), rel=1e-3)


def test_comm_fit_degenerate():
    assert fit_comm([], []) == (0.0, math.inf)
    a, bw = fit_comm([100, 100], [1e-3, 3e-3])
    assert a == pytest.approx(2e-3) and math.isinf(bw)


def test_json_round_trip(tmp_path):
    lm = fit(synthetic_profile(noise=0.01))
    lm.save(tmp_path / "m.json")
    back = LatencyModel.load(tmp_path / "m.json")
    assert back.to_dict() == lm.to_dict()
    slices = (200, 160, 152)
    assert back.step_time(slices, 1, 2, 4, 2) == lm.step_time(slices, 1, 2, 4, 2)
    no_comm = LatencyModel(n_embd=8, n_head=2, seq_len=16, vocab_size=8, b_grid=[1], l_grid=[8, 16], t0=[[1.0, 2.0]])
    no_comm.save(tmp_path / "n.json")
    assert math.isinf(LatencyModel.load(tmp_path / "n.json").comm_bandwidth)


def test_step_time_parts():
    lm = fit(synthetic_profile(noise=0.0))
    parts = lm.step_time((256, 256), 1, 2, 4, 2)
    assert parts["total"] == pytest.approx(parts["pipeline"] + parts["head"] + parts["optimizer"] + parts["embed"]
                                           + parts["constant"])
    assert parts["head"] == pytest.approx(1e-6 * 2 * 512)


def test_contention_outliers_are_dropped_and_profiles_merge():
    from ours.plan.latency import clean_outliers, isotonic, merge_profiles

    clean = synthetic_profile(noise=0.0)
    noisy = synthetic_profile(noise=0.0)
    rng = np.random.default_rng(3)
    hit = rng.choice(len(noisy["layer"]), size=len(noisy["layer"]) // 8, replace=False)
    for i in hit:  # bursts of contention: some points 2-3x slower
        noisy["layer"][i]["t"] *= float(rng.uniform(2, 3))
    lm = fit(noisy)
    assert lm.meta["fit"]["t0_outliers"]["dropped"] > 0
    for b, l, c in [(1, 64, 256), (2, 128, 128), (1, 8, 0), (2, 496, 0)]:
        assert float(lm.layer_time(b, l, c)) == pytest.approx(float(fit(clean).layer_time(b, l, c)), rel=0.05)
    merged = merge_profiles([noisy, clean])  # per point, the fastest
    assert [p["t"] for p in merged["layer"]] == [p["t"] for p in sorted(clean["layer"],
                                                                        key=lambda q: (q["b"], q["c"], q["l"]))]
    y, bad = clean_outliers(np.arange(9), np.array([1, 2, 3, 4, 50, 6, 7, 8, 9.0]))
    assert bad.tolist() == [False] * 4 + [True] + [False] * 4 and y[4] == pytest.approx(5)
    assert isotonic(np.array([1, 3, 2, 4.0])).tolist() == [1, 2.5, 2.5, 4]


def test_context_coefficients_never_negative():
    from ours.plan.latency import fit_residual

    rng = np.random.default_rng(0)
    b = np.ones(40)
    l = rng.integers(1, 10, 40) * 64.0
    c = rng.integers(1, 10, 40) * 64.0
    y = 1e-3 + 2e-6 * c - 1e-9 * l * c + 1e-4 * rng.standard_normal(40)  # a negative l*c term in the data
    co = fit_residual(b, l, c, y)
    assert min(co[:3]) >= 0.0
    lm = fit(synthetic_profile(noise=0.0))
    assert float(lm.layer_time(1, 64, 512)) >= float(lm.layer_time(1, 64, 0))
