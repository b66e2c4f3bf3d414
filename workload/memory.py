"""Memory of one GPU of a run: parameters, gradients, optimizer state and the activations its schedule
keeps, for the fullest stage. The simulator predicts ``oom`` where this exceeds what a device can hold
(``workload.compute.Device.usable_bytes``); ours' layout planner drops such layouts.

Parameters, per parameter of the rank (``workload.compute.stage_params``), with Adam:
- fp32: weights 4 B, gradients 4 B, Adam's two moments 8 B;
- mixed precision, Megatron and the seed's GPipe: half weights 2 B, half gradients 2 B, fp32 master
  weights and moments 12 B (ZeRO's accounting); torch's autocast (torch_pipe, fairscale, ours): fp32
  weights and gradients and the moments (16 B) plus the half copies of the weights a step casts (2 B);
- SGD keeps no moments, SGD with momentum one buffer (4 B) instead of Adam's two (8 B);
- sharded: FSDP (torch_pipe and fairscale at D > 1) keeps 1/D of all of it, plus one layer gathered
  whole; Megatron's distributed optimizer 1/D of the master weights and moments; ours' central PS keeps
  the optimizer on dp_rank 0 only (the fullest rank), its sharded PS 1/D of it on each.

Activations of one layer for one micro-batch of b sequences of s tokens, hidden h, a bytes an element
(2 under mixed precision, else 4), t tensor-parallel ranks (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, generalised to a): s b h a (4 + 12 / t) for the
inputs the linears, norms and GELU keep (the llama family: s b h a (4 + w / t), w = 2 + 2 kv / n + 3 f / h
with kv key/value heads of n and an MLP f wide: ``split_width``), 2 s b h for the two dropout masks
where dropout runs, and
for materialised attention (2a + 1) n s^2 b / t (softmax output, dropout mask and output; fused
attention keeps its output's log-sum-exp only). Sequence parallelism (Megatron's) splits what the
norms, dropouts and residuals keep along the sequence too: every term but attention's over t
(Korthikanti et al.'s 34 s b h / t at a = 2 with dropout). Selective recompute (Megatron's
``recompute_granularity="selective"``: the attention core run again in the backward) keeps none of
the attention core's own activations (the s^2 terms, or the log-sum-exp), everything else as without
recompute. Under full recompute a layer keeps its input (s b h a, over t with sequence parallelism)
and the backward holds one layer's activations again (Megatron, ours), or a stage keeps its input
and recomputes its layers together (torch's Pipe, fairscale's and the seed's GPipe; torch's Pipe keeps
the last micro-batch whole, checkpoint="except_last", but its backward runs first and frees them before
any other micro-batch is recomputed). A layer's backward also holds the gradients of its activations
(one layer's activations more). A stage keeps them for the micro-batches
its schedule has in flight: GPipe all of them, 1F1B P - stage (the first stage P), Megatron's
interleaved schedule its warm-up, ours (token slices) the batch slices its order holds; under the
zero-bubble schedules, where a micro-batch's activations live until its weight gradients (the W)
have run, ZB-H1 and torch's interleaved zero bubble P on every stage, ZB-H2 2P - 1, the V schedules
(ZB-V, DualPipeV) the chunks their orders hold at most (``tests/predict/test_pipeline_schedules.py``
counts them in the orders the simulator runs). The stage with the loss (the last; rank 0 in a V)
adds the logits of the micro-batches whose loss it keeps (fp32 for the loss).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from workload.compute import stage_params
from workload.configs import ModelConfig

GB = 2**30
STAGE_CHECKPOINT = ("torch_pipe", "fairscale_fsdp", "gpipe")  # recompute a stage (a Pipe partition) whole
RECOMPUTE_GRANULARITIES = ("full", "selective")  # Megatron's recompute_granularity


@dataclass(frozen=True)
class Memory:
    """Bytes of one GPU, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    stage: int = 0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in asdict(self).items() if k != "stage")
        return f"{self.total / GB:.1f} GiB (stage {self.stage}: {parts})"


def split_width(model: ModelConfig) -> float:
    """The width, in multiples of h, of the inputs a layer keeps that tensor parallelism splits: q, k
    and v (k and v by the key/value heads), the output projection's input, and the MLP's: GELU's input
    and c_proj's (2 x ffn), or SwiGLU's gate and up and c_proj's input (3 x ffn). gpt: 12."""
    kv = model.n_kv_head / model.n_head
    return 2 + 2 * kv + (3 if model.llama else 2) * model.ffn_dim / model.n_embd


def layer_activations(model: ModelConfig, b: int, s: int, a: int, tp: int, attention: str, dropout: bool,
                      sequence_parallel: bool = False, selective: bool = False) -> float:
    """Bytes one layer keeps for its backward, for b sequences of s tokens (see the module docstring;
    the scores and the log-sum-exp go by the query heads): ``sequence_parallel`` splits the norms',
    dropouts' and residuals' share over tp too; ``selective`` (selective recompute) keeps nothing of the
    attention core's own."""
    h = model.n_embd
    sp = tp if sequence_parallel else 1
    out = s * b * h * a * (4 / sp + split_width(model) / tp)
    if dropout:
        out += 2 * s * b * h / sp
    if selective:
        return out
    if attention == "materialized":
        out += (2 * a + (1 if dropout else 0)) * model.n_head * s * s * b / tp
    else:
        out += 4 * model.n_head * s * b / tp
    return out


