"""Run records read and turned into the report's frame: one row per run (its repetitions combined), with
what tells runs apart (identity, hardware, code commit) and what the tables and claims read.

Only run records are read (``contract.records``: a JSON line of a record's shape). A directory stands
for its ``*.jsonl`` files; one of them that holds no run record (a probe's loads, a study's samples) is
another kind of file and is skipped without a word per line: one line counts such files. A file named
on the command line is read as records whatever it holds, and each line that is not one is told.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from contract.config import VOLATILE_FIELDS, ConfigError, RunConfig
from contract.estimate import estimate
from contract.faults import words
from contract.records import layout_words, read_predictions, read_records, record_files
from contract.registry import get_system, read_options

# RunConfig's fields the tables show as axes, columns or in the heading (the rest of a run's identity,
# where it is not the default, is stated beside the heading)
SHOWN = frozenset({"system", "model", "pp", "tp", "dp", "batch_size", "micro_batch_size", "steps", "warmup",
                   "precision", "recompute", "network", "network_matrix", "network_trace", "network_trace_contents",
                   "options"})
KINDS = {"tp": "tensor", "pp": "pipeline", "dp": "data-parallel"}


def load_records(paths: list[str], name: str = "report.py", warn: Callable[[str], None] | None = None) -> list[dict]:
    """Every run record in ``paths`` (files; directories: their ``*.jsonl`` that hold run records), with
    the simulator's prediction kept beside its file (``python -m predict records``) where it has none of
    its own. A line of a records file that is not a record is told to ``warn`` (default: stderr, after
    ``name``); the files under a directory that hold no record are skipped and counted in one line."""
    warn = warn or (lambda why: print(f"{name}: {why}", file=sys.stderr))
    records: list[dict] = []
    skipped: list[str] = []
    for path in paths:
        scanned = Path(path).is_dir()  # its files were found, not named
        for f in record_files([path]):
            told: list[str] = []
            found = read_records(f, warn=told.append)
            if scanned and not found:
                skipped += [str(f)] if told else []  # an empty file is no file of another kind
                continue
            for why in told:
                warn(why)
            predicted = read_predictions(f, warn=warn)
            for rec in found:
                if rec.get("prediction") is None and rec.get("run_id") in predicted:
                    rec["prediction"] = predicted[rec["run_id"]]
            records += found
    if skipped:
        files = "1 file that holds" if len(skipped) == 1 else f"{len(skipped)} files that hold"
        warn(f"skipped {files} no run record: {', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}")
    return records


def commit_of(r: dict) -> str:
    """The code a record was made by, as it says it: 'commit 9d35559c0b94', '... (dirty)' where its
    tracked files differed from the commit, or 'no commit recorded'. Claims never pool two of these."""
    env = r.get("environment") or {}
    if not env.get("git_commit"):
        return "no commit recorded"
    return f"commit {str(env['git_commit'])[:12]}" + (" (dirty)" if env.get("git_dirty") else "")


def network_setting(r: dict) -> dict:
    """A record's network setting in words and numbers, as the run recorded it: its label, one-way
    delay (ms) and bandwidth (Gbit/s) of its link (None without emulation; a per-link matrix: its
    slowest link, whether all its links are one, the digest of its contents). Records from before
    ``network_setting`` was recorded: the profile their emulation described, else the setting's name."""
    if r.get("network_setting"):
        return r["network_setting"]
    prof = ((r.get("environment") or {}).get("network") or {}).get("profile") or {}
    link = prof.get("link") or {}
    if prof.get("kind") == "matrix":
        link = {k: prof[k][0][1] for k in ("delay_ms", "bandwidth_gbps")}
    return {"label": prof.get("label") or r["network"], "delay_ms": link.get("delay_ms"),
            "bandwidth_gbps": link.get("bandwidth_gbps")}


def hardware_of(environment: dict) -> str:
    """What a run ran on, as its record says: the device kind, and the device's name where it says
    more ('cpu'; 'cuda: Tesla V100-SXM2-16GB'). Part of a report row's identity: records of one
    config on different hardware never share a table."""
    kind = str(environment.get("device_kind") or "")
    name = str(environment.get("device_name") or "")
    return kind if not name or name == kind else f"{kind}: {name}" if kind else name


def network_row(r: dict) -> tuple[str, str, tuple[float, ...]]:
    """A record's network setting as a table's row: (what tells settings apart: the setting, and a
    matrix's and a trace's digests; its label; its order)."""
    setting = network_setting(r)
    return network_key(r, setting), setting["label"], network_order(setting)


