"""Gradient reducers: how a unit's flat local gradient becomes this rank's reduced shard.

The engine hands every reducer the same thing (the unit's gradient, already divided by the
gradient divide factor, in the compute dtype) and the fp32 shard to add the sum into; the
reducer owns the wire format, the collectives, and any state it keeps between steps
(`state_dict`, saved per rank in `reducer_rankNNNNN.safetensors` and restored exactly on
resume, zeropp.checkpoint).

  ExactReduceScatter   the gradient in the communication dtype, reduce-scattered (ZeRO-3)
  QuantizedReduce      qgZ (zeropp.qgz): block-quantized all-to-all, 1 hop or 2 (inside the
                       node, then across), optionally pipelined; with error feedback
  ProjectedReduce      SEPARATE (zeropp.separate): a reduce-scatter of random projections,
                       1/CR of the gradient; each rank reconstructs its own shard (and DDP's
                       comm hook, which all-reduces a bucket's projections)

The lossy ones share `ErrorFeedback`: what a compressor lost this round goes into its next input.
"""

from __future__ import annotations

import torch

from zeropp.comm import Comm

TAG = "gradient reduce"


class GradientReducer:
    """The reduce seam; subclasses implement reduce(), and state_dict/load_state_dict when stateful."""

    stateful = False  # whether a resumed run needs this rank's saved state to repeat the original

    def reduce(self, unit: str, shard: torch.Tensor, grad: torch.Tensor, async_op: bool):
        """Add the sum over DP ranks of chunk `rank` of `grad` (1-D, padded_numel) to `shard` (fp32);
        returns a handle with wait(). `grad` is the engine's buffer: its contents may be overwritten."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state, by "<unit>.<key>"."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint has {sorted(state)[:4]}")

    def describe(self) -> str:
        raise NotImplementedError

    def take_notes(self) -> list[str]:
        """What the reducer decided since the last call that belongs in the log (G-SEPARATE's adaptations)."""
        return []

    def volume(self, numel: int) -> tuple[int, int] | None:
        """(bytes sent, of which cross-node) reducing a gradient of `numel` elements; None where it
        depends on the values or the round (SEPARATE)."""
        return None


class ExactReduceScatter(GradientReducer):
    def __init__(self, comm: Comm, wire_dtype: torch.dtype):
        self.comm, self.wire_dtype = comm, wire_dtype

    def reduce(self, unit, shard, grad, async_op):
        wire = grad if grad.dtype == self.wire_dtype else grad.to(self.wire_dtype)
        return self.comm.reduce_scatter(shard, wire, tag=TAG, async_op=async_op, accumulate=True, scratch_input=True)

    def describe(self) -> str:
        return f"reduce-scatter ({str(self.wire_dtype).replace('torch.', '')})"

    def volume(self, numel: int) -> tuple[int, int]:
        chunk = numel // self.comm.mesh.world_size * self.wire_dtype.itemsize
        return self.comm.volume(chunk, "dp", node_aware=True)


class ErrorFeedback:
    """Error feedback for a lossy compressor C, per key (a unit, a DDP bucket, a hop of one):

        h = g + e                                    what C compresses (the compensated input)
        e <- memory e + (1 - memory) (h - C(h))      after the round; e <- 0 after a reset round

    memory 0 is classic error feedback (every round's whole loss is sent next round); LoCo
    (DeepSpeed's err_beta: 0.8, reset every 1024 rounds) and SEPARATE (memory = 1 - its beta)
    keep a moving average; memory 1 keeps nothing (an error left from before is sent once, then
    dropped, as on a reset round). Round k of a key is a reset round when
    `reset_interval` divides k (0: never): its input still carries the old error, which is then
    dropped, so a stale residual cannot build up. The errors (in `dtype`, fp32 arithmetic) and
    the round counters are the state a resumed run needs to repeat the original bit for bit."""

    def __init__(self, memory: float = 0.0, reset_interval: int = 0, dtype: torch.dtype = torch.float32):
        self.memory, self.reset_interval, self.dtype = memory, reset_interval, dtype
        self.errors: dict[str, torch.Tensor] = {}
        self.rounds: dict[str, int] = {}
        self._open: dict[str, float] = {}  # key -> memory of the round under way, where it feeds its loss back

    def round(self, key: str) -> int:
        """The rounds of `key` begun so far."""
        return self.rounds.get(key, 0)

    def begin(self, key: str, h: torch.Tensor, memory: float | None = None) -> bool:
        """Begin the key's next round: h += e in place (`h` holds g); returns whether this round's loss
        is to be fed back (end() then takes it), False on a reset round or with memory 1. `memory`:
        this round's, where it is not the default (G-SEPARATE adapts it per key)."""
        k = self.rounds[key] = self.round(key) + 1
        error = self.errors.get(key)
        if error is not None:
            # A step skipped for non-finite gradients left non-finite residuals: drop those (no sync).
            torch.nan_to_num_(error, nan=0.0, posinf=0.0, neginf=0.0)
            h.add_(error.view_as(h))
        memory = self.memory if memory is None else memory
        if bool(self.reset_interval) and (k - 1) % self.reset_interval == 0 or memory >= 1:
            if error is not None:  # sent once more, then dropped
                error.zero_()
            return False
        self._open[key] = memory
        return True

    def count_exact(self, key: str) -> None:
        """A round of `key` that sent its gradient exactly (a compressor's warm-up): counted, nothing lost."""
        self.rounds[key] = self.round(key) + 1

    def loss_buffer(self, key: str, numel: int, device: torch.device) -> torch.Tensor:
        """Where the round under way may write h - C(h) (fp32, flat) for end(): with memory 0 (and fp32
        errors) the error buffer itself, which the loss simply replaces; otherwise new scratch."""
        if self._open[key] == 0 and self.dtype == torch.float32:
            if key not in self.errors:
                self.errors[key] = torch.zeros(numel, device=device)
            return self.errors[key]
        return torch.empty(numel, dtype=torch.float32, device=device)

    def end(self, key: str, lost: torch.Tensor) -> None:
        """lost = h - C(h) of the round begun last (h's shape; fp32): e <- memory e + (1 - memory) lost."""
        memory = self._open.pop(key)
        error = self.errors.get(key)
        if error is lost:  # written in place (loss_buffer, memory 0)
            return
        if error is None:
            error = self.errors[key] = torch.zeros(lost.numel(), dtype=self.dtype, device=lost.device)
        lost = lost.reshape(-1)
        if memory == 0:
            error.copy_(lost)
        elif error.dtype == torch.float32:
            error.mul_(memory).add_(lost, alpha=1 - memory)
        else:
            error.copy_(error.float().mul_(memory).add_(lost, alpha=1 - memory))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """By "<key>.error" and "<key>.round"."""
        out = {f"{key}.round": torch.tensor(k, dtype=torch.int64) for key, k in self.rounds.items()}
        out.update({f"{key}.error": e for key, e in self.errors.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Replaces the state with "<key>.error" / "<key>.round" entries (others are the caller's)."""
        self.errors, self.rounds, self._open = {}, {}, {}
        for name, value in state.items():
            key, _, what = name.rpartition(".")
            if what == "round":
                self.rounds[key] = int(value)
            elif what == "error":
                self.errors[key] = value.to(device or value.device, self.dtype).reshape(-1).clone()

    def error_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.errors.values())
