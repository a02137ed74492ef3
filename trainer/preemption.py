"""The scheduler's warning before a time limit or preemption (Slurm's --signal), caught so
the run can checkpoint and exit cleanly instead of being killed mid-step."""

from __future__ import annotations

import signal


class PreemptionSignal:
    """Sets `received` when `signal_name` arrives; the trainer makes the ranks agree on it at the
    end of each step (on the loss's all-reduce)."""

    def __init__(self, signal_name: str):
        self.received = False
        self._signum = None
        self._previous = None
        if signal_name:
            self._signum = signal_number(signal_name)
            self._previous = signal.signal(self._signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def close(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None


def signal_number(name: str) -> int:
    """"SIGUSR1" / "USR1" -> its number; a clear error for anything else."""
    full = name if name.startswith("SIG") else f"SIG{name}"
    value = getattr(signal.Signals, full, None)
    if value is None or value in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{name!r} is not a signal that can be caught (e.g. SIGUSR1, SIGTERM)")
    return int(value)
