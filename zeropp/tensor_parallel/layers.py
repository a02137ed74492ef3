"""The tensor-parallel layers that zeropp.tensor_parallel.parallelize puts into a model: what a
sliced module computes and which of its parameters hold a slice (`SLICED`: parameter name -> the
dim it is cut along; the rest of its parameters are replicated).

  ColumnParallelLinear    output rows [start, end) of a Linear (and of its bias);
  RowParallelLinear       input columns [start, end): a partial sum, its bias added after g;
  VocabParallelEmbedding  rows [start, end) of the token embedding, then g (the others look up zeros);
  VocabParallelHead       the LM head's vocabulary rows [start, end), f on its input;
  TensorParallelSublayer  mixed into an attention or MLP module (`parallel_sublayer`): f at its
                          input, g at its output, with AccTFM's partitions, token top-k and
                          quantized all-reduces (zeropp.acctfm) on them.

The communication is zeropp.tensor_parallel.collectives'; the loss over the vocabulary slices is
zeropp.tensor_parallel.loss.
"""

from __future__ import annotations

import time
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.transformer import apply_rope
from zeropp import acctfm
from zeropp.tensor_parallel.collectives import (
    AwaitInputGrad,
    CopyToTP,
    ForwardReduced,
    InputGradBox,
    IssueInputGrad,
    ReduceFromTP,
    TPComm,
)


class ColumnParallelLinear(nn.Module):
    """Output rows [start, end) of a Linear: y_local = x W_local^T + b_local."""

    SLICED: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, linear: nn.Linear, start: int, end: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, end - start
        self.weight = nn.Parameter(linear.weight.detach()[start:end].clone(), linear.weight.requires_grad)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach()[start:end].clone(), linear.bias.requires_grad)
        self.keep_output = False  # top-k reads the attention's local q and k
        self.last_output = None

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.keep_output:
            self.last_output = y
        return y


class RowParallelLinear(nn.Module):
    """Input columns [start, end) of a Linear: forward gives this rank's partial sum x_local W_local^T;
    the bias (replicated) is added by the sublayer after the all-reduce."""

    SLICED: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(self, linear: nn.Linear, start: int, end: int):
        super().__init__()
        self.in_features, self.out_features = end - start, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), linear.bias.requires_grad)

    def forward(self, x):
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the token embedding; tokens outside look up zeros, the all-reduce
    over the group fills them in."""

    SLICED: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, start: int, end: int, tp: TPComm):
        super().__init__()
        self.start, self.end, self.tp = start, end, tp
        self.weight = nn.Parameter(embedding.weight.detach()[start:end].clone(), embedding.weight.requires_grad)

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return ReduceFromTP.apply(x, self.tp)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head's rows [start, end) of the vocabulary: this rank's slice of the logits, from the
    replicated hidden state (f on its input: the gradient is all-reduced over the group). The loss
    reads the slices (zeropp.tensor_parallel.loss); the full logits are never built."""

    SLICED: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, linear: nn.Linear, start: int, end: int, tp: TPComm):
        super().__init__(linear, start, end)
        self.tp = tp

    def forward(self, x):
        return super().forward(CopyToTP.apply(x, self.tp))


def _split_arg(a, k: int, batch: int):
    """A sublayer argument cut into k batch partitions: tensors (and tuples of them, RoPE's
    cos/sin) whose first dim is the batch; anything else is shared by all partitions."""
    if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch:
        return a.tensor_split(k)
    if isinstance(a, tuple):
        parts = [_split_arg(x, k, batch) for x in a]
        return [tuple(p[i] for p in parts) for i in range(k)]
    return [a] * k


