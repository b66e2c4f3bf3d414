"""megatron-core (0.16.1) tensor, pipeline and data parallelism on the shared workload (both families).

Ranks are laid out by ``parallel_state.initialize_model_parallel(tp, pp, virtual_pp)`` (megatron's
default order: TP fastest, then DP, then PP). The model is megatron's ``GPTModel`` with the local
(non-transformer-engine) layer spec, configured by its ``TransformerConfig`` for the family
(``transformer_config``): gpt: LayerNorm (eps 1e-5), biases, exact GELU, dropout 0, learned absolute
position embeddings; llama: ``normalization="RMSNorm"``, no biases, ``gated_linear_unit`` with
``F.silu`` (SwiGLU) and ``ffn_hidden_size``, ``num_query_groups`` = the key/value heads, and the
``GPTModel``'s ``position_embedding_type="rope"`` with ``rotary_base`` (megatron-core 0.16.1 keeps
both on the model, not the config), its unfused ``apply_rotary_pos_emb`` (``apply_rope_fusion=False``:
the fused kernels are CUDA's); an untied output layer either way. Its weights are the shared model's
(``workload.model.init_weights``), converted to megatron's layout and TP shards by
``baselines.megatron_convert``. Training uses megatron's ``get_forward_backward_func()`` (1F1B, or
the interleaved 1F1B with ``--schedule interleaved``: ``virtual_pp`` model chunks per rank),
megatron's DistributedDataParallel (fp32 grad buffers, all-reduce averaged over DP in
``finalize_model_grads``) and megatron's optimizer (Adam, or SGD with or without momentum, with the
shared hyperparameters, no weight decay, no clipping).

Loss: the model returns per-token losses; each micro-batch's loss is their mean and megatron's
schedule divides by the number of micro-batches, so the replica's loss is the mean over all its
tokens, as ``workload.model.lm_loss`` on the whole batch.

``--distributed-optimizer``: megatron's DDP with ``use_distributed_optimizer`` and its
DistributedOptimizer (Adam only): gradients reduce-scattered over DP, each DP rank updates its
shard of the fp32 main parameters and optimizer state, then the parameters are all-gathered.
``--sequence-parallel`` (TP > 1, the sequence length divisible by TP): the activations outside the
tensor-parallel matmuls (norms, dropout, residuals) are split along the sequence over the TP
ranks; megatron's own torch norm refuses it, so the layer spec and the block's final norm use
``TorchNorm`` (torch's LayerNorm or RMSNorm with parameters marked ``sequence_parallel``, whose
gradients ``finalize_model_grads`` all-reduces over TP, as it does for the RowParallel biases); the
llama family's spec uses it always (megatron's block would otherwise take apex's LayerNorm where
installed, which has no RMSNorm).

``--layers-per-stage``: megatron-core's ``pipeline_model_parallel_layout``, each stage's (model
chunk's) layers in model order, the embedding on the first and the loss on the last.

``--recompute``: activation recomputation, ``--recompute-granularity full`` (every layer: method
uniform, one layer per group) or ``selective`` (megatron-core's ``recompute_modules=["core_attn"]``:
the attention core run again in the backward, its activations not kept). ``--overlap-grad-reduce``
and ``--overlap-param-gather``: megatron-core's DistributedDataParallelConfig fields, the schedule's
``no_sync_func`` and ``grad_sync_func`` set as Megatron-LM's training loop sets them (gradients
reduced bucket by bucket during the last micro-batch's backward; the distributed optimizer's
all-gather started by ``zero_grad`` and waited bucket by bucket by the forward's pre-hooks, finished
before weights are read). ``--precision bf16 | fp16``: megatron's own mixed precision (Float16Module:
half-precision parameters and activations, fp32 main parameters and gradients in the optimizer),
not the reference's autocast (``SystemSpec.half_weights``: --verify compares it with the reference
run the same way, see ``runners.tolerance``). fp16's dynamic loss scaling is megatron's optimizer's,
set to the suite's policy (``workload.training.LOSS_SCALING``: initial scale 2^16, halved on every
overflow, doubled after 2000 good steps), and the schedule scales each micro-batch's loss by it
through ``grad_scale_func`` (as Megatron-LM's training loop sets it).
``dp_sync_time``: the wall time of ``finalize_model_grads`` (DP gradient all-reduce, or
reduce-scatter with the distributed optimizer) and of the distributed optimizer's parameter
all-gather.

On CPU, ``baselines.megatron_cpu_shim`` is installed before megatron is imported.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

from baselines.megatron import cpu_shim

cpu_shim.install()  # before the first import of megatron (no-op with CUDA)

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,  # noqa: E402
                                                         get_num_layers_to_build)
from megatron.core.distributed.param_and_grad_buffer import shard_buffer  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from baselines.megatron import convert as conv  # noqa: E402
from contract import RunConfig  # noqa: E402
from contract.rank import Context, Measurements, StepOutput, run_steps  # noqa: E402
from workload.configs import SGD_MOMENTUM, ModelConfig  # noqa: E402
from workload.model import init_weights, meta_gpt  # noqa: E402
from workload.training import LOSS_SCALING, compute_dtype  # noqa: E402


def transformer_config(cfg: RunConfig, cuda: bool) -> TransformerConfig:
    m = cfg.model
    fp16, bf16 = cfg.precision == "fp16", cfg.precision == "bf16"
    dtype = compute_dtype(cfg.precision)
    family = dict(normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, num_query_groups=m.n_kv_head) if m.llama else \
        dict(normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=False,
             activation_func=torch.nn.functional.gelu)
    kwargs = dict(
        num_layers=m.n_layer, hidden_size=m.n_embd, num_attention_heads=m.n_head, ffn_hidden_size=m.ffn_dim,
        kv_channels=m.head_dim, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=m.norm_eps,
        **family, init_method_std=0.02,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.options.virtual_pp if cfg.options.virtual_pp > 1 else None,
        sequence_parallel=cfg.options.sequence_parallel, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=dtype, pipeline_dtype=dtype, fp16=fp16, bf16=bf16,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, batch_p2p_sync=cuda,
        # NCCL (and gloo with one tag) matches a pair's messages in issue order: megatron's batched ops
        # post [send_prev, recv_prev, send_next, recv_next], which with pp=2 (prev == next) and the
        # interleaved schedule swaps activations and gradients (found under --p2p-semantics nccl;
        # Megatron-LM issue 750). The unbatched path orders sends and receives by rank parity.
        batch_p2p_comm=False,
    )
    if cfg.recompute and cfg.options.recompute_granularity == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif cfg.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.options.layers_per_stage is not None:
        kwargs["pipeline_model_parallel_layout"] = conv.layer_layout(cfg.options.stage_layers(cfg))
    return TransformerConfig(**kwargs)


def ddp_config(cfg: RunConfig) -> DistributedDataParallelConfig:
    """megatron-core's DDP configuration of the run: fp32 gradient buffers, the distributed optimizer and
    the overlaps as its options ask."""
    o = cfg.options
    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=o.overlap_grad_reduce,
                                         overlap_param_gather=o.overlap_param_gather,
                                         use_distributed_optimizer=o.distributed_optimizer)


def shared_weights(m: ModelConfig, seed: int, layers: set[int], first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The shared model's weights of the given layers (and embeddings / head), built alone."""
    model = meta_gpt(m)
    for i in range(m.n_layer):
        if i not in layers:
            del model.blocks[str(i)]
    if not first:
        model.wte = model.wpe = None
    if not last:
        model.ln_f = model.lm_head = None
    model.to_empty(device="cpu")
    init_weights(model, m, seed)
    return {k: v.detach() for k, v in model.state_dict().items()}


