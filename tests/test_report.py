import subprocess
import sys

from report import render
from contract import RunConfig
from runners.record import append_record, build_record
from runners.registry import get_system
from tests.conftest import REPO
from workload.configs import get_model_config


def _rec(system="megatron", tp=1, pp=1, dp=1, mb=1, status="ok", t=1.0, network="none"):
    spec = get_system(system)
    cfg = RunConfig(system=system, model=get_model_config("gpt3-xl"), batch_size=64, micro_batch_size=mb, pp=pp, tp=tp,
                    dp=dp, network=network, options=spec.options())
    n = pp * tp * dp
    ranks = None
    if status == "ok":
        ranks = [{"rank": r, "step_times": [t] * 3, "losses": [1.0] * 3 if r == n - 1 else None, "dp_sync_times": [0.0] * 3,
                  "peak_memory_bytes": 1 << 30, "extra": {}, "hostname": "h", "device": "cuda:0",
                  "device_name": "Tesla V100-SXM2-16GB", "backend": "nccl", "peak_tflops": 15.7, "peak_source": "table:fp32"}
                 for r in range(n)]
    return build_record(cfg, spec, status, None if status == "ok" else "CUDA out of memory", ranks,
                        {"torch_version": "2.13", "device_name": "Tesla V100-SXM2-16GB", "device_count": n})


def test_layout_table_like_the_seed():
    recs = [_rec(tp=8, t=25.0), _rec(pp=8, t=19.71), _rec(tp=4, pp=2, t=20.64), _rec(tp=2, pp=4, t=20.81),
            _rec(tp=8, mb=16, status="oom"), _rec(pp=8, mb=16, status="error")]
    text = render([r.__dict__ for r in recs])
    header = next(l for l in text.splitlines() if "Micro batch size" in l)
    for col in ("T-8", "P-8", "T-4 P-2", "T-2 P-4"):
        assert col in header
    assert "19.71 s" in text and "Fail (OOM)" in text and "Fail (error)" in text
    assert "precision: fp32" in text and "batch: 64" in text


def test_network_table_like_the_seed():
    recs = []
    for net, t1, t4 in [("default", 15.16, 16.17), ("d10-1g", 22.9, 33.39), ("d1-5g", 15.49, 17.55)]:
        recs += [_rec(system="ours", pp=12, network=net, t=t1), _rec(system="ours", pp=12, dp=4, network=net, t=t4)]
    text = render([r.__dict__ for r in recs])
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if "Network setting" in l)
    table = lines[start:start + 5]
    assert "P-12 D-4" in table[0] and "33.39 s" in "\n".join(table)
    # rows are ordered by delay: default first, then 1 ms, then 10 ms
    order = [l.split("|")[1] for l in table[2:5]]
    assert "1ms" in order[1] and "10ms" in order[2], order


def test_cli_reads_a_directory_and_writes_the_report(tmp_path):
    append_record(tmp_path / "a.jsonl", _rec(pp=8, t=19.71))
    append_record(tmp_path / "b.jsonl", _rec(pp=8, mb=2, status="timeout"))
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "report.py", str(tmp_path), "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "19.71 s" in out.read_text() and "Fail (timeout)" in out.read_text()
    bad = subprocess.run([sys.executable, "report.py", str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
