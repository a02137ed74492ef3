"""What the learning rlhf.py stages (reward, dpo: rlhf.pairs; ppo, grpo: rlhf.online) plug into
the one loop skeleton (trainer.skeleton.run_stage) beyond their update: their models' checkpoints
under <out_dir>/<stage>/checkpoints, the log under <out_dir>/<stage>, the ledgers, the close."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rlhf.common import ModelRuntime, StageCheckpoint, open_log
from rlhf.config import RLHFConfig
from trainer.distributed import DistEnv
from trainer.metrics import MetricsLogger
from trainer.run_dir import RunDir
from trainer.skeleton import Stage


class RLHFStage(Stage):
    """A stage whose models are ModelRuntimes; subclasses set `name`, `steps`, `models` (every model
    of the stage: checkpoints hold the trainable ones) and `train_indices`, and define `update`."""

    name: str  # the stage: its directory under out_dir
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

    @property
    def stage_dir(self) -> Path:
        return self.cfg.stage_dir(self.name)

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
        path = self.ckpt.save(step, self.models, {**state, **self.state_dict()}, self.save_tensors)
        self.run_dir.first_checkpoint_written(self.env.is_main)
        return path

    def open_log(self, step: int) -> MetricsLogger:
        self.log = open_log(self.cfg, self.name, self.steps, self.env, step)
        if self.replaced_note is not None:
            self.log.info(f"{self.name}: {self.replaced_note}")
        if self.newest_checkpoint is not None:  # set by resume() alone, just before
            self.log.info(f"{self.name}: resumed from checkpoint {self.newest_checkpoint} (step {step})")
        return self.log

    def begin_step(self) -> None:
        for m in self.models:
            m.runtime.ledger.reset()

    def close(self) -> None:
        for m in self.models:
            m.close()
