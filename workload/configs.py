"""Model shapes every system trains: the GPT-3 family by TeraPipe's names, the Llama 3 shapes, plus
small CPU models of each family.

Two families (``ModelConfig.family``), one model file (``workload.model``):

- ``gpt`` (the default, GPT-3's): learned positions, LayerNorm, a 4h GELU MLP, multi-head attention,
  biases;
- ``llama`` (Llama 3's): rotary positions (``rope_theta``), RMSNorm, a SwiGLU MLP of ``ffn_hidden``
  (three matrices: gate, up, down), grouped-query attention (``kv_heads`` key/value heads shared by
  ``n_head / kv_heads`` query heads each), no biases; the output layer untied from the embeddings, as
  GPT's.

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
    family: str = _flag("the architecture: gpt or llama (workload/configs.py)", "--family", default="gpt")
    """The architecture: ``gpt`` or ``llama`` (see the module docstring); set by the model's name."""
    kv_heads: int | None = _flag("key/value heads of grouped-query attention (llama); unset: one per query head",
                                 "--kv-heads", default=None)
    """Key/value heads; None: as many as query heads (multi-head attention, GPT's). Read ``n_kv_head``."""
    ffn_hidden: int | None = _flag("the MLP's hidden width; unset: 4 x hidden (gpt), 2/3 of that rounded up to "
                                   "a multiple of 256 (llama)", "--ffn-hidden-size", default=None)
    """The MLP's hidden width; None: the family's (``ffn_dim``)."""
    rope_theta: float = _flag("the rotary positions' base (llama)", "--rope-theta", default=500000.0)
    """The base of the rotary frequencies (Llama 3's 500000); unused by ``gpt``."""
    norm_eps: float = _flag("the epsilon of every LayerNorm (gpt) or RMSNorm (llama)", "--norm-eps", default=1e-5)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        """Key/value heads: ``kv_heads``, or one per query head."""
        return self.kv_heads or self.n_head

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width: ``ffn_hidden``, or gpt's 4h, or Llama's 2/3 of 4h rounded up to a
        multiple of 256 (its reference code's ``multiple_of``)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "llama":
            return -(-int(2 * 4 * self.n_embd / 3) // 256) * 256
        return 4 * self.n_embd

    @property
    def llama(self) -> bool:
        return self.family == "llama"

    def with_overrides(self, **fields) -> "ModelConfig":
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


FAMILIES = ("gpt", "llama")


def qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """The rows of q, k and v in the fused ``attn.c_attn`` (in that order): the query heads', then the
    key/value heads' (``n_kv_head x head_dim`` each), head by head. A tensor-parallel split keeps whole
    heads of each (T dividing ``n_kv_head``): rank t's rows are its 1/T of q, of k and of v, in that
    order."""
    return cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block. gpt: 4h^2 + 2hf + 9h + f with an MLP f wide (12h^2 + 13h
    at f = 4h: qkv, proj, fc and proj weights, their biases, two LayerNorms); llama: the q and output
    projections (h^2 each), k and v (h x kv_heads x head_dim each), gate, up and down (h x ffn each),
    two RMSNorms (h each), no biases."""
    h = cfg.n_embd
    if not cfg.llama:
        f = cfg.ffn_dim
        return 4 * h * h + 2 * h * f + 9 * h + f
    kv = cfg.n_kv_head * cfg.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim + 2 * h


def norm_params(cfg: ModelConfig) -> int:
    """Parameters of one normalisation: LayerNorm's weight and bias, RMSNorm's weight."""
    return cfg.n_embd if cfg.llama else 2 * cfg.n_embd


def count_params(cfg: ModelConfig, include_embeddings: bool = False) -> int:
    """Parameters of the model: every block, the final norm and the LM head; with ``include_embeddings``
    the token embeddings too (and gpt's learned positions)."""
    h, L = cfg.n_embd, cfg.n_layer
    n = L * block_params(cfg) + norm_params(cfg) + cfg.vocab_size * h  # final norm and LM head
    if include_embeddings:
        n += cfg.vocab_size * h + (0 if cfg.llama else cfg.seq_len * h)
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


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, seq_len: int, vocab_size: int,
           ffn_hidden: int | None = None) -> ModelConfig:
    return ModelConfig(name, layers, hidden, heads, seq_len, vocab_size, family="llama", kv_heads=kv_heads,
                       ffn_hidden=ffn_hidden)


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
        # Llama 3 (Meta's model cards and params.json): 8B and 70B, sequence 8192, rope theta 500000
        _llama("llama3-8b", 32, 4096, 32, 8, seq_len=8192, vocab_size=128256, ffn_hidden=14336),
        _llama("llama3-70b", 80, 8192, 64, 8, seq_len=8192, vocab_size=128256, ffn_hidden=28672),
        # the CPU models' shapes with the family's layers (ffn: 2/3 of 4h rounded up to 256: 512, 1536)
        _llama("llama-tiny", 4, 128, 4, 2, seq_len=128, vocab_size=512),
        _llama("llama-cpu-small", 4, 512, 8, 2, seq_len=1024, vocab_size=1024),
    )
}


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_CONFIGS)}") from None
