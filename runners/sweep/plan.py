"""Planning a sweep: a sweep file (TOML) expanded into run commands, each judged before anything runs.

A sweep file (see sweeps/*.toml)::

    name = "local"
    repeats = 3                    # launches of every run (default 1), interleaved round-robin per experiment
    [fixed]                        # settings of every run: a run's table (runners.request), snake_case
    model = "tiny"                 #   (model, seq_length, batch_size, steps, warmup, precision,
    batch_size = 4                 #    recompute, timeout, ...); booleans are switches
    [[experiment]]                 # each experiment is its own cross-product
    name = "network"
    networks = ["default", "d10-1g"]          # network profiles (default ["none"])
    layouts = ["P-2", "P-2 D-2"]              # seed notation T-/P-/D-, or {pp = 2, dp = 2}
    micro_batch_sizes = [1]                   # (default: fixed micro_batch_size)
    steps = 4                                 # any other key overrides [fixed] for this experiment
    [[experiment.systems]]
    name = "ours"                             # + the system's own options; a list is one more axis
    n_slices = 4
    dp_mode = "central_ps"
    layouts = ["P-2 D-2"]                     # optional per-system layouts / micro_batch_sizes
    batch_size = 2                            # optional: a setting of this system's runs (one value), over
                                              #   the experiment's

Every run is an argument list (never a shell string) for ``python -m runners.run``, judged with the
run command's own parser and validation (and, for a sweep run on this machine, whether its ranks fit
it): a bad combination (an unknown system, an option given to a system that does not declare it, an
option that would do nothing in a layout, a matrix of another size than the run's ranks, a layout
this machine cannot hold) makes the whole sweep file bad, as an unknown key does.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from contract import ConfigError
from contract.cli import toml_value
from network_emulation.profiles import ProfileError, parse_profile
from contract.registry import get_system
from runners.request import (ALIASES, OPTION_PREFIX, PLACEMENT_FLAGS, build_parser, check_fits_here, config_from_args,
                             judge, same_file, setting_flags, table_keys)

REPO = Path(__file__).resolve().parents[2]
SWEEPS_DIR = REPO / "sweeps"
# Flags a sweep controls itself: through its axes, or per run (out file, multi-node placement).
AXIS_FLAGS = {"system": "systems", "pp": "layouts", "tp": "layouts", "dp": "layouts",
              "micro_batch_size": "micro_batch_sizes", "network": "networks"}
EXPERIMENT_KEYS = frozenset({"name", "description", "systems", "layouts", "micro_batch_sizes", "networks",
                             "nproc_per_node"})
SYSTEM_KEYS = frozenset({"name", "layouts", "micro_batch_sizes"})  # the rest of a system table: options


class SweepError(ValueError):
    """A sweep file, hostfile or sweep request that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class PlannedRun:
    experiment: str
    system: str
    args: tuple[str, ...]  # run-command flags, without the interpreter, --out and placement flags
    network: str = "none"
    key: str | None = None  # the run's identity (None for an invalid combination)
    error: str | None = None  # why the combination is invalid
    world: int = 1  # processes the run needs
    device: str = "auto"  # the run's --device (what hardware it gets is judged where it runs)
    devices_per_process: int = 1  # devices each process uses (fairscale: its pipe's devices)
    timeout: float = 3600.0  # the run's own --timeout
    nproc_per_node: int | None = None  # placement hint from the sweep file (cluster mode)
    repetition: int = 1  # which launch of the run this is (1..the sweep's repeats), each its own record

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def emulated(self) -> bool:
        return self.network != "none"

    @property
    def devices(self) -> int:
        return self.world * self.devices_per_process

    def label(self) -> str:
        rep = f" (repetition {self.repetition})" if self.repetition > 1 else ""
        return f"[{self.experiment}] " + shlex.join(self.args) + rep

    def command(self, out: str | os.PathLike, python: str = sys.executable) -> list[str]:
        return [python, "-m", "runners.run", *self.args, "--out", str(out)]


