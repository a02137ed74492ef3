"""The scheduler's warning before a time limit or preemption (Slurm's --signal), caught so
the run can checkpoint and exit cleanly instead of being killed mid-step.

Wherever the warning lands, every rank ends up stopping at the same step:
  - on a rank, during training: PreemptionSignal's handler; the ranks agree at the end of the
    step (on the loss's all-reduce), save one checkpoint and exit 0;
  - on a rank, before training: the entry points call catch_early() first (before torch is
    imported and the config read), so the signal is recorded instead of killing the process;
    the trainer then stops every rank before the first step;
  - on the torchrun agent (or its process group: the ranks run in sessions of their own):
    the agent has no handler for SIGUSR1 and dies, which used to leave its ranks training
    unsupervised; AgentWatch notices (the ranks' parent changes) and that counts as the signal.
No torch here: train.py imports this before anything heavy.
"""

from __future__ import annotations

import os
import signal
import threading

DEFAULT_SIGNAL = "SIGUSR1"  # train.preempt_signal's default
POLL_SECONDS = 0.25  # how often AgentWatch looks at the parent pid

_early: dict = {"signum": None, "previous": None, "received": False}  # what catch_early installed
_agent: AgentWatch | None = None
_seen = {"preempted": False}  # whether a PreemptionSignal here reported the signal (see preempted())


class AgentWatch(threading.Thread):
    """Sets `gone` when this process's parent (the torchrun agent) exits, whatever killed it."""

    def __init__(self):
        super().__init__(name="torchrun-agent-watch", daemon=True)
        self.parent = os.getppid()
        self.gone = threading.Event()

    def run(self) -> None:
        while os.getppid() == self.parent:
            self.gone.wait(POLL_SECONDS)
        self.gone.set()


def agent_watch() -> AgentWatch | None:
    """The process's AgentWatch under torchrun (started on first use; TORCHELASTIC_RUN_ID is set
    for torchrun's ranks only), else None."""
    global _agent
    if _agent is None and "TORCHELASTIC_RUN_ID" in os.environ:
        _agent = AgentWatch()
        _agent.start()
    return _agent


def catch_early(name: str | None = None) -> None:
    """Record the preemption signal from an entry point's first line on: `name`, else
    $PREEMPT_SIGNAL (the Slurm launcher's), else SIGUSR1. Until the trainer's PreemptionSignal
    takes over (and after it closes), the signal is recorded rather than fatal."""
    if _early["signum"] is not None:
        return
    try:
        signum = signal_number(name or os.environ.get("PREEMPT_SIGNAL") or DEFAULT_SIGNAL)
    except ValueError as e:
        raise SystemExit(f"PREEMPT_SIGNAL: {e}") from None
    _early.update(signum=signum, received=False, previous=signal.signal(signum, _record_early))
    agent_watch()


def _record_early(signum, frame) -> None:
    _early["received"] = True


def preempted() -> bool:
    """Whether this process was told to stop for a preemption: a PreemptionSignal's `received`
    was true when the trainer looked (before the first step or at a step's end), so the run
    stopped early and saved, unless that was its last step. A signal that comes after the last
    look (during the final save) does not count: the run had finished. scripts/slurm/run_rank.py
    records it with the exit code, so that the batch script requeues a preempted run, also where
    only the ranks got the signal (Slurm's `--signal=SIG@T` without `B:`, a preemption's SIGTERM
    in its grace time), and not a finished one."""
    return _seen["preempted"]


def _take_early(signum: int) -> bool:
    """Whether catch_early saw `signum` (and forget it). Where the config names another signal
    than catch_early caught, that one gets its previous action back, and is re-raised if it came."""
    early, got = _early["signum"], _early["received"]
    _early["received"] = False
    if early is None or early == signum:
        return got
    signal.signal(early, _early["previous"])
    _early["signum"] = None
    if got:
        signal.raise_signal(early)
    return False


class PreemptionSignal:
    """`received` is true once `signal_name` arrived (here or, recorded, since catch_early), or
    the torchrun agent died; the trainer makes the ranks agree on it at the end of each step."""

    def __init__(self, signal_name: str):
        self._got = False
        self._signum = None
        self._previous = None
        self._agent = agent_watch()
        if signal_name:
            self._signum = signal_number(signal_name)
            self._got = _take_early(self._signum)
            self._previous = signal.signal(self._signum, self._handle)

    @property
    def received(self) -> bool:
        got = self._got or (self._agent is not None and self._agent.gone.is_set())
        if got:
            _seen["preempted"] = True
        return got

    def _handle(self, signum, frame) -> None:
        self._got = True

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
