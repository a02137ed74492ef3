"""Inputs the kernels are checked on, shared by tests/kernels/test_quant.py (the torch path, Triton
under the interpreter) and scripts/check_cuda.py (Triton on a GPU): one definition, so the GPU check
runs on exactly the adversarial cases the suite does, and a script never imports the test suite.
"""

import torch

from kernels.quant import quantize


def sample(numel, dtype, seed=0):
    """Gaussian values in 64-blocks: one all zero, one whose fp16 scale underflows to 0, one
    with exact .5 ties at 8 bits, then one whose fp16 scale is subnormal (x / s gets clamped)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 3
    x[64:128] = 0
    x[128:192] *= 1e-30
    x[200:208] = torch.tensor([0.125, 0.375, 0.625, 0.875, -0.375, -0.625, 31.75, -31.75])  # s = 0.25
    x[256:] *= 1e-6
    x[256] = 1.06e-5  # fp16 scale: 1.4 subnormal steps rounds to 1, so x / s = 178 gets clamped
    return x.to(dtype)


def stage_view(A, B, S, c, dtype, seed=0):
    """Stage s of an [A, B, S, c] buffer: a non-contiguous [A, B, c] view."""
    x = torch.randn(A, B, S, c, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x[:, :, 1]


def received(k, numel, bits, bs, scale_dtype=torch.float32):
    """k quantized tensors back to back, as an all-to-all delivers them."""
    parts = [quantize(torch.randn(numel, generator=torch.Generator().manual_seed(i)) * (i + 1), bits, bs,
                      scale_dtype=scale_dtype) for i in range(k)]
    return parts, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])
