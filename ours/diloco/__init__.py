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
- ``contract.outer``: the outer step's options, which the reference takes too: ``--verify`` compares
  diloco with the reference's own steps with the outer step applied to them (``reference --diloco``).

It is declared inside ``ours`` because a replica runs ours' pipeline engine: a system's training
code may import only the contract, the workload and its own package, and its package is ``ours``.

Layouts: ``D-n`` (one process per replica) and ``P-p D-n`` (ours' pipeline of p stages per
replica, rank = replica x p + stage); no tensor parallelism. Every stage splits into the same
number of fragments. The lighthouse that forms the quorums is started and stopped by the run
command (``runners.services``).
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, RunConfig, SystemSpec, option
from contract.faults import killed
from contract.outer import OuterStep, describe
from contract.registry import get_system
from ours import OursOptions, describe_slicing, slice_count, slice_lengths
from ours.schedule import SCHEDULES


@dataclass(frozen=True)
class DiLoCoAlgorithm(OuterStep):
    """The algorithm's options: the outer step's (``contract.outer``) and torchft's quantized sync."""

    quantize: bool = option(False, "torchft's quantized sync (fp8 row-wise all-reduce of the pseudo-gradients; "
                                   "torchft offers it with triton on CUDA only)")

    def lossy(self) -> str | None:
        return "fp8 sync" if self.quantize else None

    def check(self, config: RunConfig) -> None:
        self.check_algorithm(config)
        self.check_measured(config)

    def check_algorithm(self, config: RunConfig) -> None:
        """The outer step's options (``contract.outer``) and what torchft's sync allows."""
        super().check(config)
        if config.precision == "fp16":
            raise ConfigError("--precision fp16: DiLoCo's inner steps have no loss scaling here; use bf16 or fp32")
        if self.quantize and config.device != "cuda":
            raise ConfigError("--quantize: torchft quantizes its sync with triton on CUDA only (use --device cuda)")

    def check_measured(self, config: RunConfig) -> None:
        """The measured steps hold an outer step (a fragment's sync after every H/F inner steps)."""
        H, F = self.inner_steps, self.fragments
        every, w = H // F, config.warmup
        if (w + config.steps) // every == w // every:
            least = every * (w // every + 1) - w
            raise ConfigError(f"--steps {config.steps} after --warmup {w}: the measured steps hold no outer step "
                              f"(one every {every} inner steps: --inner-steps {H}"
                              + (f" / --fragments {F}" if F > 1 else "") + f"), so nothing of DiLoCo would be "
                              f"measured; give --steps >= {least} or a smaller --inner-steps")


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
        if config.dp < 2:
            raise ConfigError(f"diloco averages replicas: --dp {config.dp} has nothing to average (give --dp 2 or "
                              "more)")
        self.check_algorithm(config)
        if config.pp == 1 and (self.slices is not None or self.n_slices != "auto" or self.schedule != "1f1b"):
            raise ConfigError("--n-slices, --slices and --schedule set ours' pipeline inside a replica: "
                              "they need --pp > 1")
        if config.pp > 1:
            self.pipeline().check(config)
        self.check_measured(config)
        self.check_rejoin(config)

    def check_rejoin(self, config: RunConfig) -> None:
        """Under --rejoin, the killed replica's standby can rejoin: the killed replica took part in an
        outer step (which the others then have to heal it from), and the others ask for a quorum after
        it died and then run a step more (torchft's way in: a quorum, from which it heals)."""
        kill = killed(config)
        if not config.rejoin or kill is None:
            return
        replica, k = kill
        every, tau, total = self.inner_steps // self.fragments, self.sync_delay, config.total_steps
        if k < every:
            raise ConfigError(f"--kill-replica {config.kill_replica} --rejoin: replica {replica} dies before the first "
                              f"outer step (after step {every}), so the others would have none to heal it from: "
                              f"kill it after {every} steps or more")
        asks = next(s for s in range(k, k + every) if s % every == every - tau - 1)  # the others' next quorum
        if asks + max(tau, 1) > total - 1:
            raise ConfigError(f"--kill-replica {config.kill_replica} --rejoin: the others' next quorum after it dies "
                              f"comes at step {asks + 1} of {total}, too late to rejoin and run a step with them "
                              "(give more --steps or kill it earlier)")


def label(config: RunConfig) -> str:
    return describe(config.options) + (" fp8 sync" if config.options.quantize else "")


def reference(config: RunConfig) -> RunConfig:
    """--verify's reference: the reference system's own steps with the outer step applied to them
    (``--diloco``: the same data, replicas and outer step, in one process). It keeps --pp, which
    decides the stages' fragments; the pipeline's options do not change the math."""
    options = get_system("reference").options(diloco=True, **config.options.outer_step().to_dict())
    return config.replace(system="reference", network="none", network_matrix=None, p2p_semantics="gloo",
                          options=options)


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
    reference=reference,
    fault_tolerant=True,
)
