"""qgZ (ZeRO++ section 3.3): gradients reduced as block-quantized all-to-alls instead of a
reduce-scatter, over the transport of zeropp.comm.

hops=1: quantize, one all-to-all over all DP ranks, dequantize and sum. hops=2: reorder the
chunks node-major -> local-rank-major while quantizing, an all-to-all inside the node,
dequantize + sum + requantize, an all-to-all across nodes (same local rank), dequantize + sum:
each node's partial sum crosses the slow link once, at the quantized width. `stages` > 1 cuts
every chunk into that many slices and pipelines them: the inter-node hop of slice s runs while
the intra-node hop of slice s+1 does (paper Algorithm 2). With error feedback (zeropp.reducers.
ErrorFeedback, LoCo's moving average and reset), what each hop's quantization lost is added to
the next step's input of that hop: the gradient (first hop) and the node's partial sum (second).
"""

from __future__ import annotations

import torch

from kernels import (dequant_reduce, dequant_reduce_quant, dequantize, num_blocks, packed_bytes, quantize,
                     quantize_transposed)
from zeropp.comm import Comm
from zeropp.reducers import TAG, ErrorFeedback, GradientReducer

# Both hops quantize on the full grid (kernels.quant: all 2**bits codes). Measured (docs/zeropp.md, 500 steps on
# held-out text): int2 lands at +1.36% of ZeRO-3's validation loss where the symmetric grid's ternary codes, even
# with error feedback, land at +7.4%; int4 at -0.23% where the symmetric grid lands at -0.11%.
LEVELS = "full"


def quantized_reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor, bits: int, block_size: int,
                             hops: int = 2, stages: int = 1, tag: str = "quantized reduce-scatter",
                             async_op: bool = False):
    """`out` (fp32) += the sum over DP ranks of chunk `rank` of `full`, over quantized all-to-alls
    (on the communication thread). The chunk length must be a multiple of block_size x stages (the
    engine pads units so)."""
    return comm.run(lambda: _reduce(comm, out, full, bits, block_size, hops, stages, tag), async_op)


