"""Block quantization (kernels/): the torch path against a per-element Python reference, the
fused entry points against their explicit composition, and every Triton kernel (under
TRITON_INTERPRET=1, in a subprocess) bit-identical to the torch path."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels as K
from kernels.samples import received, sample, stage_view  # the inputs scripts/check_cuda.py checks on a GPU too

ROOT = Path(__file__).resolve().parents[2]
FP16_MAX = 65504.0


# ---------------------------------------------------------------- reference (plain Python floats)


def _f32(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def _f16(v):
    return struct.unpack("e", struct.pack("e", v))[0]


def ref_quantize(x, bits, block_size, scale_dtype, levels="symmetric"):
    """(codes as ints, scales as floats): the spec, one element at a time.

    Python floats are doubles; one double operation on fp32 values rounded back to fp32 equals
    the fp32 operation (53 >= 2 * 24 + 2), and round() is half-to-even.
    """
    half = 2 ** (bits - 1)
    lowest, highest = (-half, half - 1) if levels == "full" else (1 - half, half - 1)
    values = x.float().tolist()
    values += [0.0] * (-len(values) % block_size)
    codes, scales = [], []
    for start in range(0, len(values), block_size):
        block = values[start:start + block_size]
        if levels == "full":  # the value of largest magnitude, the larger one on a tie
            m = max(block) if max(block) >= -min(block) else min(block)
            scale = _f32(m / -half) + 0.0
        else:
            scale = _f32(max(abs(v) for v in block) / (half - 1))
        if scale_dtype == torch.float16:
            scale = _f16(max(-FP16_MAX, min(scale, FP16_MAX)))
        scales.append(scale)
        for v in block:
            q = 0 if scale == 0 else max(lowest, min(highest, round(_f32(v / scale))))
            codes.append(q + half)
    return codes, scales


def ref_pack(codes, bits):
    out = bytearray()
    for start in range(0, len(codes), 8):
        word = sum(c << (i * bits) for i, c in enumerate(codes[start:start + 8]))
        out += word.to_bytes(bits, "little")
    return torch.tensor(list(out), dtype=torch.uint8)


def ref_dequantize(codes, scales, numel, bits, block_size):
    half = 2 ** (bits - 1)
    return [_f32((c - half) * scales[n // block_size]) for n, c in enumerate(codes[:numel])]


BITS_DTYPES = [(bits, dtype, sdt) for bits in K.BITS for dtype in (torch.float32, torch.bfloat16)
               for sdt in (torch.float32, torch.float16)]
LEVELS = pytest.mark.parametrize("levels", K.quant.LEVELS)


# ---------------------------------------------------------------- torch path vs reference


@LEVELS
@pytest.mark.parametrize("bits,dtype,scale_dtype", BITS_DTYPES)
def test_quantize_matches_reference(bits, dtype, scale_dtype, levels):
    numel, bs = 4 * 64 + 13, 64  # ragged last block
    x = sample(numel, dtype)
    if levels == "full":
        x[16:64] = -x[16:64].abs()  # a block with a negative m (so a positive scale)
    q = K.quantize(x, bits, bs, scale_dtype=scale_dtype, levels=levels, impl="torch")
    codes, scales = ref_quantize(x, bits, bs, scale_dtype, levels)
    assert q.codes.numel() == K.packed_bytes(numel, bits, bs) == 5 * 64 * bits // 8
    assert q.scales.dtype == scale_dtype and q.scales.tolist() == scales
    assert K.unpack_codes(q.codes, bits).tolist() == codes
    assert torch.equal(q.codes, ref_pack(codes, bits))
    assert q.dequantize().tolist() == ref_dequantize(codes, scales, numel, bits, bs)
    as_bf16 = torch.tensor(ref_dequantize(codes, scales, numel, bits, bs)).bfloat16()
    assert torch.equal(q.dequantize(dtype=torch.bfloat16).view(torch.int16), as_bf16.view(torch.int16))


@LEVELS
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_an_all_zero_block_has_the_scale_plus_zero(scale_dtype, levels):
    """The spec's zero scale is +0.0, bit for bit (the Triton kernels on CUDA give +0.0; torch's
    max(amax, -amin) can give -0.0, and the full grid's m / -n does): fp16 values flushed to -0.0, a
    block of -0.0, a block of +0.0."""
    x = torch.cat([torch.full((64,), -1e-30).half(), -torch.zeros(64), torch.zeros(64), torch.ones(64)])
    q = K.quantize(x, 8, 64, scale_dtype=scale_dtype, levels=levels)
    assert q.scales[:3].view(torch.uint8).eq(0).all(), q.scales
    assert q.dequantize()[:192].view(torch.int32).eq(0).all()  # +0.0 out as well


def test_ties_round_to_even():
    # scale = 31.75 / 127 = 0.25 exactly, so x / s lands on .5 ties
    x = torch.tensor([0.125, 0.375, 0.625, 0.875, -0.125, -0.375, -0.625, 31.75])
    q = K.quantize(x, 8, 8, impl="torch")
    assert q.scales.tolist() == [0.25]
    assert (K.unpack_codes(q.codes, 8).int() - 128).tolist() == [0, 2, 2, 4, 0, -2, -2, 127]


def test_round_trip_error_is_at_most_half_a_step():
    """Symmetric levels: everywhere. Full levels: everywhere but above the top level (the side opposite
    m), where the error is below a step; m itself is exact up to the scale's rounding."""
    x = torch.randn(8 * 256 + 100, generator=torch.Generator().manual_seed(1)) * 10
    for bits in K.BITS:
        for scale_dtype in (torch.float32, torch.float16):
            for levels in K.quant.LEVELS:
                q = K.quantize(x, bits, 256, scale_dtype=scale_dtype, levels=levels)
                step = q.scales.double().abs().repeat_interleave(256)[: x.numel()]
                err = (x.double() - q.dequantize().double()).abs()
                top = (x.double() / q.scales.double().repeat_interleave(256)[: x.numel()]) > 2 ** (bits - 1) - 0.5
                assert (err[~top] <= step[~top] / 2 * (1 + 1e-6)).all(), (bits, scale_dtype, levels)
                assert (err[top] < step[top]).all() and (levels == "full" or not top.any())


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_full_levels_put_the_largest_magnitude_on_the_lowest_code_as_gguf(bits):
    """llama.cpp's Q4_0 reference quantizer (d = max / -8 of the signed value of largest magnitude, code
    = min(15, (int)(x * (1 / d) + 8.5))), at any width: the same scales, and codes equal except on the
    brink of a .5 tie (we divide and round half to even, it multiplies by 1 / d and rounds half up)."""
    x = torch.randn(64 * 32, generator=torch.Generator().manual_seed(bits)) * 0.02
    half = 2 ** (bits - 1)
    q = K.quantize(x, bits, 32, scale_dtype=torch.float32, levels="full")
    rows = x.view(-1, 32)
    m = rows.gather(1, rows.abs().argmax(1, keepdim=True)).squeeze(1)
    d = m / -half
    assert torch.equal(q.scales, d)
    ours = K.unpack_codes(q.codes, bits).view(-1, 32).float()
    theirs = (rows * (1 / d[:, None]) + (half + 0.5)).floor().clamp(max=2 * half - 1)
    on_brink = ((rows / d[:, None]).frac().abs() - 0.5).abs() < 1e-5
    assert torch.equal(ours[~on_brink], theirs[~on_brink]) and on_brink.sum() <= 2
    assert (ours.gather(1, rows.abs().argmax(1, keepdim=True)) == 0).all()  # m on the lowest code


