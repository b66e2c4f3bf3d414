"""Model shapes every system trains: the GPT-3 family by TeraPipe's names, plus small CPU models."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int = 50304

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def with_overrides(self, **fields) -> "ModelConfig":
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class OptimizerConfig:
    """The same optimizer for every system (Megatron's distributed optimizer takes only Adam)."""

    kind: str = "adam"  # adam | sgd
    lr: float = 1e-4
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