def network_key(r: dict, setting: dict) -> str:
    """What tells a record's network setting apart from others: its name, a matrix's digest, a trace's."""
    trace = setting.get("trace") or {}
    return (r["network"] + (f" [{setting['digest']}]" if setting.get("digest") else "")
            + (f" + trace [{trace['digest']}]" if trace.get("digest") else ""))


def network_order(setting: dict) -> tuple[float, ...]:
    """Rows go from the fastest network to the slowest: by delay, then by falling bandwidth, then by
    loss and jitter (a changing link after the same link unchanged)."""
    if setting.get("delay_ms") is None:
        return (-1.0, 0.0, 0.0, 0.0, 0.0)
    return (setting["delay_ms"], -setting["bandwidth_gbps"], setting.get("loss_pct") or 0.0,
            setting.get("jitter_ms") or 0.0, 1.0 if setting.get("trace") else 0.0)


def plain_link(setting: dict) -> bool:
    """Whether a setting is one link, lossless and steady (no per-link matrix, loss, jitter or trace): a
    point of a step time against the delay."""
    return (setting.get("uniform", True) and setting.get("delay_ms") is not None and not setting.get("loss_pct")
            and not setting.get("jitter_ms") and not setting.get("trace"))


def layout_devices(layout: dict) -> int:
    """The devices a layout spans, pp x tp x dp (fairscale's P-2, one process on CPU: 2)."""
    return layout.get("pp", 1) * layout.get("tp", 1) * layout.get("dp", 1)


def parallelism(layout: dict) -> str:
    """A layout's kind of parallelism: 'pipeline', 'tensor', 'tensor + pipeline', 'pipeline +
    data-parallel', ...; 'one device'. Claims compare runs of one kind on as many devices."""
    kinds = [name for dim, name in KINDS.items() if layout.get(dim, 1) > 1]
    return " + ".join(kinds) or "one device"


def synchronous(system: str) -> bool:
    """False for a method that changes the optimisation (it names a reference of its own math:
    ``SystemSpec.reference``, diloco), which a step time does not compare; True for an unknown system."""
    try:
        return get_system(system).reference is None
    except ConfigError:
        return True


def describe_oversubscription(over: dict) -> str:
    """'12 ranks (12 threads) on 2 cores', as a record's ``oversubscribed`` says it."""
    threads = f" ({over['threads']} threads)" if over.get("threads", over["ranks"]) != over["ranks"] else ""
    machines = f", on {over['machines']} machines" if over.get("machines", 1) > 1 else ""
    return f"{over['ranks']} ranks{threads} on {over['cores']} cores{machines}"


def faults_words(config: dict, faults: dict | None = None) -> str:
    """A run's faults in words (``contract.faults.words``, from its config and what its record says
    happened): 'rank 1 2x slower', 'replica 2 killed after 6 steps, rejoined at step 8'; '' without."""
    return words(config, faults)


def rest_of_identity(r: dict) -> str:
    """The fields of a run's identity that are neither axes nor in the tables' headings (``SHOWN``),
    where they are not RunConfig's defaults, as text (e.g. 'seed 3, sgd lr 0.001')."""
    c = r.get("config") or {}
    parts = []
    for f in dataclasses.fields(RunConfig):
        if f.name in SHOWN or f.name in VOLATILE_FIELDS or f.name not in c:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = c[f.name]
        plain = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
        if value == json.loads(json.dumps(plain)):
            continue
        if f.name == "optimizer":
            parts.append(f"{value.get('kind')} lr {value.get('lr'):g}")
        else:
            parts.append(f"{f.name.replace('_', ' ')} {value}")
    return ", ".join(parts)


def _identity(r: dict) -> str:
    """A run's identity: its key (``RunConfig.key``, which the run command records); a record made by other
    means, without one, is identified by its config, or without that by what it says of its run (records
    that say nothing but their required fields are not all one run)."""
    if r.get("key"):
        return r["key"]
    if r.get("config"):
        return json.dumps(r["config"], sort_keys=True)
    said = ("system", "model", "model_shape", "layout", "batch_size", "micro_batch_size", "network", "precision",
            "recompute", "options", "network_setting")
    return json.dumps({k: r.get(k) for k in said}, sort_keys=True)


