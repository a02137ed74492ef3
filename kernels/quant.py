"""Block quantization for ZeRO++ (qwZ weights, qgZ gradients): the API and the torch path.

Format (docs/kernels.md): a flat tensor is cut into blocks of `block_size` elements, the
last one zero-padded. With n = 2**(bits-1), per block, in fp32, stored as `scale_dtype`:

  levels="symmetric"  s = absmax / (n - 1); q in [-(n-1), n-1]: every value within half a step
                      (gradients, which are summed across ranks)
  levels="full"       s = m / -n, m the block's value of largest magnitude (amax where
                      amax >= -amin, else amin), so s may be negative; q in [-n, n-1]: all 2**bits
                      codes, m exactly on -n (weights: llama.cpp's Q4_0 rule, which GGUF Q8_0 /
                      Q4_0 hold as they are; 1.3x (4 bits) to 3.3x (2 bits) less squared error
                      on Gaussian blocks)

q = clamp(round_half_even(x / s), lowest, highest) with s read back in fp32 (q = 0 where s = 0;
a zero scale is +0.0); the code q + n is packed densely, 8 codes in `bits` bytes, little-endian
bit order. Blocks are contiguous byte ranges, so a range of blocks can be sliced out and sent as is.

The torch path (`impl="torch"`) runs on any device; `kernels.triton_quant` holds the fused
Triton kernels, bit-identical to it. "auto" picks Triton for CUDA tensors.
"""

import os
from dataclasses import dataclass

import torch

BITS = (8, 6, 4, 3, 2)
SCALE_DTYPES = (torch.float32, torch.float16)
WEIGHT_SCALE_DTYPE = torch.float16  # quantized weights' scales (qwZ, the exports): what GGUF's Q8_0/Q4_0 store
LEVELS = ("symmetric", "full")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP16_MAX = 65504.0
IMPLS = ("auto", "torch", "triton")


@dataclass
class QuantizedTensor:
    """Codes and scales of a flat tensor of `numel` elements."""

    codes: torch.Tensor  # uint8, packed_bytes(numel, bits, block_size)
    scales: torch.Tensor  # scale_dtype, num_blocks(numel, block_size)
    numel: int
    bits: int
    block_size: int

    def dequantize(self, **kwargs) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.numel, self.bits, self.block_size, **kwargs)


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_bytes(numel: int, bits: int, block_size: int) -> int:
    return num_blocks(numel, block_size) * block_size * bits // 8


# ---------------------------------------------------------------- public API


def quantize(x, bits=8, block_size=256, *, scale_dtype=torch.float32, levels="symmetric", codes_out=None,
             scales_out=None, impl="auto") -> QuantizedTensor:
    """Quantize `x` (any shape, read flat) into blocks; optionally into caller-given buffers."""
    _check_format(bits, block_size, levels)
    _check_input(x)
    numel = x.numel()
    codes, scales = _outputs(x.device, numel, bits, block_size, scale_dtype, codes_out, scales_out)
    if _pick(impl, x) == "triton":
        from kernels import triton_quant

        flat = x.reshape(-1)
        triton_quant.quantize(flat, (1, 1, numel), (0, 0, 1), bits, block_size, codes, scales, levels)
    else:
        _quantize_flat(x.reshape(-1), bits, block_size, codes, scales, levels)
    return QuantizedTensor(codes, scales, numel, bits, block_size)


