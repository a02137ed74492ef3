"""Our runtimes behind one interface (zeropp.runtime.Runtime): DDP and ZeRO-3 / ZeRO++, and
tensor parallelism (with AccTFM) inside either."""

import torch
import torch.nn as nn

from zeropp.config import TensorParallelConfig, ZeroConfig
from zeropp.ddp import DDPRuntime
from zeropp.engine import Zero3Engine
from zeropp.runtime import Runtime


def build_runtime(model: nn.Module, config: ZeroConfig, device: torch.device,
                  tensor_parallel: TensorParallelConfig | None = None) -> Runtime:
    """The runtime `zero_optimization.stage` asks for, applied to `model` from outside; with
    tensor_parallel.size > 1, inside tensor-parallel groups (zeropp.tp)."""
    if tensor_parallel is not None and tensor_parallel.size > 1:
        from zeropp.tp import TensorParallelRuntime
        return TensorParallelRuntime(model, config, tensor_parallel, device)
    if config.stage == 3:
        return Zero3Engine(model, config, device=device)
    return DDPRuntime(model, config, device)


__all__ = ["DDPRuntime", "Runtime", "TensorParallelConfig", "Zero3Engine", "ZeroConfig", "build_runtime"]
