"""Activation checkpointing per transformer block, applied to a model from outside.

Memory: a training forward keeps every block's intermediate activations (attention scores'
inputs, the MLP's wide hidden layer, the norms' inputs...) until the backward uses them; at
long sequences and large micro-batches they outweigh the model. A checkpointed block keeps
only its input: its forward runs under `torch.utils.checkpoint` (non-reentrant), which drops
the tensors autograd would save and recomputes them, by running the block's forward again, when
the block's backward first needs one. Time: one more forward of the checkpointed blocks.

`apply_activation_checkpointing(model, mode, every)` replaces the chosen `model.blocks[i]`'s
`forward` by an instance attribute; `block.__call__` still runs the module hooks a runtime
registered (Zero3Engine's gather / bind before the block and `_PreBackward` after it), outside
the checkpointed region, so the recompute runs only the block's own forward: no hook, no gather
(docs/activation_checkpointing.md says why ZeRO-3 needs none). Parameter names and state-dict
keys do not change. Forwards without autograd (evaluation, generation, rollouts) and forwards
that extend a KV cache (the recompute would append to it twice) run the plain forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "every_k")


def checkpointed_blocks(n_blocks: int, mode: str, every: int = 2) -> list[int]:
    """Indices of the blocks `mode` checkpoints: none; full (every block); every_k (every k-th
    block, counted from 1 as torchtitan's `selective_ac_option: k` does: blocks k-1, 2k-1, ...)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; expected one of {list(MODES)}")
    if every < 1:
        raise ValueError(f"activation checkpointing every {every}; expected an integer >= 1")
    if mode == "none":
        return []
    if mode == "full":
        return list(range(n_blocks))
    return [i for i in range(n_blocks) if (i + 1) % every == 0]


def _extends_cache(args, kwargs) -> bool:
    """Whether the block is called with a KV cache (any argument that is not a tensor, a tuple of
    them or None, like models.transformer.KVCache)."""
    def plain(a):
        return a is None or isinstance(a, (torch.Tensor, bool, int, float)) or \
            (isinstance(a, tuple) and all(plain(x) for x in a))
    return not all(plain(a) for a in (*args, *kwargs.values()))


def _checkpointed_forward(module: nn.Module, *args, **kwargs):
    forward = type(module).forward.__get__(module)  # the class's forward: the recompute calls exactly this
    if not torch.is_grad_enabled() or _extends_cache(args, kwargs):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Make `module`'s forward run under non-reentrant activation checkpointing when autograd
    records it. Idempotent. The instance attribute is a partial of the module (not a closure over
    its bound method), so a deep copy of the model checkpoints its own blocks."""
    if getattr(module, "_activation_checkpointed", False):
        return
    module.forward = functools.partial(_checkpointed_forward, module)  # nn.Module.__call__ calls it, hooks around
    module._activation_checkpointed = True


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[int]:
    """Checkpoint the blocks of `model.blocks` that `mode` (train.activation_checkpointing) and
    `every` (train.activation_checkpointing_every, for every_k) choose; returns their indices."""
    blocks = getattr(model, "blocks", None)
    n = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
    chosen = checkpointed_blocks(n, mode, every)
    if mode != "none" and n == 0:
        raise ValueError(f"activation checkpointing works per transformer block: {type(model).__name__} has no "
                         f"`blocks` nn.ModuleList")
    for i in chosen:
        checkpoint_module(blocks[i])
    return chosen


def describe(mode: str, every: int, chosen: list[int], n_blocks: int) -> str:
    """One log line: which blocks recompute their activations in the backward."""
    if not chosen:
        return "activation checkpointing: none"
    what = "full" if mode == "full" else f"every_k (every {every})"
    return f"activation checkpointing: {what}, {len(chosen)} of {n_blocks} blocks {chosen}"
