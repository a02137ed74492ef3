"""A rank's peak memory: predicted before the first step, measured at the end of the run.

predicted peak = the process' baseline (`baseline_bytes`: what it holds running at ~0
parameters: torch and its kernels' code, the data, the process group) + model states (the runtime's `model_state_bytes`, with AdamW's two
fp32 moments per trainable element this rank steps) + the runtime's preallocated buffers +
activations. Activations are counted, not guessed: one block's forward (and the final norm,
head and loss) runs on the meta device (attention as the fused kernels keep it, bf16 autocast
emulated) at the run's micro-batch and sequence length under autograd's saved-tensor hooks,
which see every tensor the backward will need. A checkpointed
block keeps only its input until its backward recomputes it (then one block's activations
live again). Measured: VmHWM of the process on CPU, `torch.cuda.max_memory_allocated` on CUDA
(where the baseline is 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from models.config import ModelConfig
from models.transformer import Block, Transformer, lm_loss, make_norm, rope_cos_sin
from trainer.precision import autocast_for


def _status_kib(key: str) -> int:
    found = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(found.group(1)) if found else 0


def resident_bytes() -> int:
    """This process' resident memory now (VmRSS; 0 where /proc is missing)."""
    return _status_kib("VmRSS") * 1024


def peak_bytes(device: torch.device) -> int:
    """The peak so far: VmHWM on CPU, the allocator's peak on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def baseline_bytes(config: ModelConfig, precision: str, device: torch.device) -> int:
    """What the process holds at ~0 parameters: resident memory after one training step of a
    one-block model of `config`'s family at width 16 (which pages in the kernels' code and warms
    the allocator, as the real first step would). 0 on CUDA, where the peak counts allocations."""
    if device.type == "cuda":
        return 0
    tiny = dataclasses.replace(config, n_layer=1, vocab_size=16, d_model=16, d_ff=16, n_head=2,
                               n_kv_head=2 if config.n_kv_head == config.n_head else 1, explicit_head_dim=None,
                               word_embed_proj_dim=8 if config.word_embed_proj_dim else None, num_labels=0,
                               sliding_window_layers=None, layers_without_rope=None)  # per-layer lists name layers > 0
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        model = Transformer(tiny)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.zeros(1, 9, dtype=torch.long)
        with autocast_for(precision, device):
            logits = model(tokens[:, :-1])
        lm_loss(logits, tokens[:, 1:]).backward()
        optimizer.step()
    return resident_bytes()


def _saved_bytes(module: nn.Module, fn) -> int:
    """Bytes of the tensors autograd saves while `fn()` runs (on the meta device), parameters not counted."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


class _FusedAttention(torch.autograd.Function):
    """What the fused attention kernels keep for the backward (flash / memory-efficient: torch's choice
    on CUDA and on CPU): q, k, v, the output and an fp32 log-sum-exp per query and head, not the T x T
    probabilities that SDPA's math path, the meta device's, keeps. Their output is laid out (batch,
    position, head, dim), so the o_proj input that the model reshapes it into is the same memory."""

    @staticmethod
    def forward(ctx, q, k, v, masked: bool):
        b, h, t, _ = q.shape
        out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        kept = [q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32)]
        if masked:  # a boolean mask becomes an additive one in q's dtype, kept by every block
            kept.append(q.new_empty(b, 1, t, t))
        ctx.save_for_backward(*kept)
        return out


_MATRIX_PRODUCTS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm,
                    torch.addmm, torch.baddbmm}


