"""CUDA's libraries made ready on every thread that computes, before a system posts any receive.

cuBLAS, cuBLASLt and the attention kernels create their handles and workspaces at their first use,
per thread (the rank's own, and autograd's thread for the device), and that first use waits for the
device. A receive posted on an NCCL stream before it is an NCCL kernel spinning until the peer
sends, and the peer may send only after this rank's first forward: both ranks then wait in their
first ``F.linear`` for ever (seen on the H100: ours P-2, each rank's stack in ``DeferredLinear.forward``
while its posted receives spun; the baselines, which post a receive only where they wait for it, ran).
So the worker runs one small forward and backward of the operations a GPT step uses, in fp32 and in
the run's compute type, on each of its GPUs, before the system starts (``warm_up``). On CPU: nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def warm_up(devices: tuple[torch.device, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """One forward and backward of linear (with and without bias), batched matmul, attention (causal,
    and with a mask as ours' later slices use it), layer norm, GELU and cross entropy, per dtype, on
    each CUDA device; then that device's current stream is synchronised. A no-op on CPU."""
    for device in devices:
        if device.type != "cuda":
            continue
        with torch.cuda.device(device):
            for dtype in dict.fromkeys((torch.float32, *dtypes)):
                _one(device, dtype)
            torch.cuda.current_stream(device).synchronize()


def _one(device: torch.device, dtype: torch.dtype) -> None:
    B, H, T, D = 1, 2, 16, 32
    C = H * D
    x = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(3 * C, C, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(3 * C, device=device, dtype=dtype, requires_grad=True)
    h = F.layer_norm(x, (C,))
    q, k, v = F.linear(h, w, b).view(B, T, 3, H, D).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = torch.ones(T, T, device=device, dtype=torch.bool).tril()
    y = (F.scaled_dot_product_attention(q, k, v, is_causal=True)
         + F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    y = (y + torch.matmul(q, k.transpose(-1, -2)).softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    logits = F.linear(F.gelu(y), w[:C])
    loss = F.cross_entropy(logits.reshape(-1, C).float(), torch.zeros(B * T, dtype=torch.long, device=device))
    loss.backward()
    with torch.no_grad():  # the deferred weight gradients' products, on this thread
        torch.addmm(b[:C], x.detach().reshape(-1, C).t(), h.detach().reshape(-1, C))
