"""What the simulator is asked (a run description) and what it answers (a prediction).

The run description is the simulator's own: it names the fields of a run that decide its step time
and nothing else (no steps, seeds, files or devices). ``predict.from_config`` builds one from the run
command's RunConfig; tests and the seed tables build them directly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from contract.config import PRECISIONS, ConfigError, stage_layer_counts
from contract.links import Link
from ours import OursOptions
from workload.configs import ModelConfig

# What the simulator has a program for (``predict.programs``): per system (``predict.systems``), the
# schedules its program runs, the default first. ours' engine (ours, and the seed's GPipe at one token
# slice) runs each of ours' orders; a system not named here, or another of its schedules, is not modelled.
MODELLED = {"torch_pipe": ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"), "fairscale_fsdp": ("gpipe",),
            "megatron": ("1f1b", "interleaved", "zb1p", "zb2p"), "ours": OursOptions.choices("schedule"),
            "gpipe": ("gpipe",) + tuple(s for s in OursOptions.choices("schedule") if s != "gpipe")}
# Model chunks per rank a schedule places (the V's two; the zero-bubble ZB-H1 and ZB-H2 one).
CHUNKS_PER_RANK = {"zbv": 2, "dualpipev": 2, "zb1p": 1, "zb2p": 1}
# Data parallelism: ours' modes (the baselines' all-reduce, FSDP's reduce-scatter run by their programs),
# and ``chain_ps``, the seed's (DT-FM's) central PS.
SYNCS = OursOptions.choices("dp_mode") + ("chain_ps",)
# RunSpec's fields that only megatron's program runs (its options of the same names)
MEGATRON_ONLY = ("sequence_parallel", "recompute_granularity", "distributed_optimizer", "overlap_grad_reduce",
                 "overlap_param_gather", "tp_comm_overlap")
TRANSPORTS = ("gloo", "nccl")


@dataclass(frozen=True)
class Cluster:
    """GPUs on nodes, as a scenario's ``[cluster]`` describes them: ``gpus_per_node`` GPUs on each of
    ``nodes`` nodes, ``intra`` between two GPUs of a node (NVLink or PCIe, each GPU its own links),
    ``inter`` between nodes: ``nics_per_node`` network cards a node, each of ``inter``'s bandwidth,
    the node's GPUs mapped to them round-robin (GPU g on card g mod nics_per_node; 1: one card shared
    by every GPU of the node; gpus_per_node: a rail-optimized fabric, each GPU its own card), or
    ``matrix``: per pair of nodes a link of its own (a node x node tuple of Links, None on the
    diagonal)."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link | None = None
    matrix: tuple | None = None
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus_per_node >= 1, got {self.nodes} x "
                             f"{self.gpus_per_node}")
        if self.nodes > 1 and self.inter is None and self.matrix is None:
            raise ValueError("a cluster of several nodes needs the link between them (inter or matrix)")
        if self.matrix is not None and len(self.matrix) != self.nodes:
            raise ValueError(f"the matrix has {len(self.matrix)} rows for {self.nodes} nodes")
        if self.nics_per_node < 1 or self.gpus_per_node % self.nics_per_node:
            raise ValueError(f"nics_per_node must divide gpus_per_node {self.gpus_per_node}, got {self.nics_per_node}")
        if self.nics_per_node > 1 and self.matrix is not None:
            raise ValueError("a per-link matrix gives every pair of nodes a link of its own: no network cards to "
                             "count (nics_per_node)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link from node a to node b (a != b)."""
        return self.matrix[a][b] if self.matrix is not None else self.inter

    def cards(self, gpu: int, gpus: int = 1) -> tuple[int, ...]:
        """The network cards of node-local GPUs gpu, gpu + 1, ... (``gpus`` of them, a tensor-parallel
        group's), round-robin."""
        return tuple(sorted({(gpu + i) % self.nics_per_node for i in range(min(gpus, self.gpus_per_node))}))

    def crossing(self, gpus_on_node: int) -> Link:
        """The link between nodes as a closed-form ring sees it whose ``gpus_on_node`` GPUs of a node
        reach min(nics_per_node, gpus_on_node) cards: NCCL runs a channel over each, so the ring moves
        that many cards' worth (one card: ``inter`` as it is). A matrix: its slowest link."""
        if self.inter is None:
            return min((l for row in self.matrix for l in row if l), key=lambda l: l.bandwidth)
        k = min(self.nics_per_node, max(1, gpus_on_node))
        return self.inter if k == 1 else Link(self.inter.latency, self.inter.bandwidth * k, self.inter.in_flight,
                                              self.inter.stall_bytes)


@dataclass(frozen=True)
class RunSpec:
    """A run as the simulator sees it.

    system / schedule: which program each rank runs (torch_pipe: gpipe | 1f1b | interleaved | zb | zbv |
        dualpipev; megatron: 1f1b | interleaved, and the zero-bubble zb1p | zb2p it is predicted with
        (``predict.systems``); ours: its token-level pipeline, its units in the order of
        ``ours.schedule``: 1f1b | gpipe; gpipe: the seed's GPipe as DT-FM ran it, ours' engine at one
        token slice with the gpipe order; fairscale_fsdp: fairscale's Pipe (GPipe) over a node's GPUs,
        FSDP across nodes). None: ours' default (1f1b), else gpipe.
    model: the GPT shape. pp / tp / dp: pipeline stages, tensor-parallel degree, pipelines.
    batch_size: sequences per pipeline and step; micro_batch_size: sequences per micro-batch
        (ours: per batch slice). virtual_pp: model chunks per rank (interleaved, zb; zbv and dualpipev:
        2, in a V). layers_per_stage: the layers of each pipeline stage (model chunk), in model order;
        None: equal.
    slices: ours' token slice lengths (sum = seq_len). prefetch: ours' ``--prefetch`` N, the next step's
        forwards its first stage runs at the end of a step (stage s: ``ours.schedule.ahead``; 0: none).
        dp_mode: ours' data parallelism (allreduce,
        central_ps, sharded_ps), or ``chain_ps``, the seed's (DT-FM's) central PS over NCCL, not an
        option of ours: per 25 MB bucket a chain reduce to dp_rank 0, its Adam step, a chain broadcast.
    precision: fp32, bf16 or fp16 (the half ones mixed: activations and the baselines' messages in 2
        bytes). recompute: activation recomputation (a layer's forward runs again before its backward).
    link: every inter-host link (hosts = ranks); intra_link: links between ranks of one host
        (Megatron's 8 GPUs of one machine), None when every rank is its own host.
    transport: "gloo" (a message's data leaves only after the receiver's notice that it posted the
        receive reached the sender; collectives as gloo's algorithms, message by message) or "nccl"
        (data leaves once both sides posted; collectives as NCCL's rings, message by message).
    ranks_per_host: ranks sharing one host (intra_link between them).
    cluster: a GPU cluster (``Cluster``): ranks placed on its nodes as the system places them
        (``predict.placement``), links and network cards from it (link / intra_link unused).
    head_classes: the output layer's width when it is not the vocabulary (a classification head, as the
    seed's QQP workload had), None for a language model.
    message_bytes: bytes per element of the activations and gradients sent between stages; None: what
    the system sends (ours: fp32 always; the baselines: 2 bytes under mixed precision, else 4).
    Megatron's own (``MEGATRON_ONLY``; its options of the same names): sequence_parallel (the TP
    all-reduces as a reduce-scatter and an all-gather, the norms' and dropouts' work and activations
    split by tp: the compute and memory models' part); recompute_granularity (under recompute:
    ``full``, every layer's forward again, or ``selective``, the attention core's alone);
    distributed_optimizer (the DP all-reduce as a reduce-scatter of the gradients, the optimizer over
    1/D of the parameters, an all-gather of the parameters); overlap_grad_reduce (the DP collectives
    bucket by bucket on a stream of their own as the last backward finishes each bucket);
    overlap_param_gather (the distributed optimizer's all-gather, bucket by bucket, behind the next
    step's first forward); tp_comm_overlap (TransformerEngine's: each TP collective hidden behind the
    linear GEMMs of its layer, up to their time).
    """

    system: str
    model: ModelConfig
    batch_size: int
    micro_batch_size: int
    link: Link
    pp: int = 1
    tp: int = 1
    dp: int = 1
    schedule: str | None = None
    virtual_pp: int = 1
    slices: tuple[int, ...] | None = None
    prefetch: int = 0
    dp_mode: str = "allreduce"
    precision: str = "fp32"
    recompute: bool = False
    transport: str = "gloo"
    intra_link: Link | None = None
    ranks_per_host: int = 1
    head_classes: int | None = None
    message_bytes: int | None = None
    cluster: Cluster | None = None
    sequence_parallel: bool = False
    recompute_granularity: str = "full"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.system not in MODELLED:
            raise ValueError(f"the simulator has no program for {self.system!r}; it models {', '.join(MODELLED)}")
        if self.schedule is None:
            object.__setattr__(self, "schedule", MODELLED[self.system][0])
        if self.precision == "mixed":
            object.__setattr__(self, "precision", "fp16")
        if self.schedule not in MODELLED[self.system]:
            raise ValueError(f"{self.system}'s {self.schedule!r} schedule is not modelled (the simulator runs its "
                             f"{', '.join(MODELLED[self.system])})")
        chunks = CHUNKS_PER_RANK.get(self.schedule)
        if chunks is not None and self.virtual_pp != chunks:
            raise ValueError(f"the {self.schedule} schedule places {chunks} model chunk(s) per rank, got virtual_pp "
                             f"{self.virtual_pp}")
        if self.schedule == "dualpipev" and self.dp > 1:
            raise ValueError("torch_pipe's dualpipev with dp > 1 is not modelled (FSDP2 gathers its blocks again "
                             "around forwards and backwards)")
        if self.dp_mode not in SYNCS:
            raise ValueError(f"unknown dp_mode {self.dp_mode!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("pp", "tp", "dp", "batch_size", "micro_batch_size", "virtual_pp", "ranks_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch {self.batch_size} does not divide into micro-batches of {self.micro_batch_size}")
        try:
            stage_layer_counts(self.model.n_layer, self.pp * self.virtual_pp, self.layers_per_stage)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if self.slices is not None and sum(self.slices) != self.model.seq_len:
            raise ValueError(f"slices {self.slices} do not sum to the sequence length {self.model.seq_len}")
        if self.recompute_granularity not in ("full", "selective"):
            raise ValueError(f"recompute_granularity must be full or selective, got {self.recompute_granularity!r}")
        if self.prefetch < 0 or (self.prefetch and self.system != "ours"):
            raise ValueError(f"prefetch {self.prefetch}: ours' next step's first forwards, a count >= 0 (ours only)")
        mine = [name for name in MEGATRON_ONLY if getattr(self, name) != RunSpec.__dataclass_fields__[name].default]
        if mine and self.system != "megatron":
            raise ValueError(f"{mine[0]} is megatron's; {self.system} has no such option")
        if self.overlap_param_gather and not (self.distributed_optimizer and self.overlap_grad_reduce):
            raise ValueError("overlap_param_gather needs the distributed optimizer and overlap_grad_reduce")

    @property
    def n_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """The layers of each pipeline stage (model chunk), in model order."""
        return stage_layer_counts(self.model.n_layer, self.pp * self.virtual_pp, self.layers_per_stage)

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def token_slices(self) -> tuple[int, ...]:
        return self.slices if self.slices is not None else (self.model.seq_len,)

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of the activations and gradients sent between stages."""
        if self.message_bytes is not None:
            return self.message_bytes
        return 2 if self.precision != "fp32" and self.system != "ours" else 4

    def replace(self, **changes) -> "RunSpec":
        return replace(self, **changes)

    def describe(self) -> dict:
        d = asdict(self)
        d["model"] = asdict(self.model)
        return d


BREAKDOWN_PARTS = ("compute", "overhead", "exposed_comm", "bubble", "dp_sync", "barrier")


@dataclass(frozen=True)
class Prediction:
    """The predicted step time (seconds) and where the critical rank spent it.

    compute: forward, backward, weight gradients, head, optimizer (nominal work, stretched where ranks
    share cores); overhead: the calibrated framework time per step / micro-batch; exposed_comm: waits
    for messages whose data was ready (the network's share of a wait); bubble: waits for a peer that
    had not produced the data yet; dp_sync: data-parallel synchronisation; barrier: the step's closing
    barrier. The parts sum to ``step_time``."""

    step_time: float
    compute: float
    overhead: float
    exposed_comm: float
    bubble: float
    dp_sync: float
    barrier: float
    critical_rank: int
    per_rank: tuple[float, ...] = field(default_factory=tuple)
    detail: dict = field(default_factory=dict)  # compute by kind on the critical rank

    def parts(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in BREAKDOWN_PARTS}

    def line(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in self.parts().items())
        return f"predicted step {self.step_time:.4f} s ({parts}; critical rank {self.critical_rank})"
