"""What a rank's weight shard looks like on the wire: plain (bf16/fp32) or qwZ-quantized.

A `WeightCodec` turns the fp32 master shard into the bytes the all-gather sends (`encode`,
once per weight update, so the forward and the backward gather send the very same bytes),
and the gathered bytes of all ranks into the weights the forward computes with (`decode`).

qwZ (ZeRO++ section 3.1): the shard is block-quantized (kernels.quantize_weights: full levels,
fp16 scales, the grid GGUF's Q8_0 / Q4_0 serve) into
one byte buffer per rank, codes then scales, so one all-gather moves both. Every rank
dequantizes the same bytes, so all ranks - and the backward pass, and an export of the
model - see exactly dequant(quant(W)).

qwZ deltas (`delta_gather`): each node keeps a copy of the weights (hpZ's secondary partition,
the "references"); only the quantized change since the last gather crosses nodes.
"""

from __future__ import annotations

import torch

from kernels import WEIGHT_SCALE_DTYPE, dequantize, num_blocks, packed_bytes, quantize_weights
from zeropp.comm import Comm


class PlainCodec:
    """The shard in the communication dtype (bf16 by default): a cast each way."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def wire_numel(self, shard_numel: int) -> int:
        return shard_numel

    def encode(self, master: torch.Tensor, wire: torch.Tensor) -> None:
        wire.copy_(master)

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, world: int, order: list[int] | None = None) -> None:
        """`order[p]`: the rank whose shard is p-th in `gathered` (None: rank order)."""
        if order is None:
            if out.data_ptr() != gathered.data_ptr():
                out.copy_(gathered)
            return
        sources, targets = gathered.view(world, -1), out.view(world, -1)
        for p, r in enumerate(order):
            targets[r].copy_(sources[p])


class QuantizedCodec:
    """qwZ: per rank, [packed codes | padding to 4 bytes | fp16 scales] as one uint8 buffer."""

    dtype = torch.uint8

    def __init__(self, bits: int, block_size: int):
        self.bits, self.block_size = bits, block_size

    def _layout(self, shard_numel: int) -> tuple[int, int, int]:
        codes = packed_bytes(shard_numel, self.bits, self.block_size)
        scales_at = -(-codes // 4) * 4
        return codes, scales_at, num_blocks(shard_numel, self.block_size)

    def wire_numel(self, shard_numel: int) -> int:
        _, scales_at, blocks = self._layout(shard_numel)
        return scales_at + blocks * WEIGHT_SCALE_DTYPE.itemsize

    def _split(self, wire: torch.Tensor, shard_numel: int):
        codes, scales_at, blocks = self._layout(shard_numel)
        return wire[:codes], wire[scales_at:scales_at + blocks * WEIGHT_SCALE_DTYPE.itemsize].view(WEIGHT_SCALE_DTYPE)

    def encode(self, master: torch.Tensor, wire: torch.Tensor) -> None:
        if master.is_meta:  # units built on paper (zeropp.autoplan): sizes only, no values to quantize
            return
        codes, scales = self._split(wire, master.numel())
        quantize_weights(master, self.bits, self.block_size, codes_out=codes, scales_out=scales)

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, world: int, order: list[int] | None = None) -> None:
        """`order[p]`: the rank whose shard is p-th in `gathered` (None: rank order)."""
        shard_numel = out.numel() // world
        per_rank = gathered.view(world, -1)
        for p, r in enumerate(order or range(world)):
            codes, scales = self._split(per_rank[p], shard_numel)
            dequantize(codes, scales, shard_numel, self.bits, self.block_size, dtype=out.dtype,
                       out=out[r * shard_numel:(r + 1) * shard_numel])


def delta_gather(comm: Comm, out: torch.Tensor, references: torch.Tensor, sent: torch.Tensor | None,
                 codec: QuantizedCodec | None, tag: str, async_op: bool):
    """qwZ deltas: bring this node's copy of the weights up to date, then gather it inside the node.

    `references` holds, in the communication dtype, the shards of the ranks with this local rank,
    one per node in node order. `sent` is this rank's update: the codes of its shard's change
    (`codec`) or, with `codec` None, the shard's values themselves (the first time, or after a
    load); None when the references are current. It is all-gathered across nodes (same local
    rank) and applied to `references`; then `out` receives the node's references in
    local-rank-major order (`Comm.local_major_order`). Every holder of a shard applies the same
    bytes the same way, so the copies stay identical, the sender's included."""
    m = comm.mesh
    if sent is None:  # only inside the node, as hpZ's backward gather: not queued behind the reduces
        return comm.all_gather(out, references, group="intra_node", tag=tag, async_op=async_op)
    # Recorded now, as issued (the work may run on the communication thread after the caller moved on).
    comm.record(tag, sent.dtype, sent.numel() * sent.element_size(), "inter_node")
    comm.record(tag, references.dtype, references.numel() * references.element_size(), "intra_node")

    def work():
        across = torch.empty(m.num_nodes * sent.numel(), dtype=sent.dtype, device=sent.device)
        comm.all_gather(across, sent, "inter_node", tag, thread=comm.threaded, record=False)
        if codec is None:
            references.copy_(across)
        else:
            change = torch.empty(references.numel(), dtype=torch.float32, device=references.device)
            codec.decode(across, change, m.num_nodes)
            references.copy_(change.add_(references))  # 14x faster than references.add_(change) in bf16
        comm.all_gather(out, references, "intra_node", tag, thread=comm.threaded, record=False)

    return comm.run(work, async_op)
