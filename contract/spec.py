"""How a system declares itself (``SystemSpec``) and the one function it implements (``Train``).

A system's spec module (what the registry lists) holds its options dataclass and one ``SPEC``; it
must import nothing heavy (no torch, no framework), because the run command reads every spec to
build its command line. The training code is named by ``SystemSpec.train`` and imported only in
the ranks (Megatron's CPU shims, for one, must be installed before megatron is first imported).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from contract.config import P2P_SEMANTICS, PRECISIONS, ConfigError, RunConfig, SystemOptions
from contract.faults import check_faults
from workload.configs import FAMILIES, OPTIMIZERS, ModelConfig
from workload.tokens import check_vocab

if TYPE_CHECKING:  # torch: only the ranks import it
    from contract.rank import Context, Measurements

DIMS = ("pp", "tp", "dp")


class Train(Protocol):
    def __call__(self, config: RunConfig, context: Context) -> Measurements:
        """Train ``config``'s workload on this rank and measure it: the one function a system implements.

        The run command calls it once in every rank it starts (``SystemSpec.processes(config)`` of them,
        under torchrun, ``torch.distributed`` initialised: nccl on CUDA, gloo on CPU, one thread per rank
        on CPU), with the same judged ``config`` everywhere and this rank's ``context``. It must:

        - Build its model from the shared workload, never its own: the whole model with
          ``context.build_model()``, or pipeline stages with ``context.build_stage(spec)`` (the layers
          cut by ``workload.partition.stage_specs``). Every system then starts from the same seeded
          weights, and its parameters keep the shared model's names.
        - Train on ``context.batch(step, dp_rank)``, the tokens of data-parallel replica ``dp_rank`` at
          ``step`` (``config.batch_size`` sequences a replica; the global batch is ``batch_size x dp``),
          with the optimizer and precision every system shares (``workload.training``).
        - Time its steps with ``contract.rank.run_steps(context, dp_rank, step_fn, weights)``:
          ``config.warmup`` steps untimed, then ``config.steps`` timed ones, each framed by the timing
          barrier; fewer once an eval reaches ``config.target_loss`` (a step prepared ahead asks
          ``context.plan``). ``weights()`` gives, for ``--eval-every``'s held-out eval, the full
          tensors of the parameters this rank holds by the shared model's names (gathering shards).
          ``step_fn(step, inputs, targets)`` runs one whole optimizer step and returns a ``StepOutput``:
          the replica's loss on the ranks that see it (a pipeline's last stage), None on the others,
          and the seconds of data-parallel synchronisation inside the step. Its point-to-point messages
          are matched by order, never by tag, on process groups of its own, and no receive holds back a
          send its peer waits for (NCCL runs a pair's operations in issue order).
        - Return ``run_steps``'s ``Measurements``, with ``extra`` holding the choices it resolved at
          run time (a slicing, say: the record keeps them with the options), and, under
          ``config.verify``, ``grads``: the last step's gradients of the parameters this rank holds,
          full tensors averaged over data parallelism, by the shared model's parameter names
          (``--verify`` compares them and the losses with the single-process reference's).

        It prints no tables and writes no files (a trace its options ask for aside); an exception
        fails the run (one that says out of memory is recorded as ``oom``). Its code imports only
        ``contract``, ``workload`` and its own package (``tests/test_imports.py``).

        Args:
            config: the run, judged before anything was launched; ``config.options`` is an instance of
                the system's own ``SystemSpec.options``.
            context: this rank: ``rank``, ``local_rank``, ``world_size``, ``device``, ``backend``, the
                seeded workload (``build_model``, ``build_stage``, ``batch``) and the timing barrier's
                process group.

        Returns:
            Measurements: this rank's step, busy and barrier times, its losses where it sees them, its
            gradients under ``--verify``; the launcher merges every rank's into the run's record.
        """
        ...


def all_ranks(config: RunConfig) -> int:
    return config.pp * config.tp * config.dp


def one_device(config: RunConfig) -> int:
    return 1


@dataclass(frozen=True)
class SystemSpec:
    name: str
    train: str  # "package.module:function", a Train: train(config, context) -> Measurements
    description: str  # one line, shown in --help
    options: type[SystemOptions] = SystemOptions  # the system's own options
    dims: tuple[str, ...] = ()  # parallel dimensions it supports beyond 1, of "pp", "tp", "dp"
    processes: Callable[[RunConfig], int] = all_ranks  # processes (ranks) a run starts
    devices_per_process: Callable[[RunConfig], int] = one_device
    label: Callable[[RunConfig], str] | None = None  # a run's column in reports (default: the name)
    details: Callable[[dict[str, Any]], str] | None = None  # a run's resolved choices, from its record's options
    role: str = "baseline"  # "baseline", "ours" or "reference": how reports compare it (ours against the best baseline)
    # Under --precision bf16 / fp16 it keeps the weights and activations themselves in half precision
    # (fp32 main copies in the optimizer, as megatron) rather than autocasting fp32 weights: --verify
    # then compares it with the reference run the same way (runners.tolerance).
    half_weights: bool = False
    # What the run command starts beside the ranks and stops with them (runners.services), e.g.
    # "torchft-lighthouse" for torchft's quorums.
    services: tuple[str, ...] = ()
    # The single-process run --verify compares against (None: the reference system on the global
    # batch); a system that changes the optimization names the reference's run of its math (diloco:
    # the reference's own steps with the outer step applied to them, ``reference --diloco``).
    reference: Callable[[RunConfig], RunConfig] | None = None
    # It goes on when a data-parallel replica dies (--kill-replica; torchft's quorums), and takes one
    # back (--rejoin); a synchronous system ends as error instead.
    fault_tolerant: bool = False

    def load(self) -> Train:
        """The system's train function (imports its training code)."""
        module, _, function = self.train.partition(":")
        return getattr(importlib.import_module(module), function)

    def run_label(self, config: RunConfig) -> str:
        """The run's column; a config built without this system's options labels as its defaults."""
        if type(config.options) is SystemOptions and self.options is not SystemOptions:
            config = config.replace(options=self.options())
        return self.label(config) if self.label else self.name

    def run_details(self, options: dict[str, Any]) -> str:
        return self.details(options) if self.details else ""

    def validate(self, config: RunConfig, build: bool = True) -> None:
        """Raise ConfigError (one line) if this system cannot run ``config``: the fields every run
        has, then the system's own options (their choices, then ``options.check``), then what this
        repository's build of it cannot run (``options.check_build``; ``build=False``: the system as
        published, which a prediction describes)."""
        if config.system != self.name:
            raise ConfigError(f"config of system {config.system!r} given to {self.name!r}")
        if not isinstance(config.options, self.options):
            raise ConfigError(f"system {self.name!r} takes {self.options.__name__}, "
                              f"got {type(config.options).__name__}")
        check_common(config)
        check_faults(config, self.processes(config), self.fault_tolerant)
        for dim in DIMS:
            if getattr(config, dim) > 1 and dim not in self.dims:
                supported = ", ".join(f"--{d}" for d in self.dims) or "none"
                raise ConfigError(f"system {self.name!r} does not support --{dim} > 1 (it supports: {supported})")
        for f in config.options.declared():
            choices = f.metadata.get("choices")
            value = getattr(config.options, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{self.name}: unknown --{f.name.replace('_', '-')} {value!r}; "
                                  f"choose from {', '.join(choices)}")
        config.options.check(config)
        if build:
            config.options.check_build(config)


def check_family(m: ModelConfig) -> None:
    """The family's own fields (``workload.configs``): grouped-query attention and rotary positions are
    llama's; a key/value head serves a whole number of query heads."""
    if m.family not in FAMILIES:
        raise ConfigError(f"model {m.name!r}: unknown family {m.family!r}; choose from {', '.join(FAMILIES)}")
    if m.kv_heads is not None and (not 1 <= m.kv_heads <= m.n_head or m.n_head % m.kv_heads):
        raise ConfigError(f"--kv-heads {m.kv_heads} must divide --num-heads {m.n_head}")
    if not m.llama and m.n_kv_head != m.n_head:
        raise ConfigError(f"--kv-heads {m.kv_heads}: grouped-query attention is the llama family's (model {m.name!r} "
                          f"is gpt: one key/value head per query head)")
    if m.ffn_hidden is not None and m.ffn_hidden < 1:
        raise ConfigError(f"--ffn-hidden-size must be >= 1, got {m.ffn_hidden}")
    if m.llama and (m.head_dim % 2 or not 0 < m.rope_theta < float("inf")):
        raise ConfigError(f"rotary positions need an even head width (--hidden-size {m.n_embd} / --num-heads "
                          f"{m.n_head} = {m.head_dim}) and a finite --rope-theta > 0, got {m.rope_theta}")


def check_common(config: RunConfig) -> None:
    """The fields every run has (ConfigError names the run command's flag)."""
    m = config.model
    positive = {"--pp": config.pp, "--tp": config.tp, "--dp": config.dp, "--batch-size": config.batch_size,
                "--micro-batch-size": config.micro_batch_size, "--steps": config.steps,
                "--num-layers": m.n_layer, "--hidden-size": m.n_embd, "--num-heads": m.n_head,
                "--seq-length": m.seq_len, "--vocab-size": m.vocab_size}
    for flag, value in positive.items():
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if config.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {config.warmup}")
    if config.eval_every < 0:
        raise ConfigError(f"--eval-every must be >= 0 steps (0: no eval), got {config.eval_every}")
    if config.target_loss is not None:
        if not config.eval_every:
            raise ConfigError("--target-loss needs --eval-every N (the run stops at an eval)")
        if not 0 < config.target_loss < float("inf"):
            raise ConfigError(f"--target-loss must be a finite loss > 0, got {config.target_loss}")
    if not config.timeout > 0 or config.timeout == float("inf"):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {config.timeout}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"--hidden-size {m.n_embd} is not divisible by --num-heads {m.n_head}")
    check_family(m)
    if config.batch_size % config.micro_batch_size:
        raise ConfigError(f"--batch-size {config.batch_size} is not divisible by --micro-batch-size "
                          f"{config.micro_batch_size}")
    if config.precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {config.precision!r}; choose from {', '.join(PRECISIONS)}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown --device {config.device!r}; choose from auto, cpu, cuda")
    if config.p2p_semantics not in P2P_SEMANTICS:
        raise ConfigError(f"unknown --p2p-semantics {config.p2p_semantics!r}; choose from {', '.join(P2P_SEMANTICS)}")
    opt = config.optimizer
    if opt.kind not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {opt.kind!r}; choose from {', '.join(OPTIMIZERS)}")
    if not 0 < opt.lr < float("inf"):
        raise ConfigError(f"--lr must be a finite number > 0, got {opt.lr}")
    if config.data is not None and check_vocab(config.tokenizer, m.vocab_size):
        raise ConfigError(f"--data: {check_vocab(config.tokenizer, m.vocab_size)}")
    if config.tokenizer != "byte" and config.data is None:
        raise ConfigError(f"--tokenizer {config.tokenizer} tokenizes text: it needs --data")
    if m.n_layer % config.pp and getattr(config.options, "layers_per_stage", None) is None:
        raise ConfigError(f"{m.n_layer} layers do not divide into {config.pp} pipeline stages (--pp {config.pp})")
    if m.n_head % config.tp or m.n_embd % config.tp:
        raise ConfigError(f"--tp {config.tp} must divide the heads ({m.n_head}) and the hidden size ({m.n_embd})")
