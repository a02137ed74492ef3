"""The skeleton of every training loop, once: resume, the resumable batch sampler, the log, the
evaluations, the non-finite policy, preemption, checkpoint intervals, the export and the close.

A `Stage` plugs in only what differs: how the step's batches become an update and its metrics,
evaluation, what its checkpoints hold (`resume` / `save`) and its export. Pretraining and
fine-tuning (trainer.loop.Trainer.run, rlhf.py's sft stage) and every other rlhf.py stage (reward
model, DPO, PPO, GRPO; rlhf/stage.py) run through `run_stage`.

Before the first step: the stage's `start` (its headline), a stop when any rank got the
preemption signal during startup (nothing new to save), the evaluation at step 0 (where the
stage asks for it). One step, in order: the stage's `begin_step`, `update` (reads the step's
micro-batches from the sampler, decides through the non-finite policy, steps the optimizers),
the log line every `train.log_interval` steps and at the last one, an evaluation every
`train.eval_interval` steps and at the last one, then the ranks agree on the preemption signal
and a checkpoint is written every `train.checkpoint_interval` steps, at the last step and when
preempted (then the loop ends, without the export). After it: the stage's `finish`, the export
(unless preempted) and the close.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from data.datasets import ResumableBatchSampler
from trainer.config import RunSection
from trainer.distributed import all_reduce_sum
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteSteps
from trainer.preemption import PreemptionSignal


class Stage(ABC):
    """What a training loop plugs into `run_stage`."""

    steps: int  # steps of the whole run (for rlhf.py's ppo / grpo: rollouts)
    train_indices: Sequence[int]  # the training split the resumable sampler draws from
    data_parallel: tuple[int, int]  # (this rank's data-parallel rank, the data-parallel size)
    samples_per_step: int  # samples of the training split one step consumes, all ranks together
    device: torch.device  # where the ranks' agreement on the preemption signal is reduced
    evaluate_at_start: bool = True  # evaluate before the first step of a fresh run (step 0)
    newest_checkpoint: Path | None = None  # what a run stopped before its first step leaves (the log names it)

    @abstractmethod
    def resume(self) -> dict | None:
        """Load the checkpoint the config's `resume` names into the models; its state ("step",
        "consumed_samples", "skipped" and the stage's own), or None: a fresh start."""

    @abstractmethod
    def save(self, step: int, state: dict) -> Path:
        """Checkpoint step `step` with `state` (data position, skipped steps) and the stage's own."""

    @abstractmethod
    def open_log(self, step: int) -> MetricsLogger:
        """The run's logger, starting at `step`."""

    def start(self, log: MetricsLogger, step: int) -> None:
        """After the resume, before the first step: the headline, what the stage prepares."""

    def begin_step(self) -> None:
        """Before each step (the runtimes' ledgers reset: the step's traffic is what they hold)."""

    @abstractmethod
    def update(self, step: int, batches: Iterator[list[int]], nonfinite: NonFiniteSteps,
               stop_requested: bool) -> dict[str, float]:
        """Step `step` + 1: read its micro-batches from `batches`, compute the loss and gradients, and
        update the weights unless `nonfinite.allow(...)` says no; returns the step's metrics.
        stop_requested: whether this rank got the preemption signal before the step (a stage may
        agree on it in the step's own all-reduce: `agree_to_stop`)."""

    def agree_to_stop(self, received: bool) -> bool:
        """After a step: whether any rank got the preemption signal (`received`: this rank's, now)."""
        return anyone(received, self.device)

    def log_line(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """What the log line of step `step` shows (default: the step's metrics)."""
        return metrics

    def logged(self, step: int) -> None:
        """After the log line of step `step` (extra records, e.g. decoded samples)."""

    def finish(self, log: MetricsLogger) -> None:
        """After the last step (or the preemption), before the log closes: closing reports."""

    def evaluate(self) -> dict[str, float] | None:
        """Held-out metrics (every rank calls it); None: the stage has no evaluation."""
        return None

    def export(self) -> None:
        """After the last step (not when preempted): the stage's final artefacts."""

    def close(self) -> None:
        """Release the runtimes (also after an error)."""


@dataclass
class StageResult:
    step: int = 0  # the step the run ended at
    preempted: bool = False  # stopped early by the scheduler's warning signal
    started: bool = True  # False: preempted before the first step, nothing new was saved
    checkpoint: Path | None = None  # the last checkpoint written
    history: list[dict[str, float]] = field(default_factory=list)  # every step's metrics
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> held-out metrics (0: before)


def run_stage(stage: Stage, t: RunSection) -> StageResult:
    """Run `stage` to its last step (or to the preemption signal) under the shared keys `t`."""
    result = StageResult()
    try:
        _steps(stage, t, result)
        if not result.preempted:
            stage.export()
    finally:
        stage.close()
    return result


def anyone(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (one all-reduce)."""
    return all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64, device=device)).item() > 0


def _steps(stage: Stage, t: RunSection, result: StageResult) -> None:
    preemption = PreemptionSignal(t.preempt_signal)
    log = None
    try:
        state = stage.resume() or {}
        step, consumed = state.get("step", 0), state.get("consumed_samples", 0)
        log = stage.open_log(step)
        nonfinite = NonFiniteSteps(t.max_nonfinite_steps, skipped=state.get("skipped", 0), say=log.info)
        stage.start(log, step)
        # A warning that came during startup (recorded since the entry point's first line), on any
        # rank: every rank stops here, before any step, with nothing new to save.
        if step < stage.steps and anyone(preemption.received, stage.device):
            log.info("preempted before the first step: nothing new to save" +
                     (f" (the newest checkpoint is {stage.newest_checkpoint})" if stage.newest_checkpoint else ""))
            result.step, result.preempted, result.started = step, True, False
            return

        def evaluate(at: int) -> None:
            metrics = stage.evaluate()
            if metrics is not None:
                result.evaluations[at] = metrics
                log.scalars(at, metrics, total_steps=stage.steps)

        if step == 0 and stage.evaluate_at_start:
            evaluate(0)
        rank, size = stage.data_parallel
        batches = iter(ResumableBatchSampler(stage.train_indices, t.micro_batch_size, rank, size, t.seed,
                                             consumed_samples=consumed, samples_per_step=stage.samples_per_step))
        while step < stage.steps:
            stage.begin_step()
            metrics = stage.update(step, batches, nonfinite, preemption.received)
            step += 1
            consumed += stage.samples_per_step
            metrics["skipped steps"] = nonfinite.skipped
            result.history.append(metrics)
            if step % t.log_interval == 0 or step == stage.steps:
                log.scalars(step, stage.log_line(step, metrics), total_steps=stage.steps)
                stage.logged(step)
            log.advance()
            if step % t.eval_interval == 0 or step == stage.steps:
                evaluate(step)
            stop = stage.agree_to_stop(preemption.received)
            if (t.checkpoint_interval and step % t.checkpoint_interval == 0) or step == stage.steps or stop:
                result.checkpoint = stage.save(step, {"consumed_samples": consumed, "skipped": nonfinite.skipped})
                if stop and step != stage.steps:
                    log.info(f"preempted at step {step}: saved checkpoint {result.checkpoint}")
                    result.preempted = True
                    break
        result.step = step
        stage.finish(log)
        if not result.preempted and step not in result.evaluations:
            evaluate(step)  # a finished run resumed: its final evaluation
    finally:
        preemption.close()
        if log is not None:
            log.close()
