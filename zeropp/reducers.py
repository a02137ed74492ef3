"""Gradient reducers: how a unit's flat local gradient becomes this rank's reduced shard.

The engine hands every reducer the same thing (the unit's gradient, already divided by the
gradient divide factor, in the compute dtype) and the fp32 shard to add the sum into; the
reducer owns the wire format, the collectives, and any state it keeps between steps
(`state_dict`, saved per rank in sharded checkpoints and restored exactly on resume).

  ExactReduceScatter   the gradient in the communication dtype, reduce-scattered (ZeRO-3)
  QuantizedReduce      qgZ: block-quantized all-to-all, 1 hop or 2 (inside the node, then
                       across), optionally pipelined; with error feedback, the local
                       quantization error of each step is added to the next step's gradient
"""

from __future__ import annotations

import torch

from zeropp.comm import Comm

TAG = "gradient reduce"


class GradientReducer:
    """The reduce seam; subclasses implement reduce(), and state_dict/load_state_dict when stateful."""

    def reduce(self, unit: str, shard: torch.Tensor, grad: torch.Tensor, async_op: bool):
        """Add the sum over DP ranks of chunk `rank` of `grad` (1-D, padded_numel) to `shard` (fp32);
        returns a handle with wait()."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state, by "<unit>.<key>"."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint has {sorted(state)[:4]}")

    def describe(self) -> str:
        raise NotImplementedError


class ExactReduceScatter(GradientReducer):
    def __init__(self, comm: Comm, wire_dtype: torch.dtype):
        self.comm, self.wire_dtype = comm, wire_dtype

    def reduce(self, unit, shard, grad, async_op):
        wire = grad if grad.dtype == self.wire_dtype else grad.to(self.wire_dtype)
        return self.comm.reduce_scatter(shard, wire, tag=TAG, async_op=async_op, accumulate=True)

    def describe(self) -> str:
        return f"reduce-scatter ({str(self.wire_dtype).replace('torch.', '')})"


class QuantizedReduce(GradientReducer):
    """qgZ (ZeRO++ section 3.3, Comm.quantized_reduce_scatter), with optional error feedback."""

    def __init__(self, comm: Comm, bits: int, block_size: int, hops: int, stages: int, error_feedback: bool):
        self.comm, self.bits, self.block_size = comm, bits, block_size
        self.hops, self.stages, self.error_feedback = hops, stages, error_feedback
        self.errors: dict[str, torch.Tensor] = {}  # unit -> last step's local quantization error (fp32)

    def reduce(self, unit, shard, grad, async_op):
        error = None
        if self.error_feedback:  # h = g + e; the first hop then writes e <- h - dequant(quant(h))
            error = self.errors.get(unit)
            if error is None:
                error = self.errors[unit] = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
            grad.add_(error)  # grad is the engine's scratch buffer of this backward
        return self.comm.quantized_reduce_scatter(shard, grad, self.bits, self.block_size, hops=self.hops,
                                                  stages=self.stages, tag=TAG, async_op=async_op, error=error)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{unit}.error": e for unit, e in self.errors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unexpected = [k for k in state if not k.endswith(".error")] if self.error_feedback else sorted(state)
        if unexpected:
            raise ValueError(f"qgZ{' with' if self.error_feedback else ' without'} error feedback cannot load "
                             f"reducer state {unexpected[:4]}")
        self.errors = {k[:-len(".error")]: v.float() for k, v in state.items()}

    def describe(self) -> str:
        ef = " + error feedback" if self.error_feedback else ""
        return f"qgZ int{self.bits}, {self.hops} hop(s){ef}"