def quantize_transposed(x3d, bits, block_size, *, scale_dtype=torch.float32, levels="symmetric", codes_out=None,
                        scales_out=None, impl="auto") -> QuantizedTensor:
    """Quantize x3d.transpose(0, 1).contiguous().flatten() without making that copy.

    qgZ's hierarchical all-to-all sends a gradient's slices in a different order than they lie
    in memory; reading the [A, B, C] view (any strides) in [B, A, C] order fuses that reorder
    into quantization.
    """
    _check_format(bits, block_size, levels)
    _check_input(x3d)
    if x3d.dim() != 3:
        raise ValueError(f"quantize_transposed: x3d has shape {tuple(x3d.shape)}, expected 3 dims [A, B, C]")
    A, B, C = x3d.shape
    if C % block_size:
        raise ValueError(f"quantize_transposed: C={C} must be a multiple of block_size={block_size}")
    numel = x3d.numel()
    codes, scales = _outputs(x3d.device, numel, bits, block_size, scale_dtype, codes_out, scales_out)
    if _pick(impl, x3d) == "triton":
        from kernels import triton_quant

        triton_quant.quantize(x3d, (A, B, C), x3d.stride(), bits, block_size, codes, scales, levels)
    elif numel:
        _quantize_rows(x3d.transpose(0, 1).unflatten(-1, (C // block_size, block_size)), bits, codes, scales,
                       levels)
    return QuantizedTensor(codes, scales, numel, bits, block_size)


def dequantize(codes, scales, numel, bits, block_size, *, out=None, dtype=torch.float32, accumulate=False,
               impl="auto") -> torch.Tensor:
    """Dequantize to `numel` values of `dtype`, into `out` if given (adding to it if `accumulate`)."""
    _check_format(bits, block_size)
    _check_codes(codes, scales, 1, numel, bits, block_size)
    out = _result(out, codes.device, numel, dtype, accumulate)
    if _pick(impl, codes) == "triton":
        from kernels import triton_quant

        triton_quant.dequantize(codes, scales, numel, bits, block_size, out, accumulate)
    else:
        _dequant_sum(codes, scales, 1, numel, bits, block_size, out, accumulate)
    return out


def quantize_weights(x, bits, block_size, **buffers) -> QuantizedTensor:
    """The weights' grid (qwZ, the exports): full levels, fp16 scales (WEIGHT_SCALE_DTYPE), as GGUF's Q8_0 / Q4_0."""
    return quantize(x, bits, block_size, scale_dtype=WEIGHT_SCALE_DTYPE, levels="full", **buffers)


def on_grid(tensor: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """dequant(quant(tensor)) in fp32 on the weights' grid: the values a qwZ forward computes with."""
    return quantize_weights(tensor.reshape(-1).float(), bits, block_size).dequantize().view(tensor.shape)


def dequant_reduce(codes, scales, k, numel, bits, block_size, *, out=None, accumulate=False,
                   impl="auto") -> torch.Tensor:
    """Sum (fp32, in order 0..k-1) of the k quantized tensors held back to back in codes/scales.

    This is the reduction step after qgZ's all-to-all; with `accumulate` the sum is added
    to `out` (a gradient accumulation buffer).
    """
    _check_format(bits, block_size)
    _check_codes(codes, scales, k, numel, bits, block_size)
    out = _result(out, codes.device, numel, torch.float32, accumulate)
    if _pick(impl, codes) == "triton":
        from kernels import triton_quant

        triton_quant.dequant_reduce(codes, scales, k, numel, bits, block_size, out=out, accumulate=accumulate)
    else:
        _dequant_sum(codes, scales, k, numel, bits, block_size, out, accumulate)
    return out


def dequant_reduce_quant(codes, scales, k, numel, bits, block_size, *, out_bits=None,
                         scale_dtype=torch.float32, levels="symmetric", impl="auto") -> QuantizedTensor:
    """Requantized sum (on `levels`) of k quantized tensors (qgZ's intra-node reduction before the next hop).

    One fused pass on Triton; the torch path does the same a piece at a time.
    """
    out_bits = bits if out_bits is None else out_bits
    _check_format(bits, block_size)
    _check_format(out_bits, block_size, levels)
    _check_codes(codes, scales, k, numel, bits, block_size)
    out_codes, out_scales = _outputs(codes.device, numel, out_bits, block_size, scale_dtype, None, None)
    if _pick(impl, codes) == "triton":
        from kernels import triton_quant

        triton_quant.dequant_reduce(codes, scales, k, numel, bits, block_size,
                                    quant_out=(out_codes, out_scales, out_bits, levels))
    else:
        _dequant_sum(codes, scales, k, numel, bits, block_size, None, False,
                     (out_codes, out_scales, out_bits, levels))
    return QuantizedTensor(out_codes, out_scales, numel, out_bits, block_size)


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits, a multiple of 8 of them) densely into `out`.

    Code i of each group of 8 takes bits [i*bits, (i+1)*bits) of the group's `bits` bytes read
    as a little-endian integer; when bits divides 8 that is simply 8 // bits codes per byte,
    the first in the low bits.
    """
    if 8 % bits == 0:
        # Read the codes of one output byte as one little-endian word: code i sits at bit 8i,
        # and shifting the word right by i * (8 - bits) brings it to bit i * bits while the
        # other codes land outside the low byte, which is what `out` keeps.
        word = codes.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[8 // bits])
        packed = word
        for i in range(1, 8 // bits):
            packed = packed | (word >> (i * (8 - bits)))
        out.copy_(packed)
    else:  # 3 or 6 bits: build each group's 24- or 48-bit integer, then cut it into bytes
        shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
        word = (codes.view(-1, 8).to(torch.int64) << shifts).sum(-1, keepdim=True)
        byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
        out.view(-1, bits).copy_((word >> byte_shifts) & 0xFF)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, dtype=torch.uint8) -> torch.Tensor:
    """Inverse of pack_codes: the 8 * packed.numel() // bits codes, as `dtype`."""
    mask = (1 << bits) - 1
    if 8 % bits == 0:  # one strided column per position in the byte, converted on the way
        codes = torch.empty(packed.numel(), 8 // bits, dtype=dtype, device=packed.device)
        for i in range(8 // bits):
            codes[:, i] = packed if bits == 8 else (packed >> (i * bits)) & mask
        return codes.view(-1)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (packed.view(-1, bits).to(torch.int64) << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word >> shifts) & mask).to(dtype).view(-1)


# ---------------------------------------------------------------- checks


def _check_format(bits, block_size, levels="symmetric"):
    if levels not in LEVELS:
        raise ValueError(f"levels={levels!r}: expected one of {LEVELS}")
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: expected one of {BITS}")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size={block_size!r}: expected a positive multiple of 8")


def _check_input(x):
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"input dtype {x.dtype}: expected one of {INPUT_DTYPES}")


def _check_buffer(name, t, dtype, numel, device):
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name}: got {t.dtype} with {t.numel()} elements on {t.device} (contiguous="
                         f"{t.is_contiguous()}), expected a contiguous {dtype} tensor of {numel} elements on {device}")


