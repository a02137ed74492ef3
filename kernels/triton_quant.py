"""Triton kernels for kernels.quant, bit-identical to its torch path.

Each program handles ROWS quantization blocks as a [ROWS, G, 8] tile: a block is GROUPS
groups of 8 codes (G is GROUPS rounded up to a power of two, the rest masked), and a group
packs into `bits` bytes, so packing is a reduction over the last axis.

Exactness: fp32 divisions are IEEE (`div_rn`; Triton's `/` is approximate on NVIDIA),
rounding is half-to-even done by hand (libdevice `rint` is absent in the interpreter),
fp32 -> bf16 rounds on the bits (the interpreter's cast truncates), and launches pass EXACT
so no mul+add becomes an FMA. On CPU the kernels run under TRITON_INTERPRET=1, which must be
set before triton is imported.
"""

import torch
import triton
import triton.language as tl

FP16_MAX = tl.constexpr(65504.0)
TILE = 4096  # elements per program
EXACT = {"enable_fp_fusion": False}  # launch option: no mul+add fused into an FMA (torch rounds the product)


@triton.jit
def _round_half_even(v):
    """rint for |v| < 2**22: floor, then up above .5, and on .5 ties when the floor is odd."""
    f = tl.floor(v)
    d = v - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + up.to(tl.float32)


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounding to nearest even on the bits: the interpreter's own cast truncates."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile_index(pid, nblocks, ROWS: tl.constexpr, G: tl.constexpr):
    """Block ids [ROWS], their validity, group ids [G] and in-group ids [8] of a program's tile."""
    row = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return row, row < nblocks, tl.arange(0, G), tl.arange(0, 8)


@triton.jit
def _quantize_tile(x, row, row_ok, g, i, codes_ptr, scales_ptr,
                   BITS: tl.constexpr, GROUPS: tl.constexpr, SCALE_FP16: tl.constexpr, FULL: tl.constexpr):
    """Quantize an fp32 [ROWS, G, 8] tile (zeros outside the tensor) and store codes and scales;
    FULL: the full levels (kernels.quant's spec)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    if FULL:
        amax = tl.max(tl.max(x, axis=2), axis=1)
        amin = tl.min(tl.min(x, axis=2), axis=1)
        m = tl.where(amax >= -amin, amax, amin)
        scale = tl.math.div_rn(m, tl.full(m.shape, -HALF, tl.float32))
        scale = tl.where(scale == 0.0, 0.0, scale)  # +0.0
        if SCALE_FP16:
            scale = tl.minimum(tl.maximum(scale, -FP16_MAX), FP16_MAX).to(tl.float16)
        lowest, highest = -HALF, HALF - 1
    else:
        absmax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        scale = tl.math.div_rn(absmax, tl.full(absmax.shape, HALF - 1, tl.float32))
        if SCALE_FP16:
            scale = tl.minimum(scale, FP16_MAX).to(tl.float16)
        lowest, highest = 1 - HALF, HALF - 1
    tl.store(scales_ptr + row, scale, mask=row_ok)
    s = scale.to(tl.float32)
    divisor = tl.where(s == 0.0, float("inf"), s)[:, None, None]
    v = tl.math.div_rn(x, tl.broadcast_to(divisor, x.shape))
    q = _round_half_even(tl.minimum(tl.maximum(v, lowest), highest))
    code = (q + HALF).to(tl.uint64)
    word = tl.sum(code << (i * BITS).to(tl.uint64)[None, None, :], axis=2)  # [ROWS, G]: a group's bits
    byte = ((word[:, :, None] >> (i * 8).to(tl.uint64)[None, None, :]) & 0xFF).to(tl.uint8)  # i = byte index
    offs = row[:, None, None] * (GROUPS * BITS) + g[None, :, None] * BITS + i[None, None, :]
    mask = row_ok[:, None, None] & (g < GROUPS)[None, :, None] & (i < BITS)[None, None, :]
    tl.store(codes_ptr + offs, byte, mask=mask)


@triton.jit
def _dequantize_tile(codes_ptr, scales_ptr, row, row_ok, g, i, BITS: tl.constexpr, GROUPS: tl.constexpr):
    """fp32 [ROWS, G, 8] values of the tile's blocks."""
    offs = row[:, None, None] * (GROUPS * BITS) + g[None, :, None] * BITS + i[None, None, :]
    mask = row_ok[:, None, None] & (g < GROUPS)[None, :, None] & (i < BITS)[None, None, :]
    byte = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.uint64)
    word = tl.sum(byte << (i * 8).to(tl.uint64)[None, None, :], axis=2)
    code = (word[:, :, None] >> (i * BITS).to(tl.uint64)[None, None, :]) & ((1 << BITS) - 1)
    s = tl.load(scales_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
    return (code.to(tl.int32) - (1 << (BITS - 1))).to(tl.float32) * s[:, None, None]


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, numel, nblocks, A, C, stride_a, stride_b, stride_c,
                     BLOCK: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
                     ROWS: tl.constexpr, SCALE_FP16: tl.constexpr, FULL: tl.constexpr):
    """Element n of the quantized sequence is x[a, b, c] with n = (b * A + a) * C + c."""
    row, row_ok, g, i = _tile_index(tl.program_id(0), nblocks, ROWS, G)
    first = row * BLOCK  # a block never straddles a row of C elements
    b = first // C // A
    a = first // C % A
    base = a * stride_a + b * stride_b + (first % C) * stride_c
    within = g[None, :, None] * 8 + i[None, None, :]
    mask = row_ok[:, None, None] & (g < GROUPS)[None, :, None] & (first[:, None, None] + within < numel)
    x = tl.load(x_ptr + base[:, None, None] + within * stride_c, mask=mask, other=0.0).to(tl.float32)
    _quantize_tile(x, row, row_ok, g, i, codes_ptr, scales_ptr, BITS, GROUPS, SCALE_FP16, FULL)


