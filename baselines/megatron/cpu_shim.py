"""Make megatron-core 0.16.1 train on CPU over gloo (tensor, pipeline and data parallelism).

Active only when CUDA is absent: ``install()`` is a no-op (returns False) when
``torch.cuda.is_available()``. Call it before megatron is first imported (it imports the megatron
modules it patches itself). Megatron builds on CPU with ``use_cpu_initialization=True``; every
other failure is ``torch.cuda``. The patches, and why:

1. ``torch.cuda.current_device()`` raises without CUDA, and megatron uses its value as a device
   (DDP grad buffers, pipeline receive buffers, TP/sequence-parallel gathers, the optimizer):
   it returns 0, and the device mode below (3) maps that device to cpu.
2. ``torch.cuda.synchronize()`` (p2p communication, parallel_state): a no-op (CPU work is
   synchronous). The system also passes ``batch_p2p_sync=False``.
3. Literal ``device="cuda"`` / ``device=torch.cuda.current_device()`` tensors created every step
   (schedules.py, the optimizer, grad clipping, grad scaler, DDP) and ``Tensor.cuda()``:
   a ``TorchFunctionMode`` (``CudaToCpuMode``), entered once and left on, rewrites any CUDA
   device argument (``"cuda"``, ``"cuda:N"``, an int, ``torch.device("cuda")``) of a torch call
   to ``cpu`` and makes ``Tensor.cuda()`` return the CPU tensor (moved to cpu). Cost: one Python
   call per torch op (about 3 ms per step on a tiny model). Torch function modes are not active
   inside the autograd engine, so the mode is also entered around every custom autograd
   Function's backward (``BackwardCFunction.apply``): megatron's activation recomputation
   (``CheckpointFunction.backward``) re-runs the layers' forward there.
4. ``param.type() == 'torch.cuda.FloatTensor'`` (and Half/BFloat16) string checks in
   Float16Module, the (distributed) optimizer and clipping: under the mode, the no-argument
   ``Tensor.type()`` of a CPU float tensor reports the ``torch.cuda.*`` name megatron expects.
5. The CUDA RNG tracker (``tensor_parallel.random``: ``torch.cuda.get_rng_state``/``manual_seed``,
   the private ``_get_cuda_rng_state``/``_set_cuda_rng_state`` that index
   ``torch.cuda.default_generators``): the "device generator" is CPU's default generator, which is
   what CPU dropout draws from, so ``tracker.fork()`` still gives model-parallel regions their own
   streams of random numbers.

Megatron's other CUDA-only paths (CUDA graphs, fine-grained offloading, MoE, megatron-FSDP,
TE/apex fused kernels) are not used by the system and not patched.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: "CudaToCpuMode | None" = None

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, int) and not isinstance(d, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to cpu (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(_CPU)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


def _with_mode(fn):
    def wrapped(self, *args):
        if _mode_active():
            return fn(self, *args)
        with CudaToCpuMode():
            return fn(self, *args)

    wrapped.__wrapped__ = fn
    return wrapped


def install() -> bool:
    """Patch torch.cuda and megatron-core for CPU. True if patched, False if CUDA is present (no-op)."""
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    if _installed:
        return True

    # 1, 2: torch.cuda functions megatron calls
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None

    # 5: the "CUDA" generator is the CPU generator
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    # 3, 4: device literals, .cuda(), .type() names
    _mode = CudaToCpuMode()
    _mode.__enter__()
    # 3b: torch function modes are not active inside the autograd engine, so also enter the mode
    # around custom autograd Functions' backward (e.g. megatron's CheckpointFunction recomputes the
    # layers' forward there, creating device="cuda" causal masks).
    from torch.autograd.function import BackwardCFunction

    for attr in ("apply", "apply_boxed"):
        original = getattr(BackwardCFunction, attr, None)
        if original is not None:
            setattr(BackwardCFunction, attr, _with_mode(original))
    _installed = True
    return True


def installed() -> bool:
    return _installed
