"""The records file: one run record per line of JSON (``runners.record.RunRecord``, appended by the run
command), and the one way to read it, which the report, the sweep, the cluster mode, the benchmarks,
the simulator and the tests share. Plain JSON, no torch.

A line that is not UTF-8 text, not JSON, or JSON that is not a record (an object without ``REQUIRED``'s
fields, or with one of another type; a count, a layout's degree or a ``model_shape`` entry of ``SHAPE`` that is
not a whole number >= 1), is skipped; a field of a record that is malformed (a step time that is
NaN or text, a list of numbers holding something else, a table that is not one) is left out of it;
``warn`` (if given) is told where and why, in one line naming the file and the line (after
``WARNINGS`` lines of one file, one more line counts the rest: a binary file is not a screenful). Beside a records file
``X.jsonl``, ``python -m predict records X.jsonl`` writes the simulator's predictions of its runs
(``predictions_path``: ``X.predictions.json``, by run id), which the report shows.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from contract.config import legacy_precision

# What makes a JSON object a run record (what the report needs of every one), and the type of each.
REQUIRED = ("system", "status", "model", "model_shape", "layout", "batch_size", "micro_batch_size", "network")
_REQUIRED_TYPES = dict(system=str, status=str, model=str, model_shape=dict, layout=dict, batch_size=int,
                       micro_batch_size=int, network=str)
SHAPE = ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size")  # of ``model_shape``: what the tables show of a model
# Fields a record may lack (or hold null), by what they must be when present: a finite number, a list
# of finite numbers, a table, text.
NUMBERS = ("median_step_time", "min_step_time", "max_step_time", "tokens_per_s", "tflops_per_device", "mfu",
           "peak_tflops", "dp_sync_time", "barrier_time")
NUMBER_LISTS = ("step_times", "peak_memory_bytes", "busy_fraction", "replicas_per_step")
TABLES = ("environment", "config", "options", "network_setting", "verify", "prediction")
TEXTS = ("label", "role", "error", "details", "key", "run_id", "timestamp", "withheld_output")
PREDICTIONS_SUFFIX = ".predictions.json"
WARNINGS = 10  # lines of one file told to ``warn`` one by one; the rest are counted


def layout_words(layout: dict) -> str:
    """A record's layout as the report and the simulator's cases write it: 'T-2', 'P-2 D-2', '1 device'."""
    parts = [f"{k[0].upper()}-{layout[k]}" for k in ("tp", "pp", "dp") if layout.get(k, 1) > 1]
    return " ".join(parts) or "1 device"


def finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _not_a_record(rec: Any) -> str | None:
    """Why ``rec`` is not a run record, or None."""
    if not isinstance(rec, dict):
        return "not a run record (not an object)"
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        return f"not a run record (no {', '.join(missing)})"
    wrong = [k for k, kind in _REQUIRED_TYPES.items() if kind is not int and not isinstance(rec[k], kind)]
    if wrong:
        return f"not a run record ({', '.join(wrong)}: of the wrong type)"
    wrong = [k for k, kind in _REQUIRED_TYPES.items() if kind is int and not _count(rec[k])]
    wrong += [f"layout {k}" for k in ("pp", "tp", "dp") if k in rec["layout"] and not _count(rec["layout"][k])]
    wrong += [f"model_shape {k}" for k in SHAPE if not _count(rec["model_shape"].get(k))]
    if wrong:
        return f"not a run record ({', '.join(wrong)}: not a whole number >= 1)"
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _malformed_fields(rec: dict) -> list[tuple[str, Any]]:
    """(name, value) of the record's fields that are present but malformed."""
    bad = [(k, rec[k]) for k in NUMBERS if rec.get(k) is not None and not finite_number(rec[k])]
    bad += [(k, rec[k]) for k in NUMBER_LISTS
            if rec.get(k) is not None and not (isinstance(rec[k], list) and all(map(finite_number, rec[k])))]
    bad += [(k, rec[k]) for k in TABLES if rec.get(k) is not None and not isinstance(rec[k], dict)]
    bad += [(k, rec[k]) for k in TEXTS if rec.get(k) is not None and not isinstance(rec[k], str)]
    return bad


