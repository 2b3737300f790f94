"""The CUDA-only kernels of the compiled lowering, each following its kind's call
contract in the core (:data:`sexpgpu.lang.ops.KERNEL_CALLS`).

The attention kernels are SDPA restricted to one backend, so the recorded name says
which kernel ran (the eager ``sdpa`` kernel lets torch pick per call). The
convolution engines are cuDNN's; which algorithms it may take is process-wide state
(``torch.backends.cudnn``), set by the lowering from the chosen engine
(:func:`sexpgpu_torch.cuda.take_conv_engine`), so the kernels themselves only call
the convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sexpgpu.lang.ops import AttentionKernel, Conv2dKernel
from sexpgpu_torch.kernels import conv2d_direct

Tensor = torch.Tensor


def _split(x: Tensor, heads: int) -> Tensor:
    b, t, d = x.shape
    return x.reshape(b, t, heads, d // heads).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def _sdpa(backend: SDPBackend) -> AttentionKernel:
    def attention(q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                _split(q, heads), _split(k, heads), _split(v, heads), is_causal=causal
            )
        return _merge(out)

    attention.__doc__ = f"Attention through SDPA with only the {backend.name} backend."
    return attention


attention_flash = _sdpa(SDPBackend.FLASH_ATTENTION)
attention_cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
attention_efficient = _sdpa(SDPBackend.EFFICIENT_ATTENTION)
attention_sdpa_math = _sdpa(SDPBackend.MATH)

conv2d_cudnn: Conv2dKernel = conv2d_direct
conv2d_cudnn_benchmark: Conv2dKernel = conv2d_direct


# Through these a type checker holds each kernel to its kind's contract.
_ATTENTION: tuple[AttentionKernel, ...] = (
    attention_flash,
    attention_cudnn,
    attention_efficient,
    attention_sdpa_math,
)
_CONV2D: tuple[Conv2dKernel, ...] = (conv2d_cudnn, conv2d_cudnn_benchmark)
