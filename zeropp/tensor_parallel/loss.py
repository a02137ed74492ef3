"""The loss under tensor parallelism: cross-entropy from vocabulary-sliced logits (the LM head is
vocabulary-parallel, zeropp.tensor_parallel.layers.VocabParallelHead), three all-reduces of one
number per token over the group; equal to the full cross-entropy."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeropp.tensor_parallel.collectives import TPComm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sliced logits: three all-reduces of one number per
    token (max, sum of exponentials, target logit); the full logits are never built."""

    @staticmethod
    def forward(ctx, logits, labels, start, tp, ignore_index):
        logits = logits.float()
        top = logits.max(-1).values
        tp.comm.all_reduce(top, "tp", "tp loss", op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        local = labels - start
        mine = (local >= 0) & (local < logits.shape[-1]) & (labels != ignore_index)
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        target = shifted.gather(-1, index).squeeze(-1) * mine
        packed = torch.stack([sum_exp, target])
        tp.comm.all_reduce(packed, "tp", "tp loss")
        sum_exp, target = packed
        valid = labels != ignore_index
        loss = (sum_exp.log() - target) * valid
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid = ctx.saved_tensors
        g = softmax * (grad * valid).unsqueeze(-1)
        g.scatter_add_(-1, index, -(grad * mine).unsqueeze(-1))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, start: int, tp: TPComm,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over labels != ignore_index, from logits [..., V_local] holding
    vocabulary entries [start, start + V_local): equal to models.transformer.lm_loss on the full logits."""
    losses = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), start, tp, ignore_index)
    return losses.sum() / (labels != ignore_index).sum()
