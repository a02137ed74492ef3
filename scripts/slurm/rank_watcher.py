"""Record the death of a rank that could not record it itself (killed by a signal), for
launch.sbatch; run_rank.py starts one per rank:

    python -S scripts/slurm/rank_watcher.py RANK_EXIT_DIR RANK PID

It is a child of the rank (PID), asleep until the kernel tells it its parent died
(PR_SET_PDEATHSIG), and checks its parent every second should that be missed. Then, unless the
rank wrote $RANK_EXIT_DIR/rank-RANK itself, it writes "<time of death> <code> <how>" there:
`signal:SIGKILL` with code 128 + 9 where it could read the signal from the dead rank's
/proc/PID/stat (possible until the rank's parent reaps it: torchrun's agent looks every 0.1 s,
slurmstepd at once, so under srun the signal is often unknown: `-1 signal`). It ignores every
other signal the job's processes get (Slurm signals a whole step, torchrun its ranks' process
groups). Where Slurm kills the whole step, it dies with the rank and writes nothing. Standard
library only, no site packages (-S): it starts in milliseconds.
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
DEATH = signal.SIGUSR2


def wait_for_parent(pid: int) -> None:
    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, DEATH):
            try:
                signal.signal(s, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    signal.pthread_sigmask(signal.SIG_BLOCK, {DEATH})
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(DEATH), 0, 0, 0)
    while os.getppid() == pid:
        signal.sigtimedwait({DEATH}, 1.0)


def wait_status(pid: int) -> int | None:
    """The dead process's wait status (/proc/PID/stat's exit_code), while it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[49])
    except (OSError, IndexError, ValueError):
        return None


def describe(status: int | None) -> tuple[int, str]:
    if status is None:
        return -1, "signal"
    sig = status & 0x7F
    if not sig:
        return (status >> 8) & 0xFF, "exited"  # os._exit() without a record
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    return 128 + sig, f"signal:{name}"


def main() -> None:
    folder, rank, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    wait_for_parent(pid)
    when, status = time.time(), wait_status(pid)
    path = os.path.join(folder, f"rank-{rank}")
    if os.path.exists(path):
        return  # the rank recorded its own exit
    code, how = describe(status)
    tmp = os.path.join(folder, f".rank-{rank}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{when:.6f} {code} {how}\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
