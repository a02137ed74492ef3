"""GGUF K-quants: Q4_K and Q6_K super-blocks in ggml's byte layout, and llama.cpp's Q4_K_M mix.

K-quants are what people serve at 4 bits (Q4_K_M is the default download), but their grid is
not ours: a 256-value super-block holds fp16 scales of sub-block scales (and, for Q4_K, of
sub-block minimums), so the weights are quantized again here from fp32, as llama.cpp's
`llama-quantize` does without an importance matrix (ggml-quants.c `quantize_row_q4_K_ref`,
`quantize_row_q6_K_ref`). The math is the same, vectorized over all sub-blocks at once: the
same candidate scales are tried and the best kept by the same error; only the summation order
differs from ggml's loops, so a near-tie can pick another candidate and the bytes can differ
from llama-quantize's in rare blocks (the values they hold are still read exactly). Where a
sub-block's scale rounds to 0 its codes are written as 0 (ggml leaves its search's codes; the
value, 0 * q - min, is the same).

`kquant_tensor(name, weight, mix, n_layer, tied)` is the per-tensor entry point the GGUF writer
calls: the GGML type llama.cpp's mix gives that tensor (`kquant_type`) and the bytes. Rows whose
length is not a multiple of 256 fall back as llama.cpp falls back (Q4_K -> Q5_0, Q6_K -> Q8_0,
F16 below 32), quantized by gguf-py's reference encoders for those types.

A qwZ run's grid (symmetric codes, one fp16 scale per block) is a special case of these types: at
4 bits with blocks a multiple of 256 long, every tensor of a Q4_K_M file holds it exactly, and at up to
6 bits every tensor of a Q6_K file (`grid_rows`), so such a run exports with the weights its training
forward computed with.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, LlamaFileType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from kernels import quantize_weights, unpack_codes

QK_K = 256  # values per super-block
# Mixes: Q4_K_M as llama.cpp's llama_tensor_get_type makes it; Q4_K (llama-quantize --pure Q4_K_M) and
# Q6_K put every matrix in one type. The file type is what llama-quantize writes for each.
KQUANT_MIXES = {"Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
                "Q6_K": LlamaFileType.MOSTLY_Q6_K}
# llama.cpp's tensor_type_fallback for rows that are not whole super-blocks.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


def _rint(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (it adds 1.5 * 2**23 in fp32)."""
    return np.rint(x)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to fp16: its two little-endian bytes, and its value read back in fp32 (as ggml reads it)."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(*x.shape, 2), h.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Q4_K: 8 sub-blocks of 32, x = d * sc * q - dmin * m, q in 0..15, sc and m 6-bit


