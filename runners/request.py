"""A run request from the command line: the run command's parser, generated from the fields of
``RunConfig`` (with the model's and the optimizer's) and of ``Placement``, and every system's options
under its own heading; the RunConfig it makes; and ``judge``, the one place a request is judged before
anything is launched (ConfigError, one line, names the real flag).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from contract import ConfigError, RunConfig, SystemSpec, option
from contract.cli import Parser, old_names
from contract.config import FAULTS
from contract.registry import get_system, systems
from network_emulation.profiles import MatrixProfile, ProfileError, check_emulable, parse_profile
from network_emulation.traces import load_trace, trace_from
from runners import services
from workload.configs import count_params, get_model_config
from workload.corpus import BUILTIN, split_sizes

OPTION_PREFIX = "option:"  # argparse dest of a system option
MULTI_NODE = "multi-node (passed through to torchrun)"
GROUP_TITLES = {"model": "model overrides (any field of the model config)"}  # a dataclass field's own flags
PROG = "python -m runners.run"  # the run command's name where pipebench does not give its own


class RunParser(Parser):
    """The run command's parser: ``--config FILE.toml`` stands for the flags of FILE's ``[run]`` table
    (``config_file_flags``), given before the command line's own, which override them."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        pre = Parser(prog=self.prog, add_help=False)
        pre.add_argument("--config", default=None)
        path = pre.parse_known_args(args)[0].config
        if path is not None:
            try:
                args = config_file_flags(path, table_keys(self)) + args
            except ConfigError as exc:
                self.error(f"--config {path}: {exc}")
        return super().parse_known_args(args, namespace)


class _TableParser(RunParser):
    def error(self, message: str):  # a table's parse error is the caller's to say, naming the table
        raise ConfigError(message)


@dataclass(frozen=True)
class Placement:
    """Where this invocation's ranks run: one node, or one node of a multi-node rendezvous."""

    nnodes: int = option(1, "nodes of the run", group=MULTI_NODE)
    node_rank: int = option(0, "this node's index (node 0 writes the record)", group=MULTI_NODE)
    rdzv_endpoint: str | None = option(None, "HOST:PORT of node 0", group=MULTI_NODE)


def _parse_with(parse, flag: str):
    """An argparse type that turns the option's own parse errors into one-line argparse errors."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None
    convert.__name__ = flag
    return convert


def _flag_type(hint):
    """The type a flag's text becomes: the field's own (the X of ``X | None``), else text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if len(args) == 1 else hint
    return hint if hint in (int, float, str) else str


def _dest(f: dataclasses.Field) -> str:
    return f.metadata.get("dest") or f.name


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return tuple(f.metadata.get("flags") or ()) or ("--" + f.name.replace("_", "-"),)


class _Once(argparse.Action):
    """A flag a run takes once (a fault: a second --kill-replica would silently replace the first):
    given twice, a one-line error."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "_given_" + self.dest, False):
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): a run takes "
                         f"one {option_string}")
        setattr(namespace, "_given_" + self.dest, True)
        setattr(namespace, self.dest, values)


def _add_flag(group, f: dataclasses.Field, hint, *, dest: str, help: str | None, default=argparse.SUPPRESS,
              choices=None, required: bool = False, default_said: str | None = None) -> None:
    """One field as a flag: a switch for a bool, else a value parsed as the field declares. Its first
    flag is its name; the others are old names, kept for one release (its help says so). Its help ends
    with its default (``contract.cli``), or ``default_said`` where that is not a value. A fault's value
    is given once (``_Once``)."""
    flags = _flags(f)
    if help:
        help += old_names(flags)
    if help and default_said:
        help += f" (default: {default_said})"
    kwargs = dict(dest=dest, default=default, help=help or None)
    if hint is bool:
        kwargs.update(action="store_true")
    elif choices is not None:
        kwargs.update(choices=choices)
    else:
        kwargs.update(type=_parse_with(f.metadata.get("parse") or _flag_type(hint), flags[0]),
                      metavar=f.metadata.get("metavar") or _dest(f).upper())
        if f.metadata.get("group") == FAULTS:
            kwargs.update(action=_Once)
    group.add_argument(*flags, required=required, **kwargs)


def _flag_fields(cls) -> list[tuple[dataclasses.Field, typing.Any]]:
    """The fields of a dataclass that are flags (declared with help), with their types."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("help")]


