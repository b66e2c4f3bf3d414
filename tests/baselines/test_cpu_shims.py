"""The CPU shims are installed only without CUDA: with CUDA available, install() changes nothing."""
from __future__ import annotations

import subprocess
import sys

import torch

from tests.conftest import REPO


def test_fairscale_shim_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from baselines.fairscale_fsdp import cpu_shim as fairscale_cpu_shim
    import fairscale.internal.reduce_scatter_bucketer as rsb
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_mod

    before = (torch.Tensor.record_stream, fsdp_mod.torch, fsdp_mod._get_default_cuda_device,
              fsdp_mod.FullyShardedDataParallel._setup_streams, fsdp_mod.FullyShardedDataParallel.clip_grad_norm_,
              fsdp_mod.enable_nccl_base_collectives, rsb.enable_nccl_base_collectives)
    assert fairscale_cpu_shim.install() is False
    after = (torch.Tensor.record_stream, fsdp_mod.torch, fsdp_mod._get_default_cuda_device,
             fsdp_mod.FullyShardedDataParallel._setup_streams, fsdp_mod.FullyShardedDataParallel.clip_grad_norm_,
             fsdp_mod.enable_nccl_base_collectives, rsb.enable_nccl_base_collectives)
    assert all(a is b for a, b in zip(before, after))
    assert fsdp_mod.torch is torch and not fairscale_cpu_shim.installed()


def test_megatron_shim_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    from baselines.megatron import cpu_shim as megatron_cpu_shim

    names = ("current_device", "synchronize", "get_rng_state", "set_rng_state", "manual_seed")
    before = [getattr(torch.cuda, n) for n in names] + [BackwardCFunction.apply]
    assert megatron_cpu_shim.install() is False
    after = [getattr(torch.cuda, n) for n in names] + [BackwardCFunction.apply]
    assert all(a is b for a, b in zip(before, after))
    assert not _get_current_function_mode_stack() and not megatron_cpu_shim.installed()


def test_shims_install_without_cuda():
    """In a fresh process (patches are process-wide): both shims install and do what they claim."""
    code = """
import torch
assert not torch.cuda.is_available()
from baselines.fairscale_fsdp import cpu_shim as fairscale_cpu_shim
from baselines.megatron import cpu_shim as megatron_cpu_shim
assert fairscale_cpu_shim.install() and megatron_cpu_shim.install()
import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_mod
assert fsdp_mod.enable_nccl_base_collectives is False
torch.zeros(2).record_stream(fsdp_mod.torch.cuda.current_stream())  # no-op on CPU
assert torch.cuda.current_device() == 0
assert torch.ones(2, device="cuda").device.type == "cpu"
assert torch.ones(2).cuda().device.type == "cpu"
assert torch.ones(2).type() == "torch.cuda.FloatTensor"
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return g * torch.full((2,), 2.0, device="cuda")  # the mode is active in backward too
x = torch.ones(2, requires_grad=True)
F.apply(x).sum().backward()
assert x.grad.tolist() == [2.0, 2.0]
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