def test_packing_layout():
    # codes 1..15, 15..1 in one 4-bit block: element 2j in the low nibble, 2j+1 in the high one
    x = torch.tensor([float(v) for v in list(range(-7, 8)) + list(range(7, -8, -1))] + [0.0, 0.0])
    q = K.quantize(x, 4, 32)
    codes = [v + 8 for v in x.int().tolist()]
    assert q.codes.tolist() == [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)]
    for bits in K.BITS:
        for numel, bs in [(1, 8), (100, 32), (4096, 4096), (513, 256)]:
            q = K.quantize(torch.randn(numel), bits, bs)
            assert q.codes.numel() == K.num_blocks(numel, bs) * bs * bits // 8
            assert q.scales.numel() == K.num_blocks(numel, bs)


def test_blocks_are_contiguous_byte_ranges():
    x = torch.randn(8 * 64)
    whole = K.quantize(x, 3, 64)
    part = K.quantize(x[2 * 64:5 * 64], 3, 64)
    assert torch.equal(whole.codes[2 * 24:5 * 24], part.codes)
    assert torch.equal(whole.scales[2:5], part.scales)


def test_caller_buffers_and_out():
    x = torch.randn(300)
    codes = torch.empty(K.packed_bytes(300, 4, 64), dtype=torch.uint8)
    scales = torch.empty(K.num_blocks(300, 64), dtype=torch.float16)
    q = K.quantize(x, 4, 64, scale_dtype=torch.float16, codes_out=codes, scales_out=scales)
    assert q.codes.data_ptr() == codes.data_ptr() and q.scales.data_ptr() == scales.data_ptr()
    out = torch.full((300,), 1.0)
    assert K.dequantize(codes, scales, 300, 4, 64, out=out) is not None
    assert torch.equal(out, q.dequantize())
    K.dequantize(codes, scales, 300, 4, 64, out=out, accumulate=True)
    assert torch.equal(out, q.dequantize() + q.dequantize())


