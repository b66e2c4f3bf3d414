"""Make fairscale 0.4.13's FullyShardedDataParallel (FSDP) run on CPU over gloo.

Active only when CUDA is absent: ``install()`` is a no-op (returns False) when
``torch.cuda.is_available()``, so on GPUs fairscale runs untouched. Everything is patched in
this one module, and only in fairscale's own namespaces (plus one CPU-only no-op on
``Tensor.record_stream``). What breaks on CPU, in the order FSDP meets it, and the patch:

1. The default compute device is CUDA (``_get_default_cuda_device`` returns ``cuda``):
   it returns the module's own device (cpu) instead. (Callers also pass ``compute_device``.)
2. FSDP looks up CUDA streams (``self._streams["all_gather" | "post_backward" | "fp32_to_fp16"]``,
   ``torch.cuda.stream(...)``, ``torch.cuda.current_stream()``, ``wait_stream``,
   ``torch.cuda.synchronize()``): the ``torch`` name inside the FSDP module is replaced by a
   proxy of torch whose ``cuda`` attribute is a CPU stand-in with no-op streams (a thread-local
   "current stream" so that FSDP's own stream assertions still hold); ``_setup_streams``
   creates those stand-in streams when CUDA is absent. Everything else on the proxy is torch.
3. ``record_stream`` on CPU tensors raises: ``Tensor.record_stream`` becomes a no-op for CPU
   tensors (memory on CPU is not stream-ordered); CUDA tensors keep the original method.
4. gloo has no ``_reduce_scatter_base`` / ``_all_gather_base`` fast path: the module flags
   ``enable_nccl_base_collectives`` of FSDP and of its ReduceScatterBucketer are set to False
   (what env ``ENABLE_NCCL_BASE_COLLECTIVES=0`` does at import), so they use the list forms.
5. The assertion ``torch.cuda.current_stream() == self._streams["post_backward"]`` in
   post-backward holds through the stand-in's thread-local current stream (patch 2).
6. ``clip_grad_norm_`` calls ``.cuda()`` on the local norm: replaced by the same computation
   kept on the parameters' device.
"""
from __future__ import annotations

import contextlib
import threading
import types
from math import inf

import torch

_installed = False


class _CpuStream:
    """A stand-in for torch.cuda.Stream on CPU: work is already ordered, every wait is a no-op."""

    def __init__(self, name: str = "default"):
        self.name = name

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<cpu stream {self.name}>"


_DEFAULT = _CpuStream()
_local = threading.local()


def _current_stream(device=None) -> _CpuStream:
    return getattr(_local, "stream", _DEFAULT)


@contextlib.contextmanager
def _stream(stream):
    previous = _current_stream()
    _local.stream = stream if stream is not None else previous
    try:
        yield
    finally:
        _local.stream = previous


class _CudaOnCpu(types.ModuleType):
    """What ``torch.cuda`` looks like to fairscale's FSDP on a machine without CUDA."""

    def __init__(self):
        super().__init__("torch.cuda (fairscale cpu shim)")
        self.Stream = _CpuStream
        self.stream = _stream
        self.current_stream = _current_stream
        self.synchronize = lambda device=None: None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    def __init__(self):
        super().__init__("torch (fairscale cpu shim)")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_clip_grad_norm(fsdp_mod):
    """FSDP.clip_grad_norm_ as fairscale's, its norm on the module's compute device instead of .cuda()."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        self._lazy_init()
        assert self._is_root, "clip_grad_norm should only be called on the root (parent) instance"
        self.assert_state(fsdp_mod.TrainingState.IDLE)
        max_norm, norm_type = float(max_norm), float(norm_type)
        params_with_grad = self.params_with_grad
        if not self.children_share_process_group:
            raise NotImplementedError("clip_grad_norm requires that all params share one process group")
        local_norm = fsdp_mod.calc_grad_norm(params_with_grad, norm_type).to(self.compute_device)
        if norm_type == inf:
            total_norm = local_norm
            torch.distributed.all_reduce(total_norm, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        else:
            total_norm = local_norm**norm_type
            torch.distributed.all_reduce(total_norm, group=self.process_group)
            total_norm = total_norm ** (1.0 / norm_type)
        if self.move_grads_to_cpu:
            total_norm = total_norm.cpu()
        clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype, device=total_norm.device) / (total_norm + 1e-6)
        if clip_coef < 1:
            for p in params_with_grad:
                assert p.grad is not None
                p.grad.detach().mul_(clip_coef.to(p.grad.device))
        return total_norm

    return clip_grad_norm_


def install() -> bool:
    """Patch fairscale FSDP for CPU. Returns True if patched, False if CUDA is present (no-op)."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    import fairscale.internal.reduce_scatter_bucketer as rsb
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_mod

    FSDP = fsdp_mod.FullyShardedDataParallel

    # 1. compute device
    def _default_device(module: torch.nn.Module) -> torch.device:
        try:
            return next(module.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    fsdp_mod._get_default_cuda_device = _default_device

    # 2 + 5. streams
    fsdp_mod.torch = _TorchProxy()
    original_setup_streams = FSDP._setup_streams

    def _setup_streams(self) -> None:
        if len(self._streams) > 0 or not self._is_root:
            return
        original_setup_streams(self)  # creates the reducer, shares it with children
        for name in ("fp32_to_fp16", "all_gather", "post_backward"):
            self._streams[name] = _CpuStream(name)
        for n, m in self.named_modules():
            if n != "" and isinstance(m, FSDP):
                m._streams = self._streams

    FSDP._setup_streams = _setup_streams

    # 3. record_stream on CPU tensors
    original_record_stream = torch.Tensor.record_stream

    def record_stream(tensor: torch.Tensor, stream) -> None:
        if tensor.device.type == "cpu":
            return None
        return original_record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream

    # 4. no _reduce_scatter_base / _all_gather_base on gloo
    fsdp_mod.enable_nccl_base_collectives = False
    rsb.enable_nccl_base_collectives = False

    # 6. clip_grad_norm_ without .cuda()
    FSDP.clip_grad_norm_ = _cpu_clip_grad_norm(fsdp_mod)
    _installed = True
    return True


def installed() -> bool:
    return _installed
