"""RunRecord: one JSON line per run, the only thing report.py reads."""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import platform
import statistics
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runners.config import RunConfig

STATUSES = ("ok", "oom", "error", "timeout")
# Config fields that do not change what a run measures: two records whose configs differ only in
# these measured the same thing (a re-run replaces the older one in the report; a sweep skips it).
VOLATILE_FIELDS = frozenset({"verify", "timeout", "trace", "device"})


def config_key(config: dict) -> str:
    """What identifies a run: its RunConfig dict without the volatile fields, as sorted JSON."""
    plain = json.loads(json.dumps(config))  # tuples -> lists, as in a record read back
    return json.dumps({k: v for k, v in plain.items() if k not in VOLATILE_FIELDS}, sort_keys=True)


@dataclass
class RunRecord:
    system: str
    model: str
    model_shape: dict[str, int]
    layout: dict[str, int]
    schedule: str
    batch_size: int
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    precision: str
    recompute: bool
    network: str
    status: str
    error: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    median_step_time: float | None = None
    min_step_time: float | None = None
    max_step_time: float | None = None
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    peak_memory_bytes: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    dp_sync_time: float | None = None
    barrier_time: float | None = None  # the closing barrier, as paid by the rank whose step took longest
    verify: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    timestamp: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)


def merged_losses(ranks: list[dict]) -> list[float]:
    """The global-batch loss per step: the mean over the data-parallel replicas that report one."""
    series = [r["losses"] for r in ranks if r.get("losses")]
    if not series:
        return []
    return [sum(values) / len(values) for values in zip(*series)]


def build_record(cfg: RunConfig, status: str, error: str | None, ranks: list[dict] | None,
                 environment: dict[str, Any], verify: dict[str, Any] | None = None) -> RunRecord:
    from workload.flops import flops_per_token
    from workload.model import count_params

    assert status in STATUSES, status
    m = cfg.model
    options = {"virtual_pp": cfg.virtual_pp, "optimizer": asdict(cfg.optimizer), "seed": cfg.seed, "data": cfg.data}
    if cfg.system == "ours":
        options.update(slices=list(cfg.token_slices), auto_slices=cfg.auto_slices, dp_mode=cfg.dp_mode)
    rec = RunRecord(
        system=cfg.system, model=m.name, model_shape={"n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head,
        "seq_len": m.seq_len, "vocab_size": m.vocab_size, "params": count_params(m, include_embeddings=True)},
        layout={"pp": cfg.pp, "tp": cfg.tp, "dp": cfg.dp}, schedule=cfg.schedule, batch_size=cfg.batch_size,
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size, seq_len=m.seq_len,
        precision=cfg.precision, recompute=cfg.recompute, network=cfg.network, status=status, error=error,
        options=options, environment=dict(environment), verify=verify, config=cfg.to_dict())
    if not ranks:
        return rec
    rec.environment.update(
        device_kind=ranks[0]["device"].split(":")[0], device_name=ranks[0]["device_name"], device_count=len(ranks),
        backend=ranks[0]["backend"], hostnames=sorted({r["hostname"] for r in ranks}))
    for r in ranks:  # options a system resolved at run time (e.g. the planner's slicing)
        rec.options.update(r.get("extra") or {})
    # A step takes as long as its slowest rank.
    per_step = [max(ts) for ts in zip(*(r["step_times"] for r in ranks))]
    rec.step_times = per_step
    rec.losses = merged_losses(ranks)
    rec.peak_memory_bytes = [r["peak_memory_bytes"] for r in ranks]
    syncs = [max(s) for s in zip(*(r["dp_sync_times"] for r in ranks))] if all(r["dp_sync_times"] for r in ranks) else []
    rec.dp_sync_time = statistics.median(syncs) if syncs else None
    if per_step and all(r.get("barrier_times") for r in ranks):
        # per step, the barrier of the rank that set the step time (its work plus this is the step)
        rec.barrier_time = statistics.median(
            max(zip(ts, bs))[1] for ts, bs in zip(zip(*(r["step_times"] for r in ranks)), zip(*(r["barrier_times"] for r in ranks))))
    rec.peak_tflops = statistics.mean(r["peak_tflops"] for r in ranks)
    rec.peak_source = ranks[0]["peak_source"]
    if per_step:
        med = statistics.median(per_step)
        rec.median_step_time, rec.min_step_time, rec.max_step_time = med, min(per_step), max(per_step)
        rec.tokens_per_s = cfg.global_batch_size * m.seq_len / med
        rec.tflops_per_device = rec.tokens_per_s / len(ranks) * flops_per_token(m) / 1e12
        rec.mfu = rec.tflops_per_device / rec.peak_tflops if rec.peak_tflops else None
    return rec


def host_environment(device: str = "auto") -> dict[str, Any]:
    """The launching host's view, kept for failed runs; the ranks' own report replaces the device fields."""
    import torch

    cuda = device != "cpu" and torch.cuda.is_available()
    return {"torch_version": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "launcher_host": platform.node(), "device_kind": "cuda" if cuda else "cpu",
            "device_name": torch.cuda.get_device_name(0) if cuda else "cpu"}


def append_record(path: str | Path, record: RunRecord) -> None:
    """Append one line atomically: the file is rewritten to a temporary and renamed over the old one,
    under an exclusive lock, so a crash leaves the old file or the new one, never a torn line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = path.read_bytes() if path.exists() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(old + record.to_json().encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_records(path: str | Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out