def parse_records(data: str | bytes, source: str = "records", warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records in ``data`` (JSON lines; bytes are decoded line by line), in order; a line that is
    not a record is skipped and told to ``warn`` as '<source>:<line>: why'."""
    records = []
    told = _Told(source, warn)
    for n, line in enumerate(data.splitlines(), 1):
        if isinstance(line, bytes):
            try:
                line = line.decode()
            except UnicodeDecodeError:
                told(n, "not UTF-8 text: line skipped")
                continue
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            told(n, "not JSON: line skipped")
            continue
        why = _not_a_record(rec)
        if why:
            told(n, f"{why}: line skipped")
            continue
        for name, value in _malformed_fields(rec):
            kind = ("a finite number" if name in NUMBERS else "a list of finite numbers" if name in NUMBER_LISTS
                    else "a table" if name in TABLES else "text")
            told(n, f"field {name} left out ({_shown(value)} is not {kind})")
            del rec[name]
        _upgrade_precision(rec)
        if rec["status"] == "ok" and rec.get("median_step_time") is None:
            told(n, "an ok record without a median_step_time (shown without a step time)")
        records.append(rec)
    told.close()
    return records


class _Told:
    """``warn`` of one file's lines: the first ``WARNINGS`` one by one, then a count of the rest."""

    def __init__(self, source: str, warn: Callable[[str], None] | None):
        self.source, self.warn, self.n, self.more = source, warn, 0, 0

    def __call__(self, line: int, why: str) -> None:
        if self.warn is None:
            return
        self.n += 1
        if self.n <= WARNINGS:
            self.warn(f"{self.source}:{line}: {why}")
        else:
            self.more += 1

    def close(self) -> None:
        if self.more:
            self.warn(f"{self.source}: {self.more} more warning(s) of this file not shown")


def _upgrade_precision(rec: dict) -> None:
    """A record written before the precision policy (``mixed_precision`` in its config and key,
    ``precision`` 'mixed') as one written now: its policy (``contract.config.legacy_precision``, from
    the device it ran on) in its config, its key and its ``precision``, so that it reports and is
    recognised by a sweep as the same run as a new one of that policy."""
    config = rec.get("config")
    if not isinstance(config, dict) or "mixed_precision" not in config:
        return
    kind = str((rec.get("environment") or {}).get("device_kind") or "") or None
    rec["config"] = legacy_precision(config, kind)
    rec["precision"] = rec["config"]["precision"]
    if isinstance(rec.get("key"), str):
        try:
            key = json.loads(rec["key"])
        except json.JSONDecodeError:
            return
        if isinstance(key, dict):
            rec["key"] = json.dumps(legacy_precision(key, kind), sort_keys=True)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_records(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records of one file, in order (none if it does not exist; none, told to ``warn``, if it
    cannot be read)."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        data = p.read_bytes()
    except OSError as exc:
        if warn:
            warn(f"{p}: cannot be read ({exc.strerror}): skipped")
        return []
    return parse_records(data, str(p), warn)


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


def read_predictions(records_file: str | Path, warn: Callable[[str], None] | None = None) -> dict[str, dict]:
    """The predictions kept beside ``records_file`` by run id (none if there are none); a file that is
    not a JSON object, or an entry with neither a finite ``step_time`` nor a ``not_modelled`` reason, is
    skipped and told to ``warn``."""
    p = predictions_path(records_file)
    if not p.exists():
        return {}
    try:
        d = json.loads(p.read_bytes())
    except json.JSONDecodeError as e:
        if warn:
            warn(f"{p}:{e.lineno}: not JSON: predictions skipped")
        return {}
    except (UnicodeDecodeError, OSError) as e:
        if warn:
            warn(f"{p}: {'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else e.strerror}: predictions skipped")
        return {}
    if not isinstance(d, dict):
        if warn:
            warn(f"{p}:1: not an object of predictions by run id: predictions skipped")
        return {}
    good = {k: v for k, v in d.items() if isinstance(v, dict)
            and (finite_number(v.get("step_time")) or isinstance(v.get("not_modelled"), str))}
    if warn:
        for k in d.keys() - good.keys():
            warn(f"{p}: the prediction of run {k} left out (no finite step_time)")
    return good
