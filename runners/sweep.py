"""Sweeps: a data file (TOML) expanded into run commands, run one after another.

    python -m runners.sweep SWEEP_FILE [--out results/NAME.jsonl] [--dry-run] [--only SYSTEM]
                                       [--hostfile FILE [--iface IFACE] [--nproc-per-node N] ...]
    python -m runners.sweep --networks PROFILE... [--out FILE] [--dry-run] -- RUN_ARGS...   (netem_sweep.sh)

A sweep file (see runners/sweeps/*.toml)::

    name = "local"
    [fixed]                        # settings of every run: any flag of the run command, snake_case
    model = "tiny"                 #   (model, seq_length, batch_size, steps, warmup, mixed_precision,
    batch_size = 4                 #    recompute, timeout, ...); booleans are switches
    [[experiment]]                 # each experiment is its own cross-product
    name = "network"
    networks = ["default", "d10-1g"]          # network profiles (default ["none"])
    layouts = ["P-2", "P-2 D-2"]              # seed notation T-/P-/D-, or {pp = 2, dp = 2}
    micro_batch_sizes = [1]                   # (default: fixed micro_batch_size)
    steps = 4                                 # any other key overrides [fixed] for this experiment
    [[experiment.systems]]
    name = "ours"                             # + system options; a list is one more axis
    n_slices = 4
    dp_mode = "central_ps"
    layouts = ["P-2"]                         # optional per-system layouts / micro_batch_sizes

Every run is an argument list (never a shell string) for ``python -m runners.run``; it is judged
with the run command's own parser and validation before the sweep starts: a bad combination is
reported and skipped. Runs whose configuration is already recorded in the out file are skipped
(the record's ``config`` against the run's RunConfig, volatile fields removed). A failed run is
recorded by the run command and the sweep goes on. Before the runs, each emulated network profile
is probed once; afterwards, a one-line summary and the report (``report.py``, written next to the
out file as .md).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runners.record import config_key as canonical_key  # one definition, shared with report.py

REPO = Path(__file__).resolve().parent.parent
SWEEPS_DIR = REPO / "runners" / "sweeps"
# Flags a sweep controls itself: through its axes, or per run (out file, multi-node placement).
AXIS_FLAGS = {"system": "systems", "pp": "layouts", "tp": "layouts", "dp": "layouts",
              "micro_batch_size": "micro_batch_sizes", "network": "networks"}
PLACEMENT_FLAGS = frozenset({"out", "nnodes", "node_rank", "rdzv_endpoint"})
EXPERIMENT_KEYS = frozenset({"name", "description", "systems", "layouts", "micro_batch_sizes", "networks",
                             "nproc_per_node"})
SYSTEM_KEYS = frozenset({"name", "layouts", "micro_batch_sizes"})  # the rest of a system table: options
SAFETY_MARGIN_S = 300.0  # beyond a run's own --timeout before the sweep stops it


class SweepError(ValueError):
    """A sweep file (or sweep request) that cannot be used; the message is for the user."""


# ----------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class PlannedRun:
    experiment: str
    system: str
    args: tuple[str, ...]  # run-command flags, without the interpreter, --out and placement flags
    network: str = "none"
    key: str | None = None  # canonical configuration (None for an invalid combination)
    error: str | None = None  # why the combination is invalid
    world: int = 1  # processes the run needs
    nproc_per_node: int | None = None  # placement hint from the sweep file (cluster mode)

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def emulated(self) -> bool:
        return self.network != "none"

    def label(self) -> str:
        return f"[{self.experiment}] " + shlex.join(self.args)

    def command(self, out: str | os.PathLike, python: str = sys.executable) -> list[str]:
        return [python, "-m", "runners.run", *self.args, "--out", str(out)]




def _parser_flags() -> dict[str, argparse.Action]:
    from runners.config import build_parser

    return {a.dest: a for a in build_parser()._actions if a.option_strings}


def judge(args: Sequence[str]) -> tuple[str | None, str | None, int]:
    """(key, error, world) of one run's flags, judged by the run command's parser and validation."""
    from runners.config import ConfigError, build_parser, config_from_args, validate
    from runners.registry import get_system

    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args([*args, "--out", os.devnull])
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        return None, (msg[-1] if msg else "bad arguments").removeprefix(f"{parser.prog}: error: "), 1
    try:
        cfg = config_from_args(ns)
        validate(cfg)
    except (ConfigError, KeyError) as e:
        return None, str(e).strip("'\""), 1
    return canonical_key(cfg.to_dict()), None, get_system(cfg.system).processes(cfg)


_LAYOUT_TOKEN = re.compile(r"^([TPD])-?(\d+)$", re.IGNORECASE)


def parse_layout(value, where: str) -> dict[str, int]:
    """'T-4 P-2' (the seed's notation; also 'P-12 D-4', '1' for one device) or {pp = 2, tp = 1, dp = 1}."""
    if isinstance(value, dict):
        bad = set(value) - {"pp", "tp", "dp"}
        if bad or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
            raise SweepError(f"{where}: layout {value!r} must have integer pp/tp/dp only")
        return {"pp": value.get("pp", 1), "tp": value.get("tp", 1), "dp": value.get("dp", 1)}
    if not isinstance(value, str):
        raise SweepError(f"{where}: layout {value!r} must be a string like 'T-4 P-2' or a table {{pp = 2}}")
    out = {"pp": 1, "tp": 1, "dp": 1}
    if value.strip() in ("1", "single", "1 device"):
        return out
    seen = set()
    for tok in value.split():
        m = _LAYOUT_TOKEN.match(tok)
        if not m or m.group(1).upper() in seen:
            raise SweepError(f"{where}: cannot read layout {value!r}: expected e.g. 'T-4 P-2', 'P-12 D-4' or '1'")
        seen.add(m.group(1).upper())
        out[{"T": "tp", "P": "pp", "D": "dp"}[m.group(1).upper()]] = int(m.group(2))
    if not seen:
        raise SweepError(f"{where}: empty layout")
    return out


def setting_args(key: str, value, flags: dict[str, argparse.Action], where: str) -> list[str]:
    """One sweep-file setting as run-command flags (checked against the run command's parser)."""
    dest = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "seq_length": "seq_len"}.get(key, key)
    if dest in AXIS_FLAGS:
        raise SweepError(f"{where}: {key!r} is set through the {AXIS_FLAGS[dest]!r} list, not as a setting")
    if dest in PLACEMENT_FLAGS:
        raise SweepError(f"{where}: {key!r} is set by the sweep itself (--out, --hostfile), not in a sweep file")
    action = flags.get(dest)
    if action is None:
        known = sorted(k for k in flags if k not in AXIS_FLAGS and k not in PLACEMENT_FLAGS and k != "help")
        raise SweepError(f"{where}: unknown setting {key!r}; known: {', '.join(known)}")
    flag = max(action.option_strings, key=lambda s: s == "--" + key.replace("_", "-"))
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise SweepError(f"{where}: {key!r} is a switch: true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SweepError(f"{where}: {key!r} must be a string or a number, got {value!r}")
    if isinstance(value, str) and value.startswith("-"):
        raise SweepError(f"{where}: {key!r} = {value!r} looks like a flag")
    return [flag, str(value)]


def _list(value, what: str, where: str, kind=None) -> list:
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: {what!r} must be a non-empty list, got {value!r}")
    if kind is not None:
        for v in value:
            if not isinstance(v, kind) or isinstance(v, bool):
                raise SweepError(f"{where}: {what!r} holds {v!r}, expected {kind.__name__}")
    return value


@dataclass
class Sweep:
    name: str
    runs: list[PlannedRun] = field(default_factory=list)
    description: str = ""

    @property
    def valid_runs(self) -> list[PlannedRun]:
        return [r for r in self.runs if r.valid]

    @property
    def invalid_runs(self) -> list[PlannedRun]:
        return [r for r in self.runs if not r.valid]


def expand_experiment(exp: dict, fixed: dict, flags: dict, where: str) -> list[PlannedRun]:
    name = str(exp.get("name", where))
    settings = {**fixed, **{k: v for k, v in exp.items() if k not in EXPERIMENT_KEYS}}
    if "micro_batch_size" in settings:  # a scalar default for the axis
        mb = settings.pop("micro_batch_size")
        exp = {"micro_batch_sizes": [mb], **exp}
    if "network" in settings:
        net = settings.pop("network")
        exp = {"networks": [net], **exp}
    if "model" not in settings:
        raise SweepError(f"{where}: no 'model' (set it in [fixed] or in the experiment)")
    if "batch_size" not in settings:
        raise SweepError(f"{where}: no 'batch_size' (set it in [fixed] or in the experiment)")
    model_keys = ("model", "num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size")
    ordered = sorted(settings, key=lambda k: (model_keys.index(k) if k in model_keys else len(model_keys), ))
    base_model = [a for k in ordered if k in model_keys for a in setting_args(k, settings[k], flags, where)]
    base_rest = [a for k in ordered if k not in model_keys for a in setting_args(k, settings[k], flags, where)]

    systems = _list(exp.get("systems"), "systems", where)
    default_layouts = [parse_layout(l, where) for l in _list(exp.get("layouts", ["1"]), "layouts", where)]
    default_mbs = _list(exp.get("micro_batch_sizes"), "micro_batch_sizes", where, int) if "micro_batch_sizes" in exp else None
    networks = _list(exp.get("networks", ["none"]), "networks", where, str)
    nproc = exp.get("nproc_per_node")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise SweepError(f"{where}: 'nproc_per_node' must be a positive integer, got {nproc!r}")
    for net in networks:
        if net.startswith("-"):
            raise SweepError(f"{where}: network {net!r} looks like a flag")
        if net != "none":
            try:
                from network_emulation.profiles import ProfileError, parse_profile
            except ImportError:  # pragma: no cover
                continue
            try:
                parse_profile(net)
            except ProfileError as e:
                raise SweepError(f"{where}: network {net!r}: {e}") from None

    runs: list[PlannedRun] = []
    for net in networks:
        for i, s in enumerate(systems):
            swhere = f"{where} system {i + 1}"
            if isinstance(s, str):
                s = {"name": s}
            if not isinstance(s, dict) or not isinstance(s.get("name"), str):
                raise SweepError(f"{swhere}: a system is a name or a table with 'name' and options, got {s!r}")
            layouts = ([parse_layout(l, swhere) for l in _list(s["layouts"], "layouts", swhere)]
                       if "layouts" in s else default_layouts)
            mbs = _list(s["micro_batch_sizes"], "micro_batch_sizes", swhere, int) if "micro_batch_sizes" in s else default_mbs
            if mbs is None:
                raise SweepError(f"{where}: no 'micro_batch_sizes' (nor a fixed 'micro_batch_size')")
            options = {k: v for k, v in s.items() if k not in SYSTEM_KEYS}
            opt_names = sorted(options)
            opt_values = [v if isinstance(v, list) else [v] for v in (options[k] for k in opt_names)]
            for combo in itertools.product(*opt_values):
                opt_args = [a for k, v in zip(opt_names, combo) for a in setting_args(k, v, flags, swhere)]
                for lay in layouts:
                    for mb in mbs:
                        args = ["--system", s["name"], *base_model, "--pp", str(lay["pp"]), "--tp", str(lay["tp"]),
                                "--dp", str(lay["dp"]), *_batch_first(base_rest),
                                "--micro-batch-size", str(mb), *opt_args, "--network", net]
                        key, error, world = judge(args)
                        runs.append(PlannedRun(name, s["name"], tuple(args), net, key, error, world, nproc))
    return runs


def _batch_first(rest: list[str]) -> list[str]:
    """--batch-size first among the remaining settings, for readable commands."""
    if "--batch-size" in rest:
        i = rest.index("--batch-size")
        return rest[i:i + 2] + rest[:i] + rest[i + 2:]
    return rest


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and expand a sweep file; a malformed one raises SweepError with a clear message."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (SWEEPS_DIR / p).exists():
        p = SWEEPS_DIR / p
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SweepError(f"no such sweep file: {path}") from None
    except OSError as e:
        raise SweepError(f"cannot read sweep file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{p}: invalid TOML: {e}") from None
    return sweep_from_dict(data, where=p.name)


def sweep_from_dict(data: dict, where: str = "sweep") -> Sweep:
    name = data.get("name", Path(where).stem)
    fixed = data.get("fixed", {})
    if not isinstance(fixed, dict):
        raise SweepError(f"{where}: [fixed] must be a table")
    flags = _parser_flags()
    if "experiment" in data:
        top = set(data) - {"name", "description", "fixed", "experiment"}
        if top:
            raise SweepError(f"{where}: unexpected top-level key(s) {', '.join(sorted(top))}: "
                             "put them in [fixed] or in an [[experiment]]")
        experiments = data["experiment"]
        if not isinstance(experiments, list) or not all(isinstance(e, dict) for e in experiments):
            raise SweepError(f"{where}: 'experiment' must be [[experiment]] tables")
    else:  # the file itself is one experiment
        experiments = [{k: v for k, v in data.items() if k not in ("fixed", "description")} | {"name": name}]
    runs = []
    for i, exp in enumerate(experiments):
        runs += expand_experiment(exp, fixed, flags, f"{where} experiment {exp.get('name', i + 1)!r}")
    return Sweep(str(name), runs, str(data.get("description", "")))


def adhoc_sweep(run_args: Sequence[str], networks: Sequence[str], name: str = "netem_sweep") -> Sweep:
    """One job's flags across network profiles (netem_sweep.sh)."""
    for a in run_args:
        flag = a.split("=", 1)[0]
        if flag in ("--network", "--out", "--nnodes", "--node-rank", "--rdzv-endpoint"):
            raise SweepError(f"{flag} is set by the sweep; leave it out of the run arguments")
    if not networks:
        raise SweepError("no network profiles given")
    runs = []
    system = run_args[run_args.index("--system") + 1] if "--system" in run_args[:-1] else "?"
    for net in networks:
        args = [*run_args, "--network", net]
        key, error, world = judge(args)
        runs.append(PlannedRun("netem", system, tuple(args), net, key, error, world))
    return Sweep(name, runs)


# ----------------------------------------------------------------------------------- running


def recorded_keys(out: str | os.PathLike, retry_failed: bool = False) -> set[str]:
    """The configurations already recorded in ``out`` (only the ok ones with retry_failed)."""
    p = Path(out)
    keys: set[str] = set()
    if not p.exists():
        return keys
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
            continue
        if retry_failed and rec.get("status") != "ok":
            continue
        keys.add(canonical_key(rec["config"]))
    return keys


def is_root() -> bool:
    return os.geteuid() == 0


def probe_lines(networks: Iterable[str], python: str = sys.executable) -> list[str]:
    """Run the probe once per emulated profile; its one-line measurement (or why it could not)."""
    lines = []
    for net in dict.fromkeys(networks):
        if net == "none":
            continue
        p = subprocess.run([python, "-m", "network_emulation", "probe", "--profile", net, "--samples", "10"],
                           cwd=REPO, capture_output=True, text=True)
        text = (p.stdout.strip() or p.stderr.strip() or f"exit status {p.returncode}").splitlines()
        lines.append(f"probe {net}: " + (text[-1] if p.returncode == 0 else f"unavailable ({text[-1]})"))
    return lines


def _fmt_elapsed(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


class LocalExecutor:
    """Runs one planned run on this machine through the run command (subprocess, argument list)."""

    def __init__(self, python: str = sys.executable, log=None):
        self.python, self.log = python, log

    def __call__(self, run: PlannedRun, out: Path) -> tuple[int, str]:
        cfg_timeout = _timeout_of(run.args)
        global _current_child
        proc = subprocess.Popen(run.command(out, self.python), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        _current_child = proc
        try:
            return _follow(proc, self.log, cfg_timeout + SAFETY_MARGIN_S)
        finally:
            _current_child = None


_current_child: subprocess.Popen | None = None


def _on_sigterm(signum, frame):
    """SIGTERM (or SIGHUP) stops the sweep like Ctrl-C: the running run command is interrupted, so
    that it stops its ranks, and the sweep ends with its summary."""
    child = _current_child
    if child is not None and child.poll() is None:
        child.send_signal(signal.SIGINT)
    raise KeyboardInterrupt


def _timeout_of(args: Sequence[str]) -> float:
    from runners.config import build_parser

    return build_parser().parse_args([*args, "--out", os.devnull]).timeout


def _follow(proc: subprocess.Popen, log, limit_s: float) -> tuple[int, str]:
    """Copy the run's output to the log; return (exit status, last lines). Past the safety limit,
    interrupt it (the run command stops its ranks on Ctrl-C) and then kill it."""
    import threading

    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            del lines[:-40]
            if log:
                log.write(line)
                log.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines.append(f"sweep: stopped after {limit_s:g} s\n")
    except KeyboardInterrupt:
        try:  # the run command got the same Ctrl-C: let it stop its ranks
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    t.join(timeout=5)
    return proc.returncode, "".join(lines)


@dataclass
class Outcome:
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already recorded
    invalid: int = 0  # bad combinations (judged before, or exit status 2)
    not_run: int = 0  # emulated runs without root, or --only
    failures: list[str] = field(default_factory=list)

    def line(self, name: str, elapsed: float) -> str:
        extra = f", {self.invalid} invalid" if self.invalid else ""
        extra += f", {self.not_run} not run" if self.not_run else ""
        return (f"sweep {name}: {self.ok} ok / {self.failed} failed / {self.skipped} skipped (already recorded)"
                f"{extra} in {_fmt_elapsed(elapsed)}")


def select_runs(sweep: Sweep, only: Sequence[str] = ()) -> list[PlannedRun]:
    return [r for r in sweep.runs if not only or r.system in only]


def run_sweep(sweep: Sweep, out: Path, *, executor=None, only: Sequence[str] = (), dry_run: bool = False,
              retry_failed: bool = False, need_root_for_network: bool = True, probe: bool = True,
              report: bool = True, plots: str | None = None, python: str = sys.executable,
              stream=sys.stdout) -> Outcome:
    """Run (or with dry_run print) the sweep's runs; returns the counts."""
    t0 = time.monotonic()
    outcome = Outcome()
    planned = select_runs(sweep, only)
    outcome.not_run += len(sweep.runs) - len(planned)

    def say(msg: str) -> None:
        print(msg, file=stream, flush=True)

    for r in planned:
        if not r.valid:
            say(f"skip (bad combination): {r.label()}\n    {r.error}")
            outcome.invalid += 1
    planned = [r for r in planned if r.valid]
    done = recorded_keys(out, retry_failed) if out else set()
    todo: list[PlannedRun] = []
    seen: set[str] = set()
    for r in planned:
        if r.key in done or r.key in seen:
            outcome.skipped += 1
            continue
        seen.add(r.key)
        todo.append(r)
    if need_root_for_network and not is_root():
        emulated = [r for r in todo if r.emulated]
        if emulated:
            say(f"NOTE: {len(emulated)} run(s) under an emulated network need root (network namespaces, tc); "
                f"not root, so they are skipped: {', '.join(sorted({r.network for r in emulated}))}")
            outcome.not_run += len(emulated)
            todo = [r for r in todo if not r.emulated]
    say(f"sweep {sweep.name}: {len(sweep.runs)} planned, {len(todo)} to run, {outcome.skipped} already recorded "
        f"in {out}" + (f", {outcome.invalid} invalid" if outcome.invalid else ""))
    if dry_run:
        for r in todo:
            say(shlex.join(r.command(out, python)))
        return outcome
    if probe and not executor_is_cluster(executor):
        for line in probe_lines((r.network for r in todo if r.emulated), python):
            say(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(str(out) + ".log") if out else Path(os.devnull)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    interrupted = False
    with open(log_path, "a") as log:
        execute = executor or LocalExecutor(python, log)
        if hasattr(execute, "log") and execute.log is None:
            execute.log = log
        bar = tqdm(total=len(todo), desc=f"sweep {sweep.name}", unit="run", file=sys.stderr, dynamic_ncols=True,
                   bar_format="{desc}: {n_fmt}/{total_fmt} runs |{bar}| elapsed {elapsed}, left ~{remaining}{postfix}")
        try:
            for r in todo:
                bar.set_postfix_str(f"{r.system} {r.network}", refresh=True)
                log.write(f"\n=== {shlex.join(r.command(out, python))}\n")
                log.flush()
                rc, tail = execute(r, out)
                last = [l for l in tail.splitlines() if l.strip()]
                if rc == 0:
                    outcome.ok += 1
                    bar.write(f"ok     {r.label()}\n       {last[-1] if last else ''}", file=stream)
                elif rc == 2:
                    outcome.invalid += 1
                    bar.write(f"bad    {r.label()}\n       {last[-1] if last else 'exit status 2'}", file=stream)
                else:
                    outcome.failed += 1
                    outcome.failures.append(r.label())
                    why = last[-1] if last else f"exit status {rc}"
                    bar.write(f"FAILED {r.label()}\n       {why[:300]}", file=stream)
                bar.update(1)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
    say(outcome.line(sweep.name, time.monotonic() - t0) + (" (interrupted)" if interrupted else ""))
    if report and out and Path(out).exists():
        md = Path(out).with_suffix(".md")
        argv = [python, str(REPO / "report.py"), str(out), "--out", str(md)]
        if plots:
            argv += ["--plots", plots]
        subprocess.run(argv, cwd=REPO)
        say(f"report: {md}")
    if interrupted:
        raise KeyboardInterrupt
    return outcome


def executor_is_cluster(executor) -> bool:
    return getattr(executor, "cluster", False)


# ----------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m runners.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", nargs="?", help="a sweep file (TOML), e.g. runners/sweeps/local.toml")
    ap.add_argument("--out", default=None, help="the record file (default results/<sweep name>.jsonl)")
    ap.add_argument("--dry-run", action="store_true", help="print the run commands, run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="SYSTEM", help="only this system (repeatable)")
    ap.add_argument("--retry-failed", action="store_true", help="re-run configurations recorded as failed")
    ap.add_argument("--no-report", action="store_true", help="do not run report.py at the end")
    ap.add_argument("--no-probe", action="store_true", help="do not probe the emulated networks first")
    ap.add_argument("--plots", default=None, help="also write the report's plots into this directory")
    ap.add_argument("--networks", nargs="*", default=None, metavar="PROFILE",
                    help="ad-hoc sweep: the run arguments after -- across these network profiles "
                         "(none given: the five seed profiles)")
    c = ap.add_argument_group("cluster (real hosts over ssh; netem applied on each node)")
    c.add_argument("--hostfile", default=None, help="one host per line, the first is node 0")
    c.add_argument("--iface", default="eth0", help="network interface netem shapes on every node")
    c.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default: as few nodes' worth as fit)")
    c.add_argument("--ssh-user", default=None)
    c.add_argument("--sudo", action="store_true", help="run tc through 'sudo -n' on the nodes")
    c.add_argument("--remote-dir", default=str(REPO), help="the suite's directory on the nodes (default: this one)")
    c.add_argument("--remote-python", default=None, help="python on the nodes (default: this interpreter's path)")
    c.add_argument("--port", type=int, default=29500, help="rendezvous port on node 0")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, run_args = argv[:i], argv[i + 1:]
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.hostfile:  # (cluster mode: NetemSession guards the signals while netem is on)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_sigterm)
    try:
        if args.networks is not None:
            if args.sweep or not run_args:
                raise SweepError("--networks takes the run arguments after --, and no sweep file")
            from network_emulation.profiles import SEED_PROFILES

            sweep = adhoc_sweep(run_args, args.networks or list(SEED_PROFILES))
        else:
            if not args.sweep:
                raise SweepError("give a sweep file (or --networks PROFILE... -- RUN_ARGS)")
            if run_args:
                raise SweepError("run arguments after -- go with --networks only")
            sweep = load_sweep(args.sweep)
        unknown = [s for s in args.only if s not in {r.system for r in sweep.runs}]
        if unknown:
            raise SweepError(f"--only {', '.join(unknown)}: not in this sweep (it has "
                             f"{', '.join(sorted({r.system for r in sweep.runs}))})")
        out = Path(args.out or f"results/{sweep.name}.jsonl")
        if not out.is_absolute():
            out = Path.cwd() / out
        executor = None
        if args.hostfile:
            from runners.cluster import ClusterExecutor, parse_hostfile

            executor = ClusterExecutor(parse_hostfile(args.hostfile), iface=args.iface,
                                       nproc_per_node=args.nproc_per_node, ssh_user=args.ssh_user, sudo=args.sudo,
                                       remote_dir=args.remote_dir, remote_python=args.remote_python or sys.executable,
                                       port=args.port, dry_run=args.dry_run)
            if args.dry_run:
                return executor.print_plan(sweep, select_runs(sweep, args.only), out)
        outcome = run_sweep(sweep, out, executor=executor, only=args.only, dry_run=args.dry_run,
                            retry_failed=args.retry_failed, need_root_for_network=executor is None,
                            probe=not args.no_probe, report=not args.no_report, plots=args.plots)
    except SweepError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep: interrupted", file=sys.stderr)
        return 130
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
