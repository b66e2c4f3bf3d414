"""What one run is: ``RunConfig`` (the fields every run has) and ``SystemOptions`` (the fields one
system declares for itself). Plain data and no torch: the run command builds and judges a request
with these before anything heavy is imported.

Every field that is set from the command line is declared with ``option``: its default, its one line
of help, and how it is written and read as a flag. The run command's flags are generated from these
fields (``runners.request``), RunConfig's under the ``group`` headings, a system's under its own; the
model's and the optimizer's (``workload.configs``) carry the same metadata keys. Adding a field with
``option`` is all it takes to get a flag.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any, Callable

from workload.configs import MODEL_CONFIGS, PRECISIONS, ModelConfig, OptimizerConfig
from workload.tokens import TOKENIZERS

P2P_SEMANTICS = ("gloo", "nccl")  # --p2p-semantics: gloo's own, or NCCL's rules followed on gloo


class ConfigError(ValueError):
    """A request that cannot run; the message is one line for the user."""


def option(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, identity: bool = True,
           output_path: bool = False, group: str | None = None, flags: tuple[str, ...] = (),
           default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """Declare one field of a run that the command line sets: a system's option or RunConfig's.

    ``help`` is its one line in ``--help``; ``choices`` the values it accepts; ``parse`` turns the
    command line's text into the value (default: the field's type; a bool makes a switch);
    ``identity=False`` keeps it out of the run's identity (a trace file, a timeout do not change what
    a run measures); ``output_path`` marks a file the run writes, which the run command checks is
    writable before launching. RunConfig's fields also name their ``--help`` heading (``group``;
    None: the top) and, where they differ from ``--<name>``, their ``flags``. No default: a
    required flag. A field whose type is a dataclass (the model, the optimizer) gets a flag for each
    of its own fields declared with these metadata keys."""
    meta = dict(help=help, choices=choices, parse=parse, metavar=metavar, identity=identity,
                output_path=output_path, group=group, flags=flags)
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class SystemOptions:
    """The base of a system's own options: a frozen dataclass whose fields are declared with
    ``option``. A system with nothing of its own uses this class as it is."""

    def check(self, config: RunConfig) -> None:
        """Raise ConfigError (one line) if the system cannot run ``config``. Systems override it."""

    def check_build(self, config: RunConfig) -> None:
        """Raise ConfigError (one line) for what this repository's build of the system cannot run
        though the system as its authors run it can (megatron: megatron-core's vocabulary split over
        --tp unpadded, where Megatron-LM pads it). A prediction of the system as published (a
        scenario) leaves this out; the run command judges it. Systems override it."""

    def lossy(self) -> str | None:
        """What these options round beyond the precision policy (e.g. 'bf16 wire'), or None: the run
        is exact. ``--verify`` judges a lossy run with a tolerance of its own and says so."""
        return None

    @classmethod
    def declared(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values option ``name`` takes (its declared choices)."""
        return tuple(next(f.metadata["choices"] for f in cls.declared() if f.name == name))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def identity(self) -> dict[str, Any]:
        """The options that are part of the run's identity."""
        return {f.name: getattr(self, f.name) for f in self.declared() if f.metadata.get("identity", True)}

    def output_paths(self) -> list[tuple[str, str]]:
        """(option name, path) of every file the run will write."""
        return [(f.name, getattr(self, f.name)) for f in self.declared()
                if f.metadata.get("output_path") and getattr(self, f.name) is not None]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SystemOptions:
        known = {f.name for f in cls.declared()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _plain(value: Any) -> Any:
    """As JSON would give it back (tuples become lists)."""
    return json.loads(json.dumps(value))


LAYOUT, TRAINING, RUN = "layout", "training", "run"  # --help headings of RunConfig's fields
FAULTS = "faults"


_SLOW = re.compile(r"\s*(\d+)\s*:\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*")
_KILL = re.compile(r"\s*(\d+)\s*@\s*(\d+)\s*")
MAX_SLOWDOWN = 100.0


def _slow_rank(text: str) -> str:
    """``--slow-rank R:F`` in its canonical form ('1:2'); ValueError (one line) if malformed."""
    m = _SLOW.fullmatch(text)
    if not m:
        raise ValueError(f"--slow-rank: expected R:F (rank R computes F times slower, e.g. 1:2), got {text!r}")
    factor = float(m.group(2))
    if not 1 < factor <= MAX_SLOWDOWN or not math.isfinite(factor):
        raise ValueError(f"--slow-rank: the factor must be above 1 and at most {MAX_SLOWDOWN:g}, got {factor:g}")
    return f"{int(m.group(1))}:{factor:g}"


def _kill_replica(text: str) -> str:
    """``--kill-replica R@STEP`` in its canonical form ('2@10'); ValueError (one line) if malformed."""
    m = _KILL.fullmatch(text)
    if not m:
        raise ValueError(f"--kill-replica: expected R@STEP (replica R ends after STEP steps, e.g. 2@10), got {text!r}")
    return f"{int(m.group(1))}@{int(m.group(2))}"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Every field of a run; each one declared with ``option`` is a flag of the run command, in this
    order under its heading (keyword-only, so that the fields stand in the order ``--help`` shows)."""

    system: str = option(help="the system to train (its own options: under its heading below)")
    model: ModelConfig = option(help="the model by name (the GPT-3 family, tiny and cpu-small for CPUs; the llama "
                                     "family: llama3-8b, llama3-70b, llama-tiny, llama-cpu-small)",
                                choices=tuple(sorted(MODEL_CONFIGS)))
    pp: int = option(1, "pipeline stages (fairscale_fsdp: devices in each process's pipe)", group=LAYOUT)
    tp: int = option(1, "tensor-parallel degree", group=LAYOUT)
    dp: int = option(1, "data-parallel degree (pipelines)", group=LAYOUT)
    batch_size: int = option(help="batch per pipeline; global batch = batch-size x dp", group=LAYOUT)
    micro_batch_size: int = option(help="sequences per micro-batch (batch-size divides into them)", group=LAYOUT)
    steps: int = option(10, "measured steps", group=TRAINING)
    warmup: int = option(2, "warm-up steps, not timed", group=TRAINING)
    precision: str = option("fp32", "the precision policy: fp32, bf16 autocast, or fp16 autocast with dynamic loss "
                                    "scaling (what --mixed-precision was: bf16 on CPU, fp16 on CUDA)",
                            choices=PRECISIONS, group=TRAINING)
    recompute: bool = option(False, "activation recomputation", group=TRAINING)
    seed: int = option(0, "seed of the initial weights and of the synthetic tokens", group=TRAINING)
    optimizer: OptimizerConfig = option(help="the optimizer every system runs", group=TRAINING,
                                        default_factory=OptimizerConfig)
    data: str | None = option(None, "a text file to train on (its last tenth held out for --eval-every), 'stdlib' "
                                    "(the Python standard library's sources) or 'pydocs' (the Python documentation's "
                                    "text, where installed); synthetic tokens by default", group=TRAINING)
    tokenizer: str = option("byte", "the tokens of --data: 'byte' (token = byte; --vocab-size >= 256) or 'bpe' (a "
                                    "byte-level BPE of --vocab-size tokens trained on the training split with the "
                                    "tokenizers library, made once and cached)", choices=TOKENIZERS, group=TRAINING)
    eval_every: int = option(0, "the held-out loss before the first step and every N steps, in the record (0: never)",
                             group=TRAINING, metavar="N")
    target_loss: float | None = option(None, "stop once an eval loss is at or below X (needs --eval-every)",
                                       group=TRAINING, parse=float, metavar="X")
    network: str = option("none", "network profile: none, a profile name, 'delay 10ms bandwidth 1Gbps' (optionally "
                                  "'loss 0.5%%' and 'jitter 2ms'), or a per-link matrix file FILE.json "
                                  "({\"delay_ms\": [[...]], \"bandwidth_gbps\": [[...]]}, optionally \"loss_pct\" and "
                                  "\"jitter_ms\", N x N for N ranks)", group=RUN)
    # A per-link matrix's contents ({"delay_ms": [[...]], "bandwidth_gbps": [[...]]}) as the request read
    # them from the file ``network`` names, None for any other profile: the run is emulated, recorded
    # and identified by these (their digest), never by the path alone (set by the run command).
    network_matrix: dict[str, Any] | None = None
    network_trace: str | None = option(None, "a trace file FILE.json: the links' delay, bandwidth, loss and jitter "
                                             "changing while the run goes on (network_emulation.traces; on the "
                                             "local virtual cluster)", group=RUN, metavar="FILE.json")
    # The trace's contents as the request read them (set by the run command): the run is emulated,
    # recorded and identified by these (their digest), as a matrix's.
    network_trace_contents: dict[str, Any] | None = None
    slow_rank: str | None = option(None, "rank R computes F times slower (a CPU quota on its process; on a GPU a "
                                         "pause after each step)", group=FAULTS, parse=_slow_rank, metavar="R:F")
    kill_replica: str | None = option(None, "replica R's ranks (rank R at --dp 1) are killed after STEP steps: a "
                                            "synchronous system ends as error, diloco goes on with the others",
                                      group=FAULTS, parse=_kill_replica, metavar="R@STEP")
    rejoin: bool = option(False, "a standby of the killed replica, started with the run, takes its place: it "
                                 "rejoins the others at their next quorum (diloco)", group=FAULTS)
    verify: bool = option(False, "also train the single-process reference and compare losses and gradients",
                          group=RUN, identity=False)
    no_link_probe: bool = option(False, "under --network on one machine: start the ranks without first probing the "
                                        "emulated links (the record's measured link stays empty; a sweep probes "
                                        "each network once before its runs)", group=RUN, identity=False)
    device: str = option("auto", "auto | cpu | cuda", group=RUN, identity=False)
    # What the ranks run on, resolved from ``device`` before launch (runners.request.resolve_devices):
    # "cpu" or "cuda:<GPU model>"; None until then (a planned run). Not a flag. Part of the identity: CPU
    # and GPU measurements of one config are different measurements.
    hardware: str | None = None
    timeout: float = option(3600.0, "seconds before the run is stopped and recorded as timeout", group=RUN,
                            identity=False)
    p2p_semantics: str = option("gloo", "gloo's own point-to-point semantics, or NCCL's rules followed on gloo "
                                        "(runners.nccl_rules: messages matched in issue order, tags ignored, a "
                                        "pair's operations one at a time): what would hang under NCCL hangs and "
                                        "ends as timeout naming each rank's pending operations; CPU only",
                                choices=P2P_SEMANTICS, group=RUN)
    options: SystemOptions = field(default_factory=SystemOptions)  # the system's own options (their own flags)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp

    @property
    def n_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any], options: type[SystemOptions] = SystemOptions) -> RunConfig:
        """The inverse of ``to_dict``; ``options`` is the class of the system's options. A config
        written before ``precision`` existed (``mixed_precision``) gets its policy (``legacy_precision``)."""
        d = legacy_precision(d)
        d["model"] = ModelConfig(**d["model"])
        d["optimizer"] = OptimizerConfig(**d["optimizer"])
        d["options"] = options.from_dict(d.get("options") or {})
        return cls(**d)

    def identity(self) -> dict[str, Any]:
        """What identifies the measurement: every field but the volatile ones (``VOLATILE_FIELDS``; the
        hardware is kept, None until resolved), and of the system's options only those that are part of
        its identity."""
        d = _plain(asdict(self.replace(options=SystemOptions())))
        for name in VOLATILE_FIELDS:
            del d[name]
        for f in dataclasses.fields(ModelConfig):  # the family's fields where unset: gpt's identity as it always was
            if f.name in FAMILY_FIELDS and d["model"][f.name] == f.default:
                del d["model"][f.name]
        if self.p2p_semantics == "gloo":  # the identity of every run before the field is as it always was
            del d["p2p_semantics"]
        if self.tokenizer == "byte":  # likewise
            del d["tokenizer"]
        d["options"] = _plain(self.options.identity())
        if self.network_matrix is None:  # the identity of every run without a matrix is as it always was
            del d["network_matrix"]
        else:
            d["network_matrix"] = self.network_digest()
        del d["network_trace_contents"]
        if self.network_trace is not None:  # a trace by its contents, not its path
            d["network_trace"] = _digest(self.network_trace_contents)
        for name, unset in (("network_trace", None), ("slow_rank", None), ("kill_replica", None), ("rejoin", False)):
            if d[name] == unset:  # the identity of every run without faults is as it always was
                del d[name]
        return d

    def network_digest(self) -> str | None:
        """The digest (SHA-256, 16 hex digits) of the per-link matrix the run ran under, or None."""
        return _digest(self.network_matrix)

    def key(self) -> str:
        """The run's identity as one string (sorted JSON): a sweep skips a key already recorded,
        a report cell shows the newest record of its key."""
        return json.dumps(self.identity(), sort_keys=True)


def _digest(contents: dict[str, Any] | None) -> str | None:
    """A file's contents as read (a matrix, a trace) by their digest (SHA-256, 16 hex digits), or None."""
    if contents is None:
        return None
    return hashlib.sha256(json.dumps(contents, sort_keys=True).encode()).hexdigest()[:16]


# The model's fields that came with the llama family: a run's identity holds them only where set (the
# identity of every gpt run is as it was before they existed)
FAMILY_FIELDS = frozenset({"family", "kv_heads", "ffn_hidden", "rope_theta", "norm_eps"})

# Fields of RunConfig that do not change what a run measures (declared ``identity=False``): two runs
# that differ only in these are the same measurement (a sweep runs it once; a report keeps the newest).
VOLATILE_FIELDS = frozenset(f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("identity", True))


def legacy_precision(config: dict[str, Any], device_kind: str | None = None) -> dict[str, Any]:
    """A config's fields (a dict, as ``to_dict`` or a run's key has them) with ``precision`` for the
    ``mixed_precision`` of a config written before the policy existed: false was fp32, true fp16 with
    loss scaling on CUDA and bf16 autocast elsewhere (``device_kind``, else the config's own device or
    hardware, says which: 'cuda' or not). A config that has ``precision`` comes back as it is (a copy)."""
    d = dict(config)
    if "mixed_precision" not in d:
        return d
    mixed = d.pop("mixed_precision")
    kind = device_kind or str(d.get("hardware") or d.get("device") or "").split(":")[0]
    d.setdefault("precision", ("fp16" if kind == "cuda" else "bf16") if mixed else "fp32")
    return d


def planned_key(key: str) -> tuple[str, str | None]:
    """A recorded key (``RunConfig.key``) as its planned run's key (the hardware not yet resolved),
    and the hardware it names (None: not resolved, or a record older than the hardware's place in
    the identity)."""
    d = json.loads(key)
    hardware = d.get("hardware")
    d["hardware"] = None
    return json.dumps(d, sort_keys=True), hardware


ENDS = "ends"  # --layers-per-stage: the first and the last stage one layer fewer


def layers_per_stage(text: str) -> tuple[int, ...] | str:
    """--layers-per-stage: comma-separated layer counts (e.g. 5,7,7,5), or 'ends'."""
    if text.strip() == ENDS:
        return ENDS
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--layers-per-stage takes comma-separated layer counts or '{ENDS}', got {text!r}") from None


def stage_layer_counts(n_layer: int, n_stages: int, given: tuple[int, ...] | str | None = None) -> tuple[int, ...]:
    """The layers of each of ``n_stages`` pipeline stages (model chunks with --virtual-pp), in model
    order: equal (``given`` None), the counts given, or ``ENDS``: the embeddings and the loss each
    counted as a layer, so that the first and the last stage hold one layer fewer than the others
    (Megatron-LM's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split).
    ConfigError (one line) where they do not add up to ``n_layer``."""
    if given is None:
        if n_layer % n_stages:
            raise ConfigError(f"{n_layer} layers do not divide into {n_stages} pipeline stages")
        return (n_layer // n_stages,) * n_stages
    if given == ENDS:
        if n_stages < 2 or (n_layer + 2) % n_stages or (n_layer + 2) // n_stages < 2:
            raise ConfigError(f"--layers-per-stage {ENDS}: {n_layer} layers and the embeddings and the loss (one layer "
                              f"each) do not divide into {n_stages} stages of 2 layers or more")
        k = (n_layer + 2) // n_stages
        return (k - 1,) + (k,) * (n_stages - 2) + (k - 1,)
    if len(given) != n_stages or sum(given) != n_layer or min(given) < 1:
        raise ConfigError(f"--layers-per-stage {','.join(map(str, given))}: needs {n_stages} counts of 1 layer or more "
                          f"(one per pipeline stage, per model chunk with --virtual-pp) adding up to {n_layer} layers")
    return tuple(given)


@dataclass(frozen=True)
class PipelineOptions(SystemOptions):
    """A pipeline schedule, its model chunks per rank and the layers of each stage, as pipeline systems
    declare them. A subclass redeclares ``schedule`` with its own default and choices, and lists in
    ``CHUNKED`` the schedules that place several model chunks on every rank."""

    CHUNKED = frozenset({"interleaved"})
    schedule: str = option("gpipe", "pipeline schedule")
    virtual_pp: int | None = option(None, "model chunks per rank (default 2 with a schedule that places several "
                                          "per rank, else 1)", parse=int, metavar="V")
    layers_per_stage: tuple[int, ...] | str | None = option(
        None, "layers of each pipeline stage (of each model chunk with --virtual-pp), in model order, e.g. 5,7,7,5; "
              f"'{ENDS}': the first and the last stage one layer fewer (the embeddings and the loss count as one "
              "layer each); default: equal", parse=layers_per_stage, metavar=f"N1,N2,...|{ENDS}")

    def __post_init__(self) -> None:
        if self.virtual_pp is None:
            object.__setattr__(self, "virtual_pp", 2 if self.schedule in self.CHUNKED else 1)

    def identity(self) -> dict[str, Any]:
        d = super().identity()
        if self.layers_per_stage is None:  # the identity of every run of equal stages is as it always was
            del d["layers_per_stage"]
        return d

    def stage_layers(self, config: RunConfig) -> tuple[int, ...]:
        """The layers of each of the run's pipeline stages (model chunks), in model order."""
        return stage_layer_counts(config.model.n_layer, config.pp * self.virtual_pp, self.layers_per_stage)

    def check(self, config: RunConfig) -> None:
        if self.schedule in self.CHUNKED and self.virtual_pp < 2:
            raise ConfigError(f"--schedule {self.schedule} needs --virtual-pp >= 2 (model chunks per rank)")
        if self.schedule not in self.CHUNKED and self.virtual_pp != 1:
            raise ConfigError(f"--virtual-pp > 1 needs a schedule that places several model chunks per rank "
                              f"({', '.join(sorted(self.CHUNKED))})")
        try:
            self.stage_layers(config)
        except ConfigError as exc:
            if self.layers_per_stage is not None:
                raise
            raise ConfigError(f"{exc} (--pp {config.pp} x --virtual-pp {self.virtual_pp}; or give "
                              f"--layers-per-stage)") from None
