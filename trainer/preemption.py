"""The scheduler's warning before a time limit or preemption (Slurm's --signal), caught so
the run can checkpoint and exit cleanly instead of being killed mid-step."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionSignal:
    """Sets a flag when `signal_name` arrives; ranks agree on it at step boundaries."""

    def __init__(self, signal_name: str):
        self.received = False
        self._signum = None
        self._previous = None
        if signal_name:
            self._signum = signal_number(signal_name)
            self._previous = signal.signal(self._signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def requested(self, device: torch.device) -> bool:
        """True on every rank once any rank has received the signal (a collective call)."""
        flag = torch.tensor(int(self.received), device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None


def signal_number(name: str) -> int:
    """"SIGUSR1" / "USR1" -> its number; a clear error for anything else."""
    full = name if name.startswith("SIG") else f"SIG{name}"
    value = getattr(signal.Signals, full, None)
    if value is None or value in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"train.preempt_signal: {name!r} is not a signal that can be caught (e.g. SIGUSR1, SIGTERM)")
    return int(value)