def quantized_reduce_scatter_volume(comm: Comm, numel: int, bits: int, block_size: int, hops: int = 2,
                                    stages: int = 1) -> tuple[int, int]:
    """(bytes sent, of which cross-node) by one quantized_reduce_scatter of `numel` elements: its
    all-to-alls of codes and fp32 scales, as the ledger records them."""
    m = comm.mesh
    one_hop = hops == 1 or m.num_nodes == 1 or m.ranks_per_node == 1
    sub = numel // m.world_size // stages
    hops_made = [("dp", m.world_size * sub)] if one_hop else \
        [("intra_node", m.world_size * sub), ("inter_node", m.num_nodes * sub)]
    sent = cross = 0
    for group, elements in hops_made:
        n = m.size(group)
        for chunk in (packed_bytes(elements, bits, block_size) // n, num_blocks(elements, block_size) // n * 4):
            s, c = comm.volume(chunk, group)
            sent, cross = sent + stages * s, cross + stages * c
    return sent, cross


def _reduce(comm, out, full, bits, block_size, hops, stages, tag, error=None, feedback=None):
    """`error` (fp32, like `full`), when given, receives what the first hop's quantization lost:
    full - dequant(quant(full)); `feedback` = (ErrorFeedback, key): error feedback on the second hop's
    partial sums, per slice."""
    m = comm.mesh
    world, nodes, local = m.world_size, m.num_nodes, m.ranks_per_node
    if hops == 1 or nodes == 1 or local == 1:
        nodes, local, hops = 1, world, 1  # one all-to-all over everybody
    sub = full.numel() // world // stages
    pending = []
    for s in range(stages):
        # [node, local rank, slice] -> quantized in [local rank, node, slice] order
        view = full.view(nodes, local, stages, sub)[:, :, s]
        q = quantize_transposed(view, bits, block_size, levels=LEVELS)
        if error is not None:  # the codes hold [local rank, node, slice]: compare in that order
            sent = dequantize(q.codes, q.scales, view.numel(), bits, block_size).view(local, nodes, sub)
            error.view(nodes, local, stages, sub)[:, :, s].copy_(view - sent.transpose(0, 1))
        first = "dp" if hops == 1 else "intra_node"
        codes, scales, _ = _exchange(comm, q.codes, q.scales, first, tag, async_op=False)
        if hops == 1:
            dequant_reduce(codes, scales, local, sub, bits, block_size, out=out[s * sub:(s + 1) * sub],
                           accumulate=True)
            continue
        if feedback is None:
            partial = dequant_reduce_quant(codes, scales, local, nodes * sub, bits, block_size, levels=LEVELS)
        else:
            partial = _requantized_with_feedback(*feedback, s, codes, scales, local, nodes * sub, bits, block_size)
        pending.append((s, *_exchange(comm, partial.codes, partial.scales, "inter_node", tag, async_op=True)))
    for s, codes, scales, works in pending:
        for w in works:
            w.wait()
        dequant_reduce(codes, scales, nodes, sub, bits, block_size, out=out[s * sub:(s + 1) * sub],
                       accumulate=True)


def _requantized_with_feedback(feedback: ErrorFeedback, key, stage, codes, scales, k, numel, bits, block_size):
    """dequant_reduce_quant with error feedback on the sum (LoCo's second hop): p = sum + e, sent quant(p)."""
    partial = dequant_reduce(codes, scales, k, numel, bits, block_size)
    key = f"{key}/across{stage}"
    kept = feedback.begin(key, partial)
    q = quantize(partial, bits, block_size, levels=LEVELS)
    if kept:
        feedback.end(key, partial.sub_(q.dequantize()))
    return q


def _exchange(comm, codes, scales, group, tag, async_op):
    """All-to-all of equal chunks of codes and of scales (over the communication thread's groups)."""
    recv_codes, recv_scales = torch.empty_like(codes), torch.empty_like(scales)
    works = [comm.all_to_all(recv, sent, group, tag, async_op=async_op, thread=True)
             for recv, sent in ((recv_codes, codes), (recv_scales, scales))]
    return recv_codes, recv_scales, works


class QuantizedReduce(GradientReducer):
    """qgZ as the engine's gradient reducer, with optional error feedback (`feedback`: an ErrorFeedback,
    None for none) on both hops; its errors are this rank's state."""

    def __init__(self, comm: Comm, bits: int, block_size: int, hops: int, stages: int,
                 feedback: ErrorFeedback | None = None):
        self.comm, self.bits, self.block_size = comm, bits, block_size
        self.hops, self.stages, self.feedback = hops, stages, feedback
        self.stateful = feedback is not None

    def reduce(self, unit, shard, grad, async_op):
        if self.feedback is None:
            return quantized_reduce_scatter(self.comm, shard, grad, self.bits, self.block_size, hops=self.hops,
                                            stages=self.stages, tag=TAG, async_op=async_op)
        kept = self.feedback.begin(unit, grad)  # grad is the engine's scratch buffer of this backward
        lost = self.feedback.loss_buffer(unit, grad.numel(), grad.device) if kept else None

        def work():  # the first hop writes lost = h - dequant(quant(h)); the second feeds back on its own
            _reduce(self.comm, shard, grad, self.bits, self.block_size, self.hops, self.stages, TAG, lost,
                    (self.feedback, unit))
            if kept:
                self.feedback.end(unit, lost)
        return self.comm.run(work, async_op)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.feedback.state_dict() if self.feedback is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unexpected = sorted(state) if self.feedback is None else \
            [k for k in state if k.rpartition(".")[2] not in ("error", "round")]
        if unexpected:
            raise ValueError(f"qgZ{' with' if self.feedback else ' without'} error feedback cannot load "
                             f"reducer state {unexpected[:4]}")
        if self.feedback is not None:
            self.feedback.load_state_dict(state)

    def volume(self, numel: int) -> tuple[int, int]:
        return quantized_reduce_scatter_volume(self.comm, numel, self.bits, self.block_size, self.hops, self.stages)

    def describe(self) -> str:
        fb = self.feedback
        ef = "" if fb is None else f" + error feedback (memory {fb.memory:g}" + \
            (f", reset every {fb.reset_interval}" if fb.reset_interval else "") + ")"
        return f"qgZ int{self.bits}, {self.hops} hop(s){ef}"