def _scale_min_search(x: np.ndarray, w: np.ndarray, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
                      nstep: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants over the last axis: the (scale, min) with x ~ scale * q - min, q in 0..nmax,
    of least weighted squared error among min-max rounding and nstep + 1 stretched grids, each refit by
    weighted least squares (min kept >= 0, i.e. the offset never above 0). As in ggml, each grid starts
    from the best offset so far, so the steps run in order; all sub-blocks go through each step at once.

    Codes are rounded in fp32 and the kept scale and offset are fp32, as in ggml; the sums are fp64 and
    each candidate's error comes from them in closed form (ggml sums the squared errors in fp32), which
    halves the passes over the data."""
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    flat = hi == lo
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    wx = w64 * x64
    sum_w, sum_x, sum_x2 = w64.sum(-1), wx.sum(-1), (wx * x64).sum(-1)

    def sums(stretch, offset):
        span = hi - offset
        valid = span > 0
        iscale = stretch / np.where(valid, span, 1)
        q = np.clip(_rint(iscale[..., None] * (x - offset[..., None])), 0, nmax).astype(np.float64)
        wq = w64 * q
        return valid, wq.sum(-1), np.einsum("...i,...i->...", wq, q), np.einsum("...i,...i->...", wx, q), iscale

    def error(scale, offset, sum_l, sum_l2, sum_xl):
        scale, offset = scale.astype(np.float64), offset.astype(np.float64)
        return (scale * scale * sum_l2 + offset * offset * sum_w + sum_x2
                + 2 * (scale * offset * sum_l - scale * sum_xl - offset * sum_x))

    _, *first, iscale = sums(np.float32(nmax), lo)
    scale, offset = np.where(flat, 0, 1 / np.where(flat, 1, iscale)).astype(np.float32), lo
    best = error(scale, offset, *first)
    for step in range(nstep + 1):
        # the stretched grid's nmax in fp32, as ggml computes it
        stretch = np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)
        valid, sum_l, sum_l2, sum_xl, _ = sums(stretch, offset)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = valid & (det > 0) & ~flat
        det = np.where(ok, det, 1)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_offset > 0  # an offset above 0: refit the scale alone with offset 0
        this_offset = np.where(positive, 0, this_offset).astype(np.float32)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), this_scale).astype(np.float32)
        err = error(this_scale, this_offset, sum_l, sum_l2, sum_xl)
        better = ok & (err < best)
        scale, offset, best = (np.where(better, a, b) for a, b in ((this_scale, scale), (this_offset, offset),
                                                                  (err, best)))
    return scale, -offset


def _pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K (144 bytes) from fp16 bytes d, dmin [n, 2], 6-bit sc, m [n, 8] and codes q [n, 8, 32]:
    d, dmin, 12 bytes of scales (bytes 0-3 sc[0:4] and 4-7 m[0:4], low 6 bits, with the high 2 bits of
    sc[4:8] / m[4:8] on top; bytes 8-11 sc[4:8] | m[4:8] << 4, low nibbles), 128 bytes of codes (byte
    32 * c + l = q[64 * c + l] | q[64 * c + 32 + l] << 4)."""
    n = q.shape[0]
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    scales = np.concatenate([lo_sc | (hi_sc >> 4) << 6, lo_m | (hi_m >> 4) << 6, (hi_sc & 15) | (hi_m & 15) << 4],
                            axis=1).astype(np.uint8)
    pairs = q.reshape(n, 4, 2, 32)
    return np.concatenate([d, dmin, scales, (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, 128)], axis=1)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K of fp32 `x` (a multiple of 256 values): bytes [n / 256, 144] and the values they hold.

    Per sub-block the (scale, min) search weights each value by rms(sub-block) + |x|; the 8 scales and 8
    mins are then put on 6-bit grids under fp16 d = max scale / 63 and dmin = max min / 63, and the codes
    recomputed on the grid: q = round((x + dmin * m) / (d * sc)) in 0..15 (layout: _pack_q4_k).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    w = np.sqrt((x * x).mean(-1, keepdims=True)) + np.abs(x)
    scales, mins = _scale_min_search(x, w)
    max_scale, max_min = scales.max(-1, keepdims=True), mins.max(-1, keepdims=True)
    inv_scale = np.where(max_scale > 0, np.float32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_min = np.where(max_min > 0, np.float32(63) / np.where(max_min > 0, max_min, 1), 0)
    sc = np.clip(_rint(inv_scale * scales), 0, 63).astype(np.uint8)
    m = np.clip(_rint(inv_min * mins), 0, 63).astype(np.uint8)
    d_bytes, d = _fp16(max_scale[:, 0] / np.float32(63))
    dmin_bytes, dmin = _fp16(max_min[:, 0] / np.float32(63))
    step = d[:, None] * sc.astype(np.float32)  # d * sc and dmin * m are exact in fp32, as in ggml
    offset = dmin[:, None] * m.astype(np.float32)
    safe = np.where(step == 0, 1, step)[..., None]
    q = np.where(step[..., None] == 0, 0, np.clip(_rint((x + offset[..., None]) / safe), 0, 15)).astype(np.uint8)
    values = step[..., None] * q.astype(np.float32) - offset[..., None]
    return _pack_q4_k(d_bytes, dmin_bytes, sc, m, q), values.reshape(-1)


# ---------------------------------------------------------------------------------------------
# Q6_K: 16 sub-blocks of 16, x = d * sc * (q - 32), q in 0..63, sc int8


def _symmetric_scale_search(x: np.ndarray, nmax: int = 32) -> np.ndarray:
    """ggml's make_qx_quants with rmse_type 1 over the last axis: the scale with x ~ scale * l,
    l in -nmax..nmax-1, that maximizes (sum w x l)^2 / sum w l^2 (weights w = x^2, i.e. least weighted
    squared error at the refit scale), over grids that put the largest |x| at -(nmax + 0.1 k), k in -9..9."""
    big = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # signed, first of the largest
    zero = np.abs(big) < 1e-15
    big = np.where(zero, 1, big)
    w = x * x
    wx = w * x

    def fit(k):
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(k)) / big  # fp32, as ggml
        q = np.clip(_rint(iscale[..., None] * x), -nmax, nmax - 1)
        return np.einsum("...i,...i->...", wx, q), np.einsum("...i,...i->...", w * q, q)

    sum_lx, sum_l2 = fit(0)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, 1), 0)
    best = scale * sum_lx
    for k in (*range(-9, 0), *range(1, 10)):
        sum_lx, sum_l2 = fit(k)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = np.where(better, sum_lx / np.where(sum_l2 > 0, sum_l2, 1), scale)
        best = np.where(better, scale * sum_lx, best)
    return np.where(zero, 0, scale).astype(np.float32)


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K of fp32 `x` (a multiple of 256 values): bytes [n / 256, 210] and the values they hold.

    The 16 sub-block scales are put on an int8 grid under fp16 d = -(the scale of largest |scale|) / 128
    (that scale becomes -128), and the codes recomputed: q = round(x / (d * sc)) in -32..31 (layout: _pack_q6_k).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1, 16, 16)
    scales = _symmetric_scale_search(x)
    top = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)  # signed, first of the largest
    zero = np.abs(top) < 1e-15
    iscale = np.where(zero, 0, np.float32(-128) / np.where(zero, 1, top))
    sc = np.where(zero, 0, np.minimum(127, _rint(iscale * scales))).astype(np.int8)
    d_bytes, d = _fp16(np.where(zero, 0, 1 / np.where(zero, 1, iscale))[:, 0])
    step = d[:, None] * sc.astype(np.float32)
    safe = np.where(step == 0, 1, step)[..., None]
    q = np.where(step[..., None] == 0, 0, np.clip(_rint(x / safe), -32, 31)).astype(np.int8)
    values = step[..., None] * q.astype(np.float32)
    return _pack_q6_k(d_bytes, sc, q), values.reshape(-1)