class _MetaAutocast(TorchFunctionMode):
    """bf16 autocast where there is none (the meta device): fp32 inputs of matrix products are cast
    as autocast casts them, so the casts the backward keeps (the weights' too) are counted. Our models'
    other ops get the inputs autocast would give them (norms and losses compute in fp32 explicitly)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATRIX_PRODUCTS:
            args, kwargs = _fp32_to_bf16((args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _fp32_to_bf16(tree):
    return tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                    else t, tree)


@contextlib.contextmanager
def _counting(autocast: bool):
    """SDPA as the fused kernels keep it (after autocast's cast of q, k, v), and autocast emulated."""
    sdpa = F.scaled_dot_product_attention
    cast = _fp32_to_bf16 if autocast else (lambda t: t)
    F.scaled_dot_product_attention = lambda q, k, v, attn_mask=None, **_: _FusedAttention.apply(
        cast(q), cast(k), cast(v), attn_mask is not None)
    try:
        with _MetaAutocast() if autocast else contextlib.nullcontext():
            yield
    finally:
        F.scaled_dot_product_attention = sdpa


_counted: dict[tuple, dict[str, int]] = {}  # activation_bytes by its arguments: plan.auto asks once per candidate


def activation_bytes(config: ModelConfig, micro_batch: int, seq_len: int, dtype: torch.dtype = torch.float32,
                     checkpointed: set[int] | frozenset = frozenset(),
                     param_dtype: torch.dtype = torch.float32, masked: bool = False) -> dict[str, int]:
    """Activation memory of one micro-batch's forward, kept for its backward: {"blocks", "head and
    loss", "recompute"} bytes (the head's with the backward's fp32 gradients of the logits), counted
    on the meta device from one block and the model's tail built from `config` with weights in
    `param_dtype`, computing in `dtype` (bf16 over fp32 weights: autocast, emulated, whose weight
    casts are kept too); attention as the fused kernels keep it, `masked` with an explicit mask
    (packed sequences). LoRA's small extra activations are not counted. Counted once per distinct
    arguments (a pure function of them; each count traces a block on the meta device)."""
    key = (repr(config), micro_batch, seq_len, dtype, frozenset(checkpointed), param_dtype, masked)
    if key not in _counted:
        _counted[key] = _count_activations(config, micro_batch, seq_len, dtype, checkpointed, param_dtype, masked)
    return dict(_counted[key])


def _count_activations(config: ModelConfig, micro_batch: int, seq_len: int, dtype: torch.dtype,
                       checkpointed: set[int] | frozenset, param_dtype: torch.dtype, masked: bool) -> dict[str, int]:
    autocast = dtype == torch.bfloat16 and param_dtype != dtype
    with torch.device("meta"):
        block = Block(config, 0).to(param_dtype)
        tail = nn.ModuleDict({"norm": make_norm(config),
                              "head": nn.Linear(config.embed_dim, config.head_outputs, bias=False)}).to(param_dtype)
        if config.word_embed_proj_dim:
            tail["project_out"] = nn.Linear(config.d_model, config.embed_dim, bias=False).to(param_dtype)
        x = torch.empty(micro_batch, seq_len, config.d_model, dtype=param_dtype, requires_grad=True)
        rope = None
        if config.positions == "rope":
            positions = torch.arange(seq_len).expand(micro_batch, seq_len)
            rope = rope_cos_sin(positions, config.head_dim, config.rope_theta, config.rope_scaling, config.max_seq_len)
        labels = torch.zeros(micro_batch, seq_len, dtype=torch.long)

        def run_tail():
            h = tail["norm"](x)
            if "project_out" in tail:
                h = tail["project_out"](h)
            lm_loss(tail["head"](h).float(), labels)

        with _counting(autocast):
            mask = torch.empty(micro_batch, 1, seq_len, seq_len, dtype=torch.bool) if masked else None
            per_block = _saved_bytes(block, lambda: block(x, rope, mask))
            head = _saved_bytes(tail, run_tail)
    block_input = x.numel() * x.element_size()
    kept = sum(block_input if i in checkpointed else per_block for i in range(config.n_layer))
    logits_grad = 2 * micro_batch * seq_len * config.head_outputs * 4  # fp32: d(logits) and d(log-softmax)
    return {"blocks": kept, "head and loss": head + logits_grad, "recompute": per_block if checkpointed else 0}


def predicted_peak(states: dict[str, int], buffers: int, optimizer, config: ModelConfig, micro_batch: int,
                   seq_len: int, dtype: torch.dtype, checkpointed: set[int] | frozenset, baseline: int,
                   device: torch.device, param_dtype: torch.dtype = torch.float32,
                   masked: bool = False) -> dict[str, int]:
    """Each part of the predicted peak of this rank, in bytes (see the module docstring), from its model
    states by kind and its preallocated buffers. On CUDA the states an optimizer offload keeps in host
    memory ("(host)") are not part of the device's peak."""
    states = dict(states)
    key = next((k for k in states if k.startswith("optimizer states")), "optimizer states")
    if not states.get(key):  # AdamW's moments come at the first step
        states[key] = 8 * sum(p.numel() for group in optimizer.param_groups for p in group["params"]
                                             if p.requires_grad)
    if device.type == "cuda":
        states = {k: v for k, v in states.items() if not k.endswith("(host)")}
    return {"baseline": baseline, "model states": sum(states.values()), "buffers": buffers,
            **{f"activations ({k})": v for k, v in activation_bytes(config, micro_batch, seq_len, dtype,
                                                                    checkpointed, param_dtype, masked).items() if v}}