def _row(i: int, r: dict) -> dict:
    """One record as a row of the frame (before its repetitions are combined)."""
    env = r.get("environment") or {}
    c = r.get("config") or {}
    shape = r["model_shape"]
    setting = network_setting(r)
    hardware = hardware_of(env)
    commit = commit_of(r)
    uniform = setting.get("uniform", True)
    return {
        # a run's identity: its config, the hardware it ran on and the code that ran it
        "key": _identity(r) + " on " + hardware + " of " + commit,
        "timestamp": r.get("timestamp", ""),
        "launched": (r.get("timestamp", ""), i),  # when: its time, then its place in the records (ties)
        "system": r.get("label") or r["system"],
        "role": r.get("role") or "baseline",
        "options": json.dumps(read_options(r["system"], c.get("options") or {}), sort_keys=True),
        "model": r["model"],
        "shape": "L{n_layer} h{n_embd} a{n_head} s{seq_len}".format(**shape),
        "hardware": hardware,
        "commit": commit,
        "devices": layout_devices(r["layout"]),
        "kind": parallelism(r["layout"]),
        "synchronous": synchronous(r["system"]),
        "precision": r.get("precision", "fp32"),
        "recompute": "recompute" if r.get("recompute") else "no recompute",
        "batch": f"{r['batch_size']} per pipeline",  # (global: x the DP degree)
        "steps": f"{c.get('steps', '?')} measured steps after {c.get('warmup', '?')} warm-up",
        "measured": len(r.get("step_times") or []),  # as recorded (a run may end early: --target-loss)
        "rest": rest_of_identity(r),
        "faults": faults_words(c, env.get("faults")),
        "mb": r["micro_batch_size"],
        "layout": layout_words(r["layout"]),
        "dp": r["layout"].get("dp", 1),
        "network": network_key(r, setting),
        "setting": setting["label"],
        "order": network_order(setting),
        "delay": setting.get("delay_ms") if uniform else None,  # a matrix: several
        "bandwidth": setting.get("bandwidth_gbps") if uniform else None,
        "plain_link": plain_link(setting),
        "emulated": r["network"] != "none",
        "status": r["status"],
        "median_step_time": r.get("median_step_time"),
        "predicted": (r.get("prediction") or {}).get("step_time"),
        "not_modelled": (r.get("prediction") or {}).get("not_modelled"),
        "oversubscribed": r.get("oversubscribed"),
        "tokens_per_s": r.get("tokens_per_s"),
        "mfu": r.get("mfu"),
        "peak_mem_mb": max(r.get("peak_memory_bytes") or [0]) / 2**20,
        "busy": r.get("busy_fraction") or [],
        "dp_sync_time": r.get("dp_sync_time"),
        "details": r.get("details") or "",
        "error": r.get("error") or "",
    }


def to_frame(records: list[dict]) -> pd.DataFrame:
    """One row per run (``combine_repetitions``), in the order they were recorded; ``column`` names its
    system and layout, ``code`` its commit where the records come from more than one (else '')."""
    df = pd.DataFrame(combine_repetitions([_row(i, r) for i, r in enumerate(records)]))
    if df.empty:
        return df
    df = df.sort_values("timestamp", kind="stable").reset_index(drop=True)
    df["column"] = df["system"] + " " + df["layout"]
    df["code"] = df["commit"] if df["commit"].nunique() > 1 else ""
    return df


def combine_repetitions(rows: list[dict]) -> list[dict]:
    """One row per run (identity key) from its records, its repetitions: where any is ok, the newest ok
    one's fields with the step time, tokens/s and MFU the medians over the ok ones, ``estimate`` their
    interval (``contract.estimate``), ``runs`` how many were ok and ``failed_runs`` how many were not,
    oversubscribed if any of them was; else the newest record (a failure), as it is."""
    by_key: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["timestamp"]):
        by_key.setdefault(row["key"], []).append(row)
    out = []
    for same in by_key.values():
        ok = [r for r in same if r["status"] == "ok" and r["median_step_time"] is not None]
        if not ok:
            out.append({**same[-1], "estimate": None, "runs": 0, "failed_runs": len(same), "launches": [],
                        "measured": (same[-1]["measured"],) * 2})
            continue
        est = estimate([r["median_step_time"] for r in ok])
        row = {**ok[-1], "estimate": est, "median_step_time": est.median, "runs": len(ok),
               "launches": [(r["launched"], r["median_step_time"]) for r in ok],
               "measured": (min(r["measured"] for r in ok), max(r["measured"] for r in ok)),
               "failed_runs": len(same) - len(ok),
               "oversubscribed": next((r["oversubscribed"] for r in ok if r["oversubscribed"]), None)}
        for name in ("tokens_per_s", "mfu"):
            values = [r[name] for r in ok if r[name] is not None]
            row[name] = statistics.median(values) if values else None
        out.append(row)
    return out