@triton.jit
def _dequant_reduce_kernel(codes_ptr, scales_ptr, out_ptr, out_codes_ptr, out_scales_ptr, k, numel, nblocks,
                           codes_per_tensor,
                           BLOCK: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
                           ROWS: tl.constexpr, QUANTIZE: tl.constexpr, OUT_BITS: tl.constexpr,
                           SCALE_FP16: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr,
                           FULL: tl.constexpr):
    """Sum tensors 0..k-1 in order in fp32; store it into out_ptr (k=1: plain dequantize) or
    requantize it."""
    row, row_ok, g, i = _tile_index(tl.program_id(0), nblocks, ROWS, G)
    acc = _dequantize_tile(codes_ptr, scales_ptr, row, row_ok, g, i, BITS, GROUPS)
    for _ in range(1, k):  # advancing the pointers keeps the offsets 64-bit
        codes_ptr += codes_per_tensor
        scales_ptr += nblocks
        acc += _dequantize_tile(codes_ptr, scales_ptr, row, row_ok, g, i, BITS, GROUPS)
    n = row[:, None, None] * BLOCK + g[None, :, None] * 8 + i[None, None, :]
    mask = row_ok[:, None, None] & (g < GROUPS)[None, :, None] & (n < numel)
    if QUANTIZE:
        acc = tl.where(mask, acc, 0.0)  # padding is zero, whatever codes it arrived with
        _quantize_tile(acc, row, row_ok, g, i, out_codes_ptr, out_scales_ptr, OUT_BITS, GROUPS, SCALE_FP16, FULL)
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptr + n, mask=mask)
        if OUT_BF16:
            tl.store(out_ptr + n, _to_bf16(acc), mask=mask)
        else:
            tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _geometry(block_size):
    """(GROUPS, G, ROWS): groups per block, that padded to a power of two, blocks per program."""
    groups = block_size // 8
    g = triton.next_power_of_2(groups)
    return groups, g, max(1, TILE // (8 * g))


def quantize(x, shape, strides, bits, block_size, codes, scales, levels):
    """Quantize x (read as [A, B, C] with the given element strides, in [B, A, C] order) on `levels`."""
    A, B, C = shape
    numel = A * B * C
    nblocks = scales.numel()
    groups, g, rows = _geometry(block_size)
    if nblocks:
        _quantize_kernel[(triton.cdiv(nblocks, rows),)](
            x, codes, scales, numel, nblocks, A, C, *strides,
            BLOCK=block_size, BITS=bits, GROUPS=groups, G=g, ROWS=rows,
            SCALE_FP16=scales.dtype.itemsize == 2, FULL=levels == "full", **EXACT)


def dequantize(codes, scales, numel, bits, block_size, out, accumulate):
    dequant_reduce(codes, scales, 1, numel, bits, block_size, out=out, accumulate=accumulate)


def dequant_reduce(codes, scales, k, numel, bits, block_size, out=None, accumulate=False, quant_out=None):
    """Into fp32 `out`, or requantized into quant_out = (codes, scales, out_bits, levels)."""
    nblocks = scales.numel() // k
    groups, g, rows = _geometry(block_size)
    out_codes, out_scales, out_bits, levels = quant_out if quant_out is not None else (codes, scales, bits, None)
    if nblocks:
        _dequant_reduce_kernel[(triton.cdiv(nblocks, rows),)](
            codes, scales, out if out is not None else codes, out_codes, out_scales, k, numel, nblocks,
            codes.numel() // k,
            BLOCK=block_size, BITS=bits, GROUPS=groups, G=g, ROWS=rows, QUANTIZE=quant_out is not None,
            OUT_BITS=out_bits, SCALE_FP16=out_scales.dtype.itemsize == 2, ACCUMULATE=accumulate,
            OUT_BF16=out is not None and out.dtype == torch.bfloat16, FULL=levels == "full", **EXACT)
