"""RunConfig: every field of one run, parsed from the command line and judged in one place."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict, dataclass, field

from workload.configs import MODEL_CONFIGS, ModelConfig, OptimizerConfig, get_model_config

SCHEDULES = ("gpipe", "1f1b", "interleaved")
DP_MODES = ("allreduce", "central_ps", "sharded_ps")


class ConfigError(ValueError):
    """A request that cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class RunConfig:
    system: str
    model: ModelConfig
    batch_size: int  # per pipeline (data-parallel replica), as in the seed; global batch = batch_size * dp
    micro_batch_size: int
    pp: int = 1
    tp: int = 1
    dp: int = 1
    schedule: str = "gpipe"
    virtual_pp: int = 1  # model chunks per rank (interleaved schedules)
    steps: int = 10  # measured steps
    warmup: int = 2  # steps run before the measured ones, excluded from timing
    mixed_precision: bool = False
    recompute: bool = False
    network: str = "none"
    verify: bool = False
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: str | None = None  # a text file (byte-level tokens); synthetic tokens when None
    device: str = "auto"  # auto | cpu | cuda
    timeout: float = 3600.0
    # ours (token-level pipeline)
    n_slices: int = 1
    slices: tuple[int, ...] | None = None
    auto_slices: bool = False
    dp_mode: str = "allreduce"
    trace: str | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp

    @property
    def n_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def precision(self) -> str:
        return "mixed" if self.mixed_precision else "fp32"

    @property
    def token_slices(self) -> tuple[int, ...]:
        """The token slicing of ours: explicit, or n_slices near-equal slices of the sequence."""
        if self.slices is not None:
            return self.slices
        q, r = divmod(self.model.seq_len, self.n_slices)
        return tuple(q + (1 if i < r else 0) for i in range(self.n_slices))

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = dict(d)
        d["model"] = ModelConfig(**d["model"])
        d["optimizer"] = OptimizerConfig(**d["optimizer"])
        if d.get("slices") is not None:
            d["slices"] = tuple(d["slices"])
        return cls(**d)


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError with a one-line reason if the request cannot run. The only judge of a request."""
    from runners.registry import get_system  # the registry imports no system code

    spec = get_system(cfg.system)
    m = cfg.model
    positive = dict(pp=cfg.pp, tp=cfg.tp, dp=cfg.dp, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
                    steps=cfg.steps, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head, seq_len=m.seq_len,
                    vocab_size=m.vocab_size, virtual_pp=cfg.virtual_pp, n_slices=cfg.n_slices)
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if cfg.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {cfg.warmup}")
    if cfg.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {cfg.timeout}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"hidden size {m.n_embd} is not divisible by {m.n_head} heads")
    if cfg.batch_size % cfg.micro_batch_size:
        raise ConfigError(f"batch size {cfg.batch_size} is not divisible by micro-batch size {cfg.micro_batch_size}")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"unknown --schedule {cfg.schedule!r}; choose from {', '.join(SCHEDULES)}")
    if cfg.dp_mode not in DP_MODES:
        raise ConfigError(f"unknown --dp-mode {cfg.dp_mode!r}; choose from {', '.join(DP_MODES)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown --device {cfg.device!r}; choose from auto, cpu, cuda")
    if cfg.optimizer.kind not in ("adam", "sgd"):
        raise ConfigError(f"unknown --optimizer {cfg.optimizer.kind!r}; choose from adam, sgd")
    if cfg.data is not None and m.vocab_size < 256:
        raise ConfigError(f"--data uses byte tokens and needs --vocab-size >= 256, got {m.vocab_size}")
    for dim in ("pp", "tp", "dp"):
        if getattr(cfg, dim) > 1 and dim not in spec.dims:
            raise ConfigError(f"system {cfg.system!r} does not support --{dim} > 1 (it supports: {', '.join(spec.dims) or 'none'})")
    if cfg.schedule not in spec.schedules:
        raise ConfigError(f"system {cfg.system!r} does not support --schedule {cfg.schedule} (choose from {', '.join(spec.schedules)})")
    if cfg.schedule == "interleaved" and cfg.virtual_pp < 2:
        raise ConfigError("--schedule interleaved needs --virtual-pp >= 2 (model chunks per rank)")
    if cfg.schedule != "interleaved" and cfg.virtual_pp != 1:
        raise ConfigError("--virtual-pp > 1 needs --schedule interleaved")
    stages = cfg.pp * cfg.virtual_pp
    if m.n_layer % stages:
        raise ConfigError(f"{m.n_layer} layers do not divide into {stages} pipeline stages (--pp {cfg.pp} x --virtual-pp {cfg.virtual_pp})")
    if m.n_head % cfg.tp or m.n_embd % cfg.tp:
        raise ConfigError(f"--tp {cfg.tp} must divide the heads ({m.n_head}) and the hidden size ({m.n_embd})")
    if cfg.slices is not None:
        if any(s < 1 for s in cfg.slices):
            raise ConfigError(f"--slices must be positive lengths, got {','.join(map(str, cfg.slices))}")
        if sum(cfg.slices) != m.seq_len:
            raise ConfigError(f"--slices {','.join(map(str, cfg.slices))} sum to {sum(cfg.slices)}, not the sequence length {m.seq_len}")
    if cfg.n_slices > m.seq_len:
        raise ConfigError(f"--n-slices {cfg.n_slices} exceeds the sequence length {m.seq_len}")
    if cfg.network != "none":
        from network_emulation.profiles import ProfileError, parse_profile

        try:
            parse_profile(cfg.network).check_hosts(spec.processes(cfg))
        except ProfileError as exc:
            raise ConfigError(f"--network: {exc}") from None
    spec.check(cfg)


def _slices(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slices takes comma-separated integers, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from runners.registry import SYSTEMS

    p = _Parser(prog="python -m runners.run", description="Train one system on the shared GPT workload and record one run.")
    p.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    p.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS))
    g = p.add_argument_group("model overrides (any field of the model config)")
    g.add_argument("--num-layers", "--n-layer", dest="n_layer", type=int)
    g.add_argument("--hidden-size", "--embedding-dim", dest="n_embd", type=int)
    g.add_argument("--num-heads", "--n-head", dest="n_head", type=int)
    g.add_argument("--seq-length", dest="seq_len", type=int)
    g.add_argument("--vocab-size", dest="vocab_size", type=int)
    g = p.add_argument_group("layout and schedule")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (fairscale_fsdp: devices in each process's pipe)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree (pipelines)")
    g.add_argument("--batch-size", type=int, required=True, help="batch per pipeline; global batch = batch-size x dp")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--schedule", default=None, help="gpipe | 1f1b | interleaved (default: the system's first)")
    g.add_argument("--virtual-pp", type=int, default=None, help="model chunks per rank (default 2 with --schedule interleaved)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=10, help="measured steps")
    g.add_argument("--warmup", type=int, default=2, help="warm-up steps, not timed")
    g.add_argument("--mixed-precision", action="store_true", help="fp16 + loss scaling on CUDA, bf16 autocast on CPU")
    g.add_argument("--recompute", action="store_true", help="activation recomputation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--optimizer", default="adam")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--data", default=None, help="a text file to train on (byte-level tokens); synthetic tokens by default")
    g = p.add_argument_group("ours (token-level pipeline)")
    g.add_argument("--n-slices", default="1", help="K equal token slices, or 'auto' for the planner's optimal slicing")
    g.add_argument("--slices", type=_slices, default=None, help="explicit token slice lengths, e.g. 256,256,512")
    g.add_argument("--dp-mode", default="allreduce", help="allreduce | central_ps | sharded_ps")
    g.add_argument("--trace", default=None, help="write a Chrome trace of every rank's spans to this file")
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
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    model = get_model_config(args.model).with_overrides(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len, vocab_size=args.vocab_size)
    auto = args.n_slices == "auto"
    try:
        n_slices = 1 if auto else int(args.n_slices)
    except ValueError:
        raise ConfigError(f"--n-slices takes an integer or 'auto', got {args.n_slices!r}") from None
    if args.slices is not None and (auto or args.n_slices != "1"):
        raise ConfigError("give either --n-slices or --slices, not both")
    from runners.registry import get_system

    schedule = args.schedule or get_system(args.system).schedules[0]
    virtual_pp = args.virtual_pp if args.virtual_pp is not None else (2 if schedule == "interleaved" else 1)
    return RunConfig(
        system=args.system, model=model, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
        pp=args.pp, tp=args.tp, dp=args.dp, schedule=schedule, virtual_pp=virtual_pp, steps=args.steps,
        warmup=args.warmup, mixed_precision=args.mixed_precision, recompute=args.recompute, network=args.network,
        verify=args.verify, seed=args.seed, optimizer=OptimizerConfig(kind=args.optimizer, lr=args.lr), data=args.data,
        device=args.device, timeout=args.timeout, n_slices=n_slices, slices=args.slices, auto_slices=auto,
        dp_mode=args.dp_mode, trace=args.trace)
