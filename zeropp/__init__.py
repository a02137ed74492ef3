"""Our data-parallel runtimes behind one interface (zeropp.runtime.Runtime): DDP and ZeRO-3 / ZeRO++."""

import torch
import torch.nn as nn

from zeropp.config import ZeroConfig
from zeropp.ddp import DDPRuntime
from zeropp.engine import Zero3Engine
from zeropp.runtime import Runtime


def build_runtime(model: nn.Module, config: ZeroConfig, device: torch.device) -> Runtime:
    """The runtime `zero_optimization.stage` asks for, applied to `model` from outside."""
    if config.stage == 3:
        return Zero3Engine(model, config, device=device)
    return DDPRuntime(model, config, device)


__all__ = ["DDPRuntime", "Runtime", "Zero3Engine", "ZeroConfig", "build_runtime"]