V_SHAPED = ("zbv", "dualpipev")  # two model chunks a rank, in a V: rank 0 holds the first and the last


def in_flight(system: str, schedule: str, stage: int, pp: int, n_micro: int, virtual_pp: int = 1) -> float:
    """Micro-batches' worth of a stage's layers the schedule keeps at its peak (a micro-batch's
    activations live until its backward's weight gradients: under a zero-bubble schedule, its W)."""
    M, P, V = n_micro, pp, virtual_pp
    if schedule == "gpipe":
        return M
    if schedule == "interleaved" and V > 1:
        rounds = M // max(1, M // P)
        warm = min(M * V, (P - stage - 1) * 2 + (V - 1) * rounds + 1)
        return warm / V
    if schedule == "zb2p":  # ZB-H2: 2 (P - s) - 1 warm-up forwards, Ws delayed by 2s: 2P - 1 on every stage
        return min(M, 2 * P - 1)
    if schedule == "zb1p":  # ZB-H1: P - 1 - s warm-up forwards, Ws delayed by s: P on every stage
        return min(M, P)
    if schedule == "zb":  # torch's interleaved ZB-H1: its warm-up's (V - 1) R + P chunks on every stage
        per_round = M // max(1, M // P)
        return min(V * M, (V - 1) * per_round + P) / V
    if schedule == "zbv":  # chunk by chunk, P + 1 + s chunks' worth from M = P on, 2P at most, in halves of the rank
        return min(2 * P, M + 1 + stage, 2 * M) / 2
    if schedule == "dualpipev":  # 2P + 1 chunks' worth (M >= 2P, its minimum)
        return min(2 * P + 1, 2 * M) / 2
    return min(M, P - stage)


STATE_BYTES = {"adam": 8, "sgd": 0, "sgd_momentum": 4}  # the update rule's fp32 state per parameter


def param_bytes(system: str, precision: str, update_rule: str = "adam") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter, unsharded."""
    state = STATE_BYTES[update_rule]
    if precision == "fp32":
        return 4, 4, state
    if system in ("megatron", "gpipe"):
        return 2, 2, 4 + state  # the fp32 master weights and the state
    return 6, 4, state


def rank_memory(model: ModelConfig, *, system: str, tp: int, pp: int, dp: int, micro_batch: int, n_micro: int,
                precision: str, recompute: bool, schedule: str, attention: str, dropout: bool = False,
                dp_mode: str = "allreduce", head: int | None = None, virtual_pp: int = 1,
                distributed_optimizer: bool = False, update_rule: str = "adam", sequence_parallel: bool = False,
                recompute_granularity: str = "full", rank_layers: tuple[int, ...] | None = None) -> Memory:
    """The fullest GPU of the run (see the module docstring); ``recompute_granularity``: under
    ``recompute``, ``full`` (a layer's input kept) or ``selective`` (the attention core run again);
    ``rank_layers``: the layers each pipeline rank holds (None: equal)."""
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, "
                         f"got {recompute_granularity!r}")
    selective = recompute and recompute_granularity == "selective"
    sp = tp if sequence_parallel else 1
    a = 4 if precision == "fp32" else 2
    s = model.seq_len
    w, g, o = param_bytes(system, precision, update_rule)
    best = None
    for stage in range(pp):
        layers = rank_layers[stage] if rank_layers is not None else model.n_layer // pp
        first, last = stage == 0, stage == (0 if schedule in V_SHAPED else pp - 1)
        n = stage_params(model, layers, first, last, tp, head)
        fw, fg, fo = w, g, o
        if dp > 1 and dp_mode == "fsdp":
            fw, fg, fo = w / dp, g / dp, o / dp
        elif dp > 1 and (distributed_optimizer or dp_mode == "sharded_ps"):
            fo = o / dp
        weights = n * fw + (stage_params(model, 1, False, False, tp) * w if dp > 1 and dp_mode == "fsdp" else 0)
        act_layer = layer_activations(model, micro_batch, s, a, tp, attention, dropout, sequence_parallel)
        held = in_flight(system, schedule, stage, pp, n_micro, virtual_pp)
        checkpoint = s * micro_batch * model.n_embd * a / sp
        if selective:  # the attention core's activations not kept; one layer's made again in its backward
            acts = held * layers * layer_activations(model, micro_batch, s, a, tp, attention, dropout,
                                                     sequence_parallel, selective=True)
        elif not recompute:
            acts = held * layers * act_layer
        elif system in STAGE_CHECKPOINT:  # the stage's input kept, the stage recomputed whole
            acts = held * checkpoint + layers * act_layer
        else:  # each layer's input kept, one layer recomputed at a time
            acts = held * layers * checkpoint + act_layer
        acts += act_layer  # the gradients of one layer's activations, alive during its backward
        if last and head != 0:
            width = head or model.vocab_size
            kept = held if (system in ("torch_pipe", "fairscale_fsdp") and schedule == "gpipe") else 1
            acts += kept * micro_batch * s * width / tp * (a + 4)
        m = Memory(weights, n * fg, n * fo, acts, stage)
        if best is None or m.total > best.total:
            best = m
    return best
