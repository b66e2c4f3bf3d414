"""A run request from the command line: the run command's parser (built from the registry: every
system's options under its own heading), the RunConfig it makes, and the one place a request is
judged before anything is launched (ConfigError, one line, names the real flag).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from contract import ConfigError, RunConfig, SystemSpec
from network_emulation.profiles import ProfileError, check_emulable, parse_profile
from runners import services
from runners.registry import get_system, systems
from workload.configs import MODEL_CONFIGS, OptimizerConfig, get_model_config
from workload.corpus import BUILTIN, read_corpus

OPTION_PREFIX = "option:"  # argparse dest of a system option


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Placement:
    """Where this invocation's ranks run: one node, or one node of a multi-node rendezvous."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0


def _parse_with(parse, flag: str):
    """An argparse type that turns the option's own parse errors into one-line argparse errors."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None
    convert.__name__ = flag
    return convert


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
        fields = [f for f in spec.options.declared() if f.name not in added]
        if not fields:
            continue
        g = p.add_argument_group(f"{spec.name} options", spec.description)
        for f in fields:
            added.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            shared = owners[f.name]
            help_text = f.metadata.get("help", "")
            if len(shared) == 1:
                notes = [_describe(f)]
            else:
                help_text += f" (also of {', '.join(shared[1:])})"
                notes = [_describe(next(x for x in specs[o].options.declared() if x.name == f.name), o) for o in shared]
            help_text = "; ".join([help_text] + [n for n in notes if n])
            if isinstance(f.default, bool):
                kwargs = dict(action="store_true")
            else:
                parse = f.metadata.get("parse") or (type(f.default) if f.default is not None else str)
                kwargs = dict(type=_parse_with(parse, flag), metavar=f.metadata.get("metavar") or f.name.upper())
            g.add_argument(flag, dest=OPTION_PREFIX + f.name, default=argparse.SUPPRESS, help=help_text, **kwargs)


def build_parser(specs: dict[str, SystemSpec] | None = None) -> argparse.ArgumentParser:
    specs = systems() if specs is None else specs
    p = Parser(prog="python -m runners.run", description="Train one system on the shared GPT workload and record one run.")
    p.add_argument("--system", required=True, choices=list(specs))
    p.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS))
    g = p.add_argument_group("model overrides (any field of the model config)")
    g.add_argument("--num-layers", "--n-layer", dest="n_layer", type=int)
    g.add_argument("--hidden-size", "--embedding-dim", dest="n_embd", type=int)
    g.add_argument("--num-heads", "--n-head", dest="n_head", type=int)
    g.add_argument("--seq-length", dest="seq_len", type=int)
    g.add_argument("--vocab-size", dest="vocab_size", type=int)
    g = p.add_argument_group("layout")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (fairscale_fsdp: devices in each process's pipe)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree (pipelines)")
    g.add_argument("--batch-size", type=int, required=True, help="batch per pipeline; global batch = batch-size x dp")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=10, help="measured steps")
    g.add_argument("--warmup", type=int, default=2, help="warm-up steps, not timed")
    g.add_argument("--mixed-precision", action="store_true", help="fp16 + loss scaling on CUDA, bf16 autocast on CPU")
    g.add_argument("--recompute", action="store_true", help="activation recomputation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--optimizer", default="adam", help="adam | sgd")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--data", default=None, help="a text file to train on (byte-level tokens; its last tenth held out "
                   "for --eval-every), or 'stdlib' (the Python standard library's sources); synthetic tokens by default")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="the held-out loss before the first step and every N steps, in the record (0: never)")
    g.add_argument("--target-loss", type=float, default=None, metavar="X",
                   help="stop once an eval loss is at or below X (needs --eval-every)")
    g = p.add_argument_group("run")
    g.add_argument("--network", default="none", help="network profile: none, a profile name, or 'delay 10ms bandwidth 1Gbps'")
    g.add_argument("--verify", action="store_true", help="also train the single-process reference and compare losses and gradients")
    g.add_argument("--out", default="results/runs.jsonl", help="the JSON-lines file the run record is appended to")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is stopped and recorded as timeout")
    g = p.add_argument_group("multi-node (passed through to torchrun)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0)
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0")
    _add_system_options(p, specs)
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of parsed arguments; an option of another system is a ConfigError."""
    spec = get_system(args.system)
    try:
        model = get_model_config(args.model)
    except KeyError as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    model = model.with_overrides(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                                 vocab_size=args.vocab_size)
    given = {k.removeprefix(OPTION_PREFIX): v for k, v in vars(args).items() if k.startswith(OPTION_PREFIX)}
    mine = {f.name for f in spec.options.declared()}
    foreign = [name for name in given if name not in mine]
    if foreign:
        owners = option_owners(systems())[foreign[0]]
        raise ConfigError(f"--{foreign[0].replace('_', '-')} is an option of {' and '.join(owners)}, "
                          f"not of {spec.name}")
    return RunConfig(
        system=spec.name, model=model, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
        pp=args.pp, tp=args.tp, dp=args.dp, steps=args.steps, warmup=args.warmup,
        mixed_precision=args.mixed_precision, recompute=args.recompute, network=args.network, seed=args.seed,
        optimizer=OptimizerConfig(kind=args.optimizer, lr=args.lr), data=args.data, device=args.device,
        verify=args.verify, timeout=args.timeout, eval_every=args.eval_every, target_loss=args.target_loss,
        options=spec.options(**given))


def placement_from_args(args: argparse.Namespace) -> Placement:
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0)")
    return Placement(args.nnodes, args.node_rank, args.rdzv_endpoint)


def judge(cfg: RunConfig) -> None:
    """Raise ConfigError if ``cfg`` cannot run: the system's judgement (common fields, its own
    options), then the network profile."""
    spec = get_system(cfg.system)
    spec.validate(cfg)
    services.check(spec.services)
    if cfg.network != "none":
        try:
            profile = parse_profile(cfg.network)
            profile.check_hosts(spec.processes(cfg))
            check_emulable(profile)
        except ProfileError as exc:
            raise ConfigError(f"--network: {exc}") from None


def check_writable(path: str, flag: str) -> None:
    """A file the run will append to can be written (a record file is rewritten beside itself and
    renamed over it): it is a regular file or does not exist yet, and its directory takes a new file.
    Tried for real: root passes every permission check but not a read-only file system."""
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


def check_environment(cfg: RunConfig, out: str | None) -> None:
    """What this machine must offer the run: writable output files, a readable data file, the device."""
    if out:
        check_writable(out, "--out")
    for name, path in cfg.options.output_paths():
        check_writable(path, "--" + name.replace("_", "-"))
    if cfg.data is not None:
        if cfg.data not in BUILTIN and (not Path(cfg.data).is_file() or not os.access(cfg.data, os.R_OK)):
            raise ConfigError(f"--data {cfg.data}: not a readable file")
        split = read_corpus(cfg.data)
        for name, text in (("training", split.train), ("held-out", split.heldout)):
            if len(text) < cfg.model.seq_len + 2:
                raise ConfigError(f"--data {cfg.data}: its {name} split has {len(text)} bytes, need more than "
                                  f"{cfg.model.seq_len + 1} (one sequence; the last tenth is held out)")
    if cfg.device == "cuda":
        import torch  # only when CUDA is asked for: importing torch takes seconds

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")
    if not math.isfinite(cfg.timeout):
        raise ConfigError(f"--timeout must be finite, got {cfg.timeout}")