def chunk_first_layer(chunk: GPTModel) -> int:
    layers = getattr(chunk.decoder, "layers", [])
    return min((layer.layer_number - 1 for layer in layers), default=0)


class TorchNorm:
    """torch's LayerNorm or RMSNorm (``config.normalization``), built as megatron's specs build a
    norm, with its parameters marked ``sequence_parallel`` when sequence parallelism is on: each TP
    rank then normalises only its slice of the sequence, and ``finalize_model_grads`` sums their
    gradients over the TP group."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(config: TransformerConfig, vp_stage: int | None) -> ModuleSpec:
    """The local (non-TE) GPT layer spec for the config's normalisation; with sequence parallelism
    or RMSNorm, the whole block's spec with ``TorchNorm`` for the layers' two norms and the block's
    final norm."""
    layer = get_gpt_layer_local_spec(normalization=config.normalization if config.normalization != "LayerNorm"
                                     else None)
    if not config.sequence_parallel and config.normalization == "LayerNorm":
        return layer
    sub = dataclasses.replace(layer.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
    layer = dataclasses.replace(layer, submodules=sub)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * n, layer_norm=TorchNorm))


def build_chunks(cfg: RunConfig, config: TransformerConfig) -> list[GPTModel]:
    vpp = cfg.options.virtual_pp
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if vpp > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=layer_spec(config, vp_stage), vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.model.seq_len,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False, parallel_output=True, vp_stage=vp_stage,
            **(dict(position_embedding_type="rope", rotary_base=cfg.model.rope_theta) if cfg.model.llama else
               dict(position_embedding_type="learned_absolute"))))
    return chunks


@torch.no_grad()
def load_shared_weights(cfg: RunConfig, chunks: list[GPTModel]) -> None:
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    layers = {layer.layer_number - 1 for c in chunks for layer in getattr(c.decoder, "layers", [])}
    first = any(c.pre_process for c in chunks)
    last = any(c.post_process for c in chunks)
    m = cfg.model
    full = conv.shared_to_megatron(shared_weights(m, cfg.seed, layers, first, last), m.n_head, m.n_kv_head)
    for c in chunks:
        offset = chunk_first_layer(c)
        for name, p in c.named_parameters():
            gname = conv.global_name(name, offset)
            p.copy_(conv.shard(gname, full.pop(gname), tp, tp_rank, gated=m.llama).to(p.dtype))
    if full:
        raise RuntimeError(f"shared weights with no megatron parameter: {sorted(full)[:3]}")


@torch.no_grad()
def gather_grad_shards(chunks: list[DistributedDataParallel]) -> None:
    """With the distributed optimizer each DP rank holds only its shard of the reduced gradients
    (the rest of its grad buffer is its own unreduced ones): all-gather the shards, so every
    ``main_grad`` is the full averaged gradient (for --verify, after the last step)."""
    for c in chunks:
        for group in c.bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                shards = shard_buffer(bucket.grad_data, size)
                dist.all_gather_into_tensor(bucket.grad_data, shards[rank].clone(),
                                            group=group.intra_distributed_optimizer_instance_group)


@torch.no_grad()
def gather_grads(cfg: RunConfig, chunks: list[GPTModel], of: str = "grad") -> dict[str, torch.Tensor]:
    """Full gradients (``of="data"``: weights) by shared names (TP shards gathered; DDP already
    averaged over DP)."""
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for c in chunks:
        offset = chunk_first_layer(c)
        for name, p in c.named_parameters():
            g = p.data if of == "data" else getattr(p, "main_grad", None)
            if g is None:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.detach().float().contiguous()
            gname = conv.global_name(name, offset)
            if tp > 1 and conv.tp_dim(gname) is not None:
                parts = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(parts, g, group=tp_group)
                g = conv.unshard(gname, parts, gated=cfg.model.llama)
            out[gname] = g.clone()
    return conv.megatron_to_shared(out, cfg.model.n_head, cfg.model.n_kv_head)


def stage_layers(cfg: RunConfig, config: TransformerConfig) -> list[int]:
    """The layers megatron-core builds on each pipeline stage (model chunk), in model order (its
    layout's count for a rank, which ``get_num_layers_to_build`` takes from the calling rank)."""
    vpp, layout = cfg.options.virtual_pp, config.pipeline_model_parallel_layout
    out = []
    for v in range(vpp):
        for r in range(cfg.pp):
            vp = v if vpp > 1 else None
            out.append(layout.get_num_layers_to_build(vp_stage=vp, pp_rank=r) if layout is not None
                       else get_num_layers_to_build(config, vp_stage=vp, pp_rank=r))
    return out


def _kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def describe_modules(chunk: GPTModel) -> dict:
    """What megatron-core built for the model (from its modules, for the record): the first layer's
    classes, norm, attention heads and query groups per TP rank, MLP gating and activation, whether
    its linears have biases, whether its attention core is recomputed (selective recompute), and the
    positions (rotary: the RotaryEmbedding and its base)."""
    rotary = getattr(chunk, "rotary_pos_emb", None)
    out: dict = {"positions": chunk.position_embedding_type, "rotary": _kind(rotary) if rotary else None,
                 "rotary_base": chunk.rotary_base if rotary else None}
    layers = getattr(chunk.decoder, "layers", [])
    if layers:
        layer = layers[0]
        attn, mlp = layer.self_attention, layer.mlp
        out.update(layer=_kind(layer), norm=_kind(layer.input_layernorm), attention=_kind(attn), mlp=_kind(mlp),
                   heads=attn.num_attention_heads_per_partition, query_groups=attn.num_query_groups_per_partition,
                   gated=mlp.config.gated_linear_unit, activation=mlp.config.activation_func.__name__,
                   fc1_rows=mlp.linear_fc1.weight.shape[0], biases=attn.linear_qkv.bias is not None,
                   recomputed_core=attn.checkpoint_core_attention)
    return out


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    m = cfg.model
    if m.vocab_size % cfg.tp:
        raise ValueError(f"megatron: vocab size {m.vocab_size} must divide by --tp {cfg.tp} (no vocab padding)")
    cuda = ctx.device.type == "cuda"
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 virtual_pipeline_model_parallel_size=(cfg.options.virtual_pp
                                                                       if cfg.options.virtual_pp > 1 else None),
                                 # its groups' operation timeout, in whole minutes (its default: 30)
                                 distributed_timeout_minutes=math.ceil(ctx.op_timeout.total_seconds() / 60))
    try:
        return _train(cfg, ctx, cuda)
    finally:
        ps.destroy_model_parallel()


