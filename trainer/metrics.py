"""Rank 0's view of training: a Megatron-style log line, a tqdm bar, TensorBoard scalars.

The same names are used in the log line and in TensorBoard, so a figure read in one is
found in the other.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from trainer.config import TrainSection


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
        return f"{value:.3E}"
    return f"{value:.4f}"


class MetricsLogger:
    def __init__(self, cfg: TrainSection, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.bar = None
        self.writer = None
        self.jsonl = None
        if not enabled:
            return
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))
        if cfg.progress_bar:
            self.bar = tqdm(total=cfg.steps, initial=start_step, desc="train", dynamic_ncols=True, leave=False)

    def info(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self) -> None:
        if self.bar:
            self.bar.update(1)

    def scalars(self, step: int, values: dict[str, float], total_steps: int) -> None:
        if not self.enabled:
            return
        width = len(str(total_steps))
        parts = [f" iteration {step:>{width}}/{total_steps}"]
        parts += [f"{name}: {_format(value)}" for name, value in values.items()]
        self.info(" | ".join(parts))
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.writer:
            self.writer.close()
        if self.jsonl:
            self.jsonl.close()
