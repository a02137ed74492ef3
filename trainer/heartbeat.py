"""Every rank's heartbeat in the rendezvous store, read when a collective fails, so that the
surviving ranks name the rank that stopped responding instead of only timing out.

gloo and NCCL only say that a collective timed out (or that a pair closed), and torchrun blames
whichever rank exited first: a healthy one. Here each rank's daemon thread writes a small record
under `heartbeat/<rank>` of the store at MASTER_ADDR:MASTER_PORT (torchrun's agent's or rank 0's)
every `interval` seconds: the time, host, pid, what the rank is doing (the trainer's phase, with
its step) and the last collective it issued (zeropp.comm.FLIGHT: tag and number). A process that
is stopped (SIGSTOP, a debugger, a swapped-out host), wedged holding the GIL, or dead stops
writing; one that waits in a collective keeps writing. When a collective fails, a survivor reads
every rank's last record: a record older than STALE_INTERVALS intervals names its rank. The
ages compare clocks of different hosts, so they must agree to within a few intervals (NTP).
torchrun stops every rank as soon as the first one exits, so a survivor waits (at most a
collective timeout) until every other survivor has written its own sentence before it exits.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from zeropp.comm import FLIGHT

STALE_INTERVALS = 4  # a record this many intervals old: its rank stopped responding
READ_TIMEOUT = 5.0  # seconds a survivor waits for the store when diagnosing


def interval_for(dist_timeout: float) -> float:
    """A tenth of the collective timeout, within [0.2, 5] s: a rank that stopped is stale long
    before a collective gives up on it, and a store of thousands of ranks gets few writes."""
    return min(5.0, max(0.2, dist_timeout / 10))


def _store(timeout: float) -> dist.Store:
    """A client of the launcher's store of its own (a beat that blocks on a frozen store host
    must not hold up the diagnosis), under a prefix per torchrun attempt."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(f"zeropp-heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


class Heartbeat(threading.Thread):
    """This rank's beat (see the module's docstring); `doing()` says what the rank does now."""

    def __init__(self, rank: int, world_size: int, dist_timeout: float, doing: Callable[[], str]):
        super().__init__(name="zeropp-heartbeat", daemon=True)
        self.rank, self.world_size, self.dist_timeout, self.doing = rank, world_size, dist_timeout, doing
        self.interval = interval_for(dist_timeout)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.stopped, self.woken = threading.Event(), threading.Event()
        self.store = _store(max(self.interval, 1.0) * STALE_INTERVALS)
        self.beat()  # the first record before any collective can fail

    def record(self) -> dict:
        return {"time": time.time(), "host": self.host, "pid": self.pid, "doing": self.doing(),
                "collective": FLIGHT.tag, "calls": FLIGHT.calls}

    def beat(self) -> None:
        self.store.set(f"rank{self.rank}", json.dumps(self.record()))

    def run(self) -> None:
        while True:
            self.woken.wait(self.interval)
            self.woken.clear()
            if self.stopped.is_set():
                return
            try:
                self.beat()
            except Exception:  # the store is gone (its host ended) or stuck: the diagnosis says so
                return

    def wake(self) -> None:
        """Beat now (the rank started something new: its record should say so), not on this thread."""
        self.woken.set()

    def stop(self) -> None:
        self.stopped.set()
        self.woken.set()

    def diagnosis(self, timed_out: bool) -> str:
        """Who stopped responding, where and when, as one sentence for a failed collective's error
        (`timed_out`: the collective waited out its timeout, rather than lost its connection);
        returns once every other responding rank has its own, or after train.dist_timeout."""
        try:
            store = _store(READ_TIMEOUT)
            records = {r: json.loads(store.get(f"rank{r}")) if store.check([f"rank{r}"]) else None
                       for r in range(self.world_size)}
        except Exception as e:
            return (f"the ranks' store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does not "
                    f"answer ({type(e).__name__}): the process hosting it (torchrun's agent, else rank 0) stopped "
                    f"responding or its host is unreachable")
        now = time.time()
        silent = stale(records, self.rank, self.interval * STALE_INTERVALS, now)
        try:  # the other survivors' turn to say it before this one exits
            store.add("diagnosed", 1)
            deadline = time.monotonic() + self.dist_timeout
            while store.add("diagnosed", 0) < self.world_size - len(silent) and time.monotonic() < deadline:
                time.sleep(self.interval / 4)
        except Exception:
            pass
        return describe(records, silent, self.rank, now, self.record(), timed_out)


def stale(records: dict[int, dict | None], rank: int, stale_after: float, now: float) -> list[int]:
    """The other ranks whose last record (None: never written) is older than `stale_after` seconds."""
    return [r for r, rec in records.items() if r != rank and (rec is None or now - rec["time"] > stale_after)]


def describe(records: dict[int, dict | None], silent: list[int], rank: int, now: float, own: dict,
             timed_out: bool) -> str:
    """The sentence for `rank` given every rank's last record and the ranks that stopped writing."""
    mine = f"this rank's last collective: {_collective(own)}"
    if silent:
        parts = []
        for r in silent:
            rec = records[r]
            parts.append(f"rank {r} never reported (it did not reach the heartbeat's start)" if rec is None else
                         f"rank {r} (host {rec['host']}, pid {rec['pid']}) stopped responding: its last heartbeat "
                         f"was {now - rec['time']:.0f} s ago, during {rec['doing']}, its last collective "
                         f"{_collective(rec)}")
        return "; ".join(parts) + f"; {mine}"
    if not timed_out:
        return (f"another rank closed its connection (it died or exited; its own error or the launcher's summary "
                f"names it); {mine}")
    groups: dict[str, list[int]] = {}
    for r, rec in sorted(records.items()):
        groups.setdefault(_collective(rec if r != rank else own), []).append(r)
    where = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {c}" for c, rs in groups.items())
    return f"every rank's heartbeat is current (none stopped; a slow or diverging rank?): last collectives {where}"


def _collective(record: dict) -> str:
    return f"'{record['collective']}' (call {record['calls']})" if record["collective"] else "none yet"


def start_heartbeat(rank: int, world_size: int, dist_timeout: float, doing: Callable[[], str]) -> Heartbeat | None:
    """This rank's running Heartbeat; None for one process, or without a launcher's store address."""
    if world_size < 2 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None
    try:
        heartbeat = Heartbeat(rank, world_size, dist_timeout, doing)
    except Exception as e:  # no store there (a group made another way): train on, unwatched
        warnings.warn(f"rank {rank}: no heartbeat (the store at {os.environ['MASTER_ADDR']}:"
                      f"{os.environ['MASTER_PORT']} does not answer: {type(e).__name__}); a rank that stops "
                      f"responding will not be named")
        return None
    heartbeat.start()
    return heartbeat
