"""Run one rank's entry point and record how it ended, for launch.sbatch.

    python scripts/slurm/run_rank.py train.py --config configs/quickstart.yaml

runs `train.py` exactly as `python train.py ...` would (as __main__, with its own directory
first on sys.path and sys.argv[0] set to it), then writes one line to
$RANK_EXIT_DIR/rank-<RANK> (RANK from torchrun, else SLURM_PROCID):

    <time> <exit code> <how>
    <the rank's one-line error>          (where it exited with one: sys.exit("train.py: error: ..."))

`how` is `exited`; `preempted` where the rank's trainer saw the preemption signal and so
stopped (trainer.preemption.preempted: the batch script requeues on that, also where only the
ranks got the signal, and not where the run had finished when it came); `peer` for a failure caused by another
rank's death (a collective whose peer's connection closed); `signal:SIGKILL` (`signal` where
the signal could not be read) for a rank killed by a signal, with 128 + the signal's number as
its exit code. launch.sbatch reads these lines to make the job's exit code the first failure's:
torchrun itself always exits 1 when a worker fails, srun reports the highest code or the
signal it killed the surviving ranks with, and the survivors of a killed rank fail (exit 1,
"a collective failed") about when the kernel closes its sockets, before its death is reported
(so `peer` failures never count as the first).

A rank killed by a signal cannot write its own line: rank_watcher.py, a small child process
of the rank, writes it instead (see there).

It also starts the rank with $PREEMPT_SIGNAL (the scheduler's warning, e.g. USR1) ignored,
as torchrun's ranks are under launch.sbatch: the entry point installs its own handler
(train.py, finetune.py and rlhf.py from their first line: trainer.preemption.catch_early), and
a warning that arrives before that is then ignored instead of killing the rank.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer import preemption  # no torch: the wrapper starts fast (the project is installed: pip install -e .)

WATCHER = Path(__file__).resolve().with_name("rank_watcher.py")
_watcher: subprocess.Popen | None = None  # referenced for the rank's lifetime (never waited for)


def _record_path() -> str | None:
    folder = os.environ.get("RANK_EXIT_DIR")
    if not folder:
        return None
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return os.path.join(folder, f"rank-{rank}")


# A collective whose peer's connection closed (gloo's words; trainer.distributed.is_peer_failure
# knows these and timeouts): the rank failed because another one died first.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is a collective that
    lost its peer: this rank failed because another one had died (not: timed out waiting)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(text in str(error) for text in LOST_PEER):
            return True
        error = error.__cause__ or error.__context__
    return False


def _record(code: int, error: BaseException | None = None) -> None:
    path = _record_path()
    if path is None:
        return
    if code and lost_peer(error):
        how = "peer"
    else:
        how = "preempted" if preemption.preempted() else "exited"
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}")
        message = error.code if isinstance(error, SystemExit) and isinstance(error.code, str) else ""
        with open(tmp, "w") as f:
            f.write(f"{time.time():.6f} {code} {how}\n" + (message.splitlines()[0] + "\n" if message else ""))
        os.replace(tmp, path)
    except OSError as e:  # recording is best effort; never mask the rank's own outcome
        print(f"run_rank.py: could not record exit code {code} in {folder}: {e}", file=sys.stderr)


def _start_watcher() -> None:
    """Forget an earlier attempt's record of this rank and start the watcher that records this
    process's death by a signal (best effort: without it only that line is missing)."""
    global _watcher
    path = _record_path()
    if path is None or not sys.platform.startswith("linux"):
        return
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(path):
            os.remove(path)
        _watcher = subprocess.Popen(
            [sys.executable, "-S", str(WATCHER), folder, path.rsplit("rank-", 1)[1], str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as e:
        print(f"run_rank.py: no watcher for this rank's exit ({e})", file=sys.stderr)


def _code_of(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    return 1  # sys.exit("message") prints the message and exits 1


def _ignore_preempt_signal() -> None:
    name = os.environ.get("PREEMPT_SIGNAL", "").strip()
    if not name:
        return
    try:
        number = preemption.signal_number(name)
    except ValueError as e:
        sys.exit(f"run_rank.py: PREEMPT_SIGNAL: {e}")
    signal.signal(number, signal.SIG_IGN)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: run_rank.py SCRIPT [ARGS...]")
    _ignore_preempt_signal()
    _start_watcher()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code, error = 1, None
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code, error = _code_of(e), e
        raise
    except BaseException as e:
        error = e
        raise
    finally:
        _record(code, error)


if __name__ == "__main__":
    main()
