"""TeraPipe's latency model on the one compute model: a slice's time on a stage, its table, the
ping-pong fit; ours.plan, auto and the simulator give the same compute time for the same slice."""
from __future__ import annotations

import math

import pytest

from contract.links import Link
from ours.plan.latency import fit_comm, slice_table, slice_time
from workload.compute import gpu_compute
from workload.configs import get_model_config

XL = get_model_config("gpt3-xl")


def test_a_slice_is_its_layers_and_its_two_messages():
    cm = gpu_compute("V100 SXM2 16GB", XL, "fp16")
    link = Link(1e-3, 1e9)
    t = slice_time(cm, 2048, 1, 256, 512, layers=3, n_stages=4, link=link)
    assert t == pytest.approx(3 * cm.layer_step(1, 256, 512) + 2 * (1e-3 + 256 * 2048 * 4 / 1e9))
    one = slice_time(cm, 2048, 1, 256, 512, layers=3, n_stages=1, link=link)
    assert one == pytest.approx(3 * cm.layer_step(1, 256, 512))
    ring = Link(5e-6, 1e11)
    with_tp = slice_time(cm, 2048, 1, 256, 0, layers=1, n_stages=1, tp=4, tp_link=ring, act_bytes=2, recompute=True)
    ring_s = ring.collective("allreduce", 4, 256 * 2048 * 2)
    assert with_tp == pytest.approx(cm.layer_step(1, 256, 0, 4, True) + 6 * ring_s)
    assert ring.collective("allreduce", 4, 4e6) == pytest.approx(6 * (5e-6 + 1e6 / 1e11))
    assert ring.collective("allreduce", 1, 4e6) == 0


def test_the_table_covers_every_slice_once():
    cm = gpu_compute("A100 SXM4 80GB", XL, "bf16")
    pos, table, fill, _ = slice_table(cm, 2048, 2048, 256, 1, layers=2, n_stages=2)
    assert list(pos) == list(range(0, 2049, 256))
    assert math.isinf(table[3, 3]) and math.isinf(table[5, 2]) and math.isinf(fill[3, 3])
    assert table[1, 3] == pytest.approx(2 * cm.layer_step(1, 512, 256))
    assert table[0, 1] < table[7, 8]  # the same length after more context costs more
    # the fill: what the other stages wait for, the slice without its deferred weight gradients
    assert fill[1, 3] == pytest.approx(table[1, 3] - 2 * cm.layer_wgrad(1, 512))


def test_comm_fit():
    a, bw = fit_comm([1e3, 1e5, 1e6], [1e-4 + 1e3 / 1e9, 1e-4 + 1e5 / 1e9, 1e-4 + 1e6 / 1e9])
    assert a == pytest.approx(1e-4, rel=1e-6) and bw == pytest.approx(1e9, rel=1e-6)
    assert fit_comm([], []) == (0.0, math.inf)
    assert fit_comm([1e3], [2e-4]) == (2e-4, math.inf)


def test_comm_fit_keeps_a_positive_latency_under_noise():
    """A ping-pong on a busy host: the largest message took twice its time. An absolute least
    squares puts the intercept below zero (a 0-latency link); the fit keeps the small messages' latency."""
    sizes = [2 ** k for k in range(10, 23, 3)]
    times = [5e-5 + b / 2e9 for b in sizes]
    times[-1] *= 2.0  # the 4 MiB message waited behind another process
    a, bw = fit_comm(sizes, times)
    assert 2e-5 < a < 1e-4 and 1e9 < bw < 5e9
    a, _ = fit_comm([1e3, 1e6], [1e-3, 1e-4])  # slower at the small size: no positive slope
    assert a > 0