def _add_fields(p: argparse.ArgumentParser, cls, choices: dict[str, list[str]] | None = None) -> None:
    """The flags of ``cls``'s fields (RunConfig, Placement), each under its group's heading in field
    order; a dataclass field's own fields are flags under a heading of their own (the model's
    overrides) or its group's (the optimizer's), their defaults the dataclass's."""
    groups: dict[str | None, argparse._ArgumentGroup] = {}

    def group(title):
        if title is None:
            return p
        return groups.setdefault(title, p.add_argument_group(title))

    for f, hint in _flag_fields(cls):
        nested = dataclasses.is_dataclass(hint)
        if not nested or f.metadata.get("choices"):  # a nested dataclass chosen by name (the model)
            explicit = (choices or {}).get(f.name) or f.metadata.get("choices")
            default = f.default if f.default is not dataclasses.MISSING else None
            _add_flag(group(f.metadata.get("group")), f, str if nested else hint, dest=f.name,
                      help=f.metadata["help"], default=default, choices=list(explicit) if explicit else None,
                      required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if nested:  # chosen by name: its fields override the named one's; else they set its fields
            g = group(GROUP_TITLES.get(f.name, f.metadata.get("group")))
            for sub, sub_hint in _flag_fields(hint):
                default = None if f.metadata.get("choices") or sub.default is dataclasses.MISSING else sub.default
                _add_flag(g, sub, sub_hint, dest=_dest(sub), help=sub.metadata["help"], default=default,
                          default_said=f"the --{f.name}'s" if default is None else None)


def option_owners(specs: dict[str, SystemSpec]) -> dict[str, list[str]]:
    """Option name -> the systems that declare it."""
    owners: dict[str, list[str]] = {}
    for spec in specs.values():
        for f in spec.options.declared():
            owners.setdefault(f.name, []).append(spec.name)
    return owners


def _describe(field, owner: str | None = None) -> str:
    """An option's accepted values and default, for --help (prefixed by its system when shared)."""
    choices, default = field.metadata.get("choices"), field.default
    parts = [" | ".join(choices)] if choices else []
    if default is not None and not isinstance(default, bool):
        parts.append(f"default {default}")
    text = ", ".join(parts)
    return f"{owner}: {text}" if owner and text else text


def _add_system_options(p: argparse.ArgumentParser, specs: dict[str, SystemSpec]) -> None:
    """Every system's options under its own heading; an option several systems declare is added
    once, under the first, its help naming each owner's values."""
    owners = option_owners(specs)
    added: set[str] = set()
    for spec in specs.values():
        hints = typing.get_type_hints(spec.options)
        fields = [f for f in spec.options.declared() if f.name not in added]
        if not fields:
            continue
        g = p.add_argument_group(f"{spec.name} options", spec.description)
        for f in fields:
            added.add(f.name)
            shared = owners[f.name]
            help_text = f.metadata.get("help", "")
            if len(shared) == 1:
                notes = [_describe(f)]
            else:
                help_text += f" (also of {', '.join(shared[1:])})"
                notes = [_describe(next(x for x in specs[o].options.declared() if x.name == f.name), o) for o in shared]
            help_text = "; ".join([help_text] + [n for n in notes if n])
            _add_flag(g, f, hints[f.name], dest=OPTION_PREFIX + f.name, help=help_text)


def build_parser(specs: dict[str, SystemSpec] | None = None, prog: str | None = None,
                 parser: type[RunParser] = RunParser) -> argparse.ArgumentParser:
    """The run command's parser (named ``prog``, default ``PROG``): RunConfig's flags, --out, --config,
    the placement's, every system's options (``specs``: these systems; default the registry's); each
    flag's help with its default."""
    specs = systems() if specs is None else specs
    p = parser(prog=prog or PROG, description="Train one system on the shared GPT workload and record one run.")
    _add_fields(p, RunConfig, choices={"system": list(specs)})
    run = next(g for g in p._action_groups if g.title == "run")
    run.add_argument("--out", default="results/runs.jsonl", help="the JSON-lines file the run record is appended to")
    run.add_argument("--config", default=None, metavar="FILE.toml",
                     help="the run's settings from FILE's [run] table: the keys a sweep's settings take (RunConfig's "
                          "fields, the model's and the optimizer's, the system's options, by their flags' names in "
                          "snake_case; a switch true or false); flags given as well override them")
    _add_fields(p, Placement)
    _add_system_options(p, specs)
    return p


def _from_args(cls, args: argparse.Namespace, **given):
    """An instance of a flag dataclass (the optimizer, the placement) from the parsed flags given;
    its own defaults for the rest."""
    values = {f.name: getattr(args, _dest(f)) for f, _ in _flag_fields(cls)
              if getattr(args, _dest(f), None) is not None}
    return cls(**{**values, **given})


def config_from_args(args: argparse.Namespace, spec: SystemSpec,
                     specs: dict[str, SystemSpec] | None = None) -> RunConfig:
    """The RunConfig of parsed arguments for ``spec`` (the system's spec, looked up once by the
    caller); an option of another system (of ``specs``, default the registry's) is a ConfigError."""
    try:
        model = get_model_config(args.model)
    except KeyError as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    model = model.with_overrides(**{_dest(f): getattr(args, _dest(f)) for f, _ in _flag_fields(type(model))})
    given = {k.removeprefix(OPTION_PREFIX): v for k, v in vars(args).items() if k.startswith(OPTION_PREFIX)}
    mine = {f.name for f in spec.options.declared()}
    foreign = [name for name in given if name not in mine]
    if foreign:
        owners = option_owners(systems() if specs is None else specs)[foreign[0]]
        raise ConfigError(f"--{foreign[0].replace('_', '-')} is an option of {' and '.join(owners)}, "
                          f"not of {spec.name}")
    common = {f.name: getattr(args, f.name) for f, hint in _flag_fields(RunConfig)
              if not dataclasses.is_dataclass(hint)}
    nested = {f.name: _from_args(hint, args) for f, hint in _flag_fields(RunConfig)
              if dataclasses.is_dataclass(hint) and f.name != "model"}
    return RunConfig(**{**common, **nested, "system": spec.name, "model": model, "options": spec.options(**given),
                        "network_matrix": matrix_contents(common["network"]),
                        "network_trace_contents": trace_contents(common["network_trace"])})


# A run's table (a file's [run] for --config, a scenario's [run], a sweep's settings): the run command's
# flags by their names in snake_case (RunConfig's fields, the model's and the optimizer's, a system's
# options), the model's fields also by the names below; a switch is true or false.
ALIASES = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "seq_length": "seq_len",
           "ffn_hidden_size": "ffn_hidden"}  # a table's key named as its flag is -> the key it stands for
