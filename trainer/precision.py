"""What a run computes in: bf16 autocast where the hardware multiplies bf16 natively, else fp32.

`train.precision: auto` decides per machine, because the answer flips between CPU kinds: a CPU
with bf16 dot-product instructions (x86 `avx512_bf16` / `amx_bf16`, Arm `bf16`) runs a bf16
matmul several times faster than fp32 (4.6x measured on an AMD EPYC with avx512_bf16), one
without emulates it and runs ~4x slower. bf16 autocast keeps fp32 master weights, optimizer
states and gradient accumulation; only the matmuls (and what autocast picks) run in bf16.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo: x86 "flags", Arm "Features"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device: torch.device, flags: set[str] | None = None) -> bool:
    """Whether `device` multiplies bf16 natively (`flags`: the CPU's, read when None)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def compute_dtype(precision: str, device: torch.device, flags: set[str] | None = None) -> torch.dtype:
    """The matmul dtype of `train.precision` on this device: "auto" is bf16 where it is native."""
    if precision == "bf16" or (precision == "auto" and native_bf16(device, flags)):
        return torch.bfloat16
    return torch.float32


def autocast_for(precision: str, device: torch.device):
    """bf16 autocast when `compute_dtype` says bf16, else nothing (fp32)."""
    if compute_dtype(precision, device) == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
