"""Our runtimes behind one interface (zeropp.runtime.Runtime): DDP and ZeRO-3 / ZeRO++, and
tensor parallelism (with AccTFM) inside either."""

import torch
import torch.nn as nn

from models.weights import WeightSource, materialize
from zeropp.config import TensorParallelConfig, ZeroConfig
from zeropp.ddp import DDPRuntime
from zeropp.engine import Zero3Engine
from zeropp.runtime import Runtime


def build_runtime(model: nn.Module, config: ZeroConfig, device: torch.device,
                  tensor_parallel: TensorParallelConfig | None = None, weights: WeightSource | None = None,
                  site_size: int | None = None) -> Runtime:
    """The runtime `zero_optimization.stage` asks for, applied to `model` from outside; with
    tensor_parallel.size > 1, inside tensor-parallel groups (zeropp.tensor_parallel). A model built
    on the meta device gets its values from `weights`: ZeRO-3 reads only this rank's shards, the
    replicated runtimes (DDP, tensor parallelism) materialize the model first, one parameter at a time.
    site_size: DiLoCo's sites (zeropp.diloco): the runtime runs over its site's ranks only."""
    sharded = config.stage == 3 and not (tensor_parallel is not None and tensor_parallel.size > 1)
    if weights is not None and not sharded:
        materialize(model, weights, device).to(device)  # (parameters made in memory, e.g. LoRA adapters, too)
    if tensor_parallel is not None and tensor_parallel.size > 1:
        from zeropp.tensor_parallel.runtime import TensorParallelRuntime
        return TensorParallelRuntime(model, config, tensor_parallel, device)
    if config.stage == 3:
        return Zero3Engine(model, config, None, device, weights, site_size=site_size)
    return DDPRuntime(model, config, device, site_size=site_size)


__all__ = ["DDPRuntime", "Runtime", "TensorParallelConfig", "Zero3Engine", "ZeroConfig", "build_runtime"]
