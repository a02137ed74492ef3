"""What the learning rlhf.py stages (reward, dpo: rlhf.pairs; ppo, grpo: rlhf.online) plug into
the one loop skeleton (trainer.skeleton.run_stage) beyond their update: their models' checkpoints
under <out_dir>/<stage>/checkpoints, the log under <out_dir>/<stage>, the ledgers, the close."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from models.transformer import Transformer
from rlhf.common import ModelRuntime, StageCheckpoint, open_log
from rlhf.config import RLHFConfig
from trainer.config import ConfigError
from trainer.distributed import DistEnv
from trainer.loop import plan_zero_optimization
from trainer.memory import baseline_bytes
from trainer.metrics import MetricsLogger
from trainer.run_dir import RunDir
from trainer.skeleton import Stage
from zeropp.autoplan import StepTimeCheck


class RLHFStage(Stage):
    """A stage whose models are ModelRuntimes; subclasses set `name`, `steps`, `models` (every model
    of the stage: checkpoints hold the trainable ones) and `train_indices`, and define `update`."""

    name: str  # the stage: its directory under out_dir
    unpriced = ""  # the work of a step plan.auto's cost model leaves out (said in the plan's log line)
    priced = "the update"  # and what it prices, which its plan check times (priced_work_took)
    models: list[ModelRuntime]
    train_indices: Sequence[int]

    def __init__(self, cfg: RLHFConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.ckpt = StageCheckpoint(cfg, self.name, env)
        self.run_dir = RunDir(self.stage_dir, f"the {self.name} stage's directory")
        self.run_dir.claim(cfg.resume, cfg.train.overwrite)  # before any model is loaded
        self.replaced_note: str | None = None
        self.data_parallel = (env.rank, env.world_size)
        self.samples_per_step = cfg.train.micro_batch_size * env.world_size
        self.device = env.device
        self.plan: dict | None = None  # plan.auto's choice (state.json "plan"), its log lines and step-time check
        self.plan_lines: list[str] = []
        self.plan_check: StepTimeCheck | None = None
        if cfg.plan.auto:
            self._auto_plan()

    @property
    def stage_dir(self) -> Path:
        return self.cfg.stage_dir(self.name)

    # --- plan.auto: the stage's zero_optimization chosen from the machine

    def trained(self) -> tuple[list[tuple[Transformer, int, int]], int, list[int]]:
        """What one step trains, for plan.auto (zeropp.autoplan.price_step): each trained model on the meta
        device, prepared as the stage trains it (rlhf.common.prepare_trained), with its micro-batches per
        optimizer step and optimizer steps per step; the rows of one micro-batch (of data.max_len tokens);
        the first model's checkpointed blocks."""
        raise ConfigError(f"plan.auto: the {self.name} stage does not say what it trains")

    def _auto_plan(self) -> None:
        """trainer.loop.plan_zero_optimization over what the stage trains; every model of the stage is built
        with the choice."""
        cfg = self.cfg
        trained, rows, checkpointed = self.trained()
        zero, self.plan, lines = plan_zero_optimization(
            trained, rows, cfg.data.max_len, cfg.zero_optimization, cfg.plan, cfg.train.precision, self.env.device,
            checkpointed, baseline_bytes(trained[0][0].config, cfg.train.precision, self.env.device), cfg.data.packing,
            self.ckpt.resume_path())
        self.cfg = self.ckpt.cfg = dataclasses.replace(cfg, zero_optimization=zero)
        self.plan_lines = lines[:-1] + [lines[-1] + (f"; not priced: {self.unpriced}" if self.unpriced else "")]
        self.plan_check = StepTimeCheck(self.plan["step_seconds"], cfg.plan.check_after_steps,
                                        scope=f"{self.priced}, timed alone" if self.unpriced else "")

    # --- what the stage's checkpoints hold besides the models' shards and optimizer states

    def state_dict(self) -> dict:
        """The stage's own state (a KL controller, ...), in state.json."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_tensors(self, directory: Path) -> None:
        """This rank's extra tensors (an EMA) into a checkpoint directory."""

    def load_tensors(self, directory: Path) -> None:
        pass

    # --- trainer.skeleton.Stage

    def resume(self) -> dict | None:
        # The stage's models are built: only now may train.overwrite move the old run aside.
        self.replaced_note = self.run_dir.take_over(self.env.is_main)
        path = self.ckpt.resume_path()
        if path is None:
            return None
        state = self.ckpt.load(path, self.models, self.samples_per_step, self.load_tensors)
        self.load_state_dict(state)
        self.newest_checkpoint = path
        return state

    def save(self, step: int, state: dict) -> Path:
        plan = {"plan": self.plan} if self.plan else {}
        path = self.ckpt.save(step, self.models, {**state, **self.state_dict(), **plan}, self.save_tensors)
        self.run_dir.first_checkpoint_written(self.env.is_main)
        return path

    def open_log(self, step: int) -> MetricsLogger:
        self.log = open_log(self.cfg, self.name, self.steps, self.env, step)
        if self.replaced_note is not None:
            self.log.info(f"{self.name}: {self.replaced_note}")
        for line in self.plan_lines:
            self.log.info(f"{self.name}: {line}")
        if self.newest_checkpoint is not None:  # set by resume() alone, just before
            self.log.info(f"{self.name}: resumed from checkpoint {self.newest_checkpoint} (step {step})")
        return self.log

    def begin_step(self) -> None:
        for m in self.models:
            m.runtime.ledger.reset()

    def priced_work_took(self, seconds: float) -> None:
        """A step's update (what plan.auto priced) took `seconds`: its plan check, when one is due."""
        checked = self.plan_check.add(seconds) if self.plan_check is not None else None
        if checked:
            self.log.info(f"{self.name}: {checked}")

    def close(self) -> None:
        for m in self.models:
            m.close()
