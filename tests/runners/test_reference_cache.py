"""--verify's reference kept by its config and the code that computes it (runners.reference_cache)."""
from __future__ import annotations

import json

import pytest
import torch

from contract import RunConfig
from runners import reference_cache
from runners.run import reference_config
from tests.conftest import TINY, assert_verified, run_cli
from workload.configs import OptimizerConfig, get_model_config


def _ref(**changes) -> RunConfig:
    cfg = RunConfig(system="torch_pipe", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1, pp=2,
                    steps=2, warmup=0, verify=True)
    return reference_config(cfg.replace(**changes))


def _sources(root, text="x = 1\n"):
    for name in reference_cache.SOURCES:
        p = root / name
        if name.endswith(".py"):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        else:
            p.mkdir(parents=True, exist_ok=True)
            (p / "a.py").write_text(text)


def test_the_key_is_the_reference_config_and_the_code():
    base = reference_cache.key(_ref())
    assert reference_cache.key(_ref(timeout=5.0)) == base  # volatile: not what is computed
    assert reference_cache.key(_ref(pp=1, dp=1)) == base  # the run's layout: the same reference
    assert reference_cache.key(_ref(optimizer=OptimizerConfig(lr=1e-3))) != base
    assert reference_cache.key(_ref(steps=3)) != base
    assert reference_cache.key(_ref(precision="bf16")) != base != reference_cache.key(_ref(precision="fp16"))


def test_a_changed_source_file_is_another_key(tmp_path):
    _sources(tmp_path)
    before = reference_cache.key(_ref(), root=tmp_path)
    (tmp_path / "workload" / "a.py").write_text("x = 2\n")
    assert reference_cache.key(_ref(), root=tmp_path) != before


def test_store_then_load_and_a_broken_file_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEBENCH_CACHE", str(tmp_path))
    ref = _ref()
    assert reference_cache.load(reference_cache.entry(ref)) is None
    ranks, grads = [{"rank": 0, "losses": [1.5, 1.25]}], {"w": torch.arange(3.0)}
    reference_cache.store(reference_cache.entry(ref), ranks, grads)
    got_ranks, got_grads = reference_cache.load(reference_cache.entry(ref))
    assert got_ranks == ranks and torch.equal(got_grads["w"], grads["w"])
    monkeypatch.setenv("PIPEBENCH_REFERENCE_CACHE", "0")
    assert reference_cache.load(reference_cache.entry(ref)) is None
    monkeypatch.delenv("PIPEBENCH_REFERENCE_CACHE")
    (path,) = (tmp_path / "references").glob("*.pt")
    path.write_bytes(b"not a torch file")
    assert reference_cache.load(reference_cache.entry(ref)) is None


@pytest.mark.multiprocess
def test_a_second_verified_run_uses_the_kept_reference_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEBENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs.jsonl"
    args = ("--system", "torch_pipe", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1",
            "--steps", "1", "--warmup", "0", "--verify", "--out", str(out))
    first, second = run_cli(*args), run_cli(*args)
    for proc in (first, second):
        assert_verified(proc)
    line = lambda p: next(l for l in p.stdout.splitlines() if l.startswith("verify ("))  # noqa: E731
    assert "reference cached" not in line(first) and "reference cached" in line(second)
    assert line(first).replace("; reference cached", "") == line(second).replace("; reference cached", "")
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["verify"]["reference"] for r in recs] == ["trained", "cached"]