def _parser_flags() -> dict[str, argparse.Action]:
    """Sweep-file key (a key of a run's table, or one the sweep sets) -> the run command's action."""
    return {k: a for k, a in table_keys(build_parser()).items() if k not in AXIS_FLAGS and k not in PLACEMENT_FLAGS}


def plan_run(args: Sequence[str], experiment: str, network: str, nproc_per_node: int | None = None,
             here: bool = False) -> PlannedRun:
    """One run's flags, judged by the run command's own parser and validation; ``here``: also whether
    its ranks fit this machine (``check_fits_here``), for a sweep run on it."""
    system = args[args.index("--system") + 1] if "--system" in args[:-1] else "?"
    base = dict(experiment=experiment, system=system, args=tuple(args), network=network,
                nproc_per_node=nproc_per_node)
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args([*args, "--out", os.devnull])
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        return PlannedRun(**base, error=(msg[-1] if msg else "bad arguments").removeprefix(f"{parser.prog}: error: "))
    spec = get_system(ns.system)
    try:
        cfg = config_from_args(ns, spec)
        judge(cfg, spec)
        if here:
            check_fits_here(cfg, spec)
    except ConfigError as e:
        return PlannedRun(**base, error=str(e))
    return PlannedRun(**base, key=cfg.key(), world=spec.processes(cfg),
                      devices_per_process=spec.devices_per_process(cfg),
                      timeout=cfg.timeout, device=cfg.device)


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
    """One sweep-file setting as run-command flags: a key of a run's table (``runners.request``)
    that is not one of the sweep's axes nor set by the sweep itself."""
    dest = ALIASES.get(key, key)
    if dest in AXIS_FLAGS:
        raise SweepError(f"{where}: {key!r} is set through the {AXIS_FLAGS[dest]!r} list, not as a setting")
    if dest in PLACEMENT_FLAGS:
        raise SweepError(f"{where}: {key!r} is set by the sweep itself (--out, --hostfile), not in a sweep file")
    try:
        return setting_flags(key, value, flags, where)
    except ConfigError as exc:
        raise SweepError(str(exc)) from None


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
    repeats: int = 1  # launches of every run, each its own record (``runners.sweep.execute.repetitions``)

    @property
    def valid_runs(self) -> list[PlannedRun]:
        return [r for r in self.runs if r.valid]

    @property
    def invalid_runs(self) -> list[PlannedRun]:
        return [r for r in self.runs if not r.valid]


def expand_experiment(exp: dict, fixed: dict, flags: dict, where: str, here: bool = False) -> list[PlannedRun]:
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
    axes = sorted(k for k, v in settings.items() if isinstance(v, list))  # a list is one more axis
    for k in axes:
        _list(settings[k], k, where)
    runs: list[PlannedRun] = []
    for combo in itertools.product(*(settings[k] for k in axes)):
        runs += _expand_systems(exp, {**settings, **dict(zip(axes, combo))}, flags, where, name, here)
    return runs


MODEL_KEYS = ("model", "num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size")


def _setting_flags(settings: dict, flags: dict, where: str) -> tuple[list[str], list[str]]:
    """Settings as run-command flags: (the model's, the rest)."""
    ordered = sorted(settings, key=lambda k: (MODEL_KEYS.index(k) if k in MODEL_KEYS else len(MODEL_KEYS), ))
    return ([a for k in ordered if k in MODEL_KEYS for a in setting_args(k, settings[k], flags, where)],
            [a for k in ordered if k not in MODEL_KEYS for a in setting_args(k, settings[k], flags, where)])


def _run_setting_keys() -> frozenset[str]:
    """The run command's own settings (not a system's options), by their sweep-file keys."""
    return frozenset(a.dest for a in build_parser()._actions
                     if a.option_strings and not a.dest.startswith(OPTION_PREFIX))


