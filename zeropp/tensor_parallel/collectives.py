"""The tensor-parallel group's collectives: `TPComm` (its all-reduces, exact or compressed by
AccTFM) and Megatron's two operators as autograd functions, f (identity forward, all-reduce of the
gradient backward) and g (all-reduce forward, identity backward).

f comes in two halves so a pipelined sublayer (zeropp.tensor_parallel.layers) can issue each
partition's input-gradient all-reduce as that partition's backward ends and wait for all of them
after the last: `IssueInputGrad` issues, `AwaitInputGrad` waits, an `InputGradBox` carries the
handle from one to the other. g is `ForwardReduced` (its all-reduce issued by the caller). The
embedding and the LM head use the plain pair `ReduceFromTP` (g) and `CopyToTP` (f).
"""

from __future__ import annotations

import time

import torch

from zeropp import acctfm
from zeropp.comm import Comm
from zeropp.config import TensorParallelConfig
from zeropp.topology import Mesh


class _Reduced:
    """An all-reduce in flight; wait() gives the full [..., d] result."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> torch.Tensor:
        return self._finish()


class TPComm:
    """The tensor-parallel group of one rank and how its all-reduces run (exact or compressed).
    Every collective goes through `comm` (zeropp.comm.Comm, mesh group "tp"), so its ledger
    counts each byte; the runtime points it at the data-parallel runtime's ledger."""

    def __init__(self, mesh: Mesh, config: TensorParallelConfig):
        self.mesh, self.config = mesh, config
        self.comm = Comm(mesh, node_aware=False)
        self.size = mesh.tp_size
        self.rank = mesh.group_rank("tp")
        self.seconds_waiting = 0.0

    def all_reduce(self, x: torch.Tensor, tag: str, mask: torch.Tensor | None = None,
                   compress: bool = False) -> _Reduced:
        """Sum `x` [..., d] over the group. With `mask` [...] (token top-k) the selected rows are
        the kept ones, and the others ("pruned") get what config.topk_pruned says: "reduce" sums
        them too, at topk_pruned_bits a value (1: the sign and one mean |x| per row), in the same
        message as the kept rows; "drop" returns them zero; "local" returns this rank's own rows
        times the group size (nothing travels). With `compress` the kept rows travel
        piecewise-quantized at quantize_bits (zeropp.acctfm, one scale per row). Issued
        asynchronously: `wait()` gives the result, bit-identical on every rank (but "local"'s
        pruned rows)."""
        cfg = self.config
        flat = x.detach()
        kept = flat[mask] if mask is not None else flat.reshape(-1, flat.shape[-1])
        pruned_mode = cfg.topk_pruned if mask is not None else None
        quantize = compress and cfg.quantize_bits > 0
        method = "gather" if self.size <= 4 else "two_step"
        blocks = [(kept, cfg.quantize_bits)] if quantize else []
        if pruned_mode == "reduce":
            blocks.append((flat[~mask], cfg.topk_pruned_bits))
        compressed = work = None
        if blocks:
            compressed = acctfm.all_reduce_compressed_blocks(blocks, self.comm, "tp", method=method, async_op=True,
                                                             tag=tag)
        if not quantize:
            kept = kept.contiguous().clone() if mask is None else kept.contiguous()
            work = self.comm.all_reduce(kept, "tp", tag, async_op=True)

        def finish() -> torch.Tensor:
            sums = compressed.wait() if compressed is not None else []
            if work is not None:
                work.wait()
            kept_sum = sums[0] if quantize else kept
            if mask is None:
                return kept_sum.view(flat.shape)
            out = flat * self.size if pruned_mode == "local" else torch.zeros_like(flat)
            out[mask] = kept_sum.to(out.dtype)
            if pruned_mode == "reduce":
                out[~mask] = sums[-1].to(out.dtype)
            return out
        return _Reduced(finish)

    def wait(self, reduced: _Reduced) -> torch.Tensor:
        """The all-reduce's result, the time spent waiting for it counted."""
        start = time.perf_counter()
        out = reduced.wait()
        self.seconds_waiting += time.perf_counter() - start
        return out


# ---------------------------------------------------------------------------- Megatron's f and g

class InputGradBox:
    """What a partition's backward input-gradient all-reduce hands from its issue to its wait."""

    def __init__(self, mask=None):
        self.mask, self.pending = mask, None


class AwaitInputGrad(torch.autograd.Function):
    """f's second half: identity forward; backward returns the all-reduced input gradient that
    IssueInputGrad started (the gradient arriving here is the unreduced one, ignored)."""

    @staticmethod
    def forward(ctx, x, tp, box):
        ctx.tp, ctx.box = tp, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, _):
        grad = ctx.tp.wait(ctx.box.pending)
        ctx.box.pending = None
        return grad, None, None


class IssueInputGrad(torch.autograd.Function):
    """f's first half: identity forward; backward issues the input gradient's all-reduce and
    returns without waiting, so autograd goes on with the other partitions meanwhile."""

    @staticmethod
    def forward(ctx, x, tp, box, compress):
        ctx.tp, ctx.box, ctx.compress = tp, box, compress
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.box.pending = ctx.tp.all_reduce(grad, "tp backward all-reduce", ctx.box.mask, ctx.compress)
        return grad, None, None, None


class ForwardReduced(torch.autograd.Function):
    """g: the partial sums' all-reduce (already issued) in forward; identity backward (`mask`:
    zero for the rows top-k dropped, whose output did not depend on this rank's partial sum;
    quantized rows pass the gradient straight through)."""

    @staticmethod
    def forward(ctx, partial, tp, pending, mask):
        ctx.mask = mask
        return tp.wait(pending)

    @staticmethod
    def backward(ctx, grad):
        if ctx.mask is not None:
            grad = grad * ctx.mask.unsqueeze(-1).to(grad.dtype)
        return grad, None, None, None


class CopyToTP(torch.autograd.Function):
    """f for the LM head's input: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.wait(ctx.tp.all_reduce(grad, "tp head all-reduce")), None


class ReduceFromTP(torch.autograd.Function):
    """g for the embedding's output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.wait(tp.all_reduce(x, "tp embedding all-reduce"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None
