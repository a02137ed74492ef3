"""Tensor parallelism (Megatron-LM's layout), applied to a models.transformer.Transformer from
outside, with AccTFM's (seed 004) pipelined and compressed all-reduces; docs/tensor_parallel.md.

`parallelize(model, tp)` slices the model in place for one rank of a tensor-parallel group:
  column-parallel  q/k/v projections (whole heads: key/value heads too, so GQA splits by kv
                   head) and the MLP's up/gate projections: each rank holds some output rows;
  row-parallel     the attention output and MLP down projections: each rank holds the matching
                   input columns and computes a partial sum, which one all-reduce completes;
  vocab-parallel   the token embedding (a rank looks up only its rows; an all-reduce fills the
                   rest) and the LM head (each rank scores its slice of the vocabulary; the loss
                   `vocab_parallel_cross_entropy` never builds the full logits).
Norms, biases of the row-parallel layers, positions and OPT's projections stay replicated:
their inputs and output gradients are identical on every rank of the group, so are their
gradients, and they stay equal without any extra communication.

Each attention and MLP sublayer runs Megatron's two operators: f (identity forward, all-reduce
of the input gradient backward) at its input and g (all-reduce forward, identity backward) at
its output. AccTFM changes how those all-reduces run:
  partitions   the sublayer's batch is split into K partitions; partition i's all-reduce is
               issued asynchronously and overlaps the compute of partitions i+1.. (forward),
               and in the backward partition i's input-gradient all-reduce overlaps the
               backward of the partitions still to go (autograd runs the later-created nodes
               first; the waits are created before every partition's compute);
  top-k        only the tokens receiving the most attention (scores summed over the group)
               have their sublayer outputs all-reduced in full; the other ("pruned") rows
               travel in the same message at 3 bits a value (tensor_parallel.topk_pruned_bits),
               so every rank still gets the same, coarser, sum (topk_pruned: or they are
               dropped, or get each rank's local partial sum); the backward reuses the mask;
  quantization the kept rows travel piecewise-quantized (zeropp.acctfm).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.transformer import MLP, Attention, Transformer, apply_rope
from zeropp import acctfm
from zeropp.checkpoint import FULL, SHARDED, read_safetensors, unsharded_tensors
from zeropp.comm import Comm
from zeropp.config import TensorParallelConfig, ZeroConfig
from zeropp.runtime import Runtime, clip_by_norm_, squared_norm
from zeropp.topology import Mesh, TopologyError, mesh_from_config


PLAN_FILE = "tensor_parallel.json"  # in a checkpoint: the group size and each sliced tensor's dim


# ---------------------------------------------------------------------------- the group's all-reduces

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

class _Box:
    """What a partition's backward input-gradient all-reduce hands from its issue to its wait."""

    def __init__(self, mask=None):
        self.mask, self.pending = mask, None


class _AwaitInputGrad(torch.autograd.Function):
    """f's second half: identity forward; backward returns the all-reduced input gradient that
    _IssueInputGrad started (the gradient arriving here is the unreduced one, ignored)."""

    @staticmethod
    def forward(ctx, x, tp, box):
        ctx.tp, ctx.box = tp, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, _):
        grad = ctx.tp.wait(ctx.box.pending)
        ctx.box.pending = None
        return grad, None, None


class _IssueInputGrad(torch.autograd.Function):
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


class _ForwardReduced(torch.autograd.Function):
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


class _CopyToTP(torch.autograd.Function):
    """f for the LM head's input: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.wait(ctx.tp.all_reduce(grad, "tp head all-reduce")), None


class _ReduceFromTP(torch.autograd.Function):
    """g for the embedding's output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.wait(tp.all_reduce(x, "tp embedding all-reduce"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------- the sliced layers

