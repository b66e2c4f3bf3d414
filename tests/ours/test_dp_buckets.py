"""ours.dp without processes: buckets in the pipeline's gradient order, readiness, the PS ranges."""
from __future__ import annotations

import pytest
import torch

from ours.dp import _ordered, _Readiness, buckets


def _params(*sizes: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_readiness_releases_each_bucket_once_in_index_order_when_its_last_gradient_is_final():
    ps = _params(4, 4, 4, 4, 4)
    bs = buckets(ps, bucket_bytes=32)  # two fp32 tensors of 4 per bucket
    assert [len(b) for b in bs] == [2, 2, 1]
    r = _Readiness(bs)
    assert r.ready([ps[0]]) == []
    assert r.ready([ps[2], ps[1]]) == [0]
    assert r.ready([ps[4]]) == []  # complete, but bucket 1 is not: the peers receive buckets in index order
    assert r.rest() == [1, 2]  # 1 never reported: taken as complete once, then not again
    assert r.rest() == []
    r.reset()
    assert r.ready(ps) == [0, 1, 2]


def test_gradient_order_must_cover_every_parameter_once():
    ps = _params(1, 2, 3)
    named = [(f"p{i}", p) for i, p in enumerate(ps)]
    assert _ordered(named, None) == ps
    assert _ordered(named, ps[::-1]) == ps[::-1]
    with pytest.raises(ValueError):
        _ordered(named, ps[:2])
    with pytest.raises(ValueError):
        _ordered(named, [ps[0], ps[0], ps[1]])