def _expand_systems(exp: dict, settings: dict, flags: dict, where: str, name: str, here: bool) -> list[PlannedRun]:
    """One experiment's systems x options x layouts x micro-batch sizes x networks, at fixed settings
    (a system's table may set some of them for its own runs)."""
    run_keys = _run_setting_keys()

    systems = _list(exp.get("systems"), "systems", where)
    default_layouts = [parse_layout(l, where) for l in _list(exp.get("layouts", ["1"]), "layouts", where)]
    default_mbs = (_list(exp.get("micro_batch_sizes"), "micro_batch_sizes", where, int)
                   if "micro_batch_sizes" in exp else None)
    networks = _list(exp.get("networks", ["none"]), "networks", where, str)
    nproc = exp.get("nproc_per_node")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise SweepError(f"{where}: 'nproc_per_node' must be a positive integer, got {nproc!r}")
    for net in networks:
        if net.startswith("-"):
            raise SweepError(f"{where}: network {net!r} looks like a flag")
        if net != "none":
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
            mbs = (_list(s["micro_batch_sizes"], "micro_batch_sizes", swhere, int)
                   if "micro_batch_sizes" in s else default_mbs)
            if mbs is None:
                raise SweepError(f"{where}: no 'micro_batch_sizes' (nor a fixed 'micro_batch_size')")
            own = {k: v for k, v in s.items() if k not in SYSTEM_KEYS and ALIASES.get(k, k) in run_keys}
            for k, v in own.items():
                if isinstance(v, list):
                    raise SweepError(f"{swhere}: {k!r} is a setting of the system's runs: one value, not a list")
            base_model, base_rest = _setting_flags({**settings, **own}, flags, swhere)
            options = {k: v for k, v in s.items() if k not in SYSTEM_KEYS and k not in own}
            for k, v in options.items():
                if isinstance(v, list):
                    _list(v, k, swhere)
            opt_names = sorted(options)
            opt_values = [v if isinstance(v, list) else [v] for v in (options[k] for k in opt_names)]
            for combo in itertools.product(*opt_values):
                opt_args = [a for k, v in zip(opt_names, combo) for a in setting_args(k, v, flags, swhere)]
                for lay in layouts:
                    for mb in mbs:
                        args = ["--system", s["name"], *base_model, "--pp", str(lay["pp"]), "--tp", str(lay["tp"]),
                                "--dp", str(lay["dp"]), *_batch_first(base_rest),
                                "--micro-batch-size", str(mb), *opt_args, "--network", net]
                        runs.append(plan_run(args, name, net, nproc, here))
    return runs


def _batch_first(rest: list[str]) -> list[str]:
    """--batch-size first among the remaining settings, for readable commands."""
    if "--batch-size" in rest:
        i = rest.index("--batch-size")
        return rest[i:i + 2] + rest[:i] + rest[i + 2:]
    return rest


def sweep_path(path: str | os.PathLike) -> Path:
    """The sweep file a path names: as given, else (relative, and not here) in ``SWEEPS_DIR``."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (SWEEPS_DIR / p).exists():
        p = SWEEPS_DIR / p
    return p


def check_out(out: str | os.PathLike, inputs: Sequence[tuple[str, str | os.PathLike | None]]) -> None:
    """SweepError if the records file ``out`` is one of the sweep's ``inputs`` ((what, path): the sweep
    file, the hostfile, ...): the records would be appended to it."""
    for what, path in inputs:
        if path is not None and Path(path).exists() and same_file(out, path):
            raise SweepError(f"--out {out} is the {what}: the records would be appended to it (give another --out)")


def fixed_settings(pairs: Sequence[str]) -> dict:
    """``KEY=VALUE`` pairs (``--set``) as [fixed] settings: the value read as TOML (a number, a quoted
    string, a boolean), else as a bare string."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip()] = toml_value(value)
    return out


