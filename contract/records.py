"""The records file: one run record per line of JSON (``runners.record.RunRecord``, appended by the run
command), and the one way to read it, which the report, the sweep, the cluster mode, the benchmarks,
the simulator and the tests share. Plain JSON, no torch.

A line that is not JSON, or JSON that is not a record (an object without ``REQUIRED``'s fields),
is skipped; ``warn`` (if given) is told where and why, in one line. Beside a records file
``X.jsonl``, ``python -m predict records X.jsonl`` writes the simulator's predictions of its runs
(``predictions_path``: ``X.predictions.json``, by run id), which the report shows.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

# What makes a JSON object a run record (what the report needs of every one).
REQUIRED = ("system", "status", "model", "model_shape", "layout", "batch_size", "micro_batch_size", "network")
PREDICTIONS_SUFFIX = ".predictions.json"


def parse_records(text: str, source: str = "records", warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records in ``text`` (JSON lines), in order; a line that is not a record is skipped and
    told to ``warn`` as '<source>:<line>: why'."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if warn:
                warn(f"{source}:{n}: not JSON")
            continue
        missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
        if missing:
            if warn:
                warn(f"{source}:{n}: not a run record (no {', '.join(missing)})")
            continue
        records.append(rec)
    return records


def read_records(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records of one file, in order (none if it does not exist)."""
    p = Path(path)
    return parse_records(p.read_text(), str(p), warn) if p.exists() else []


def record_files(paths: Iterable[str | Path]) -> list[Path]:
    """The records files among ``paths``: a directory stands for every ``*.jsonl`` below it."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return files


def newest(records: list[dict], key: str) -> dict | None:
    """The last record of the run ``key`` (a run's identity, ``RunConfig.key``), or None."""
    return next((r for r in reversed(records) if r.get("key") == key), None)


def predictions_path(records_file: str | Path) -> Path:
    """Where the simulator's predictions of a records file's runs are kept: ``X.jsonl`` ->
    ``X.predictions.json``, a JSON object {run id: {"step_time": seconds, its parts..., "source": ...}}."""
    p = Path(records_file)
    return p.with_name(p.name.removesuffix(".jsonl") + PREDICTIONS_SUFFIX)


def read_predictions(records_file: str | Path) -> dict[str, dict]:
    """The predictions kept beside ``records_file`` by run id (none if there are none)."""
    p = predictions_path(records_file)
    if not p.exists():
        return {}
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError:
        return {}
    return d if isinstance(d, dict) else {}