def split_bounds(n: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """This rank's [start, end) of n items in whole `unit`s, as torch.tensor_split cuts them
    (the first n/unit % size ranks get one unit more): uneven sizes pad nothing and need no assert."""
    units = n // unit
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


class ColumnParallelLinear(nn.Module):
    """Output rows [start, end) of a Linear: y_local = x W_local^T + b_local."""

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

    def __init__(self, embedding: nn.Embedding, start: int, end: int, tp: TPComm):
        super().__init__()
        self.start, self.end, self.tp = start, end, tp
        self.weight = nn.Parameter(embedding.weight.detach()[start:end].clone(), embedding.weight.requires_grad)

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(x, self.tp)


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
    """Mixed into an attention or MLP module's class by `parallelize`: its own forward computes
    this rank's partial sum (its output projection is row-parallel); this forward wraps it in f
    and g, partition by partition (AccTFM pipelining), with top-k rows and quantization."""

    tp: TPComm
    partitions: int
    row_parallel: RowParallelLinear
    mask_source: "TensorParallelSublayer"  # the attention whose token mask this sublayer uses
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
        boxes = [_Box(None if masks is None or not backward_topk else masks[i]) for i in range(k)]
        if grad:  # the waits first: autograd runs them after every partition's backward
            xs = [_AwaitInputGrad.apply(c, tp, b) for c, b in zip(xs, boxes)]
        partials, pending, chunk_masks, own_masks = [], [], [], []
        for i, c in enumerate(xs):
            if grad:
                c = _IssueInputGrad.apply(c, tp, boxes[i], compress)
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
        outs = [_ForwardReduced.apply(y, tp, p, m) for y, p, m in zip(partials, pending, chunk_masks)]
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


def _make_parallel(module: nn.Module) -> None:
    """Swap the module's class for one that also derives from TensorParallelSublayer (as FSDP2's
    fully_shard does): parameter names, state dicts and hooks stay as they were."""
    cls = type(module)
    module.__class__ = type(f"TensorParallel{cls.__name__}", (TensorParallelSublayer, cls), {})


def parallelize(model: Transformer, tp: TPComm) -> dict[str, tuple[int, int, int]]:
    """Slice `model` in place for this rank of `tp`'s group; returns, per sliced parameter name,
    (dim, start, end) of the full tensor this rank holds (what consolidation concatenates)."""
    if not isinstance(model, Transformer):
        raise TypeError(f"tensor parallelism slices a models.transformer.Transformer, not {type(model).__name__}")
    cfg, p, r = model.config, tp.size, tp.rank
    for name, count in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head)):
        if count % p:
            raise TopologyError(f"tensor_parallel.size={p} must divide the model's {name}={count}: attention is "
                                f"split by whole (key/value) heads")
    for mod_name, module in model.named_modules():
        if type(module).__name__.startswith("LoRA"):
            raise TopologyError(f"tensor parallelism does not slice LoRA adapters ({mod_name}); use size 1 with LoRA")
    plan: dict[str, tuple[int, int, int]] = {}

    def column(owner, attr, prefix, start, end):
        setattr(owner, attr, ColumnParallelLinear(getattr(owner, attr), start, end))
        plan[f"{prefix}.{attr}.weight"] = (0, start, end)
        if getattr(owner, attr).bias is not None:
            plan[f"{prefix}.{attr}.bias"] = (0, start, end)

    def row(owner, attr, prefix, start, end):
        setattr(owner, attr, RowParallelLinear(getattr(owner, attr), start, end))
        plan[f"{prefix}.{attr}.weight"] = (1, start, end)

    hd = cfg.head_dim
    for i, block in enumerate(model.blocks):
        attn, mlp, prefix = block.attn, block.mlp, f"blocks.{i}"
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            raise TypeError(f"{prefix}: tensor parallelism expects models.transformer Attention and MLP")
        q0, q1 = split_bounds(cfg.n_head * hd, p, r, hd)
        kv0, kv1 = split_bounds(cfg.n_kv_head * hd, p, r, hd)
        column(attn, "q_proj", f"{prefix}.attn", q0, q1)
        column(attn, "k_proj", f"{prefix}.attn", kv0, kv1)
        column(attn, "v_proj", f"{prefix}.attn", kv0, kv1)
        row(attn, "o_proj", f"{prefix}.attn", q0, q1)
        attn.n_head, attn.n_kv_head = cfg.n_head // p, cfg.n_kv_head // p
        f0, f1 = split_bounds(cfg.d_ff, p, r)
        if mlp.activation == "swiglu":
            column(mlp, "gate_proj", f"{prefix}.mlp", f0, f1)
        column(mlp, "up_proj", f"{prefix}.mlp", f0, f1)
        row(mlp, "down_proj", f"{prefix}.mlp", f0, f1)
        for sub, out in ((attn, attn.o_proj), (mlp, mlp.down_proj)):
            _make_parallel(sub)
            sub.tp, sub.partitions, sub.token_mask, sub.profile = tp, max(1, tp.config.partitions), None, None
            # Plain references, not submodules: no second name for o_proj, no cycle through attn.
            sub.__dict__["row_parallel"], sub.__dict__["mask_source"] = out, attn
        attn.q_proj.keep_output = attn.k_proj.keep_output = tp.config.topk_keep_ratio < 1.0
    v0, v1 = split_bounds(cfg.vocab_size, p, r)
    model.embed.tokens = VocabParallelEmbedding(model.embed.tokens, v0, v1, tp)
    plan["embed.tokens.weight"] = (0, v0, v1)
    if cfg.num_labels == 0:  # an LM head: vocab-parallel; a score head stays whole
        head = ColumnParallelLinear(model.head, v0, v1)
        if cfg.tied_head:
            head.weight = model.embed.tokens.weight
        model.head = head
        plan["head.weight"] = (0, v0, v1)
        model.head.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0], tp), *args[1:]))
    model.vocab_start = v0
    return plan