def load_sweep(path: str | os.PathLike, transform: Callable[[dict], dict] | None = None, here: bool = False) -> Sweep:
    """Read and expand a sweep file; a malformed one, or one with a bad combination, raises SweepError
    with a clear message. ``transform`` rewrites the file's contents before they are planned (e.g.
    ``scale.scale_down``); ``here``: the sweep runs on this machine (its runs must fit it)."""
    p = sweep_path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SweepError(f"no such sweep file: {path}") from None
    except OSError as e:
        raise SweepError(f"cannot read sweep file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{p}: invalid TOML: {e}") from None
    return sweep_from_dict(transform(data) if transform else data, where=p.name, here=here)


def sweep_from_dict(data: dict, where: str = "sweep", here: bool = False) -> Sweep:
    name = data.get("name", Path(where).stem)
    fixed = data.get("fixed", {})
    if not isinstance(fixed, dict):
        raise SweepError(f"{where}: [fixed] must be a table")
    flags = _parser_flags()
    if "experiment" in data:
        top = set(data) - {"name", "description", "fixed", "experiment", "repeats"}
        if top:
            raise SweepError(f"{where}: unexpected top-level key(s) {', '.join(sorted(top))}: "
                             "put them in [fixed] or in an [[experiment]]")
        experiments = data["experiment"]
        if not isinstance(experiments, list) or not all(isinstance(e, dict) for e in experiments):
            raise SweepError(f"{where}: 'experiment' must be [[experiment]] tables")
    else:  # the file itself is one experiment
        experiments = [{k: v for k, v in data.items() if k not in ("fixed", "description", "repeats")}
                       | {"name": name}]
    repeats = check_repeats(data.get("repeats", 1), where)
    runs = []
    for i, exp in enumerate(experiments):
        runs += expand_experiment(exp, fixed, flags, f"{where} experiment {exp.get('name', i + 1)!r}", here)
    return refuse_bad_combinations(Sweep(str(name), runs, str(data.get("description", "")), repeats), where)


def check_repeats(value, where: str) -> int:
    """A sweep's ``repeats`` (or ``--repeats``): a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SweepError(f"{where}: 'repeats' must be a positive integer (launches of every run), got {value!r}")
    return value


def refuse_bad_combinations(sweep: Sweep, where: str) -> Sweep:
    """The sweep, if every run in it can run and each is planned once; else SweepError naming the first
    bad one and why (a run planned twice, by two identical experiments say, would be launched once and
    its second plan reported as recorded: ``repeats`` is how a run is launched again)."""
    bad = sweep.invalid_runs
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise SweepError(f"{where}: bad combination{more}: {bad[0].label()}: {bad[0].error}")
    first: dict[str, PlannedRun] = {}
    for run in sweep.runs:
        if run.key in first:
            twice = (f"in experiment {run.experiment!r}" if first[run.key].experiment == run.experiment
                     else f"in experiments {first[run.key].experiment!r} and {run.experiment!r}")
            raise SweepError(f"{where}: the same run planned twice {twice}: {run.label()} (plan it once; 'repeats' "
                             "launches it again)")
        first[run.key] = run
    return sweep


def adhoc_sweep(run_args: Sequence[str], networks: Sequence[str], name: str = "netem_sweep",
                here: bool = False) -> Sweep:
    """One job's flags across network profiles (netem_sweep.sh); ``here`` as ``load_sweep``'s."""
    for a in run_args:
        flag = a.split("=", 1)[0]
        if flag in ("--network", "--out", "--nnodes", "--node-rank", "--rdzv-endpoint"):
            raise SweepError(f"{flag} is set by the sweep; leave it out of the run arguments")
    if not networks:
        raise SweepError("no network profiles given")
    return refuse_bad_combinations(Sweep(name, [plan_run([*run_args, "--network", net], "netem", net, here=here)
                                                for net in networks]), "--networks")
