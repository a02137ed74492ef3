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
        path = self.ckpt.resume_path()
        if path is None:
            return None
        state = self.ckpt.load(path, self.models, self.samples_per_step, self.load_tensors)
        self.load_state_dict(state)
        self.newest_checkpoint = path
        return state

    def save(self, step: int, state: dict) -> Path:
        return self.ckpt.save(step, self.models, {**state, **self.state_dict()}, self.save_tensors)

    def open_log(self, step: int) -> MetricsLogger:
        self.log = open_log(self.cfg, self.name, self.steps, self.env, step)
        if self.newest_checkpoint is not None:  # set by resume() alone, just before
            self.log.info(f"{self.name}: resumed from checkpoint {self.newest_checkpoint} (step {step})")
        return self.log

    def begin_step(self) -> None:
        for m in self.models:
            m.runtime.ledger.reset()

    def close(self) -> None:
        for m in self.models:
            m.close()