def _pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """ggml's block_q6_K (210 bytes) from fp16 bytes d [n, 2], int8 sc [n, 16] and codes q in -32..31 [n, 16, 16]:
    128 bytes ql (low nibbles of q + 32), 64 bytes qh (its high 2 bits), the 16 scales, d. Per half h of 128
    values with quarters Q0..Q3 of 32: ql[64h + l] = Q0[l] | Q2[l] << 4, ql[64h + 32 + l] = Q1[l] | Q3[l] << 4,
    qh[32h + l] = Q0[l] >> 4 | Q1[l] >> 4 << 2 | Q2[l] >> 4 << 4 | Q3[l] >> 4 << 6."""
    n = q.shape[0]
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = ((u[:, :, 0:2] & 15) | (u[:, :, 2:4] & 15) << 4).reshape(n, 128)
    qh = ((u[:, :, 0] >> 4) | (u[:, :, 1] >> 4) << 2 | (u[:, :, 2] >> 4) << 4 | (u[:, :, 3] >> 4) << 6).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d], axis=1)


KQUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


# ---------------------------------------------------------------------------------------------
# llama.cpp's Q4_K_M mix and the per-tensor entry point


def _more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def _fallback(qtype: T, cols: int) -> T:
    """llama.cpp's tensor_type_fallback: a K-quant needs whole 256-value super-blocks along a row."""
    if qtype in KQUANTIZERS and cols % QK_K:
        qtype = _FALLBACK[qtype]
        if cols % 32:
            qtype = T.F16
    return qtype


