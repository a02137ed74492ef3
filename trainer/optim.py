"""AdamW with the usual decay/no-decay split, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch

from trainer.config import OptimSection
from zeropp.flat import is_decayed


def build_optimizer(model: torch.nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    # Parameters shared by two modules (tied embeddings) appear once in parameters().
    return build_shard_optimizer([(p, is_decayed(p)) for p in model.parameters() if p.requires_grad], cfg)


def build_shard_optimizer(pieces: list[tuple[torch.Tensor, bool]], cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW over (tensor, decayed) pairs: whole parameters, or a sharded runtime's shard pieces."""
    return _adamw([{"params": [p for p, decay in pieces if decay], "weight_decay": cfg.weight_decay},
                   {"params": [p for p, decay in pieces if not decay], "weight_decay": 0.0}], cfg)


def _adamw(groups: list[dict], cfg: OptimSection) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,  # the same arithmetic on every backend keeps resumes bit-exact
    )


def lr_at(step: int, total_steps: int, cfg: OptimSection) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
