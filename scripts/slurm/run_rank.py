"""Run one rank's entry point and record its exit code for launch.sbatch.

    python scripts/slurm/run_rank.py train.py --config configs/quickstart.yaml

runs `train.py` exactly as `python train.py ...` would (as __main__, with its own directory
first on sys.path and sys.argv[0] set to it), then writes "<time> <exit code>" to
$RANK_EXIT_DIR/rank-<RANK> (RANK from torchrun, else SLURM_PROCID). launch.sbatch reads these
files to make the job's exit code the first failing rank's: torchrun itself always exits 1
when a worker fails, and srun reports the signal it killed the surviving ranks with.

A rank killed by a signal records nothing; the launcher then keeps srun's exit code.

It also starts the rank with $PREEMPT_SIGNAL (the scheduler's warning, e.g. USR1) ignored,
as torchrun's ranks are under launch.sbatch: the entry point installs its own handler
(train.py and finetune.py from their first line: trainer.preemption.catch_early), and a
warning that arrives before that is then ignored instead of killing the rank.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

from trainer.preemption import signal_number  # no torch: the wrapper starts fast


def _record(code: int) -> None:
    folder = os.environ.get("RANK_EXIT_DIR")
    if not folder:
        return
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".rank-{rank}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(f"{time.time():.6f} {code}\n")
        os.replace(tmp, os.path.join(folder, f"rank-{rank}"))
    except OSError as e:  # recording is best effort; never mask the rank's own outcome
        print(f"run_rank.py: could not record exit code {code} in {folder}: {e}", file=sys.stderr)


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
        number = signal_number(name)
    except ValueError as e:
        sys.exit(f"run_rank.py: PREEMPT_SIGNAL: {e}")
    signal.signal(number, signal.SIG_IGN)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: run_rank.py SCRIPT [ARGS...]")
    _ignore_preempt_signal()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _code_of(e)
        raise
    finally:
        _record(code)


if __name__ == "__main__":
    main()
