"""The buffers a ZeRO-3 engine preallocates once and reuses every step, and who holds each.

Rotating weight buffers: the blocks share `slots` of them (zeropp.plan.rotating_buffer_count),
each holding one block's units side by side: the gathered bytes, and the decoded weights when
those differ in dtype. Block p uses buffer p % slots. Taking a buffer makes its previous holder
let go of it, and is refused while that holder still needs it (a gather in flight into it, or
its block is being computed): a schedule bug surfaces as an error, not as wrong weights.

Gradient buffers: the blocks' flat gradients are written into one (two with overlap_comm: a
block's gradients are written while the one before is still being reduced from the other).
The embeddings and the norms ("resident" units: gathered once per step and kept) have buffers
of their own.
"""

from __future__ import annotations

import torch

from zeropp.unit import BufferInUseError, Unit, UnitState


def _aligned(nbytes: int) -> int:
    """Byte offsets inside the shared block buffers: 64-aligned, so any dtype can view them."""
    return -(-nbytes // 64) * 64


class BufferPool:
    def __init__(self, block_groups: list[list[Unit]], resident: list[Unit], slots: int, grad_buffers: int,
                 compute_dtype: torch.dtype, device: torch.device, comm):
        """comm: the gathers' (whether a unit decodes in place, Unit.decodes_in_place, depends on its order)."""
        self.slots, self.compute_dtype, self.device = slots, compute_dtype, device
        blocks = [u for group in block_groups for u in group]
        shared_compute = all(u.decodes_in_place(comm, compute_dtype) for u in blocks)
        gather_bytes = compute_numel = grad_numel = 0
        offsets = {}  # unit -> (byte offset in a gather buffer, element offset in a compute buffer)
        for group in block_groups:
            gather_at = compute_at = 0
            for u in group:
                offsets[u] = gather_at, compute_at
                gather_at += _aligned(u.gathered_numel * u.codec.dtype.itemsize)
                compute_at += u.padded_numel
                if u.trainable:
                    grad_numel = max(grad_numel, u.padded_numel)
            gather_bytes, compute_numel = max(gather_bytes, gather_at), max(compute_numel, compute_at)
        gather_bufs = [self.new(gather_bytes, torch.uint8) for _ in range(slots)]
        compute_bufs = [] if shared_compute else [self.new(compute_numel, compute_dtype) for _ in range(slots)]
        self.block_buffers = gather_bufs + compute_bufs
        self.grad_buffers = [self.new(grad_numel, compute_dtype) for _ in range(grad_buffers)]
        self._holder: list[list[Unit] | None] = [None] * slots  # the block group each weight buffer holds
        self._grad_holder: list[Unit | None] = [None] * grad_buffers
        for u, (gather_at, compute_at) in offsets.items():
            for s in range(slots):
                gather = gather_bufs[s][gather_at:gather_at + u.gathered_numel * u.codec.dtype.itemsize] \
                    .view(u.codec.dtype)
                compute = gather if shared_compute else compute_bufs[s][compute_at:compute_at + u.padded_numel]
                u.buffers.append((gather, compute))
        for u in resident:
            gather = self.new(u.gathered_numel, u.codec.dtype)
            compute = gather if u.decodes_in_place(comm, compute_dtype) else self.new(u.padded_numel, compute_dtype)
            u.buffers = [(gather, compute)]
            u.grad_buffer = self.new(u.padded_numel, compute_dtype) if u.trainable else None
        self._resident, self._units = resident, blocks + resident

    def new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def assign(self, group: list[Unit], position: int) -> None:
        """The group is the `position`-th block of the recorded order: its buffers follow."""
        for unit in group:
            unit.slot = position % self.slots
            unit.grad_slot = position % len(self.grad_buffers)

    def take(self, group: list[Unit]) -> None:
        """The block group is about to be gathered into its weight buffer: the previous holder lets
        go (BufferInUseError while it still needs it)."""
        s = group[0].slot
        previous = self._holder[s]
        if previous is group:
            return
        for unit in previous or ():
            if unit.state in (UnitState.GATHERING, UnitState.COMPUTING):
                raise BufferInUseError(
                    f"{', '.join(u.name for u in group)} tried to take rotating weight buffer {s}, but it is in use "
                    f"by {unit.name} ({unit.state.value})")
        for unit in previous or ():
            unit.release()
        self._holder[s] = group

    def release_all(self) -> None:
        """Every holder lets go of its weight buffer (a rollout gathers into copies of its own)."""
        for s, group in enumerate(self._holder):
            for unit in group or ():
                unit.release()
            self._holder[s] = None

    def grad_target(self, unit: Unit, timings) -> torch.Tensor:
        """The zeroed flat buffer the unit's gradients are written into in this backward. The
        buffer's previous writer must have been reduced out of it (a reduce in flight is waited
        for, timed in `timings`); one whose gate has not fired yet (autograd ran the unit below
        first) keeps its buffer, and this unit writes into a temporary one."""
        if unit in self._resident:
            buf, previous = unit.grad_buffer, unit
        else:
            s = unit.grad_slot
            previous = self._grad_holder[s]
            if previous is not None and previous is not unit and previous.writing_grads:
                buf, previous = None, None
            else:
                self._grad_holder[s] = unit
                buf = self.grad_buffers[s][:unit.padded_numel]
        if previous is not None:
            previous.wait_reduce(timings)
        if buf is None:
            return self.new(unit.padded_numel, self.compute_dtype)
        return buf.zero_()

    def preallocated(self) -> list[torch.Tensor]:
        """Every buffer made once and reused: the units' gather and compute views, the resident
        units' gradient buffers and the blocks' alternating ones."""
        views = [t for u in self._units for pair in u.buffers for t in pair]
        return views + [u.grad_buffer for u in self._resident if u.grad_buffer is not None] + self.grad_buffers

    def block_bytes(self) -> int:
        """Bytes of the rotating weight buffers (what describe() reports)."""
        return sum(b.numel() * b.element_size() for b in self.block_buffers)

    def nbytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.preallocated()}
        return sum(storages.values())