# ---------------------------------------------------------------- fused entry points vs composition


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_transposed_equals_quantize_of_the_copy(dtype):
    x3d = stage_view(3, 4, 2, 128, dtype)
    assert not x3d.is_contiguous()
    for bits in (8, 4, 3):
        got = K.quantize_transposed(x3d, bits, 64, scale_dtype=torch.float16)
        want = K.quantize(x3d.transpose(0, 1).contiguous().flatten(), bits, 64, scale_dtype=torch.float16)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("bits,out_bits", [(4, 4), (8, 4), (2, 8)])
def test_dequant_reduce_equals_composition(bits, out_bits):
    k, numel, bs = 3, 5 * 64 + 7, 64
    parts, codes, scales = received(k, numel, bits, bs, torch.float16)
    total = parts[0].dequantize()
    for p in parts[1:]:
        total = total + p.dequantize()
    assert torch.equal(K.dequant_reduce(codes, scales, k, numel, bits, bs), total)
    acc = torch.randn(numel)
    expect = acc + total
    K.dequant_reduce(codes, scales, k, numel, bits, bs, out=acc, accumulate=True)
    assert torch.equal(acc, expect)
    got = K.dequant_reduce_quant(codes, scales, k, numel, bits, bs, out_bits=out_bits, scale_dtype=torch.float16)
    want = K.quantize(total, out_bits, bs, scale_dtype=torch.float16)
    assert (got.bits, got.numel) == (out_bits, numel)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("chunk", [64, 200])
