"""AccTFM (seed 004): the building blocks of tensor parallelism's compressed, pipelined all-reduce.

Four parts, each usable on its own (docs/tensor_parallel.md, section AccTFM):

  piecewise quantization   encode / decode (paper eq. 6-12): N clusters per sign whose level
                           spacing doubles, N + 1 bits a value, one scale per group of rows
  compressed all-reduce    all_reduce_compressed: the sum of every rank's tensor, built from
                           the ranks' quantized payloads, bit-identical on every rank
  token-level top-k        token_scores (how much attention each key token receives) and
                           topk_token_mask (the same tokens on every rank)
  partition planner        plan_partitions / simulate (Algorithm 1: K in {1, 2, 4} per layer),
                           on the alpha-beta model: comm_time, fit_alpha_beta, measure_alpha_beta

Piecewise quantization of a group with absmax M at bits = N + 1:

    U0  = M / (N * 2^(N-1))          the finest level spacing (eq. 12)
    cluster k = 0..N-1 covers |x| in [k*M/N, (k+1)*M/N) with spacing U_k = U0 * 2^k,
    so it holds p / 2^k intervals, p = 2^(N-1) (eq. 10-11): 2^N - 1 intervals, 2^N levels
    code = sign bit (the top bit) | index of the level of |x|'s cluster nearest to |x|

For N = 3 (4 bits) the magnitudes are {0, 1, 2, 3, 4, 6, 8, 12} * U0 with U0 = M / 12. A value
in cluster k rounds to a level at most U_k / 2 = M * 2^k / (N * 2^N) away: M/24, M/12, M/6.

bits = 1 (N = 0, not in the paper) is the sign alone: each value decodes to sign(x) * s with s the
mean |x| of its group, the magnitude that minimises the squared error for given signs (relative
MSE 1 - 2/pi = 0.36 on Gaussian rows, against 0.59-0.75 for the piecewise 2-bit code, which can
only say 0 or +-M). Tensor parallelism can send the rows token top-k prunes this way
(tensor_parallel.topk_pruned_bits 1); its default is 3-bit piecewise, which trains far better.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from kernels import pack_codes, unpack_codes
from zeropp.comm import Comm

SCALE_DTYPE = torch.float32  # one U0 per group of rows, sent as its 4 raw bytes
METHODS = ("gather", "two_step")
PARTITION_SIZES = (1, 2, 4)


# ---------------------------------------------------------------- piecewise quantization


def _check_bits(bits: int) -> int:
    """N, the number of clusters (and of magnitude bits) for `bits` = N + 1 bits a value (0: the sign code)."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8 (1: the sign and a mean magnitude per group; 2-8: a "
                         f"sign bit and 1-7 magnitude bits), got {bits!r}")
    return bits - 1


def _group_size(rows: int, group_rows: int | None) -> int:
    """Rows per scale; None is one scale for the whole tensor (the paper's per-tensor max|R|)."""
    if group_rows is None:
        return max(rows, 1)
    if not isinstance(group_rows, int) or group_rows < 1:
        raise ValueError(f"group_rows must be a positive int or None (per tensor), got {group_rows!r}")
    return group_rows


def _as_rows(shape: Sequence[int]) -> tuple[int, int]:
    """[rows, cols] view of a tensor shape: the last dimension is a row (one token's hidden vector)."""
    shape = tuple(shape)
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def levels(bits: int, device=None) -> torch.Tensor:
    """The 2^N magnitudes a code can decode to, in units of U0 (ascending, exact small integers);
    for bits = 1 the one magnitude, in units of the group's mean |x|."""
    n = _check_bits(bits)
    if n == 0:
        return torch.ones(1, dtype=torch.float32, device=device)
    p = 2 ** (n - 1)
    values = [k * p + j * 2**k for k in range(n) for j in range(p >> k)] + [n * p]
    return torch.tensor(values, dtype=torch.float32, device=device)


_SIGNED_LEVELS: dict = {}


