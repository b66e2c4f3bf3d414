"""The CPU peak of MFU: the model's own operations on one thread, kept per host, and the check that
no record the tests write shows an MFU above it."""
import json

import pytest
import torch

from tests.conftest import records_above_peak
from workload.configs import get_model_config
from workload.cpu_peak import best_times, cpu_peak_tflops, model_ops, model_peak
from workload.flops import flops_per_token

SHAPE = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 128}  # a record's

TINY = get_model_config("tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=128)


def test_the_peak_counts_a_steps_model_flops():
    ops = model_ops(TINY, micro_batch=2)
    tokens = 2 * TINY.seq_len
    # the step's operations carry exactly the model FLOPs the MFU divides by (6N + 12·L·h·s per token),
    # but the biases and LayerNorms, which the FLOP count has and no GEMM runs
    counted = sum(op.flops * op.count for op in ops)
    assert counted == pytest.approx(flops_per_token(TINY) * tokens, rel=0.02)
    assert model_peak(ops, [1.0] * len(ops)) == pytest.approx(counted / sum(op.count for op in ops) / 1e12)


def test_the_peak_is_kept_per_host_and_measured_again_when_the_host_got_faster(tmp_path):
    peak, source = cpu_peak_tflops(TINY, 1, cache=tmp_path)
    assert peak > 0 and source.startswith("model-ops:fp32, 1 thread (measured")
    again, source = cpu_peak_tflops(TINY, 1, cache=tmp_path)
    kept = json.loads((tmp_path / "cpu-peak.json").read_text())
    (entry,) = kept.values()
    if "kept" in source:
        assert again == peak
    # a peak kept from a slow (busy) moment: the quick trial beats it, and it is measured again
    entry.update(largest_gemm_s=1e9, times=[1e9] * len(entry["ops"]), tflops=1e-9)
    (tmp_path / "cpu-peak.json").write_text(json.dumps(kept))
    faster, source = cpu_peak_tflops(TINY, 1, cache=tmp_path)
    assert faster > 1e-6 and "measured" in source


def test_one_thread_is_measured_and_the_callers_threads_are_left_as_they_were():
    torch.set_num_threads(2)
    try:
        assert all(t > 0 for t in best_times(model_ops(TINY, 1)[:2], trials=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_the_audit_finds_a_record_above_the_peak(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit")  # not this test's tmp_path: the audit would fail the test itself
    base = {"system": "reference", "status": "ok", "model": "tiny", "model_shape": SHAPE, "layout": {"pp": 1},
            "batch_size": 2, "micro_batch_size": 1, "network": "none", "peak_tflops": 0.1, "peak_source": "x"}
    (d / "r.jsonl").write_text(json.dumps({**base, "mfu": 0.9}) + "\n" + json.dumps({**base, "mfu": None}) + "\n")
    assert records_above_peak(d) == []
    (d / "sub").mkdir()
    (d / "sub" / "s.jsonl").write_text(json.dumps({**base, "mfu": 1.059}) + "\n")
    (bad,) = records_above_peak(d)
    assert "s.jsonl: reference" in bad and "105.9%" in bad
