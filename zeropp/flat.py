"""FlatUnit: one unit's parameters as one flat buffer, padded so every rank holds an equal shard.

A unit is either all trainable or all frozen (the engine puts frozen parameters in units of
their own). Inside the flat buffer the parameters are laid out with weight decay first, then
without (biases, norm gains), then padding. A rank's shard therefore splits into at most two
contiguous pieces, and the optimizer works on each piece as an ordinary tensor with the
right weight decay: the update is elementwise, so it is exactly what AdamW does to the
unsharded parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


def is_decayed(p: torch.Tensor) -> bool:
    """Matrices (embeddings, linear weights) get weight decay; biases and norm gains do not."""
    return p.requires_grad and p.dim() >= 2


@dataclass
class ParamSlot:
    name: str  # qualified name in the model (the first one, for a shared parameter)
    shape: torch.Size
    offset: int  # into the unit's flat buffer
    trainable: bool
    decay: bool
    aliases: list[tuple[nn.Module, str]] = field(default_factory=list)  # every (module, attribute) holding it
    alias_names: list[str] = field(default_factory=list)  # their qualified names

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatUnit:
    """The parameters of one unit (a transformer block, the embeddings, the norms).

    Per rank it owns: `master` (fp32 shard; None once the engine stores a frozen unit as qwZ
    codes), `grad_shard` (fp32, reduce-scattered gradients summed over micro-batches) and
    `optim_params`, the pieces of `master` the optimizer updates. What the all-gather sends
    is the engine's business (zeropp.quantized).
    """

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
                 world_size: int, rank: int, device: torch.device,
                 param_align: int = 1, shard_align: int = 1):
        """param_align: every parameter starts at a multiple of it (quantization blocks then
        never straddle two parameters); shard_align: the shard length is a multiple of it."""
        self.name = name
        self.world_size, self.rank = world_size, rank

        if len({p.requires_grad for _, p, _, _ in params}) > 1:
            raise ValueError(f"unit {name} mixes trainable and frozen parameters; split them into two units")
        ordered = sorted(params, key=lambda entry: not is_decayed(entry[1]))  # stable: model order within each
        self.slots: list[ParamSlot] = []
        offset = 0
        for qualname, p, aliases, alias_names in ordered:
            offset = -(-offset // param_align) * param_align
            self.slots.append(ParamSlot(qualname, p.shape, offset, p.requires_grad, is_decayed(p),
                                        aliases, alias_names))
            offset += p.numel()
        self.numel = offset
        # Pad to a multiple of the world size (and at least one element per rank).
        self.shard_numel = -(-max(1, -(-self.numel // world_size)) // shard_align) * shard_align
        self.padded_numel = self.shard_numel * world_size
        self.decay_end = max((s.offset + s.numel for s in self.slots if s.decay), default=0)
        self.trainable_end = max((s.offset + s.numel for s in self.slots if s.trainable), default=0)

        full = torch.zeros(self.padded_numel, dtype=torch.float32)
        for slot, (_, p, _, _) in zip(self.slots, ordered):
            full[slot.offset:slot.offset + slot.numel] = p.detach().reshape(-1).float().cpu()
        start = rank * self.shard_numel
        self.shard_start = start
        self.master = full[start:start + self.shard_numel].clone().to(device)
        self.grad_shard = torch.zeros_like(self.master) if self.trainable_end else None

        # The optimizer's view of this shard: the decayed and the undecayed trainable pieces.
        self.optim_params: list[tuple[nn.Parameter, bool]] = []
        for lo, hi, decay in ((0, self.decay_end, True), (self.decay_end, self.trainable_end, False)):
            a, b = max(lo, start) - start, min(hi, start + self.shard_numel) - start
            if b > a:
                piece = nn.Parameter(self.master[a:b])  # shares storage with master
                piece.grad = self.grad_shard[a:b]
                self.optim_params.append((piece, decay))

    @property
    def trainable(self) -> bool:
        return self.trainable_end > 0

    def trainable_grad(self) -> torch.Tensor:
        """This rank's gradient elements that belong to trainable parameters (no padding)."""
        return self.grad_shard[:max(0, min(self.shard_numel, self.trainable_end - self.shard_start))]

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds for the unit (optimizer states are counted by the engine)."""
        out = {} if self.master is None else {"master": self.master.numel() * self.master.element_size()}
        if self.grad_shard is not None:
            out["gradient shard"] = self.grad_shard.numel() * self.grad_shard.element_size()
        return out
