"""LoRA (Hu et al., 2021), applied to a model from outside: the model code stays plain.

`apply_lora` freezes every parameter and replaces chosen `nn.Linear` layers of the
transformer blocks by a `LoRALinear`, which holds the frozen layer as `base` and a trainable
rank-r update: y = base(x) + B A dropout(x) * alpha / r. B starts at zero, so the wrapped model
computes exactly what the base model did until the first optimizer step. `merge_lora` folds
the updates into the base weights and puts the plain `nn.Linear` layers back, so the result
is an ordinary model that saves as a normal Hugging Face checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` (`base`) plus a trainable low-rank update `lora_B @ lora_A`."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's init, as PEFT does
        self.enabled = True  # False: the base layer alone (adapters_disabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.base(x)
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update B @ A * alpha / r in fp32, shaped like the base weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def _matches(name: str, target: str) -> bool:
    """A target names a module by its full name or its last parts: "q_proj", "attn.q_proj", "blocks.0.attn.q_proj"."""
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, targets: Sequence[str] = DEFAULT_TARGETS, r: int = 8, alpha: float = 16.0,
               dropout: float = 0.0) -> list[str]:
    """Freeze all of `model` and wrap the block Linear layers matching `targets`; returns their names.

    Only layers inside `model.blocks` are wrapped: the embeddings and a (possibly tied) LM head
    stay frozen as they are. Every target must match at least one layer.
    """
    if r < 1:
        raise ValueError(f"LoRA rank r={r}; expected at least 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout={dropout}; expected 0 <= dropout < 1")
    if not targets:
        raise ValueError("no LoRA targets given; name the Linear layers to adapt, e.g. ['q_proj', 'v_proj']")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters; merge_lora it first")
    linears = [(f"blocks.{name}", m) for name, m in model.blocks.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in targets if not any(_matches(name, t) for name, _ in linears)]
    if unmatched:
        in_block = sorted({name.split(".", 2)[2] for name, _ in linears})
        raise ValueError(f"LoRA targets {unmatched} match no nn.Linear in the transformer blocks; the blocks' "
                         f"Linear layers are {in_block} (name a layer, e.g. 'q_proj', or a longer suffix of its "
                         f"full name, e.g. 'blocks.0.attn.q_proj')")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in linears:
        if any(_matches(name, t) for t in targets):
            parent, attr = name.rsplit(".", 1)
            lora = LoRALinear(module, r, alpha, dropout).train(module.training)  # the model's mode
            setattr(model.get_submodule(parent), attr, lora)
            wrapped.append(name)
    return wrapped


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model` computes as its base model: every adapter off (PEFT's
    disable_adapter). RLHF's reference of a LoRA policy is the policy itself this way, no copy."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + B @ A * alpha / r, computed in fp32) and
    put the base `nn.Linear` back in its place; returns `model`, now free of LoRA modules."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            weight = module.base.weight
            weight.copy_(weight.float() + module.delta_weight())
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, module.base)
    return model