def kquant_type(name: str, cols: int, mix: str, n_layer: int, tied: bool) -> T:
    """The GGML type of the 2-D GGUF tensor `name` (rows of `cols`) in `mix`, as llama-quantize picks it for a
    dense model: Q4_K_M puts the LM head (token_embd where the head is tied) in Q6_K (Q8_0 for rows that
    are not whole super-blocks), attn_v / attn_qkv and ffn_down in Q6_K on the _more_bits layers, every
    other matrix in Q4_K; then the fallback for rows that are not whole super-blocks."""
    if mix not in KQUANT_MIXES:
        raise ValueError(f"K-quant mix {mix!r}: expected one of {list(KQUANT_MIXES)}")
    qtype = T.Q6_K if mix == "Q6_K" else T.Q4_K
    if mix == "Q4_K_M":
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = T.Q6_K if cols % QK_K == 0 else T.Q8_0
        elif name.startswith("blk.") and name.endswith((".attn_v.weight", ".attn_qkv.weight", ".ffn_down.weight")):
            if _more_bits(int(name.split(".")[1]), n_layer):
                qtype = T.Q6_K
    return _fallback(qtype, cols)


def quantize_rows(weight: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """`weight` [rows, cols] fp32 as GGML `qtype`: bytes [rows, row bytes] and the fp32 values they hold
    (what gguf-py's and ggml's dequantizers give). K-quants by our encoders, the fallbacks by gguf-py's."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    rows, cols = weight.shape
    if qtype in KQUANTIZERS:
        blocks, values = KQUANTIZERS[qtype](weight.reshape(-1))
        return blocks.reshape(rows, -1), values.reshape(rows, cols)
    data = gguf_quantize(weight, qtype)
    return data, np.asarray(gguf_dequantize(data, qtype), dtype=np.float32).reshape(rows, cols)


# The largest of our bit widths each type holds as it is, and the span one scale of it covers.
_GRID_BITS = {T.Q4_K: 4, T.Q6_K: 6, T.Q5_0: 5, T.Q8_0: 8}
_GRID_SPAN = {T.Q4_K: QK_K, T.Q6_K: QK_K, T.Q5_0: 32, T.Q8_0: 32}


def holds_grid(qtype: T, bits: int, block_size: int, cols: int) -> bool:
    """Whether `qtype` holds our (bits, block_size) grid of a matrix with rows of `cols` exactly (grid_rows)."""
    span = _GRID_SPAN.get(qtype)
    return span is not None and bits <= _GRID_BITS[qtype] and block_size % span == 0 and cols % span == 0


def grid_rows(weight: torch.Tensor, qtype: T, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`qtype` bytes [rows, row bytes] holding our grid, kernels.quantize_weights(W.reshape(-1), bits, block_size)
    (what a qwZ forward computes with), exactly, and its values; None where `qtype` cannot.

    Our value is q * s, -2**(bits-1) <= q < 2**(bits-1), s of either sign. Where each of the type's scaled
    spans (a Q4_K / Q6_K super-block of 256, a Q5_0 / Q8_0 block of 32) lies in one of our blocks and one row
    (block_size and the row length multiples of it) and the codes fit: Q4_K d = dmin = s, sc = 1, m = 8, code q + 8
    (d * (q + 8) - 8 * s = q * s exactly in fp32); Q6_K d = s, sc = 1, code q; Q5_0 / Q8_0 d = s, code q.
    """
    rows, cols = weight.shape
    if not holds_grid(qtype, bits, block_size, cols):
        return None
    span = _GRID_SPAN[qtype]
    grid = quantize_weights(weight.detach().reshape(-1).float(), bits, block_size)
    n = rows * cols // span
    q = (unpack_codes(grid.codes, bits)[:rows * cols].to(torch.int16) - 2 ** (bits - 1)).numpy().reshape(n, span)
    s = grid.scales.repeat_interleave(block_size // span)[:n].numpy()
    d = s.view(np.uint8).reshape(n, 2)
    values = grid.dequantize().numpy().reshape(rows, cols)
    if qtype == T.Q4_K:
        blocks = _pack_q4_k(d, d, np.ones((n, 8), np.uint8), np.full((n, 8), 8, np.uint8), (q + 8).astype(np.uint8))
    elif qtype == T.Q6_K:
        blocks = _pack_q6_k(d, np.ones((n, 16), np.int8), q)
    elif qtype == T.Q5_0:  # d, 4 bytes of fifth bits (bit j of element j), 16 bytes: low nibble j | j + 16 << 4
        u = (q + 16).astype(np.uint8)
        high = np.packbits(u >> 4, axis=1, bitorder="little")
        blocks = np.concatenate([d, high, (u[:, :16] & 15) | (u[:, 16:] & 15) << 4], axis=1)
    else:
        blocks = np.concatenate([d, q.astype(np.int8).view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1), values


def kquant_tensor(name: str, weight: torch.Tensor, mix: str, n_layer: int, tied: bool, *, grid=None,
                  row_order=None) -> tuple[np.ndarray, T, bool]:
    """What the GGUF writer stores for the matrix `name` (GGUF name; nn.Linear / embedding layout, ours) in
    `mix`: its bytes [rows, row bytes] (F16: the fp16 values), GGML type, and whether they hold our grid.

    With grid=(bits, block_size) (a qwZ checkpoint's settings) the bytes hold that grid exactly where the
    type can (grid_rows); otherwise, and without a grid, `weight` is quantized by the type's encoder.
    `row_order` permutes the rows afterwards (llama.cpp's q/k layout): our blocks run along W.reshape(-1).
    """
    qtype = kquant_type(name, weight.shape[1], mix, n_layer, tied)
    held = grid_rows(weight, qtype, *grid) if grid is not None else None
    if held is not None:
        data = held[0]
    elif qtype == T.F16:
        data = weight.detach().to(torch.float16).numpy()
    else:
        data = quantize_rows(weight.detach().float().numpy(), qtype)[0]
    return (data if row_order is None else data[np.asarray(row_order)]), qtype, held is not None


def kquant_summary(path, grid=None) -> str:
    """One line on a K-quant GGUF file as written: its matrices by type, those that fell back (rows not whole
    super-blocks) and, for a qwZ grid=(bits, block_size), whether every matrix holds it exactly."""
    tensors = [t for t in GGUFReader(path).tensors if len(t.shape) == 2 and t.tensor_type != T.F32]
    mats = [(t.name, t.tensor_type, int(t.shape[0])) for t in tensors]
    counts = {}
    for _, qtype, _ in mats:
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    bpw = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    line = ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) + f" ({bpw:.2f} bits per weight)"
    fell = [f"{name} ({qtype.name})" for name, qtype, cols in mats if qtype not in KQUANTIZERS and cols % QK_K]
    if fell:
        line += f"; rows not a multiple of {QK_K}, fell back as llama.cpp does: {', '.join(fell)}"
    if grid is None:
        return line + "; quantized from the fp32 weights as llama-quantize does (no importance matrix)"
    off = [name for name, qtype, cols in mats if not holds_grid(qtype, *grid, cols)]
    if not off:
        return line + f"; exact: every matrix holds the {grid[0]}-bit qwZ grid (block size {grid[1]})"
    return (line + f"; {len(mats) - len(off)} of {len(mats)} matrices hold the {grid[0]}-bit qwZ grid exactly, "
            f"quantized again from the weights (Q4_K holds it at <= 4 bits, Q6_K at <= 6, blocks a multiple of 256): "
            + ", ".join(off))
