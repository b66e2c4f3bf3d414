"""diloco: DiLoCo and Streaming DiLoCo (torchft), data parallel over D replicas, each replica one
process or ours' token-level pipeline over P ranks (``--pp P``): a pipeline within a site, DiLoCo
across sites. This module declares it (options, ``SPEC``); the rest:

- ``ours.diloco.train``: the ranks' training: per replica, ours' ``StageEngine`` (P > 1) or the whole
  model (P = 1) with the run's optimizer as the inner optimizer; on every rank a torchft ``Manager``
  (its replica group: the replica's P ranks; its process group: the same stage of every replica)
  and ``torchft.local_sgd.DiLoCo`` over the stage's fragments, with an SGD Nesterov outer optimizer
  per fragment;
- ``ours.diloco.fragments``: the model's units (embeddings, blocks, head) each stage splits into
  Streaming DiLoCo's fragments;
- ``ours.diloco.reference`` declares ``diloco_sim``, and ``ours.diloco.simulate`` trains it: the same
  algorithm in one process without torchft (``--verify``'s reference for this system).

It is declared inside ``ours`` because a replica runs ours' pipeline engine: a system's training
code may import only the contract, the workload and its own package, and its package is ``ours``.

Layouts: ``D-n`` (one process per replica) and ``P-p D-n`` (ours' pipeline of p stages per
replica, rank = replica x p + stage); no tensor parallelism. Every stage splits into the same
number of fragments. The lighthouse that forms the quorums is started and stopped by the run
command (``runners.services``).
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, RunConfig, SystemOptions, SystemSpec, option
from ours import OursOptions, describe_slicing, slice_count, slice_lengths
from ours.schedule import SCHEDULES


@dataclass(frozen=True)
class DiLoCoAlgorithm(SystemOptions):
    """The algorithm's options (what the simulation takes too)."""

    inner_steps: int = option(8, "H: inner steps (each replica's own optimizer steps) between outer steps; 1 "
                                 "averages every step", metavar="H")
    outer_lr: float = option(0.7, "the outer optimizer's learning rate (SGD with Nesterov momentum on the averaged "
                                  "pseudo-gradient, as the DiLoCo paper)", metavar="LR")
    outer_momentum: float = option(0.9, "the outer optimizer's Nesterov momentum (0: plain SGD)", metavar="M")
    fragments: int = option(1, "Streaming DiLoCo: each stage's model split into F fragments, one synced every H/F "
                               "steps in turn (1: DiLoCo)", metavar="F")
    sync_delay: int = option(0, "Streaming DiLoCo: inner steps a fragment's all-reduce overlaps before the outer "
                                "step waits for it (tau, < H/F)", metavar="TAU")
    fragment_alpha: float = option(0.0, "Streaming DiLoCo: after an outer step, a fragment's weights are "
                                        "(1 - alpha) x global + alpha x local", metavar="ALPHA")
    quantize: bool = option(False, "torchft's quantized sync (fp8 row-wise all-reduce of the pseudo-gradients; "
                                   "torchft offers it with triton on CUDA only)")

    @property
    def streaming(self) -> bool:
        return self.fragments > 1

    def lossy(self) -> str | None:
        return "fp8 sync" if self.quantize else None

    def algorithm(self) -> DiLoCoAlgorithm:
        return DiLoCoAlgorithm(**{f.name: getattr(self, f.name) for f in DiLoCoAlgorithm.declared()})

    def check(self, config: RunConfig) -> None:
        H, F = self.inner_steps, self.fragments
        if H < 1:
            raise ConfigError(f"--inner-steps must be >= 1, got {H}")
        if F < 1:
            raise ConfigError(f"--fragments must be >= 1, got {F}")
        if H % F:
            raise ConfigError(f"--inner-steps {H} must be a multiple of --fragments {F} (one fragment every H/F steps)")
        if not 0 <= self.sync_delay < H // F:
            raise ConfigError(f"--sync-delay must be in 0..{H // F - 1} (below H/F = {H // F}), got {self.sync_delay}")
        if not 0 <= self.fragment_alpha <= 1:
            raise ConfigError(f"--fragment-alpha must be in [0, 1], got {self.fragment_alpha}")
        if not 0 < self.outer_lr < float("inf"):
            raise ConfigError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if config.precision == "fp16":
            raise ConfigError("--precision fp16: DiLoCo's inner steps have no loss scaling here; use bf16 or fp32")
        if self.quantize and config.device != "cuda":
            raise ConfigError("--quantize: torchft quantizes its sync with triton on CUDA only (use --device cuda)")
        fewest = min_units(config.model.n_layer, config.pp)
        if F > fewest:
            raise ConfigError(f"--fragments {F}: a stage of {config.model.n_layer // config.pp} layers has only "
                              f"{fewest} units (embeddings, blocks, head) to split")


@dataclass(frozen=True)
class DiLoCoOptions(DiLoCoAlgorithm):
    """The algorithm's options and those of ours' pipeline inside a replica."""

    n_slices: int | str = option("auto", "ours' pipeline inside a replica (--pp > 1): K equal token slices or 'auto' "
                                         "(as ours)", parse=slice_count, metavar="K|auto")
    slices: tuple[int, ...] | None = option(None, "ours' pipeline inside a replica: explicit token slice lengths",
                                            parse=slice_lengths, metavar="L1,L2,...")
    schedule: str = option("1f1b", "ours' pipeline inside a replica: the order of forwards and backwards (as ours)",
                           choices=SCHEDULES)

    def __post_init__(self) -> None:
        if self.slices is not None and self.n_slices == "auto":  # one canonical form, as ours
            object.__setattr__(self, "n_slices", len(self.slices))

    def pipeline(self) -> OursOptions:
        """ours' options for the pipeline inside a replica."""
        return OursOptions(n_slices=self.n_slices, slices=self.slices, schedule=self.schedule)

    def check(self, config: RunConfig) -> None:
        super().check(config)
        if config.pp == 1 and (self.slices is not None or self.n_slices != "auto" or self.schedule != "1f1b"):
            raise ConfigError("--n-slices, --slices and --schedule set ours' pipeline inside a replica: "
                              "they need --pp > 1")
        if config.pp > 1:
            self.pipeline().check(config)


def min_units(n_layer: int, pp: int) -> int:
    """The fewest fragment units a stage holds: its blocks, plus the embeddings (first stage) and
    the head (last stage)."""
    per = n_layer // pp
    if pp == 1:
        return per + 2
    return per + 1 if pp == 2 else per


def label(config: RunConfig) -> str:
    o: DiLoCoAlgorithm = config.options
    name = f"diloco H={o.inner_steps}"
    if o.streaming:
        name = (f"streaming {name} F={o.fragments}" + (f" tau={o.sync_delay}" if o.sync_delay else "")
                + (f" alpha={o.fragment_alpha:g}" if o.fragment_alpha else ""))
    return name + (" fp8 sync" if o.quantize else "")


def simulation(config: RunConfig) -> RunConfig:
    """--verify's reference: the same algorithm, data and replicas in one process. It keeps --pp,
    which decides the stages' fragments; the pipeline's options do not change the math."""
    return config.replace(system="diloco_sim", network="none", options=config.options.algorithm())


SPEC = SystemSpec(
    name="diloco",
    train="ours.diloco.train:train",
    description="DiLoCo / Streaming DiLoCo (torchft) across D replicas, each one process or ours' pipeline (--pp)",
    options=DiLoCoOptions,
    dims=("pp", "dp"),
    label=label,
    details=describe_slicing,
    role="ours",
    services=("torchft-lighthouse",),
    reference=simulation,
    fault_tolerant=True,
)
