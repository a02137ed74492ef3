"""The one policy for a step whose loss or gradient norm is not finite, for every training loop:
pretraining and fine-tuning (trainer.loop.Trainer) and every rlhf.py stage (reward, DPO, PPO, GRPO).

- The decision is global. The caller hands over global values (the loss summed over the ranks, the
  runtime's global gradient norm), so every rank takes the same decision without asking the others.
- A step with any non-finite value is skipped: no optimizer update (the caller drops the
  gradients), while the batch counts as consumed and the step counter and learning-rate schedule
  move on, so a resumed run reads the same batches.
- Each skip is logged with one line (`step N: loss L / grad norm G is not finite: update skipped
  (k in a row; at M the run stops)`) and counted: `skipped`, the "skipped steps" metric, kept in
  checkpoints.
- `train.max_nonfinite_steps` skips in a row raise NonFiniteError: the run stops, and nothing of
  the diverged steps is saved (a checkpoint refuses non-finite weights: `nonfinite_tensors`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from trainer.distributed import all_gather_objects


class NonFiniteError(RuntimeError):
    """Training diverged: too many steps in a row had a non-finite loss or gradient norm, or the
    weights themselves are not finite (then nothing is saved)."""


class NonFiniteSteps:
    """The policy above, for one run: `allow(step, values)` before each optimizer update."""

    def __init__(self, limit: int, skipped: int = 0, say: Callable[[str], None] | None = None):
        """limit: train.max_nonfinite_steps; skipped: the count a resumed run starts from;
        say: where the line of a skipped step goes (a MetricsLogger's info; None: nowhere)."""
        self.limit = limit
        self.skipped = skipped  # skipped steps of the whole run, resumed runs included
        self.streak = 0  # skipped steps in a row, up to the last one
        self.say = say or (lambda line: None)

    def allow(self, step: int | str, values: dict[str, float]) -> bool:
        """Whether step `step` (as the log names it) may update the weights. `values` are global
        (the same on every rank): the loss and the gradient norm, or whatever the stage's update
        depends on. False: the step is skipped, counted and logged; raises NonFiniteError at the
        limit."""
        if all(math.isfinite(v) for v in values.values()):
            self.streak = 0
            return True
        self.skipped += 1
        self.streak += 1
        what = " / ".join(f"{name} {value}" for name, value in values.items())
        self.say(f"step {step}: {what} is not finite: update skipped ({self.streak} in a row; at {self.limit} "
                 f"the run stops)")
        if self.streak >= self.limit:
            raise NonFiniteError(
                f"{self.streak} steps in a row (up to step {step}) had a non-finite loss or gradient norm (last: "
                f"{', '.join(f'{name} {value}' for name, value in values.items())}); their updates were skipped "
                f"and nothing was saved from them (train.max_nonfinite_steps {self.limit}). Lower the learning "
                f"rate or set optim.clip_grad, and resume from the last checkpoint")
        return False


def nonfinite_tensors(models: Iterable[tuple[torch.nn.Module, torch.optim.Optimizer | None]]) -> list[str]:
    """Names of weights and optimizer states that hold a NaN or an infinity, on any rank (every rank
    calls it: one gather), over (module, its optimizer) pairs: what a checkpoint refuses to save."""
    mine = []
    for module, optimizer in models:
        names = {p: n for n, p in module.named_parameters()}
        mine += [names.get(p, "a parameter") for p in names if not torch.isfinite(p.detach()).all()]
        if optimizer is not None:
            mine += [f"{names.get(p, 'a parameter')}.{key}" for p, state in optimizer.state.items()
                     for key, v in state.items() if torch.is_tensor(v) and v.is_floating_point()
                     and not torch.isfinite(v).all()]
    return [f"rank {r}: {n}" for r, part in enumerate(all_gather_objects(mine)) for n in part]