def _wrapped(config, ddp, models: list) -> list:
    """The model chunks in megatron-core's DDP (behind Float16Module in half precision); with
    overlap_grad_reduce, the schedule's hooks as Megatron-LM's training loop sets them (only the last
    micro-batch syncs, chunk by chunk)."""
    wrapped = models
    if config.fp16 or config.bf16:
        from megatron.core.transformer.module import Float16Module

        wrapped = [Float16Module(config, c) for c in models]
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp, module=c, disable_bucketing=i > 0)
              for i, c in enumerate(wrapped)]
    if ddp.overlap_grad_reduce:
        one = len(chunks) == 1
        config.no_sync_func = chunks[0].no_sync if one else [c.no_sync for c in chunks]
        config.grad_sync_func = chunks[0].start_grad_sync if one else [c.start_grad_sync for c in chunks]
    return chunks


def optimizer_config(cfg: RunConfig, config) -> OptimizerConfig:
    """megatron-core's optimizer for the run's (adam, sgd, sgd with momentum; no decay, no clipping)."""
    opt = cfg.optimizer
    return OptimizerConfig(
        optimizer="adam" if opt.kind == "adam" else "sgd", lr=opt.lr, min_lr=opt.lr, weight_decay=0.0,
        adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
        sgd_momentum=SGD_MOMENTUM if opt.kind == "sgd_momentum" else 0.0, clip_grad=0.0, fp16=config.fp16,
        bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.options.distributed_optimizer,
        # fp16's loss scaling as every system's (megatron's defaults: 2^32, halved after 2 overflows in a row)
        initial_loss_scale=LOSS_SCALING["init_scale"], loss_scale_window=LOSS_SCALING["growth_interval"],
        hysteresis=1)