def _check_codes(codes, scales, k, numel, bits, block_size):
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: expected the number (>= 1) of quantized tensors in codes/scales")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"scales dtype {scales.dtype}: expected one of {SCALE_DTYPES}")
    _check_buffer("codes", codes, torch.uint8, k * packed_bytes(numel, bits, block_size), codes.device)
    _check_buffer("scales", scales, scales.dtype, k * num_blocks(numel, block_size), codes.device)


def _outputs(device, numel, bits, block_size, scale_dtype, codes_out, scales_out):
    """Codes and scales buffers: the caller's (checked) or new ones."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype}: expected one of {SCALE_DTYPES}")
    n_codes, n_scales = packed_bytes(numel, bits, block_size), num_blocks(numel, block_size)
    if codes_out is None:
        codes_out = torch.empty(n_codes, dtype=torch.uint8, device=device)
    if scales_out is None:
        scales_out = torch.empty(n_scales, dtype=scale_dtype, device=device)
    _check_buffer("codes_out", codes_out, torch.uint8, n_codes, device)
    _check_buffer("scales_out", scales_out, scale_dtype, n_scales, device)
    return codes_out.view(-1), scales_out.view(-1)


def _result(out, device, numel, dtype, accumulate):
    """The dequantized output buffer: the caller's (checked) or a new one."""
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {INPUT_DTYPES}")
    if accumulate and (out is None or dtype != torch.float32):
        raise ValueError("accumulate=True needs an fp32 `out` to add into")
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    _check_buffer("out", out, dtype, numel, device)
    return out.view(-1)


