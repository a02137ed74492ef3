"""Gradient reducers: how a unit's flat local gradient becomes this rank's reduced shard.

The engine hands every reducer the same thing (the unit's gradient, already divided by the
gradient divide factor, in the compute dtype) and the fp32 shard to add the sum into; the
reducer owns the wire format, the collectives, and any state it keeps between steps
(`state_dict`, saved per rank in sharded checkpoints and restored exactly on resume).

  ExactReduceScatter   the gradient in the communication dtype, reduce-scattered (ZeRO-3)
  QuantizedReduce      qgZ: block-quantized all-to-all, 1 hop or 2 (inside the node, then
                       across), optionally pipelined; with error feedback, the local
                       quantization error of each step is added to the next step's gradient
  ProjectedReduce      SEPARATE (zeropp.separate): a reduce-scatter of random projections,
                       1/CR of the gradient; each rank reconstructs its own shard
"""

from __future__ import annotations

import torch

from zeropp.comm import Comm, CallbackWork
from zeropp.runtime import Timings
from zeropp.separate import Separate

TAG = "gradient reduce"


class GradientReducer:
    """The reduce seam; subclasses implement reduce(), and state_dict/load_state_dict when stateful."""

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
            # A step skipped for non-finite gradients left non-finite residuals: drop those (no sync).
            torch.nan_to_num_(error, nan=0.0, posinf=0.0, neginf=0.0)
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

    def volume(self, numel: int) -> tuple[int, int]:
        return self.comm.quantized_reduce_scatter_volume(numel, self.bits, self.block_size, self.hops, self.stages)

    def describe(self) -> str:
        ef = " + error feedback" if self.error_feedback else ""
        return f"qgZ int{self.bits}, {self.hops} hop(s){ef}"


class ProjectedReduce(GradientReducer):
    """SEPARATE on the ZeRO reduce path: the unit's gradient, as `world` shard rows, is projected
    blockwise; the projections are reduce-scattered (in the communication dtype) and each rank
    adds the reconstruction of its own shard. G-SEPARATE's measuring rounds also reduce-scatter
    the exact gradient and all-reduce three sums for the cosine similarity."""

    def __init__(self, comm: Comm, compressor: Separate, wire_dtype: torch.dtype, timings: Timings,
                 qgz: QuantizedReduce | None = None):
        self.comm, self.compressor, self.wire_dtype, self.timings = comm, compressor, wire_dtype, timings
        self.qgz = qgz  # when set, the projections go through qgZ's quantized all-to-all instead
        self.cosines: dict[str, float] = {}  # G-SEPARATE: each unit's last measured cosine

    def reduce(self, unit, shard, grad, async_op):
        world, rank = self.comm.mesh.size("dp"), self.comm.mesh.group_rank("dp")
        exact = exact_work = None
        if self.compressor.adapt_round(unit):  # the raw gradient's exact mean, before e is added
            exact = torch.zeros_like(shard)
            exact_work = self.comm.reduce_scatter(exact, grad.to(self.wire_dtype), tag=TAG + " (exact, G-SEPARATE)",
                                                  async_op=True, accumulate=True)
        with self.timings.timer("gradient compression"):
            rnd = self.compressor.compress(unit, grad.view(world, -1))
        per_chunk = rnd.projections.shape[1]
        if self.qgz is None:
            summed = torch.zeros(per_chunk, device=shard.device)
            work = self.comm.reduce_scatter(summed, rnd.projections.to(self.wire_dtype).reshape(-1), tag=TAG,
                                            async_op=True, accumulate=True)
        else:  # qgZ needs whole quantization blocks (per stage) in every chunk: pad the projections
            align = self.qgz.block_size * self.qgz.stages
            padded = torch.zeros(world, -(-per_chunk // align) * align, device=shard.device)
            padded[:, :per_chunk] = rnd.projections
            summed_padded = torch.zeros(padded.shape[1], device=shard.device)
            work = self.qgz.reduce(unit, summed_padded, padded.reshape(-1), async_op=True)
            summed = summed_padded[:per_chunk]

        def finish():
            work.wait()
            with self.timings.timer("gradient compression"):
                estimate = self.compressor.decompress(rnd, summed, rank)
            shard.add_(estimate)
            if exact is not None:
                exact_work.wait()
                sums = torch.stack([(estimate * exact).sum(), estimate.square().sum(), exact.square().sum()]).double()
                self.comm.all_reduce(sums, tag="G-SEPARATE cosine")
                cosine = float(sums[0] / (sums[1].sqrt() * sums[2].sqrt()).clamp_min(1e-30))
                self.cosines[unit] = cosine
                self.compressor.adapt(unit, cosine)

        if async_op:
            return CallbackWork(finish)
        finish()
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.compressor.load_state_dict(state)

    def describe(self) -> str:
        if self.qgz is not None:
            return f"projections over {self.qgz.describe()}"
        return f"a reduce-scatter of projections ({str(self.wire_dtype).replace('torch.', '')})"