def test_torch_path_in_pieces_equals_one_piece(monkeypatch, chunk):
    """The torch path works CHUNK elements at a time; tiny chunks must not change a bit."""
    x, x3d = sample(7 * 64 + 5, torch.bfloat16), stage_view(3, 2, 2, 192, torch.float32)
    _, codes, scales = received(3, 5 * 64 + 7, 4, 64)

    def run():
        q = K.quantize(x, 3, 64, scale_dtype=torch.float16)
        t = K.quantize_transposed(x3d, 4, 64)
        acc = torch.linspace(-1, 1, 5 * 64 + 7)
        K.dequant_reduce(codes, scales, 3, 5 * 64 + 7, 4, 64, out=acc, accumulate=True)
        r = K.dequant_reduce_quant(codes, scales, 3, 5 * 64 + 7, 4, 64, out_bits=8)
        return [q.codes, q.scales, q.dequantize(dtype=torch.bfloat16), t.codes, t.scales, acc, r.codes, r.scales]

    whole = run()
    monkeypatch.setattr(K.quant, "CHUNK", chunk)
    for a, b in zip(whole, run()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- chunked torch path vs a plain full-size reference


def plain_quantize(x, bits, block_size, scale_dtype, levels="symmetric"):
    """(unpacked codes [blocks, block_size], scales): the spec in whole-tensor torch ops, with none of
    the torch path's tricks (pieces, magic-number rounding, clamp only where needed, xor unpacking)."""
    half = 2 ** (bits - 1)
    flat = x.reshape(-1)
    rows = torch.cat([flat, flat.new_zeros(-flat.numel() % block_size)]).view(-1, block_size).float()
    amax, amin = rows.amax(-1), rows.amin(-1)
    if levels == "full":
        scale, lowest = torch.where(amax >= -amin, amax, amin) / -half + 0.0, -half
    else:
        scale, lowest = torch.maximum(amax, -amin) / (half - 1), 1 - half
    if scale_dtype == torch.float16:
        scale = scale.clamp(-FP16_MAX, FP16_MAX)
    scales = scale.to(scale_dtype)
    s = scales.float().unsqueeze(-1)
    q = torch.where(s == 0, 0.0, rows / s).clamp(lowest, half - 1).round()
    return (q + half).to(torch.uint8), scales


def plain_pack(codes, bits):
    """Each group of 8 codes as one 64-bit integer, cut into `bits` little-endian bytes."""
    word = (codes.reshape(-1, 8).long() << (torch.arange(8) * bits)).sum(-1, keepdim=True)
    return ((word >> (torch.arange(bits) * 8)) & 0xFF).to(torch.uint8).view(-1)


def plain_dequantize(codes, scales, numel, bits):
    return ((codes.float() - 2 ** (bits - 1)) * scales.float().unsqueeze(-1)).view(-1)[:numel]


def awkward(numel, dtype, seed=0):
    """Gaussian values with, where they fit, blocks (of 64) that take every branch of the torch path:
    all zero, tiny (fp16 scale 0 or subnormal, so the clamp is needed), huge (fp16 scale clamped),
    exact .5 ties at 8 bits, and -0.0."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    for start, fill in [(64, lambda b: b.zero_()), (192, lambda b: b.mul_(1e-30)), (320, lambda b: b.mul_(1e-6)),
                        (448, lambda b: b.mul_(1e7)), (576, lambda b: b.zero_().neg_())]:
        if start + 64 <= numel:
            fill(x[start:start + 64])
    if numel >= 264:
        x[256:264] = torch.tensor([0.125, 0.375, 0.625, 0.875, -0.375, -0.625, 31.75, -31.75])
    return x.to(dtype)


def assert_bits_equal(got, want):
    """Equal bit patterns, except that 0.0 and -0.0 count as one: the sign of a zero scale follows
    torch.maximum(+0, -0), which differs between its vectorised body and its scalar tail."""
    assert got.dtype == want.dtype and got.shape == want.shape
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    if got.is_floating_point():
        got, want = got + 0.0, want + 0.0  # -0.0 + 0.0 = 0.0, anything else unchanged
    assert torch.equal(got.view(as_int), want.view(as_int))


SMALL_CHUNK = 512  # 8 blocks of 64: sizes around a few pieces stay small
AWKWARD_SIZES = sorted({1, 63, 64, 65, 511, 512, 513, 1023, 1025, 3 * 512 + 1, 5 * 512 - 1, 8 * 512 + 65})


@LEVELS
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_path_equals_plain_reference(monkeypatch, bits, dtype, levels):
    """Bit for bit, at sizes around the block and the piece size, for both scale dtypes."""
    monkeypatch.setattr(K.quant, "CHUNK", SMALL_CHUNK)
    bs = 64
    for numel in AWKWARD_SIZES:
        x = awkward(numel, dtype, seed=numel)
        if dtype == torch.float16:
            x = x.clamp(-60000, 60000)
        for scale_dtype in (torch.float32, torch.float16):
            codes, scales = plain_quantize(x, bits, bs, scale_dtype, levels)
            q = K.quantize(x, bits, bs, scale_dtype=scale_dtype, levels=levels, impl="torch")
            assert_bits_equal(q.scales, scales)
            assert torch.equal(q.codes, plain_pack(codes, bits)), (numel, scale_dtype)
            want = plain_dequantize(codes, scales, numel, bits)
            assert_bits_equal(q.dequantize(impl="torch"), want)
            assert_bits_equal(q.dequantize(dtype=torch.bfloat16, impl="torch"), want.bfloat16())
            acc = torch.linspace(-1, 1, numel)
            assert_bits_equal(q.dequantize(out=acc.clone(), accumulate=True, impl="torch"), acc + want)


@pytest.mark.parametrize("bits,dtype,levels", [(8, torch.float32, "symmetric"), (4, torch.bfloat16, "symmetric"),
                                               (4, torch.float32, "full"), (8, torch.bfloat16, "full")])
def test_default_chunk_equals_plain_reference(bits, dtype, levels):
    """Sizes around the real CHUNK (1M elements): one piece, one piece and one element, two pieces."""
    bs = 256
    for numel in (K.quant.CHUNK - 1, K.quant.CHUNK + 1, 2 * K.quant.CHUNK + 3 * bs):
        x = awkward(numel, dtype, seed=bits)
        codes, scales = plain_quantize(x, bits, bs, torch.float16, levels)
        q = K.quantize(x, bits, bs, scale_dtype=torch.float16, levels=levels, impl="torch")
        assert_bits_equal(q.scales, scales)
        assert torch.equal(q.codes, plain_pack(codes, bits))
        assert_bits_equal(q.dequantize(impl="torch"), plain_dequantize(codes, scales, numel, bits))


@pytest.mark.parametrize("bits,out_bits,levels", [(8, 8, "symmetric"), (4, 4, "symmetric"), (8, 4, "symmetric"),
                                                  (4, 8, "symmetric"), (2, 2, "full"), (4, 8, "full")])
def test_fused_paths_equal_plain_reference(monkeypatch, bits, out_bits, levels):
    """quantize_transposed, dequant_reduce and dequant_reduce_quant across piece boundaries."""
    monkeypatch.setattr(K.quant, "CHUNK", SMALL_CHUNK)
    bs = 64
    x3d = stage_view(3, 5, 2, 3 * bs, torch.bfloat16)  # pieces of 2 of the 5 [3, 3 * 64] slabs
    x3d[1, 2, :bs] = 0
    want_codes, want_scales = plain_quantize(x3d.transpose(0, 1).contiguous(), bits, bs, torch.float16, levels)
    t = K.quantize_transposed(x3d, bits, bs, scale_dtype=torch.float16, levels=levels, impl="torch")
    assert_bits_equal(t.scales, want_scales)
    assert torch.equal(t.codes, plain_pack(want_codes, bits))
    for numel in (1, 65, SMALL_CHUNK - 1, 3 * SMALL_CHUNK + 7):
        k, parts = 3, [awkward(numel, torch.float32, seed=numel + i) * (i + 1) for i in range(3)]
        plain = [plain_quantize(p, bits, bs, torch.float32) for p in parts]
        codes = torch.cat([plain_pack(c, bits) for c, _ in plain])
        scales = torch.cat([s for _, s in plain])
        total = plain_dequantize(*plain[0], numel, bits)
        for c, s in plain[1:]:
            total = total + plain_dequantize(c, s, numel, bits)
        assert_bits_equal(K.dequant_reduce(codes, scales, k, numel, bits, bs, impl="torch"), total)
        acc = torch.linspace(-1, 1, numel)
        K.dequant_reduce(codes, scales, k, numel, bits, bs, out=acc, accumulate=True, impl="torch")
        assert_bits_equal(acc, torch.linspace(-1, 1, numel) + total)
        r = K.dequant_reduce_quant(codes, scales, k, numel, bits, bs, out_bits=out_bits, scale_dtype=torch.float16,
                                   levels=levels, impl="torch")
        want_codes, want_scales = plain_quantize(total, out_bits, bs, torch.float16, levels)
        assert_bits_equal(r.scales, want_scales)
        assert torch.equal(r.codes, plain_pack(want_codes, out_bits))


# ---------------------------------------------------------------- errors


def test_errors_name_the_value():
    x = torch.randn(64)
    q = K.quantize(x, 4, 32)
    cases = [
        (lambda: K.quantize(x, 5, 32), "bits=5"),
        (lambda: K.quantize(x, 4, 12), "block_size=12"),
        (lambda: K.quantize(x.int(), 4, 32), "input dtype"),
        (lambda: K.quantize(x, 4, 32, scale_dtype=torch.bfloat16), "scale_dtype"),
        (lambda: K.quantize(x, 4, 32, levels="asymmetric"), "levels='asymmetric'"),
        (lambda: K.quantize(x, 4, 32, codes_out=torch.empty(31, dtype=torch.uint8)), "codes_out"),
        (lambda: K.quantize(x, 4, 32, scales_out=torch.empty(2, dtype=torch.float16)), "scales_out"),
        (lambda: K.quantize(x, 4, 32, impl="cuda"), "impl="),
        (lambda: K.quantize_transposed(torch.randn(2, 2, 48), 4, 32), "C=48"),
        (lambda: K.quantize_transposed(torch.randn(2, 64), 4, 32), "3 dims"),
        (lambda: K.dequantize(q.codes[:-1], q.scales, 64, 4, 32), "codes"),
        (lambda: K.dequantize(q.codes, q.scales, 64, 4, 32, out=torch.empty(63)), "out"),
        (lambda: K.dequantize(q.codes, q.scales, 64, 4, 32, out=torch.empty(64).bfloat16()), "out"),
        (lambda: K.dequantize(q.codes, q.scales, 64, 4, 32, accumulate=True), "accumulate"),
        (lambda: K.dequant_reduce(q.codes, q.scales, 2, 64, 4, 32), "codes"),
        (lambda: K.dequant_reduce_quant(q.codes, q.scales, 1, 64, 4, 32, out_bits=7), "bits=7"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            K.quantize(x, 4, 32, impl="triton")


# ---------------------------------------------------------------- Triton == torch (interpreter)


def _stored(q):
    return [q.codes, q.scales]


def _triton_cases():
    """name -> callable(impl) returning the tensors to compare; small, the interpreter is slow."""
    cases = {}
    for bits, dtype, sdt in BITS_DTYPES:
        x = sample(4 * 64 + 13, dtype, seed=bits)
        x[16:64] = -x[16:64].abs()  # a block with a negative m
        for levels in K.quant.LEVELS:
            cases[f"quantize-{bits}-{str(dtype)[6:]}-{str(sdt)[6:]}-{levels}"] = (
                lambda impl, x=x, bits=bits, sdt=sdt, levels=levels: _stored(
                    K.quantize(x, bits, 64, scale_dtype=sdt, levels=levels, impl=impl)))
    odd = torch.randn(2 * 96 + 7, generator=torch.Generator().manual_seed(5))  # block 96: 12 groups of 8, 16 in a tile
    odd[:96] = odd[:96].abs() + 0.5  # all positive: padding zeros must not become m
    odd[96:192] = -odd[96:192].abs() - 0.5
    cases["quantize-full-block96"] = lambda impl: _stored(
        K.quantize(odd, 4, 96, scale_dtype=torch.float16, levels="full", impl=impl))
    for bits in K.BITS:
        q = K.quantize(sample(300, torch.float32), bits, 128, scale_dtype=torch.float16)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            cases[f"dequantize-{bits}-{str(dtype)[6:]}"] = (
                lambda impl, q=q, dtype=dtype: [q.dequantize(dtype=dtype, impl=impl)])
        cases[f"dequantize-accumulate-{bits}"] = (
            lambda impl, q=q: [q.dequantize(out=torch.linspace(-1, 1, 300), accumulate=True, impl=impl)])
    # ties only: with absmax 31.75 the 8-bit scale is 0.25 and x / s is k + .5
    ties = torch.tensor([0.125, 0.375, 0.625, 0.875, -0.125, -0.375, -0.625, 31.75] * 8)
    cases["quantize-ties"] = lambda impl: _stored(K.quantize(ties, 8, 64, impl=impl))
    for dtype, levels in [(torch.float32, "symmetric"), (torch.bfloat16, "symmetric"), (torch.float32, "full")]:
        x3d = stage_view(3, 2, 3, 256, dtype)
        cases[f"quantize_transposed-{str(dtype)[6:]}-{levels}"] = (
            lambda impl, x3d=x3d, levels=levels: _stored(K.quantize_transposed(x3d, 4, 128, levels=levels, impl=impl)))
    for bits, out_bits in [(4, 4), (8, 4), (3, 8)]:
        _, codes, scales = received(3, 2 * 128 + 5, bits, 128)
        args = (codes, scales, 3, 2 * 128 + 5, bits, 128)
        cases[f"dequant_reduce-{bits}"] = lambda impl, args=args: [
            K.dequant_reduce(*args, impl=impl),
            K.dequant_reduce(*args, out=torch.linspace(-1, 1, args[3]), accumulate=True, impl=impl)]
        for levels in K.quant.LEVELS:
            cases[f"dequant_reduce_quant-{bits}-{out_bits}-{levels}"] = \
                lambda impl, args=args, out_bits=out_bits, levels=levels: _stored(K.dequant_reduce_quant(
                    *args, out_bits=out_bits, scale_dtype=torch.float16, levels=levels, impl=impl))
    return cases


TRITON_CASES = list(_triton_cases())


def triton_report():
    """Run in a TRITON_INTERPRET=1 subprocess: print {case: None or what differs} as JSON."""
    report = {}
    for name, run in _triton_cases().items():
        try:
            want, got = run("torch"), run("triton")
            same = all(w.dtype == g.dtype and torch.equal(w.view(torch.uint8), g.view(torch.uint8))
                       for w, g in zip(want, got))
            report[name] = None if same else f"torch {want} != triton {got}"
        except Exception as e:  # reported per case
            report[name] = repr(e)
    print(json.dumps(report))


@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", "from tests.kernels.test_quant import triton_report; "
                           "triton_report()"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_torch(triton_results, case):
    assert triton_results[case] is None, triton_results[case]


# ---------------------------------------------------------------- Triton compiled for the GPU (no GPU needed)

PTX_CASES = {  # kernel, pointer types, constexprs: the variants whose arithmetic differs
    "quantize-bf16-3bit-fp16scale": ("_quantize_kernel", {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp16"},
                                     dict(BLOCK=256, BITS=3, GROUPS=32, G=32, ROWS=16, SCALE_FP16=True,
                                          FULL=False)),
    "quantize-full-4bit-fp16scale": ("_quantize_kernel", {"x_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*fp16"},
                                     dict(BLOCK=64, BITS=4, GROUPS=8, G=8, ROWS=64, SCALE_FP16=True, FULL=True)),
    "dequantize-accumulate": ("_dequant_reduce_kernel",
                              {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "out_codes_ptr": "*u8",
                               "out_scales_ptr": "*fp32"},
                              dict(BLOCK=256, BITS=4, GROUPS=32, G=32, ROWS=16, QUANTIZE=False, OUT_BITS=4,
                                   SCALE_FP16=False, ACCUMULATE=True, OUT_BF16=False, FULL=False)),
    "dequantize-bf16": ("_dequant_reduce_kernel",
                        {"codes_ptr": "*u8", "scales_ptr": "*fp16", "out_ptr": "*bf16", "out_codes_ptr": "*u8",
                         "out_scales_ptr": "*fp16"},
                        dict(BLOCK=96, BITS=6, GROUPS=12, G=16, ROWS=32, QUANTIZE=False, OUT_BITS=6,
                             SCALE_FP16=True, ACCUMULATE=False, OUT_BF16=True, FULL=False)),
    "dequant_reduce_quant": ("_dequant_reduce_kernel",
                             {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "out_codes_ptr": "*u8",
                              "out_scales_ptr": "*fp16"},
                             dict(BLOCK=256, BITS=4, GROUPS=32, G=32, ROWS=16, QUANTIZE=True, OUT_BITS=8,
                                  SCALE_FP16=True, ACCUMULATE=False, OUT_BF16=False, FULL=True)),
    "dequant_reduce-accumulate": ("_dequant_reduce_kernel",
                                  {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32",
                                   "out_codes_ptr": "*u8", "out_scales_ptr": "*fp32"},
                                  dict(BLOCK=256, BITS=8, GROUPS=32, G=32, ROWS=16, QUANTIZE=False, OUT_BITS=8,
                                       SCALE_FP16=False, ACCUMULATE=True, OUT_BF16=False, FULL=False)),
}


def ptx_report():
    """Run in a subprocess without the interpreter: compile for sm_90 and count PTX instructions."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_quant

    report = {}
    for name, (kernel, pointers, consts) in PTX_CASES.items():
        fn = getattr(triton_quant, kernel)
        signature = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=triton_quant.EXACT).asm["ptx"]
        report[name] = {op: len(re.findall(pattern, ptx)) for op, pattern in
                        [("div.rn", r"div\.rn\.f32"), ("inexact div", r"div\.(full|approx)"), ("fma", r"\bfma\.")]}
    print(json.dumps(report))


def test_compiled_kernels_divide_exactly_and_never_fuse():
    """The interpreter cannot show what the GPU build does: IEEE divisions, no FMA contraction."""
    pytest.importorskip("triton.backends.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "from tests.kernels.test_quant import ptx_report; ptx_report()"],
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip("no ptxas to compile for the GPU")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, counts in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert counts["inexact div"] == 0 and counts["fma"] == 0, (name, counts)
        assert (counts["div.rn"] > 0) == name.startswith(("quantize", "dequant_reduce_quant")), (name, counts)