class TensorParallelSublayer:
    """Mixed into an attention or MLP module's class by `parallel_sublayer`: its own forward computes
    this rank's partial sum (its output projection is row-parallel); this forward wraps it in f
    and g, partition by partition (AccTFM pipelining), with top-k rows and quantization."""

    tp: TPComm
    partitions: int
    row_parallel: RowParallelLinear
    mask_source: TensorParallelSublayer  # the attention whose token mask this sublayer uses
    token_mask: torch.Tensor | None
    profile: list | None  # set by the planner: (seconds, rows, bytes per row) per partition computed

    def forward(self, x, *args):
        cfg, tp = self.tp.config, self.tp
        batch = x.shape[0]
        caching = any(a is not None and not isinstance(a, (torch.Tensor, tuple)) for a in args)  # a KV cache
        k = 1 if caching else max(1, min(self.partitions, batch))
        xs = x.tensor_split(k) if k > 1 else (x,)
        split_args = [_split_arg(a, k, batch) for a in args]
        topk = cfg.topk_keep_ratio < 1.0 and not caching
        forward_topk, backward_topk = topk and cfg.topk_passes != "backward", topk and cfg.topk_passes != "forward"
        compress = cfg.quantize_bits > 0
        grad = torch.is_grad_enabled() and x.requires_grad
        own_mask = self.mask_source is self
        masks = None if not topk or own_mask else self.mask_source.token_mask.tensor_split(k)
        boxes = [InputGradBox(None if masks is None or not backward_topk else masks[i]) for i in range(k)]
        if grad:  # the waits first: autograd runs them after every partition's backward
            xs = [AwaitInputGrad.apply(c, tp, b) for c, b in zip(xs, boxes)]
        partials, pending, chunk_masks, own_masks = [], [], [], []
        for i, c in enumerate(xs):
            if grad:
                c = IssueInputGrad.apply(c, tp, boxes[i], compress)
            start = time.perf_counter() if self.profile is not None else 0.0
            y = super().forward(c, *(a[i] for a in split_args))
            if self.profile is not None:  # the planner's measurement: one partition's compute and rows
                self.profile.append((time.perf_counter() - start, y[..., 0].numel(), y.shape[-1] * y.element_size()))
            mask = None if masks is None else masks[i]
            if topk and own_mask:
                mask = self._token_mask(split_args, i)
                own_masks.append(mask)
                if backward_topk:
                    boxes[i].mask = mask
            mask = mask if forward_topk else None
            partials.append(y)
            chunk_masks.append(mask if cfg.topk_pruned == "drop" else None)  # dropped rows get no gradient
            pending.append(tp.all_reduce(y, "tp forward all-reduce", mask, compress))
        outs = [ForwardReduced.apply(y, tp, p, m) for y, p, m in zip(partials, pending, chunk_masks)]
        if topk and own_mask:
            self.token_mask = torch.cat(own_masks)
        out = outs[0] if k == 1 else torch.cat(outs)
        bias = self.row_parallel.bias
        return out if bias is None else out + bias

    def _token_mask(self, split_args, i: int) -> torch.Tensor:
        """The tokens of partition i whose outputs travel: attention received, summed over the group."""
        b, t, _ = self.q_proj.last_output.shape
        q = self.q_proj.last_output.detach().view(b, t, self.n_head, self.head_dim)
        k = self.k_proj.last_output.detach().view(b, t, self.n_kv_head, self.head_dim)
        if getattr(self, "q_norm", None) is not None:  # Qwen3's per-head norms, as the attention applies them
            with torch.no_grad():
                q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rope = split_args[0][i] if split_args else None
        if isinstance(rope, tuple):
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        self.q_proj.last_output = self.k_proj.last_output = None
        scores = acctfm.token_scores(q, k, causal=True)
        return acctfm.topk_token_mask(scores, self.tp.config.topk_keep_ratio, self.tp.comm, "tp", tag="tp top-k")


def parallel_sublayer(module: nn.Module, tp: TPComm, row_parallel: RowParallelLinear,
                      mask_source: nn.Module) -> None:
    """Make `module` (an attention or MLP whose output projection `row_parallel` is already sliced)
    a TensorParallelSublayer: its class is swapped for one that also derives from it (as FSDP2's
    fully_shard does), so parameter names, state dicts and hooks stay as they were. `mask_source`:
    the attention whose token top-k mask it uses (the attention itself: it computes the mask from
    its q and k projections' outputs, which are then kept for it)."""
    cls = type(module)
    module.__class__ = type(f"TensorParallel{cls.__name__}", (TensorParallelSublayer, cls), {})
    module.tp, module.partitions, module.token_mask, module.profile = tp, max(1, tp.config.partitions), None, None
    # Plain references, not submodules: no second name for o_proj, no cycle through attn.
    module.__dict__["row_parallel"], module.__dict__["mask_source"] = row_parallel, mask_source
    if mask_source is module:
        module.q_proj.keep_output = module.k_proj.keep_output = tp.config.topk_keep_ratio < 1.0