def _loss_func(per_token: torch.Tensor):
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach().clone()}  # the schedule divides loss in place


def _train(cfg: RunConfig, ctx: Context, cuda: bool) -> Measurements:
    m = cfg.model
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    config = transformer_config(cfg, cuda)
    models = build_chunks(cfg, config)
    load_shared_weights(cfg, models)
    if cuda:
        models = [c.to(ctx.device) for c in models]
    distributed_optimizer = cfg.options.distributed_optimizer
    ddp = ddp_config(cfg)
    chunks = _wrapped(config, ddp, models)

    sync = {"t": 0.0}

    def timed(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync["t"] += time.perf_counter() - start
        return run

    config.finalize_model_grads_func = timed(finalize_model_grads)
    for c in chunks:  # the distributed optimizer's parameter all-gather (called by its step)
        c.start_param_sync = timed(c.start_param_sync)
    opt = get_megatron_optimizer(optimizer_config(cfg, config), chunks)
    if config.fp16:
        config.grad_scale_func = opt.scale_loss  # the schedule scales each micro-batch's loss before backward
    forward_backward = get_forward_backward_func()
    n_micro = cfg.n_micro_batches
    mbs = cfg.micro_batch_size
    is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
    dp_rank = ps.get_data_parallel_rank()
    positions = torch.arange(m.seq_len, device=ctx.device).unsqueeze(0).expand(mbs, -1)

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        return model(x, positions, None, labels=y), _loss_func

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        sync["t"] = 0.0
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        micro = list(zip(inputs.split(mbs), targets.split(mbs)))
        iters = [iter(micro) for _ in chunks]
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=n_micro, seq_length=m.seq_len,
            micro_batch_size=mbs, forward_only=False)
        opt.step()
        loss = None
        if is_last and ps.get_tensor_model_parallel_rank() == 0:
            loss = float(torch.stack([d["loss"] for d in losses]).mean())
        return StepOutput(loss=loss, dp_sync_time=sync["t"])

    def gathered() -> None:  # the distributed optimizer's all-gather, where it overlaps the next forward
        if ddp.overlap_param_gather:
            for c in chunks:
                c.start_param_sync(force_sync=True)

    def weights() -> dict[str, torch.Tensor]:  # for --eval-every; TP ranks gather, one pipeline gives
        gathered()
        held = gather_grads(cfg, models, of="data")
        return held if dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0 else {}

    result = run_steps(ctx, dp_rank, step, weights)
    inner = getattr(opt, "chained_optimizers", [opt])
    result.extra.update(megatron_optimizer="+".join(sorted({type(o).__name__ for o in inner})),
                        megatron_layout=dict(tp_rank=ps.get_tensor_model_parallel_rank(),
                                             pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=dp_rank),
                        megatron_modules=describe_modules(models[0]), megatron_stage_layers=stage_layers(cfg, config))
    if cfg.verify:
        if distributed_optimizer:
            gather_grad_shards(chunks)
        grads = gather_grads(cfg, models)
        keep = dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
        result.grads = grads if keep else {}
    return result
