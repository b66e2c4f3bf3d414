"""ours: the project's own system — a token-level pipeline (TeraPipe), tensor parallelism inside a
stage, and all-reduce or parameter-server data parallelism. This module declares it (options and SPEC); the rest:

- ``ours.train``: ``train(config, context)``, the entry point the ranks call;
- ``ours.engine``: one stage's token-sliced pipeline step (asynchronous point-to-point transfers,
  deferred weight gradients that fill the bubble);
- ``ours.schedule``: the order of a stage's forwards and backwards (1F1B over batch slices, or GPipe),
  and the next step's first forwards each stage runs at the end of a step (``--prefetch``);
- ``ours.kernels``: the exact sliced attention Function (KV state, gradient accumulation for earlier
  slices) and the deferred-gradient linear;
- ``ours.tp``: Megatron-style tensor parallelism inside a stage (``--tp``);
- ``ours.dp``: allreduce, central_ps and sharded_ps data parallelism;
- ``ours.trace``: the measured schedule as a Chrome trace;
- ``ours.plan``: the latency model and slicing planner (``--n-slices auto``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract import ConfigError, RunConfig, SystemOptions, SystemSpec, option
from ours.schedule import SCHEDULES, leading_forwards

DP_MODES = ("allreduce", "central_ps", "sharded_ps")
WIRE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --wire-dtype: the torch dtype's name


def slice_count(text: str) -> int | str:
    """--n-slices: a positive integer, 'auto' or 'search'."""
    if text in ("auto", "search"):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--n-slices takes an integer, 'auto' or 'search', got {text!r}") from None


def prefetch_count(text: str) -> int | str:
    """--prefetch: a count of forwards, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--prefetch takes an integer or 'auto', got {text!r}") from None


