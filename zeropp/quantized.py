"""What a rank's weight shard looks like on the wire: plain (bf16/fp32) or qwZ-quantized.

A `WeightCodec` turns the fp32 master shard into the bytes the all-gather sends (`encode`,
once per weight update, so the forward and the backward gather send the very same bytes),
and the gathered bytes of all ranks into the weights the forward computes with (`decode`).

qwZ (ZeRO++ section 3.1): the shard is block-quantized (kernels.quantize, fp16 scales) into
one byte buffer per rank, codes then scales, so one all-gather moves both. Every rank
dequantizes the same bytes, so all ranks - and the backward pass, and an export of the
model - see exactly dequant(quant(W)).
"""

from __future__ import annotations

import torch

from kernels import WEIGHT_SCALE_DTYPE, dequantize, num_blocks, packed_bytes, quantize


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
        codes, scales = self._split(wire, master.numel())
        quantize(master, self.bits, self.block_size, scale_dtype=WEIGHT_SCALE_DTYPE, codes_out=codes,
                 scales_out=scales)

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, world: int, order: list[int] | None = None) -> None:
        """`order[p]`: the rank whose shard is p-th in `gathered` (None: rank order)."""
        shard_numel = out.numel() // world
        per_rank = gathered.view(world, -1)
        for p, r in enumerate(order or range(world)):
            codes, scales = self._split(per_rank[p], shard_numel)
            dequantize(codes, scales, shard_numel, self.bits, self.block_size, dtype=out.dtype,
                       out=out[r * shard_numel:(r + 1) * shard_numel])
