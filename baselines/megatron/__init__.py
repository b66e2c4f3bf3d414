"""megatron-core (0.16.1) tensor, pipeline and data parallelism on the shared workload (gpt and llama). The
training code is ``baselines.megatron.train``; the weight conversion ``convert``; the CPU shim
``cpu_shim`` (active only where CUDA is absent, installed before megatron is first imported)."""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, PipelineOptions, RunConfig, SystemSpec, option

SCHEDULES = ("1f1b", "interleaved")
RECOMPUTE_GRANULARITIES = ("full", "selective")  # megatron-core's TransformerConfig.recompute_granularity


@dataclass(frozen=True)
class MegatronOptions(PipelineOptions):
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULES)
    distributed_optimizer: bool = option(False, "megatron's distributed optimizer: gradients reduce-scattered, "
                                                "optimizer state and fp32 main parameters sharded over the dp ranks, "
                                                "parameters all-gathered after the step (Adam only)")
    sequence_parallel: bool = option(False, "sequence parallelism: LayerNorms, dropout and residuals split along "
                                            "the sequence over the tp ranks (needs --tp > 1 dividing --seq-length)")
    recompute_granularity: str = option("full", "what --recompute runs again: every layer's forward (full: each "
                                                "layer keeps its input) or the attention core alone (selective: "
                                                "scores, softmax, dropout, context; their activations not kept)",
                                        choices=RECOMPUTE_GRANULARITIES)
    overlap_grad_reduce: bool = option(False, "megatron-core's DDP overlaps the gradients' all-reduce (or "
                                              "reduce-scatter) with the backward, bucket by bucket")
    overlap_param_gather: bool = option(False, "the distributed optimizer's parameter all-gather overlaps the next "
                                               "forward, bucket by bucket (needs --distributed-optimizer and "
                                               "--overlap-grad-reduce)")
    tp_comm_overlap: bool = option(False, "tensor-parallel communication overlapped with the GEMMs "
                                          "(TransformerEngine's userbuffers; predicted only: this build has no "
                                          "TransformerEngine)")

    def check(self, config: RunConfig) -> None:
        if self.distributed_optimizer and config.optimizer.kind != "adam":
            raise ConfigError("megatron's distributed optimizer takes only Adam, got --optimizer "
                              f"{config.optimizer.kind}")
        if self.sequence_parallel and config.tp < 2:
            raise ConfigError("megatron's --sequence-parallel splits the sequence over the tensor-parallel ranks: "
                              "it needs --tp > 1")
        if self.sequence_parallel and config.model.seq_len % config.tp:
            raise ConfigError(f"megatron's --sequence-parallel needs --seq-length {config.model.seq_len} to divide "
                              f"by --tp {config.tp}")
        if self.recompute_granularity != "full" and not config.recompute:
            raise ConfigError(f"megatron's --recompute-granularity {self.recompute_granularity} says what --recompute "
                              "runs again: it needs --recompute")
        if self.overlap_param_gather and not (self.distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError("megatron's --overlap-param-gather needs --distributed-optimizer and "
                              "--overlap-grad-reduce")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ConfigError("megatron's --tp-comm-overlap overlaps sequence parallelism's collectives: it needs "
                              "--sequence-parallel")
        if self.schedule == "interleaved" and config.pp < 2:
            raise ConfigError("megatron's interleaved schedule needs --pp >= 2")
        super().check(config)
        if config.model.n_kv_head % config.tp:
            raise ConfigError(f"megatron splits the key/value heads over --tp {config.tp}: --kv-heads "
                              f"{config.model.n_kv_head} must divide by it")
        if self.schedule == "interleaved" and config.n_micro_batches % config.pp:
            raise ConfigError(f"megatron's interleaved schedule needs the micro-batch count ({config.n_micro_batches}) "
                              f"to divide by --pp {config.pp}")

    def check_build(self, config: RunConfig) -> None:
        if self.tp_comm_overlap:
            raise ConfigError("megatron's --tp-comm-overlap needs TransformerEngine (its userbuffers), which this "
                              "build does not have: a scenario predicts it")
        if config.model.vocab_size % config.tp:  # Megatron-LM pads it (make_vocab_size_divisible_by x tp)
            raise ConfigError(f"megatron splits the vocabulary over --tp {config.tp}: --vocab-size "
                              f"{config.model.vocab_size} must divide by it")


def label(config: RunConfig) -> str:
    """'megatron', then the schedule if not 1F1B, then '+distopt', '+sp', '+overlap-grad' and '+overlap-param'
    for the switches and '+selective' for selective recompute."""
    options = config.options
    parts = ["megatron"] + ([options.schedule] if options.schedule != "1f1b" else [])
    parts += ["+distopt"] * options.distributed_optimizer + ["+sp"] * options.sequence_parallel
    parts += ["+overlap-grad"] * options.overlap_grad_reduce + ["+overlap-param"] * options.overlap_param_gather
    parts += ["+selective"] * (config.recompute and options.recompute_granularity == "selective")
    return " ".join(parts)


SPEC = SystemSpec(
    name="megatron",
    train="baselines.megatron.train:train",
    description="megatron-core tensor/pipeline/data parallelism",
    options=MegatronOptions,
    dims=("pp", "tp", "dp"),
    label=label,
    half_weights=True,  # --precision bf16 / fp16: megatron's Float16Module, half weights, fp32 main params
)