def slice_lengths(text: str) -> tuple[int, ...]:
    """--slices: comma-separated token lengths."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--slices takes comma-separated integers, got {text!r}") from None


def uniform_slices(seq_len: int, k: int) -> tuple[int, ...]:
    """K near-equal token slices of the sequence."""
    q, r = divmod(seq_len, k)
    return tuple(q + (1 if i < r else 0) for i in range(k))


@dataclass(frozen=True)
class OursOptions(SystemOptions):
    n_slices: int | str = option("auto", "K equal token slices; 'auto': the planner's optimal slicing for the run "
                                 "(TeraPipe's formula over the device's compute model: ours.plan.auto); 'search': "
                                 "time steps of K = 1, 2, 4, 8, 16 before the first step, starting near the "
                                 "planner's K, and keep the fastest (ours.plan.tune)",
                                 parse=slice_count, metavar="K|auto|search")
    slices: tuple[int, ...] | None = option(None, "explicit token slice lengths, e.g. 256,256,512",
                                            parse=slice_lengths, metavar="L1,L2,...")
    schedule: str = option("1f1b", "the order of the units' forwards and backwards (ours.schedule): 1f1b over batch "
                                   "slices (a stage holds at most P - stage batch slices' activations), or gpipe "
                                   "(every forward, then every backward); the same with one batch slice",
                           choices=SCHEDULES)
    prefetch: int | str = option("auto", "the next step's first forwards each stage but the last runs at the end of a "
                                         "step, once its optimizer has stepped: N on the first stage, N - s on stage "
                                         "s (ours.schedule.ahead); 'auto': P - 1, so that no stage waits for its first "
                                         "input when a step begins; 0: off. They are the next step's own work, run in "
                                         "this step's timed window", parse=prefetch_count, metavar="N|auto")
    dp_mode: str = option("allreduce", "data parallelism across pipelines", choices=DP_MODES)
    wire_dtype: str = option("fp32", "the type activations, their gradients and the DP push and pull cross the "
                                     "network in; bf16 and fp16 halve the bytes and are lossy (opt-in, as "
                                     "AQ-SGD / CocktailSGD compress what crosses a slow link)",
                             choices=tuple(WIRE_DTYPES))
    trace: str | None = option(None, "write a Chrome trace of every rank's spans to this file", identity=False,
                               output_path=True, metavar="FILE")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "OursOptions":
        # a record written before --schedule existed ran every forward, then every backward; one written
        # before --prefetch existed ran nothing ahead
        return super().from_dict({"schedule": "gpipe", "prefetch": 0, **values})

    def __post_init__(self) -> None:
        if self.slices is not None and self.n_slices in ("auto", "search"):  # one form of an explicit slicing
            object.__setattr__(self, "n_slices", len(self.slices))

    def lossy(self) -> str | None:
        return None if self.wire_dtype == "fp32" else f"{self.wire_dtype} wire"

    @property
    def auto(self) -> bool:
        """The slicing is chosen at run time (by the planner, and with 'search' timed after it)."""
        return self.n_slices in ("auto", "search")

    @property
    def search(self) -> bool:
        return self.n_slices == "search"

    def first_ahead(self, pp: int) -> int:
        """N of ``--prefetch``: the forwards the first stage runs of the next step ('auto': P - 1; each
        stage's own count: ``ours.schedule.ahead``)."""
        return pp - 1 if self.prefetch == "auto" else self.prefetch

    def token_slices(self, seq_len: int) -> tuple[int, ...]:
        """The slicing when it is fixed by the options (explicit, or K equal slices); not for 'auto'."""
        if self.slices is not None:
            return self.slices
        if self.auto:
            raise ValueError(f"the {self.n_slices!r} slicing is chosen at run time")
        return uniform_slices(seq_len, self.n_slices)

    def check(self, config: RunConfig) -> None:
        seq = config.model.seq_len
        if config.model.n_kv_head % config.tp:
            raise ConfigError(f"ours splits the key/value heads over --tp {config.tp}: --kv-heads "
                              f"{config.model.n_kv_head} must divide by it")
        if self.prefetch != "auto" and self.prefetch < 0:
            raise ConfigError(f"--prefetch must be >= 0 forwards, got {self.prefetch}")
        self._check_effect(config)
        if self.slices is not None:
            text = ",".join(map(str, self.slices))
            if self.n_slices != len(self.slices):
                raise ConfigError(f"give either --n-slices or --slices, not both (--n-slices {self.n_slices}, "
                                  f"--slices {text})")
            if any(s < 1 for s in self.slices):
                raise ConfigError(f"--slices must be positive lengths, got {text}")
            if sum(self.slices) != seq:
                raise ConfigError(f"--slices {text} sum to {sum(self.slices)}, not the sequence length {seq}")
        elif not self.auto:
            if self.n_slices < 1:
                raise ConfigError(f"--n-slices must be >= 1, got {self.n_slices}")
            if self.n_slices > seq:
                raise ConfigError(f"--n-slices {self.n_slices} exceeds the sequence length {seq}")

    def _check_effect(self, config: RunConfig) -> None:
        """An option that would do nothing in this layout is a bad request: it would still change the
        run's label and identity (a column of its own for the same measurement)."""
        if self.dp_mode != "allreduce" and config.dp == 1:
            raise ConfigError(f"--dp-mode {self.dp_mode} needs --dp > 1: with one pipeline there is no data "
                              "parallelism to run")
        if self.wire_dtype != "fp32" and config.pp == 1 and config.dp == 1:
            raise ConfigError(f"--wire-dtype {self.wire_dtype} needs --pp > 1 or --dp > 1: it is the type of the "
                              "pipeline's activations and gradients and of the DP push and pull"
                              + (", not of tensor parallelism's all-reduces (they keep --precision's type)"
                                 if config.tp > 1 else "; on one device nothing crosses the wire"))
        given = self.prefetch if self.prefetch != "auto" else 0  # 'auto' does nothing at P-1: never refused
        if given and config.pp == 1:
            raise ConfigError("--prefetch needs --pp > 1: with one stage no later stage waits for the next step's "
                              "first forwards")
        if given and not self.auto:
            k = len(self.token_slices(config.model.seq_len))
            lead = leading_forwards(self.schedule, config.n_micro_batches, k, 0, config.pp)
            if self.prefetch > lead:
                raise ConfigError(f"--prefetch {self.prefetch} exceeds the {lead} forwards the first stage runs before "
                                  f"its first backward ({config.n_micro_batches} batch slice(s) x {k} token slices, "
                                  f"--schedule {self.schedule}): give at most {lead}")


def describe_slicing(options: dict[str, Any]) -> str:
    """The slicing a run used, from its record's options (``slices``: what the ranks resolved)."""
    slices = options.get("slices")
    if not slices:
        return ""
    parts, run = [], [slices[0], 0]
    for s in slices:  # run-length: 128x8, or 88x6,56x3,48
        if s == run[0]:
            run[1] += 1
        else:
            parts.append(run)
            run = [s, 1]
    parts.append(run)
    text = ",".join(f"{s}x{n}" if n > 1 else str(s) for s, n in parts)
    source = str(options.get("slicing", ""))
    how = f"{options.get('n_slices')}, {source.split(' ')[0].rstrip(':')}: " if options.get("n_slices") in (
        "auto", "search") and source else ""
    return f"{how}K={len(slices)} ({text})"


def describe_run(options: dict[str, Any]) -> str:
    """ours' choices from its record's options: the slicing (``describe_slicing``) and what the first
    stage ran ahead (``--prefetch``; a count given, lowered with the slicing 'auto', to the forwards
    before the first backward; 'auto' not yet resolved by a run says nothing)."""
    parts = [describe_slicing(options)]
    if options.get("prefetch") and options["prefetch"] != "auto":
        asked = options.get("prefetch_asked")
        parts.append(f"prefetch {options['prefetch']}" + (f" ({asked} asked: the forwards the first stage runs before "
                                                          "its first backward)" if asked else ""))
    return ", ".join(p for p in parts if p)


SPEC = SystemSpec(
    name="ours",
    train="ours.train:train",
    description="token-level pipeline (TeraPipe) with all-reduce or parameter-server data parallelism",
    options=OursOptions,
    dims=("pp", "tp", "dp"),
    label=lambda config: " ".join(["ours"] + ([config.options.schedule] if config.options.schedule != "1f1b" else [])
                                  + ([config.options.dp_mode] if config.dp > 1 else [])
                                  + ([config.options.lossy()] if config.options.lossy() else [])),
    details=describe_run,
    role="ours",
)
