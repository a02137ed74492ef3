"""Block quantization for ZeRO++ qwZ / qgZ: one API over a torch path and Triton kernels (docs/kernels.md)."""

from kernels.quant import (
    BITS,
    WEIGHT_SCALE_DTYPE,
    QuantizedTensor,
    dequant_reduce,
    dequant_reduce_quant,
    dequantize,
    num_blocks,
    on_grid,
    pack_codes,
    packed_bytes,
    quantize,
    quantize_transposed,
    quantize_weights,
    unpack_codes,
)

__all__ = [
    "BITS",
    "WEIGHT_SCALE_DTYPE",
    "QuantizedTensor",
    "dequant_reduce",
    "dequant_reduce_quant",
    "dequantize",
    "num_blocks",
    "on_grid",
    "pack_codes",
    "packed_bytes",
    "quantize",
    "quantize_transposed",
    "quantize_weights",
    "unpack_codes",
]