# Keys of the run command that say where it runs and writes, not what the run is.
PLACEMENT_FLAGS = frozenset({"out", "nnodes", "node_rank", "rdzv_endpoint"})


def table_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A table's key (snake_case, a system option by its own name) -> the run command's action."""
    return {a.dest.removeprefix(OPTION_PREFIX): a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config")}


def setting_flags(key: str, value, keys: dict[str, argparse.Action], where: str) -> list[str]:
    """One key of a run's table as run-command flags (ConfigError, naming ``where`` and the key, for an
    unknown key or a value of the wrong kind; its text is judged with the rest)."""
    action = keys.get(ALIASES.get(key, key))
    if action is None:
        named = {dest: name for name, dest in ALIASES.items()}  # each known key as its flag names it
        known = ", ".join(sorted(named.get(k, k) for k in keys))
        raise ConfigError(f"{where}: unknown setting {key!r}; known: {known}")
    flag = max(action.option_strings, key=lambda s: s == "--" + key.replace("_", "-"))
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key!r} is a switch: true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        value = ",".join(map(str, value))  # a list flag's text (--layers-per-stage 5,7,7,5)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: {key!r} must be a string, a number or a list of whole numbers, got {value!r}")
    if isinstance(value, str) and value.startswith("-"):
        raise ConfigError(f"{where}: {key!r} = {value!r} looks like a flag")
    return [flag, str(value)]


def _judge_value(key: str, value, action: argparse.Action, where: str) -> None:
    """A table's value as the run command judges its flag's text (its choices, its type)."""
    text = str(value)
    if action.choices is not None and text not in action.choices:
        raise ConfigError(f"{where}: {key} = {value!r} is not one of {', '.join(map(str, action.choices))}")
    if callable(action.type):
        try:
            action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {key} = {value!r}: {exc}") from None


def table_flags(table: dict, keys: dict[str, argparse.Action], where: str = "[run]") -> list[str]:
    """A run's table as run-command flags, each value judged as its flag's text is."""
    out = []
    for key, value in table.items():
        flags = setting_flags(key, value, keys, where)
        if len(flags) == 2:
            _judge_value(key, flags[1] if isinstance(value, list) else value, keys[ALIASES.get(key, key)], where)
        out += flags
    return out


def read_toml(path: str | Path) -> dict:
    """A TOML file's contents; ConfigError (one line) where it cannot be read or parsed."""
    import tomllib

    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read it ({exc.__class__.__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not TOML ({exc})") from None


def config_file_flags(path: str | Path, keys: dict[str, argparse.Action]) -> list[str]:
    """The flags of a run config file: its ``[run]`` table (``table_flags``). Its other tables are
    other tools' (a scenario's ``[cluster]`` and ``[predict]``: ``predict.scenario``), not read here."""
    data = read_toml(path)
    loose = [k for k, v in data.items() if not isinstance(v, dict)]
    if loose:
        raise ConfigError(f"{loose[0]} stands outside [run] (a run's settings go under [run])")
    if not isinstance(data.get("run"), dict):
        raise ConfigError("no [run] table (a run's settings go under [run])")
    return table_flags(data["run"], keys)


def config_from_table(table: dict, specs: dict[str, SystemSpec] | None = None,
                      where: str = "[run]") -> tuple[RunConfig, SystemSpec]:
    """The RunConfig (not judged) of a run's table, as ``--config`` reads it, and its system's spec
    (``specs``: the systems it may name, default the registry's). Where the run is launched and
    written (``PLACEMENT_FLAGS``) is not part of a run's table. ConfigError (one line) names the key."""
    specs = systems() if specs is None else specs
    parser = build_parser(specs, parser=_TableParser)
    keys = table_keys(parser)
    for action in parser._actions:
        if action.required and action.dest not in table:
            raise ConfigError(f"{where} {action.dest} is missing")
    placed = sorted(PLACEMENT_FLAGS & {ALIASES.get(k, k) for k in table})
    if placed:
        raise ConfigError(f"{where}: {placed[0]!r} says where a run is launched or written, not what it is")
    flags = table_flags(table, keys, where)
    try:
        ns = parser.parse_args(flags)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    spec = specs[ns.system]
    return config_from_args(ns, spec, specs), spec


def matrix_contents(network: str) -> dict | None:
    """The contents of the per-link matrix file ``network`` names, as they are now, or None (another
    profile, or one that does not parse: ``judge`` says why)."""
    if network == "none":
        return None
    try:
        profile = parse_profile(network)
    except ProfileError:
        return None
    return profile.contents() if isinstance(profile, MatrixProfile) else None


def trace_contents(path: str | None) -> dict | None:
    """The contents of the trace file ``path`` names, as they are now, or None (no trace, or one that
    does not parse: ``judge`` says why)."""
    if path is None:
        return None
    try:
        return load_trace(path).contents()
    except ProfileError:
        return None


def judge_trace(cfg: RunConfig, world: int, nnodes: int | None) -> None:
    """ConfigError if the run's --network-trace cannot be applied to it (``nnodes``: the placement's,
    None while only the request is judged)."""
    if cfg.network_trace is None:
        return
    flag = f"--network-trace {cfg.network_trace}"
    try:
        trace = trace_from(cfg.network_trace_contents, Path(cfg.network_trace).stem) \
            if cfg.network_trace_contents is not None else load_trace(cfg.network_trace)
        trace.timeline(parse_profile(cfg.network, cfg.network_matrix), world)
    except ProfileError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if nnodes is not None and nnodes > 1:
        raise ConfigError(f"{flag}: a trace changes the links of the local virtual cluster; on a cluster of "
                          "nodes it is not applied (run on one node)")


def placement_from_args(args: argparse.Namespace) -> Placement:
    return _from_args(Placement, args)


def parse_request(argv: Sequence[str]) -> tuple[RunConfig, SystemSpec]:
    """The RunConfig of run-command flags and its system's spec (not judged; a flag argparse refuses
    exits as the run command does)."""
    args = build_parser().parse_args(list(argv))
    spec = get_system(args.system)
    return config_from_args(args, spec), spec


# The rule for --p2p-semantics nccl where the ranks compute on GPUs: it follows NCCL's rules on gloo,
# and on CUDA the backend is NCCL itself, so the flag would change nothing but the run's identity.
P2P_ON_CUDA = ("--p2p-semantics nccl holds gloo to NCCL's rules on CPU; ranks on CUDA run NCCL itself "
               "(use --device cpu, or leave the flag out)")


def judge(cfg: RunConfig, spec: SystemSpec, placement: Placement | None = None, out: str | None = None) -> None:
    """Raise ConfigError if ``cfg`` cannot run: the system's judgement (common fields, its own
    options), then the network profile. For a run about to be launched here (``placement`` given),
    also what this machine must offer it: a valid placement, root for a local virtual cluster,
    writable output files (``out``: the record's, on node 0), a readable data file, the device."""
    spec.validate(cfg)
    if cfg.network != "none":
        try:
            profile = parse_profile(cfg.network, cfg.network_matrix)
            check_emulable(profile)
            if spec.processes(cfg) > 1:
                profile.check_hosts(spec.processes(cfg))
        except ProfileError as exc:
            raise ConfigError(f"--network: {exc}") from None
        if spec.processes(cfg) == 1:
            raise ConfigError(f"--network {cfg.network}: {spec.name} runs one process here, which has no link to "
                              "emulate (use --network none)")
    judge_trace(cfg, spec.processes(cfg), placement.nnodes if placement is not None else None)
    if cfg.p2p_semantics == "nccl":
        if spec.processes(cfg) == 1:
            raise ConfigError(f"--p2p-semantics nccl: {spec.name} runs one process here, which sends no message to "
                              "hold to NCCL's rules (leave the flag out)")
        if cfg.device == "cuda":
            raise ConfigError(P2P_ON_CUDA)
    if placement is None:
        return
    if placement.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {placement.nnodes}")
    if not 0 <= placement.node_rank < placement.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{placement.nnodes - 1}, got {placement.node_rank}")
    if placement.nnodes > 1 and not placement.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0)")
    if cfg.kill_replica is not None and spec.fault_tolerant and placement.nnodes > 1:
        raise ConfigError(f"--kill-replica with --nnodes {placement.nnodes}: {spec.name}'s replicas are started (and "
                          "restarted) by one run command on one node (leave out --nnodes)")
    check_fits_here(cfg, spec, placement.nnodes)
    _check_environment(cfg, out)
    services.check(spec.services)
    if cfg.network != "none" and placement.nnodes == 1 and os.geteuid() != 0:
        raise ConfigError(f"--network {cfg.network!r} runs the ranks in a local virtual cluster of network "
                          "namespaces, which needs root (run as root, or use --network none)")


def check_writable(path: str, flag: str) -> None:
    """A file the run will append to can be written (a record file is rewritten beside itself and
    renamed over it): it is a regular file or does not exist yet, its directory takes a new file, and
    its file system has room for it again and ``WRITE_MARGIN_BYTES``. Tried for real: root passes every
    permission check but not a read-only file system."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory, not a file")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {path} is not a regular file")
    parent = Path(os.path.realpath(p)).parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory {parent}")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".write-check-")
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write in {parent} ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {path}: not writable")
    fs = os.statvfs(parent)
    free = (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize
    need = (p.stat().st_size if p.exists() else 0) + WRITE_MARGIN_BYTES  # a record file is rewritten beside itself
    if fs.f_blocks and free < need:
        raise ConfigError(f"{flag} {path}: its file system has {free / 2**20:.1f} MiB free, and writing it needs "
                          f"{need / 2**20:.1f} MiB (free some space, or give a file elsewhere)")


WRITE_MARGIN_BYTES = 2**20  # free space a file the run writes needs beyond its present size (a record: kilobytes)


# A rank's process holds this much before any model is built (torch, gloo; the peak RSS of a rank of
# the tiny model measured here: 0.32 GiB), and every replica of the model at least its fp32 weights
# and their gradients (the optimizer's state, activations and buffers come on top): a layout whose
# ranks need more than the machine has cannot run on it.
RANK_PROCESS_BYTES = int(0.3 * 2**30)
WEIGHT_AND_GRAD_BYTES = 8  # per parameter
MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1


def machine_memory() -> int | None:
    """This machine's memory as the run's processes see it: MemTotal of /proc/meminfo, or the memory
    cgroup's limit where that is lower (None where neither is readable)."""
    sizes = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                sizes.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in MEMORY_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def check_fits_here(cfg: RunConfig, spec: SystemSpec, nnodes: int = 1) -> None:
    """The ranks a run starts on this machine (its share of ``nnodes``) fit it: their processes
    (``RANK_PROCESS_BYTES`` each) and, where they compute on the CPU (the resolved hardware, or
    ``--device cpu`` before it is resolved), their share of every replica's weights and gradients,
    within this machine's memory (``machine_memory``). A lower bound of what the run needs: a layout
    refused here cannot run here."""
    share = 1 / max(1, nnodes)
    local = math.ceil(spec.processes(cfg) * share)
    on_cpu = (cfg.hardware or cfg.device) == "cpu"
    model = count_params(cfg.model, include_embeddings=True) * cfg.dp * share if on_cpu else 0
    need = local * RANK_PROCESS_BYTES + model * WEIGHT_AND_GRAD_BYTES
    have = machine_memory()
    if have is not None and need > have:
        raise ConfigError(f"--pp {cfg.pp} --tp {cfg.tp} --dp {cfg.dp} starts {local} ranks on this machine, which "
                          f"need at least {need / 2**30:.0f} GiB ({RANK_PROCESS_BYTES / 2**30:.1f} GiB a process"
                          + (f", {model * WEIGHT_AND_GRAD_BYTES / 2**30:.0f} GiB of fp32 weights and gradients"
                             if model else "")
            + f"); it has {have / 2**30:.0f} GiB: run it across nodes with --nnodes N")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same path once links are resolved, or (both existing) the
    same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def file_roles(cfg: RunConfig, out: str | None) -> list[tuple[str, str]]:
    """(flag, path) of every file the run reads or writes: the record's, its outputs', the data's, a
    per-link matrix's."""
    roles = [("--out", out)] if out else []
    roles += [("--" + name.replace("_", "-"), path) for name, path in cfg.options.output_paths()]
    if cfg.data is not None and cfg.data not in BUILTIN:
        roles.append(("--data", cfg.data))
    if cfg.network != "none" and Path(cfg.network.strip()).is_file():
        roles.append(("--network", cfg.network.strip()))
    if cfg.network_trace is not None:
        roles.append(("--network-trace", cfg.network_trace))
    return roles


def check_roles(roles: list[tuple[str, str]]) -> None:
    """One file given for two roles is a bad request (a record appended to the training text, a
    trace that becomes line 1 of the records file)."""
    for i, (flag, path) in enumerate(roles):
        for other, other_path in roles[i + 1:]:
            if same_file(path, other_path):
                raise ConfigError(f"{flag} {path} and {other} {other_path} are the same file: "
                                  "give each role a file of its own")


def _check_environment(cfg: RunConfig, out: str | None) -> None:
    """What this machine must offer the run: one file per role, writable output files, a readable data
    file that fits its memory (the devices: ``resolve_devices``)."""
    check_roles(file_roles(cfg, out))
    if out:
        check_writable(out, "--out")
    for name, path in cfg.options.output_paths():
        check_writable(path, "--" + name.replace("_", "-"))
    if cfg.data is not None:
        if cfg.data not in BUILTIN and (not Path(cfg.data).is_file() or not os.access(cfg.data, os.R_OK)):
            raise ConfigError(f"--data {cfg.data}: not a readable file")
        train, heldout = split_sizes(cfg.data)
        splits = [("training split (the first nine tenths)", train), ("held-out split", heldout)]
        for name, size in splits[: 2 if cfg.eval_every else 1]:  # the held-out split only for the eval
            if size < cfg.model.seq_len + 2:
                raise ConfigError(f"--data {cfg.data}: its {name} has {size} bytes, need more than "
                                  f"{cfg.model.seq_len + 1} (one sequence)")
        size = train + heldout
        have = machine_memory()
        if have is not None and size > have:  # one byte a token, the file mapped once for every rank
            raise ConfigError(f"--data {cfg.data}: its {size / 2**30:.1f} GiB of byte tokens do not fit this "
                              f"machine's memory ({have / 2**30:.1f} GiB)")
    _check_cache(cfg)


def _check_cache(cfg: RunConfig) -> None:
    """The suite's cache keeps what the run needs (a CPU's peak, a BPE's tokens: ``workload.cache``);
    a BPE is made there now (or checked, and made again if damaged), and must have learned every
    token of --vocab-size."""
    from workload.cache import CacheError, cache_dir, writable

    try:
        if cfg.device != "cuda":  # the CPU's peak is measured once and kept (workload.cpu_peak)
            writable(cache_dir())
        if cfg.data is not None and cfg.tokenizer == "bpe":
            from workload.tokens import learned_short

            short = learned_short(cfg.data, cfg.model.vocab_size)
            if short:
                raise ConfigError(f"--tokenizer bpe {short}")
    except CacheError as exc:
        raise ConfigError(str(exc)) from None


def resolve_devices(cfg: RunConfig, spec: SystemSpec, placement: Placement) -> RunConfig:
    """``cfg`` with the hardware its ranks on this machine run on (``runners.devices.judge_gpus``:
    one GPU of their own per rank, a torch build that runs on them; else a ConfigError). The last
    judgement before launch, after ``judge``: it imports torch (and on a GPU machine reads its GPUs in a
    subprocess), which the run command does only once the request is otherwise judged runnable."""
    from runners.devices import Gpus, judge_gpus, local_gpus

    gpus = local_gpus() if cfg.device != "cpu" else Gpus()
    here = spec.processes(cfg) // placement.nnodes
    resolved = cfg.replace(hardware=judge_gpus(cfg.device, gpus, here, spec.devices_per_process(cfg)))
    if cfg.p2p_semantics == "nccl" and resolved.hardware != "cpu":
        raise ConfigError(P2P_ON_CUDA)
    check_fits_here(resolved, spec, placement.nnodes)  # now knowing whether the weights live in this memory
    return resolved
