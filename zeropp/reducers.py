"""Gradient reducers: how a unit's flat local gradient becomes this rank's reduced shard.

The engine hands every reducer the same thing (the unit's gradient, already divided by the
gradient divide factor, in the compute dtype) and the fp32 shard to add the sum into; the
reducer owns the wire format, the collectives, and any state it keeps between steps
(`state_dict`, saved per rank in `reducer_rankNNNNN.safetensors` and restored exactly on
resume, zeropp.checkpoint).

  ExactReduceScatter   the gradient in the communication dtype, reduce-scattered (ZeRO-3)
  QuantizedReduce      qgZ (zeropp.qgz): block-quantized all-to-all, 1 hop or 2 (inside the
                       node, then across), optionally pipelined; with error feedback
  ProjectedReduce      SEPARATE (zeropp.separate): a reduce-scatter of random projections,
                       1/CR of the gradient; each rank reconstructs its own shard (and DDP's
                       comm hook, which all-reduces a bucket's projections)
"""

from __future__ import annotations

import torch

from zeropp.comm import Comm

TAG = "gradient reduce"


class GradientReducer:
    """The reduce seam; subclasses implement reduce(), and state_dict/load_state_dict when stateful."""

    stateful = False  # whether a resumed run needs this rank's saved state to repeat the original

    def reduce(self, unit: str, shard: torch.Tensor, grad: torch.Tensor, async_op: bool):
        """Add the sum over DP ranks of chunk `rank` of `grad` (1-D, padded_numel) to `shard` (fp32);
        returns a handle with wait(). `grad` is the engine's buffer: its contents may be overwritten."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state, by "<unit>.<key>"."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint has {sorted(state)[:4]}")

    def describe(self) -> str:
        raise NotImplementedError

    def volume(self, numel: int) -> tuple[int, int] | None:
        """(bytes sent, of which cross-node) reducing a gradient of `numel` elements; None where it
        depends on the values or the round (SEPARATE)."""
        return None


class ExactReduceScatter(GradientReducer):
    def __init__(self, comm: Comm, wire_dtype: torch.dtype):
        self.comm, self.wire_dtype = comm, wire_dtype

    def reduce(self, unit, shard, grad, async_op):
        wire = grad if grad.dtype == self.wire_dtype else grad.to(self.wire_dtype)
        return self.comm.reduce_scatter(shard, wire, tag=TAG, async_op=async_op, accumulate=True, scratch_input=True)

    def describe(self) -> str:
        return f"reduce-scatter ({str(self.wire_dtype).replace('torch.', '')})"

    def volume(self, numel: int) -> tuple[int, int]:
        chunk = numel // self.comm.mesh.world_size * self.wire_dtype.itemsize
        return self.comm.volume(chunk, "dp", node_aware=True)