def _signed_levels(bits: int, device) -> torch.Tensor:
    """The value of every code in units of U0: levels(bits), then their negatives (code | sign bit)."""
    key = (bits, str(device))
    if key not in _SIGNED_LEVELS:
        magnitude = levels(bits, device)
        _SIGNED_LEVELS[key] = torch.cat([magnitude, -magnitude])
    return _SIGNED_LEVELS[key]


def num_scales(rows: int, group_rows: int | None = 1) -> int:
    """Scales of a [rows, cols] tensor: one per group of `group_rows` rows, the last group maybe short."""
    g = _group_size(rows, group_rows)
    return -(-rows // g)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of `numel` codes packed densely (the code count is padded to a multiple of 8)."""
    return -(-numel // 8) * bits


def _scales(x: torch.Tensor, n: int, group_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """U0 of each group of rows of fp32 [rows, cols] `x` (n = 0: the group's mean |x|), and the
    per-row unit to divide by (1 where the scale is 0)."""
    rows = x.shape[0]
    g = _group_size(rows, group_rows)
    groups = num_scales(rows, g)
    if x.numel() == 0:
        return torch.zeros(groups, dtype=SCALE_DTYPE, device=x.device), x.new_ones(rows, 1)
    if n == 0:  # the sign code: the mean magnitude of the group's values (a short last group: its own count)
        row_sum = torch.nn.functional.pad(x.abs().sum(1), (0, groups * g - rows)).view(groups, g).sum(1)
        counts = torch.full((groups,), g * x.shape[1], dtype=torch.float32, device=x.device)
        counts[-1] = (rows - (groups - 1) * g) * x.shape[1]
        scales = row_sum / counts
    else:
        row_max = torch.nn.functional.pad(x.abs().amax(1), (0, groups * g - rows))
        scales = row_max.view(groups, g).amax(1) / (n * 2 ** (n - 1))
    return scales, torch.where(scales > 0, scales, 1.0).repeat_interleave(g)[:rows, None]


_BIT = torch.arange(8)  # the bit of each of a byte's 8 one-bit codes, LSB first


def _pack_signs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 codes (a multiple of 8) packed 8 to a byte, the first in the low bit (as pack_codes)."""
    return (codes.view(-1, 8).long() << _BIT.to(codes.device)).sum(1).to(torch.uint8)


def _unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    return ((packed.long()[:, None] >> _BIT.to(packed.device)) & 1).view(-1)


def encode(x: torch.Tensor, bits: int = 4, group_rows: int | None = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Piecewise-quantize `x` ([rows, cols]; any shape is read as [-1, last dim]).

    Returns (codes, scales): codes uint8, packed_bytes(x.numel(), bits) of them; scales
    float32, U0 of each group of `group_rows` rows (the last group may be short; 0 for an
    all-zero group). Arithmetic is in fp32 whatever x's dtype.
    """
    n = _check_bits(bits)
    rows, cols = _as_rows(x.shape)
    x = x.reshape(rows, cols).float()
    scales, unit = _scales(x, n, group_rows)
    if x.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device), scales
    if n == 0:  # the sign code: 1 for negative
        negative = torch.nn.functional.pad((x < 0).view(-1).to(torch.uint8), (0, -x.numel() % 8))
        return _pack_signs(negative), scales
    p = 2 ** (n - 1)
    t = x.abs() / unit  # |x| in units of U0: 0 .. N*p
    k = torch.floor(t / p).clamp_(max=n - 1)  # eq. 9, with |x| = M put in the last cluster
    j = torch.round((t - k * p) / torch.exp2(k))  # eq. 6: nearest level inside cluster k
    index = (2**n - torch.exp2(n - k) + j).clamp_(max=2**n - 1)  # clusters 0..k-1 hold 2^n - 2^(n-k) levels
    negative = (x < 0) & (index > 0)  # no -0: a zero decodes to +0
    codes = index.to(torch.uint8) | (negative.to(torch.uint8) << n)
    codes = torch.nn.functional.pad(codes.view(-1), (0, -codes.numel() % 8))
    packed = torch.empty(packed_bytes(rows * cols, bits), dtype=torch.uint8, device=x.device)
    return pack_codes(codes, bits, packed), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int], bits: int = 4,
           group_rows: int | None = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of encode: the tensor of `shape` that (codes, scales) stand for, in `dtype`."""
    n = _check_bits(bits)
    rows, cols = _as_rows(shape)
    g = _group_size(rows, group_rows)
    if codes.numel() != packed_bytes(rows * cols, bits) or scales.numel() != num_scales(rows, g):
        raise ValueError(f"{codes.numel()} code bytes and {scales.numel()} scales do not fit shape {tuple(shape)} "
                         f"at bits={bits}, group_rows={group_rows}: expected {packed_bytes(rows * cols, bits)} "
                         f"and {num_scales(rows, g)}")
    if n == 0:
        value = 1.0 - 2.0 * _unpack_signs(codes)[: rows * cols].view(rows, cols).float()
    else:  # one lookup of the signed level: the table is indexed by the whole code, sign bit included
        value = _signed_levels(bits, codes.device)[unpack_codes(codes, bits)[: rows * cols].view(rows, cols).long()]
    unit = scales.to(torch.float32).repeat_interleave(g)[:rows, None]
    return (value * unit).to(dtype).view(tuple(shape))


def error_bound(x: torch.Tensor, bits: int = 4, group_rows: int | None = 1) -> torch.Tensor:
    """Per element, the most encode/decode may move it: U_k / 2 for the cluster k of |x| (fp32);
    for bits = 1 exactly how far it moves, | |x| - s | with s the group's mean |x|."""
    n = _check_bits(bits)
    rows, cols = _as_rows(x.shape)
    flat = x.reshape(rows, cols).float()
    scales, unit = _scales(flat, n, group_rows)
    if n == 0:
        s = scales.repeat_interleave(_group_size(rows, group_rows))[:rows, None]
        return (flat.abs() - s).abs().view(x.shape)
    k = torch.floor(flat.abs() / unit / 2 ** (n - 1)).clamp_(max=n - 1)
    u0 = scales.repeat_interleave(_group_size(rows, group_rows))[:rows, None]
    return (u0 * torch.exp2(k - 1)).view(x.shape)


# ---------------------------------------------------------------- compressed all-reduce


def payload_bytes(rows: int, cols: int, bits: int = 4, group_rows: int | None = 1) -> int:
    """Bytes one quantized [rows, cols] block travels as: packed codes, then the fp32 scales."""
    return packed_bytes(rows * cols, bits) + num_scales(rows, group_rows) * SCALE_DTYPE.itemsize


def _to_payload(x: torch.Tensor, bits: int, group_rows: int | None) -> torch.Tensor:
    codes, scales = encode(x, bits, group_rows)
    return torch.cat([codes, scales.view(torch.uint8)])  # one buffer, one collective


def _from_payload(buf: torch.Tensor, rows: int, cols: int, bits: int, group_rows: int | None) -> torch.Tensor:
    split = packed_bytes(rows * cols, bits)
    scales = buf[split:]
    if scales.storage_offset() % SCALE_DTYPE.itemsize:  # 1-, 3-, 5-, 7-bit codes may end off a 4-byte boundary
        scales = scales.clone()
    return decode(buf[:split], scales.view(SCALE_DTYPE), (rows, cols), bits, group_rows)


def _sum_payloads(bufs: torch.Tensor, rows: int, cols: int, bits: int, group_rows: int | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Decode each rank's payload and add them in rank order, so every rank gets the same bits."""
    total = torch.zeros(rows, cols, dtype=dtype, device=bufs.device)
    for buf in bufs:
        total += _from_payload(buf, rows, cols, bits, group_rows)
    return total


def _world(comm: Comm | None, group: str) -> int:
    return comm.mesh.size(group) if comm is not None else 1


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def wire_bytes(shape: Sequence[int], world_size: int, bits: int = 4, group_rows: int | None = 1,
               method: str = "gather") -> int:
    """Bytes one rank sends (and receives) in all_reduce_compressed, counted as CommLedger does.

    gather: its payload to each of the other world_size - 1 ranks. two_step: one chunk of
    ceil(rows / world_size) rows to each other rank in the all-to-all, and its re-quantized
    summed chunk to each other rank in the all-gather.
    """
    _check_method(method)
    rows, cols = _as_rows(shape)
    if world_size == 1 or rows * cols == 0:
        return 0
    if method == "gather":
        return (world_size - 1) * payload_bytes(rows, cols, bits, group_rows)
    return 2 * (world_size - 1) * payload_bytes(-(-rows // world_size), cols, bits, group_rows)


class CompressedWork:
    """Async handle of all_reduce_compressed: wait() finishes the reduction and returns the sum."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish()
        return self._result


def all_reduce_compressed(x: torch.Tensor, comm: Comm | None = None, group: str = "world", bits: int = 4,
                          group_rows: int | None = 1, method: str = "gather", async_op: bool = False,
                          tag: str = "compressed all-reduce") -> torch.Tensor | CompressedWork:
    """The sum over the ranks of `comm`'s mesh group `group` of their `x` (same shape everywhere),
    sent piecewise-quantized (without a comm: a group of one). The collectives go through `comm`,
    recorded in its ledger under `tag`.

    Every rank returns the same bits: the sum is built only from bytes all ranks hold, decoded
    and added in rank order in fp32 (each rank's own term included, as sent). Returns a new
    tensor of x's shape and dtype (a copy of x in a group of one), or with async_op a
    CompressedWork whose wait() returns it. Bytes sent: wire_bytes().

    gather (small TP groups): all-gather every rank's quantized x, decode and sum locally.
    Error per element <= the sum over ranks of their error_bound.
    two_step (qgZ-like, for larger groups): cut the rows into world_size chunks (zero rows
    pad the last; group_rows=None is one scale per chunk here), all-to-all the quantized
    chunks, each rank sums its own chunk, re-quantizes it and all-gathers it. Sends 2(W-1)/W
    of the payload instead of W-1 times it, and adds one re-quantization's error. Async, it
    overlaps the all-to-all; its all-gather runs in wait().
    """
    work = all_reduce_compressed_blocks([(x, bits)], comm, group, group_rows, method, async_op=True, tag=tag)
    if async_op:
        return CompressedWork(lambda: work.wait()[0])
    return work.wait()[0]


def all_reduce_compressed_blocks(blocks: Sequence[tuple[torch.Tensor, int]], comm: Comm | None = None,
                                 group: str = "world", group_rows: int | None = 1, method: str = "gather",
                                 async_op: bool = False, tag: str = "compressed all-reduce"
                                 ) -> list[torch.Tensor] | CompressedWork:
    """all_reduce_compressed of several tensors, each at its own bits, in one message.

    `blocks` is [(x, bits), ...]; returns the list of sums (each x's shape and dtype), with
    async_op a CompressedWork whose wait() returns it. One collective carries every block's
    payload back to back (two for two_step), so a block costs its bytes and no extra start-up:
    tensor parallelism sends a sublayer's kept rows at quantize_bits and its pruned rows at
    1 bit this way. Bytes sent: the sum of wire_bytes() over the blocks.
    """
    _check_method(method)
    for _, bits in blocks:
        _check_bits(bits)
    _group_size(1, group_rows)  # checks group_rows
    world = _world(comm, group)
    live = [i for i, (x, _) in enumerate(blocks) if x.numel() > 0]
    if world == 1 or not live:
        return CompressedWork(lambda: [x.clone() for x, _ in blocks]) if async_op else [x.clone() for x, _ in blocks]
    device = blocks[live[0]][0].device
    shapes = {i: _as_rows(blocks[i][0].shape) for i in live}
    flats = {i: blocks[i][0].reshape(shapes[i]) for i in live}
    accs = {i: torch.promote_types(blocks[i][0].dtype, torch.float32) for i in live}

    def results(sums: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [sums[i].to(x.dtype).view(x.shape) if i in sums else x.clone() for i, (x, _) in enumerate(blocks)]

    if method == "gather":
        sizes = [payload_bytes(*shapes[i], blocks[i][1], group_rows) for i in live]
        mine = torch.cat([_to_payload(flats[i], blocks[i][1], group_rows) for i in live])
        everyone = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
        work = comm.all_gather(everyone, mine, group=group, tag=tag, async_op=True)

        def finish() -> list[torch.Tensor]:
            work.wait()
            per_rank, sums, offset = everyone.view(world, -1), {}, 0
            for i, size in zip(live, sizes):
                sums[i] = _sum_payloads(per_rank[:, offset:offset + size], *shapes[i], blocks[i][1], group_rows,
                                        accs[i])
                offset += size
            return results(sums)
    else:
        chunks = {i: -(-shapes[i][0] // world) for i in live}
        sizes = [payload_bytes(chunks[i], shapes[i][1], blocks[i][1], group_rows) for i in live]
        parts = {i: torch.nn.functional.pad(flats[i], (0, 0, 0, chunks[i] * world - shapes[i][0]))
                 .view(world, chunks[i], shapes[i][1]) for i in live}
        # Destination by destination, every block's chunk for it: one all-to-all of equal pieces.
        send = torch.cat([_to_payload(parts[i][d], blocks[i][1], group_rows) for d in range(world) for i in live])
        received = torch.empty_like(send)
        work = comm.all_to_all(received, send, group=group, tag=tag, async_op=True)

        def finish() -> list[torch.Tensor]:
            work.wait()
            per_rank, summed, offset = received.view(world, -1), [], 0
            for i, size in zip(live, sizes):
                total = _sum_payloads(per_rank[:, offset:offset + size], chunks[i], shapes[i][1], blocks[i][1],
                                      group_rows, accs[i])
                summed.append(_to_payload(total, blocks[i][1], group_rows))
                offset += size
            mine = torch.cat(summed)
            everyone = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
            comm.all_gather(everyone, mine, group=group, tag=tag)
            per_rank, sums, offset = everyone.view(world, -1), {}, 0
            for i, size in zip(live, sizes):
                decoded = [_from_payload(buf, chunks[i], shapes[i][1], blocks[i][1], group_rows)
                           for buf in per_rank[:, offset:offset + size]]
                sums[i] = torch.cat(decoded)[:shapes[i][0]]
                offset += size
            return results(sums)

    return CompressedWork(finish) if async_op else finish()


# ---------------------------------------------------------------- token-level top-k


@torch.no_grad()
def token_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = True, scale: float | None = None,
                 chunk: int = 128) -> torch.Tensor:
    """[B, T] attention each key token receives: softmax(q k^T * scale) summed over heads and queries.

    q [B, Hq, T, D], k [B, Hk, T, D] (this rank's heads; GQA: Hk divides Hq, query head h
    reads key head h // (Hq / Hk)). `chunk` queries at a time, so memory is O(B*Hq*chunk*T).
    fp32 throughout. Each sequence's scores sum to Hq * T (each query row sums to 1).
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must be [B, H, T, D] with equal B and D, got {tuple(q.shape)} and {tuple(k.shape)}")
    b, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"key heads ({hk}) must divide query heads ({hq})")
    if causal and tq != tk:
        raise ValueError(f"causal scores need as many queries as keys, got {tq} and {tk}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    scale = d**-0.5 if scale is None else scale
    q = q.float().view(b, hk, hq // hk, tq, d)
    k = k.float()
    scores = torch.zeros(b, tk, dtype=torch.float32, device=q.device)
    keys = torch.arange(tk, device=q.device)
    for start in range(0, tq, chunk):
        logits = torch.einsum("bgrqd,bgkd->bgrqk", q[:, :, :, start:start + chunk], k) * scale
        if causal:
            queries = torch.arange(start, min(start + chunk, tq), device=q.device)
            logits.masked_fill_(keys > queries[:, None], float("-inf"))
        scores += logits.softmax(-1).sum((1, 2, 3))
    return scores


def keep_count(tokens: int, keep_ratio: float) -> int:
    """Tokens kept of `tokens`: keep_ratio * tokens rounded to nearest (halves up), at least 1."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    return min(tokens, max(1, math.floor(keep_ratio * tokens + 0.5)))


def topk_token_mask(scores: torch.Tensor, keep_ratio: float, comm: Comm | None = None, group: str = "world",
                    tag: str = "top-k scores") -> torch.Tensor:
    """bool [B, T]: per sequence the keep_count(T, keep_ratio) tokens of highest score over `comm`'s `group`.

    The ranks' scores are all-gathered and summed in rank order (not all_reduce, whose sum
    may differ in the last bit between ranks), so every rank ranks the same numbers; ties go
    to the earlier token (stable sort). Every rank therefore returns the same mask.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, T], got shape {tuple(scores.shape)}")
    batch, tokens = scores.shape
    kept = keep_count(tokens, keep_ratio)
    scores = scores.float().contiguous()
    world = _world(comm, group)
    if world > 1:
        everyone = torch.empty(world * scores.numel(), dtype=torch.float32, device=scores.device)
        comm.all_gather(everyone, scores.view(-1), group=group, tag=tag)
        scores = torch.zeros_like(scores)
        for part in everyone.view(world, batch, tokens):
            scores += part
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    mask = torch.zeros(batch, tokens, dtype=torch.bool, device=scores.device)
    return mask.scatter_(1, order[:, :kept], True)


# ---------------------------------------------------------------- partition planner

# A layer's schedule state: (end of its last computation, end of each partition's all-reduce).
State = tuple[float, tuple[float, ...]]


def _split_or_merge(pre_cm: tuple[float, ...], k: int) -> list[float]:
    """End of the all-reduce each of the next layer's k partitions waits for (paper lines 30-36).

    Partition i (1-based) of k holds samples up to i/k of the batch, the last of which sit in
    the previous layer's partition ceil(i * n / k) of n; all-reduces finish in order, so that
    one is the last it needs.
    """
    n = len(pre_cm)
    return [pre_cm[-(-i * n // k) - 1] for i in range(1, k + 1)]


def _cal_par_end(state: State, t_cp: float, t_cm: float, k: int) -> State:
    """One layer cut into k partitions after `state` (paper lines 19-28).

    One compute stream and one communication stream, each in order: partition i computes once
    its input's all-reduce and the previous partition's compute are done, then all-reduces once
    its compute and the previous all-reduce (of this layer or the last) are done.
    """
    cp, cm = state[0], state[1][-1]
    ends = []
    for ready in _split_or_merge(state[1], k):
        cp = max(ready, cp) + t_cp
        cm = max(cp, cm) + t_cm
        ends.append(cm)
    return cp, tuple(ends)


def _check_times(t_cp, t_cm, sizes) -> int:
    if len(t_cp) != len(t_cm) or any(len(row) != len(sizes) for row in (*t_cp, *t_cm)):
        raise ValueError(f"t_cp and t_cm must both be [layers][{len(sizes)}] (one time per partition size in "
                         f"{tuple(sizes)}), got {len(t_cp)} and {len(t_cm)} layers")
    return len(t_cp)


def simulate(plan: Sequence[int], t_cp, t_cm, sizes: Sequence[int] = PARTITION_SIZES) -> float:
    """Completion time (end of the last all-reduce) of `plan`, K per layer, under the paper's model.

    t_cp[l][i], t_cm[l][i]: compute and all-reduce time of ONE partition of layer l cut into
    sizes[i] partitions.
    """
    layers = _check_times(t_cp, t_cm, sizes)
    if len(plan) != layers or any(k not in sizes for k in plan):
        raise ValueError(f"plan must give one of {tuple(sizes)} for each of the {layers} layers, got {list(plan)}")
    state: State = (0.0, (0.0,))
    for layer, k in enumerate(plan):
        i = list(sizes).index(k)
        state = _cal_par_end(state, t_cp[layer][i], t_cm[layer][i], k)
    return state[1][-1]


@dataclass
class PartitionPlan:
    partitions: list[int]  # K of each layer
    time: float  # predicted completion time: simulate(partitions, ...)


def _dominates(a: State, b: State) -> bool:
    return a[0] <= b[0] and all(x <= y for x, y in zip(a[1], b[1]))


def plan_partitions(t_cp, t_cm, sizes: Sequence[int] = PARTITION_SIZES, exact: bool = True) -> PartitionPlan:
    """K per layer minimising simulate(): Algorithm 1's layer-by-layer dynamic program.

    For each layer and each K it keeps the schedules that can still win. The paper keeps one
    (the earliest last all-reduce) per K, but a schedule ending later may leave the compute
    stream or an early partition free sooner and win in a later layer, so from 3 layers on
    it can miss the optimum (exact=False reproduces it). exact=True keeps every schedule no
    other beats in all of its end times (a Pareto front per K); the schedule is monotone in
    those times, so that finds the optimum, in a handful of states per K in practice.

    Forward: layers in order. Backward: pass the layers' backward times reversed and reverse
    the plan. Every rank must pass the same times (all-reduce them first), or plans differ.
    """
    layers = _check_times(t_cp, t_cm, sizes)
    if layers == 0:
        return PartitionPlan([], 0.0)
    fronts: list[list[tuple[State, tuple[int, ...]]]] = [[((0.0, (0.0,)), ())]]
    for layer in range(layers):
        new_fronts = []
        for i, k in enumerate(sizes):
            candidates = [(_cal_par_end(state, t_cp[layer][i], t_cm[layer][i], k), plan + (k,))
                          for front in fronts for state, plan in front]
            candidates.sort(key=lambda c: (c[0][1][-1], c[0][0]))
            if exact:
                kept: list[tuple[State, tuple[int, ...]]] = []
                for c in candidates:
                    if not any(_dominates(s, c[0]) for s, _ in kept):
                        kept.append(c)
            else:
                kept = candidates[:1]
            new_fronts.append(kept)
        fronts = new_fronts
    state, plan = min((c for front in fronts for c in front), key=lambda c: c[0][1][-1])
    return PartitionPlan(list(plan), state[1][-1])


# ---------------------------------------------------------------- alpha-beta communication model


def comm_time(nbytes: float, alpha: float, beta: float) -> float:
    """Paper eq. 3 with the algorithm's constants folded into alpha (startup) and beta (s per byte)."""
    return alpha + beta * nbytes


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of times = alpha + beta * sizes (bytes, seconds).

    A negative intercept (noise on a fast link) is clamped: alpha = 0, beta refit through the origin.
    """
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError(f"need times for at least 2 distinct sizes, got sizes={list(sizes)} times={list(times)}")
    n = len(sizes)
    mean_m, mean_t = sum(sizes) / n, sum(times) / n
    var = sum((m - mean_m) ** 2 for m in sizes)
    beta = sum((m - mean_m) * (t - mean_t) for m, t in zip(sizes, times)) / var
    alpha = mean_t - beta * mean_m
    if alpha < 0:
        alpha, beta = 0.0, sum(m * t for m, t in zip(sizes, times)) / sum(m * m for m in sizes)
    return alpha, beta


def measure_alpha_beta(comm: Comm, group: str = "world", sizes: Sequence[int] = tuple(1 << s for s in range(12, 23, 2)),
                       repeats: int = 5, op: str = "all_reduce", device=None,
                       tag: str = "link measurement") -> tuple[float, float]:
    """(alpha, beta) of `op` on `comm`'s mesh group `group`, timed: the median of `repeats` calls per
    size in bytes (the calls are in `comm`'s ledger under `tag`).

    op "all_reduce" times an fp32 all-reduce of `size` bytes; "all_gather" an all-gather of
    `size` bytes from each rank (what all_reduce_compressed's gather method sends). Every
    rank gets the same fit: it uses the slowest rank's time for each size. Collective: every
    rank of the group must call it.
    """
    if op not in ("all_reduce", "all_gather"):
        raise ValueError(f"op must be 'all_reduce' or 'all_gather', got {op!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else "cpu"
    world = comm.mesh.size(group)
    nbytes, medians = [], []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        out = torch.empty(world * buf.numel(), dtype=torch.float32, device=device)
        run = (lambda: comm.all_reduce(buf, group, tag)) if op == "all_reduce" else \
            (lambda: comm.all_gather(out, buf, group, tag))
        run()  # warm-up, and lines the ranks up
        samples = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            samples.append(time.perf_counter() - start)
        nbytes.append(buf.numel() * 4)
        medians.append(statistics.median(samples))
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    comm.all_reduce(slowest, group, tag, op=dist.ReduceOp.MAX)
    return fit_alpha_beta(nbytes, slowest.tolist())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
