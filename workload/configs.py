"""Model shapes every system trains: the GPT-3 family by TeraPipe's names, plus small CPU models.

A field with ``help`` in its metadata is a flag of the run command (``contract.option`` declares the
same keys; ``flags`` where they are not ``--<name>``): the model's fields override the named model's,
the optimizer's set it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


def _flag(help: str, *flags: str, dest: str | None = None, **kwargs):
    return field(metadata=dict(help=help, flags=flags, dest=dest), **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layer: int = _flag("transformer layers", "--num-layers", "--n-layer")
    n_embd: int = _flag("hidden size", "--hidden-size", "--embedding-dim")
    n_head: int = _flag("attention heads", "--num-heads", "--n-head")
    seq_len: int = _flag("sequence length (tokens)", "--seq-length", "--seq-len")
    vocab_size: int = _flag("vocabulary size", "--vocab-size", default=50304)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def with_overrides(self, **fields) -> "ModelConfig":
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


def count_params(cfg: ModelConfig, include_embeddings: bool = False) -> int:
    h, L = cfg.n_embd, cfg.n_layer
    per_block = 12 * h * h + 13 * h  # qkv + proj + fc + proj weights, their biases, two LayerNorms
    n = L * per_block + 2 * h + cfg.vocab_size * h  # final LayerNorm and LM head
    if include_embeddings:
        n += cfg.vocab_size * h + cfg.seq_len * h
    return n


# The precision policies (``RunConfig.precision``): every system runs each, the compute and memory
# models charge each (``workload.training`` holds what each means).
PRECISIONS = ("fp32", "bf16", "fp16")
# The optimizers every system runs (``OptimizerConfig.kind``; ``workload.training.make_optimizer``): Adam,
# plain SGD (no state), SGD with momentum ``SGD_MOMENTUM`` (one buffer a parameter: the seed's Megatron
# runs, apex's FusedSGD with Megatron's default momentum). What each keeps and touches per parameter is
# what the compute and memory models charge (``workload.compute``, ``workload.memory``).
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")
SGD_MOMENTUM = 0.9


@dataclass(frozen=True)
class OptimizerConfig:
    """The same optimizer for every system (Megatron's distributed optimizer takes only Adam)."""

    kind: str = _flag(" | ".join(OPTIMIZERS) + f" (SGD with momentum {SGD_MOMENTUM:g})", "--optimizer",
                      dest="optimizer", default="adam")
    lr: float = _flag("learning rate", "--lr", default=1e-4)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(name, layers, hidden, heads, seq_len=2048)


MODEL_CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        _gpt3("gpt3-1hm", 12, 768, 12),
        _gpt3("gpt3-3hm", 24, 1024, 16),
        _gpt3("gpt3-7hm", 24, 1536, 16),
        _gpt3("gpt3-1b", 24, 2048, 16),
        _gpt3("gpt3-xl", 24, 2048, 16),  # the seed's GPT-3 XL table: same shape as gpt3-1b
        _gpt3("gpt3-2b", 32, 2560, 32),
        _gpt3("gpt3-6b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        ModelConfig("tiny", 4, 128, 4, seq_len=128, vocab_size=512),
        ModelConfig("cpu-small", 4, 512, 8, seq_len=1024, vocab_size=1024),
    )
}


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_CONFIGS)}") from None
