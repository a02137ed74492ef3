"""One run per out_dir: a fresh run refuses a directory that holds another run, unless
`train.overwrite` asks to replace it, and then the old run is kept aside until the new one has
written its first checkpoint (a new run that fails before that leaves the old one there).

train.py / finetune.py (trainer.loop) and every rlhf.py stage (its own directory under out_dir) use it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer.checkpoint import LATEST
from trainer.config import ConfigError
from trainer.distributed import barrier

OVERWRITTEN = ".overwritten"  # <out_dir>/.overwritten: the run train.overwrite replaces, until the first save
RUN_OUTPUTS = ("checkpoints", "tensorboard", "hf", "metrics.jsonl")  # what a run writes into its out_dir


def held_by_another_run(out_dir: Path) -> list[Path]:
    """What in `out_dir` says a run was there: its latest pointer, a non-empty metrics.jsonl, its
    newest step directory, or a replaced run an earlier overwrite left."""
    ckpt_root = out_dir / "checkpoints"
    held = [p for p in (ckpt_root / LATEST, out_dir / "metrics.jsonl") if p.is_file() and p.stat().st_size]
    return held + sorted(ckpt_root.glob("step_*"))[-1:] + [p for p in [out_dir / OVERWRITTEN] if p.is_dir()]


class RunDir:
    """The out_dir of one run (or one rlhf.py stage): `claim` before the run is built, `take_over`
    once every check has passed, `first_checkpoint_written` after each save."""

    def __init__(self, out_dir: str | Path, what: str = "train.out_dir"):
        self.out_dir, self.what = Path(out_dir), what
        self.replaced: Path | None = None  # the run being replaced, until this one's first checkpoint
        self._replace = False

    def claim(self, resume: str | None, overwrite: bool) -> None:
        """Refuse a fresh run into another run's directory (its `latest` would move back, its
        metrics.jsonl would hold both), unless `overwrite`; a resumed run continues its own."""
        held = [] if resume else held_by_another_run(self.out_dir)
        if held and not overwrite:
            raise ConfigError(
                f"{self.what} {str(self.out_dir)!r} holds another run ({', '.join(str(p) for p in held)}); continue "
                f"it with --resume auto (or latest), start over with --train.overwrite true (replaces its "
                f"checkpoints and metrics), or choose another --train.out_dir")
        self._replace = bool(held)

    def take_over(self, is_main: bool) -> str | None:
        """With overwrite, move the old run's outputs into <out_dir>/.overwritten (renames on one file
        system; every rank calls it). Returns the line for the log, or None when nothing was replaced."""
        if not self._replace:
            return None
        self.replaced = self.out_dir / OVERWRITTEN
        barrier()  # every rank has looked before rank 0 moves
        if is_main:
            # An earlier overwrite that never reached its first checkpoint left the run it replaces
            # there: that one is still the run replaced, and what the earlier attempt wrote goes.
            earlier = self.replaced.is_dir()
            self.replaced.mkdir(exist_ok=True)
            for path in (self.out_dir / name for name in RUN_OUTPUTS):
                if earlier:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                elif path.exists():
                    os.replace(path, self.replaced / path.name)
        barrier()
        return (f"train.overwrite: the previous run is in {self.replaced} until this run's first checkpoint, "
                f"then deleted")

    def first_checkpoint_written(self, is_main: bool) -> None:
        """This run is now resumable: the one it replaces can go."""
        if self.replaced is not None:
            if is_main:
                shutil.rmtree(self.replaced, ignore_errors=True)
            self.replaced = None
