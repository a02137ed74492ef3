"""AdamW with the usual decay/no-decay split, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch

from trainer.config import OptimSection


def is_decayed(p: torch.Tensor) -> bool:
    """Matrices (embeddings, linear weights) get weight decay; biases and norm gains do not. A
    sharded runtime's parameter is a 1-D piece: its `unsharded_shape` says what it is a piece of."""
    return len(getattr(p, "unsharded_shape", p.shape)) >= 2


def build_optimizer(model: torch.nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (after wrapping: what this rank steps).
    Parameters shared by two modules (tied embeddings) appear once in parameters()."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if is_decayed(p)], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if not is_decayed(p)], "weight_decay": 0.0}]
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