# ---------------------------------------------------------------------------- the loss

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


# ---------------------------------------------------------------------------- the runtime

class TensorParallelRuntime(Runtime):
    """Tensor parallelism inside each group of `tensor_parallel.size` consecutive ranks, and a
    data-parallel runtime (DDP, ZeRO-3 / ZeRO++) across the groups (each DP group holds the same
    slice). The trainer drives it like any runtime; the loss must come from `lm_loss`, which
    takes the vocabulary-sliced logits the model now returns."""

    def __init__(self, model: Transformer, zero: ZeroConfig, tp_config: TensorParallelConfig, device: torch.device):
        from zeropp.ddp import DDPRuntime
        from zeropp.engine import Zero3Engine
        mesh = mesh_from_config(zero, tp_config.size)
        self.tp = TPComm(mesh, tp_config)
        self.plan = parallelize(model, self.tp)
        self.vocab_start = model.vocab_start
        self.inner = Zero3Engine(model, zero, mesh=mesh, device=device) if zero.stage == 3 else \
            DDPRuntime(model, zero, device, mesh=mesh)
        self.module, self.mesh = model, mesh
        self.ledger = self.tp.comm.ledger = self.inner.ledger
        self.timings = self.inner.timings
        self.checkpoint_format = f"{self.inner.checkpoint_format}+tp"  # loads any TP size (see load)
        self.partition_plan: list[int] | None = None  # tensor_parallel.partitions 0: planned on the first batch
        self._notes: list[str] = []

    def __call__(self, *args, **kwargs):
        if self.tp.config.partitions == 0 and self.partition_plan is None:
            self._plan_partitions(*args, **kwargs)
        return self.inner(*args, **kwargs)

    def _plan_partitions(self, *args, **kwargs) -> None:
        """AccTFM's partition plan (paper Algorithm 1), from the first batch: each sublayer's compute
        per partition profiled at K = 1, 2, 4 (no-grad forwards; the backward taken as twice the
        forward), the link's alpha and beta measured on the group, the all-reduce times predicted
        from them. The dynamic program runs on the forward and on the reversed backward; one K
        per sublayer serves both (autograd replays the forward's partitions), so the plan with
        the smaller predicted forward + backward time is kept. Every rank plans from the group's
        slowest times, so all ranks choose alike."""
        subs = [m for m in self.module.modules() if isinstance(m, TensorParallelSublayer)]
        cfg = self.tp.config
        op = "all_gather" if cfg.quantize_bits else "all_reduce"
        alpha, beta = acctfm.measure_alpha_beta(self.tp.comm, "tp", op=op, tag="tp plan")
        sizes = acctfm.PARTITION_SIZES
        compute = torch.zeros(len(subs), len(sizes), dtype=torch.float64)
        rows, row_bytes = [0] * len(subs), [0] * len(subs)
        with torch.no_grad():
            for i, k in enumerate((1, *sizes)):  # K = 1 twice: the first forward warms up
                for sub in subs:
                    sub.partitions, sub.profile = k, []
                self.inner(*args, **kwargs)
                for j, sub in enumerate(subs):
                    if i > 0:
                        compute[j, i - 1] = sum(t for t, _, _ in sub.profile) / len(sub.profile)
                    rows[j] = sum(r for _, r, _ in sub.profile)
                    row_bytes[j] = sub.profile[0][2]
        self.tp.comm.all_reduce(compute, "tp", "tp plan", op=dist.ReduceOp.MAX)
        sparse = {"forward": cfg.topk_passes != "backward", "backward": cfg.topk_passes != "forward"}

        def comm(j, k, direction):  # one partition's all-reduce, predicted from the measured link
            keep = cfg.topk_keep_ratio if sparse[direction] else 1.0
            n = max(1, round(rows[j] * keep / k))
            cols = row_bytes[j] // 4
            nbytes = acctfm.wire_bytes((n, cols), self.tp.size, cfg.quantize_bits) if cfg.quantize_bits \
                else n * row_bytes[j]
            if keep < 1.0 and cfg.topk_pruned == "reduce":  # the pruned rows, in the same message
                nbytes += acctfm.wire_bytes((max(0, round(rows[j] / k) - n), cols), self.tp.size, cfg.topk_pruned_bits)
            return acctfm.comm_time(nbytes, alpha, beta)
        t_cm = [[comm(j, k, "forward") for k in sizes] for j in range(len(subs))]
        t_cm_bw = [[comm(j, k, "backward") for k in sizes] for j in reversed(range(len(subs)))]
        t_fw = compute.tolist()
        t_bw = [[2 * t for t in row] for row in reversed(t_fw)]
        forward = acctfm.plan_partitions(t_fw, t_cm)
        backward = acctfm.plan_partitions(t_bw, t_cm_bw)

        def total(plan):
            return acctfm.simulate(plan, t_fw, t_cm) + acctfm.simulate(plan[::-1], t_bw, t_cm_bw)
        chosen = min((forward.partitions, backward.partitions[::-1]), key=total)
        for sub, k in zip(subs, chosen):
            sub.partitions, sub.profile = k, None
        synchronous = [1] * len(subs)
        self.partition_plan = chosen
        self._notes.append(
            f"AccTFM partition plan (K per sublayer, attention/MLP alternating): {chosen}; link alpha "
            f"{alpha * 1e6:.0f} us, {8e-6 / beta if beta > 0 else float('inf'):.0f} Mbit/s; predicted forward + "
            f"backward {total(chosen) * 1e3:.1f} ms (all K = 1: {total(synchronous) * 1e3:.1f} ms)")

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.tp)

    def no_sync(self):
        return self.inner.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)
        self.timings["waiting for tp all-reduces"] += self.tp.seconds_waiting
        self.tp.seconds_waiting = 0.0

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.inner.set_gradient_divide_factor(factor)

    def attach_optimizer(self, optimizer):
        return self.inner.attach_optimizer(optimizer)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm over the whole model: sliced parameters summed over the tensor-parallel group,
        replicated ones counted once (tp rank 0's), and over the DP shards under ZeRO."""
        device = next(self.module.parameters()).device
        sliced = [p.grad for name, p in self.module.named_parameters() if p.grad is not None and name in self.plan]
        replicated = [p.grad for name, p in self.module.named_parameters()
                      if p.grad is not None and name not in self.plan]
        parts = torch.stack([squared_norm(sliced, device), squared_norm(replicated, device) * (self.tp.rank == 0)])
        # DDP holds the same full gradient on every DP rank; ZeRO-3 holds shards of it.
        self.tp.comm.all_reduce(parts, "tp" if self.inner.checkpoint_format == FULL else "world", "grad norm")
        return clip_by_norm_(sliced + replicated, parts.sum(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unsliced model (the group's slices concatenated), on every rank."""
        return {name: _gather_slices(t, self.plan[name][0], self.tp) if name in self.plan else t
                for name, t in self.inner.full_state_dict().items()}

    def _subdir(self, directory) -> Path:
        path = Path(directory) / f"tp{self.tp.rank:02d}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def save(self, directory, optimizer) -> None:
        self.inner.save(self._subdir(directory), optimizer)
        if dist.get_rank() == 0:  # how to put the slices back together, for consolidation
            dims = {name: dim for name, (dim, _, _) in self.plan.items()}
            (Path(directory) / PLAN_FILE).write_text(json.dumps({"size": self.tp.size, "dims": dims}, indent=1))

    def load(self, directory, optimizer) -> None:
        """Restore a checkpoint of any tensor-parallel size (a plain one is size 1): the same size
        loads each slice as saved (the DP runtime reshards a different DP size); another size is
        consolidated in memory and re-sliced for this rank, weights and optimizer states alike."""
        directory = Path(directory)
        plan_path = directory / PLAN_FILE
        saved_size = json.loads(plan_path.read_text())["size"] if plan_path.is_file() else 1
        if saved_size == self.tp.size:
            self.inner.load(directory / f"tp{self.tp.rank:02d}", optimizer)
            return
        read = unsharded_tensors if self.inner.checkpoint_format == SHARDED else _full_tensors
        full = consolidated_tensors(directory, read) if saved_size > 1 else read(directory)
        mine = {}
        for key, tensor in full.items():
            base = key if key in self.plan else key.rsplit(".", 1)[0]  # "<param>.<optimizer state>"
            if base in self.plan and tensor.dim() > 0:
                dim, start, end = self.plan[base]
                tensor = tensor.narrow(dim, start, end - start).clone()
            mine[key] = tensor
        self.inner.load_unsharded(mine, optimizer)

    @contextmanager
    def inference_weights(self, max_bytes=None):
        raise NotImplementedError("generation under tensor parallelism is not supported (the logits are "
                                  "vocabulary slices); run it with tensor_parallel.size 1")
        yield

    def describe(self) -> str:
        return f"{self.tp.config.describe()} x {self.inner.describe()}"

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        return self.inner.zero3_cross_node_bytes(micro_batches)

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        return self.inner.predicted_step_bytes(micro_batches)  # the DP dimension's (TP's all-reduces: not yet)

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        return self.inner.model_state_bytes(optimizer)

    def buffer_bytes(self) -> int:
        return self.inner.buffer_bytes()

    def close(self) -> None:
        self.inner.close()


def consolidated_tensors(directory: str | Path, read_slice) -> dict[str, torch.Tensor]:
    """The unsliced tensors of a tensor-parallel checkpoint: `read_slice(subdirectory)` reads one
    slice's tensors (whatever the data-parallel format), and sliced ones are concatenated along
    the dims the run recorded; needs no process group."""
    directory = Path(directory)
    plan_path = directory / PLAN_FILE
    if not plan_path.is_file():
        raise FileNotFoundError(f"{directory}: no {PLAN_FILE}; not a tensor-parallel checkpoint")
    meta = json.loads(plan_path.read_text())
    slices = [read_slice(directory / f"tp{t:02d}") for t in range(meta["size"])]
    out = {}
    for name, tensor in slices[0].items():
        dim = meta["dims"].get(name, meta["dims"].get(name.rsplit(".", 1)[0]))  # optimizer states too
        out[name] = torch.cat([s[name] for s in slices], dim=dim) if dim is not None and tensor.dim() else tensor
    return out


def _full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The full (DDP) format's weights and "<param>.<state>" optimizer states."""
    return {**read_safetensors(directory / "model.safetensors"), **read_safetensors(directory / "optimizer.safetensors")}


def _gather_slices(tensor: torch.Tensor, dim: int, tp: TPComm) -> torch.Tensor:
    """Concatenate every rank's slice along `dim` (slices may differ by one unit in length)."""
    size = torch.tensor([tensor.shape[dim]], dtype=torch.int64)
    sizes = torch.empty(tp.size, dtype=torch.int64)
    tp.comm.all_gather(sizes, size, "tp", tag="consolidate")
    longest = int(sizes.max())
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, longest - tensor.shape[dim]]
    padded = F.pad(tensor.float(), pad).contiguous()
    pieces = torch.empty(tp.size * padded.numel(), dtype=padded.dtype)
    tp.comm.all_gather(pieces, padded.view(-1), "tp", tag="consolidate")
    return torch.cat([piece.narrow(dim, 0, int(s)) for piece, s in zip(pieces.view(tp.size, *padded.shape), sizes)],
                     dim=dim)