def _pick(impl, tensor):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "auto":
        return "triton" if tensor.is_cuda else "torch"
    if impl == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    return impl


# ---------------------------------------------------------------- torch path
#
# The torch path works CHUNK elements at a time with one set of scratch buffers per call: each
# piece is read from memory once, and the other passes over it (a few vectorised torch ops) run
# while it is still in cache instead of streaming full-size temporaries through DRAM.

CHUNK = 1 << 20

# fl(_MAGIC + v) = _MAGIC + round_half_even(v) for |v| < 2**22: the sum lies in [2**23, 2**24),
# where fp32 values are spaced 1 apart, and _MAGIC is even. The integer ends up in the low bits of
# the sum's bit pattern, so one add rounds and one int32 -> uint8 narrowing extracts the code.
_MAGIC = 1.5 * 2 ** 23


class _Scratch:
    """Buffers reused by every piece of one call, grown on demand."""

    def __init__(self, device):
        self.device, self.bufs = device, {}

    def get(self, name, numel, dtype):
        nbytes = numel * dtype.itemsize
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[name] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(dtype)


def _pieces(rows, limit):
    """Views of consecutive whole blocks covering a [..., block_size] view, in order, of about
    `limit` elements each (at least one block)."""
    if rows.numel() <= limit:
        yield rows
    elif rows.dim() == 2 or rows[0].numel() <= limit:
        step = max(1, limit // rows[0].numel())
        for i in range(0, rows.shape[0], step):
            yield rows[i:i + step]
    else:
        for sub in rows:
            yield from _pieces(sub, limit)


def _quantize_flat(flat, bits, block_size, codes, scales, levels, scratch=None):
    """Whole blocks straight from `flat`; only a ragged last block is copied to be padded."""
    scratch = scratch or _Scratch(flat.device)
    whole = flat.numel() // block_size
    split = whole * block_size * bits // 8
    if whole:
        _quantize_rows(flat[: whole * block_size].view(whole, block_size), bits, codes[:split], scales[:whole],
                       levels, scratch)
    if whole < scales.numel():
        tail = flat.new_zeros(1, block_size)
        tail[0, : flat.numel() - whole * block_size] = flat[whole * block_size:]
        _quantize_rows(tail, bits, codes[split:], scales[whole:], levels, scratch)


def _quantize_rows(rows, bits, codes, scales, levels, scratch=None):
    """Quantize a [..., block_size] view (any strides, any input dtype) into flat codes/scales."""
    scratch = scratch or _Scratch(rows.device)
    block_bytes = rows.shape[-1] * bits // 8
    done = 0
    for piece in _pieces(rows, CHUNK):
        n = piece.numel() // piece.shape[-1]
        _quantize_piece(piece, bits, codes[done * block_bytes:(done + n) * block_bytes], scales[done:done + n],
                        levels, scratch)
        done += n
    _requantize_clamped(rows, bits, codes, scales, levels)


def _code_range(bits, levels):
    """The lowest and highest q of the grid."""
    half = 2 ** (bits - 1)
    return (-half, half - 1) if levels == "full" else (1 - half, half - 1)


def _quantize_piece(rows, bits, codes, scales, levels, scratch):
    """The spec without its clamp, in five passes over the piece: amax (from memory), amin, x / s,
    + magic, narrowing to uint8. `_requantize_clamped` redoes the blocks that need the clamp. The
    full grid takes a sixth pass, the clamp at the top: the value opposite m can reach +n steps.

    16-bit input is widened to fp32 first (one pass): torch reduces fp32 rows 5x faster than bf16
    ones. An all-zero block's max(amax, -amin) can be -0.0 (e.g. fp16 values that flushed to signed
    zeros; torch's vectorised and scalar loops differ there): the scales' abs_() makes it the spec's
    +0.0, as the Triton kernels give on CUDA (one pass over the scales only).
    """
    lowest, highest = _code_range(bits, levels)
    q = scratch.get("q", rows.numel(), torch.float32).view(rows.shape)
    if rows.dtype != torch.float32:
        rows = q.copy_(rows)
    stored = scales.view(rows.shape[:-1])
    amax, amin = rows.amax(-1), rows.amin(-1)
    if levels == "full":  # m / -n, and a zero scale as +0.0 (m = +0.0 gives -0.0)
        scale = torch.where(amax >= amin.neg(), amax, amin).div_(lowest)
        scale.masked_fill_(scale == 0, 0.0)
    else:
        scale = torch.maximum(amax, amin.neg_()).div_(highest).abs_()
    if scales.dtype == torch.float16:
        scale.clamp_(-FP16_MAX, FP16_MAX)
    s = stored.copy_(scale).float()  # fp16: rounds and reads it back
    # The spec divides by inf where s = 0 (so q = 0). s = 0 means absmax < n * 2**-150 (fp32) or
    # <= n * 2**-25 (fp16), so x / tiny < 1/2 rounds to 0 as well, with one op instead of two;
    # subnormal scales, which this raises, are redone by _requantize_clamped anyway.
    divisor = torch.where(s == 0, torch.finfo(scales.dtype).tiny, s).unsqueeze(-1)
    quotient = torch.div(rows, divisor, out=q)
    if levels == "full":
        quotient.clamp_(max=highest)
    words = quotient.add_(_MAGIC + highest + 1).view(torch.int32).view(-1)  # code q + n
    if bits == 8:  # code = v + 2**(bits-1), the low byte of each word
        codes.copy_(words)
    else:
        _pack(scratch.get("codes", words.numel(), torch.uint8).copy_(words), bits, codes, scratch)


def _requantize_clamped(rows, bits, codes, scales, levels):
    """Redo, as the spec says, the blocks whose stored scale is neither 0 nor a normal number.

    clamp(round(v), lowest, highest) = round(v) when v lies within half a step of the range. With s
    normal, a rounded-down scale makes |x / s| exceed |m / s| by at most n * 2**-10 (and the full
    grid's top is clamped anyway), so only subnormal scales, fp16 scales clamped to FP16_MAX, inf and
    NaN need the clamp (and NaN quotients the int8 cast's code).
    """
    s = scales.float().abs()
    limit = FP16_MAX if scales.dtype == torch.float16 else float("inf")
    normal = (s >= torch.finfo(scales.dtype).tiny) & (s < limit) | (s == 0)
    if bool(normal.all()):
        return
    bad = (~normal).nonzero().squeeze(1)
    blocks = rows[torch.unravel_index(bad, rows.shape[:-1])] if rows.dim() > 2 else rows[bad]
    lowest, highest = _code_range(bits, levels)
    stored = scales[bad].float()
    divisor = torch.where(stored == 0, float("inf"), stored).unsqueeze(-1)
    q = torch.div(blocks, divisor, out=torch.empty(blocks.shape, dtype=torch.float32, device=rows.device))
    fixed = q.clamp_(lowest, highest).round_().to(torch.int8).view(torch.uint8).add_(highest + 1)
    block_bytes = rows.shape[-1] * bits // 8
    if bits != 8:
        fixed = pack_codes(fixed.view(-1), bits, torch.empty(bad.numel() * block_bytes, dtype=torch.uint8,
                                                              device=rows.device))
    codes.view(-1, block_bytes)[bad] = fixed.view(-1, block_bytes)


def _pack(codes, bits, out, scratch):
    """pack_codes with its temporaries in `scratch`."""
    if 8 % bits:
        pack_codes(codes, bits, out)
        return
    word = codes.view({2: torch.int16, 4: torch.int32}[8 // bits])
    packed = torch.bitwise_right_shift(word, (8 // bits - 1) * (8 - bits),
                                       out=scratch.get("packed", word.numel(), word.dtype))
    for i in range(1, 8 // bits - 1):
        packed.bitwise_or_(torch.bitwise_right_shift(word, i * (8 - bits),
                                                     out=scratch.get("shift", word.numel(), word.dtype)))
    out.copy_(packed.bitwise_or_(word))


def _centered(packed, bits, scratch):
    """The codes minus 2**(bits-1) as int8 (exact), unpacked from `packed`."""
    out = scratch.get("centered", packed.numel() * 8 // bits, torch.uint8)
    if bits == 8:
        return torch.bitwise_xor(packed, 128, out=out).view(torch.int8)  # c ^ 128 = c - 128 (mod 256)
    if 8 % bits:
        out.copy_(unpack_codes(packed, bits))
    else:
        # Inverse of pack_codes: widen each byte to a word of one byte per code, code i shifted
        # left by i * (8 - bits) to bit 8i, then keep the low `bits` bits of every byte.
        wide, step = {2: torch.int16, 4: torch.int32}[8 // bits], 8 - bits
        word, words = scratch.get("word", packed.numel(), wide).copy_(packed), out.view(wide)
        torch.bitwise_left_shift(word, (8 // bits - 1) * step, out=words)
        for i in range(1, 8 // bits - 1):
            words.bitwise_or_(torch.bitwise_left_shift(word, i * step, out=scratch.get("shift", word.numel(), wide)))
        words.bitwise_or_(word).bitwise_and_(int.from_bytes(bytes([2 ** bits - 1]) * (8 // bits), "little"))
    return out.sub_(2 ** (bits - 1)).view(torch.int8)


def _dequant_sum(codes, scales, k, numel, bits, block_size, out, accumulate, requantize=None):
    """Sum (fp32, in order 0..k-1) of k quantized tensors, a piece at a time, into `out` (adding to
    it if `accumulate`), or quantized into requantize = (codes, scales, bits, levels).

    A piece decodes straight into `out` when that is the fp32 result; otherwise into scratch.
    """
    scratch = _Scratch(codes.device)
    n_codes, n_blocks = packed_bytes(numel, bits, block_size), num_blocks(numel, block_size)
    block_bytes = block_size * bits // 8
    step = max(1, CHUNK // block_size)
    for first in range(0, n_blocks, step):
        last = min(first + step, n_blocks)
        size, valid = (last - first) * block_size, min(numel, last * block_size) - first * block_size
        direct = requantize is None and not accumulate and out.dtype == torch.float32 and valid == size
        total = (out[first * block_size:last * block_size] if direct
                 else scratch.get("total", size, torch.float32)).view(-1, block_size)
        for t in range(k):
            part = total if t == 0 else scratch.get("part", size, torch.float32).view(-1, block_size)
            part.copy_(_centered(codes[t * n_codes + first * block_bytes:t * n_codes + last * block_bytes], bits,
                                 scratch).view(part.shape))
            part.mul_(scales[t * n_blocks + first:t * n_blocks + last].float().unsqueeze(-1))
            if t:
                total.add_(part)
        if requantize is not None:
            out_codes, out_scales, out_bits, levels = requantize
            out_bytes = block_size * out_bits // 8
            _quantize_flat(total.view(-1)[:valid], out_bits, block_size, out_codes[first * out_bytes:last * out_bytes],
                           out_scales[first:last], levels, scratch)
        elif not direct:
            dest, values = out[first * block_size:first * block_size + valid], total.view(-1)[:valid]
            if accumulate:
                dest.add_(values)
            else:
                dest.copy_(values)
