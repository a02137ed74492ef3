"""Rank 0's view of training: a Megatron-style log line, a tqdm bar, metrics.jsonl, and the
trackers people compare runs in: TensorBoard, and optionally Weights & Biases and MLflow.

The log line and metrics.jsonl keep the metrics' own names ("lm loss", "MFU %"; scripts and
tests read them). The trackers get grouped tags instead (`TAGS`: train/loss, eval/loss,
perf/..., comm/..., memory/...), the same in all three, and the run's hyperparameters (the
flattened config) once, when the logger opens.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import sys
from pathlib import Path

from tqdm import tqdm

from trainer.config import TrainSection, format_value

# Our metric names -> the trackers' tags. A name not here goes under train/ (`tag`).
TAGS = {
    "lm loss": "train/loss",
    "loss": "train/loss",
    "learning rate": "train/lr",
    "grad norm": "train/grad_norm",
    "consumed samples": "train/consumed_samples",
    "skipped steps": "train/skipped_steps",
    "validation loss": "eval/loss",
    "validation perplexity": "eval/perplexity",
    "held-out loss": "eval/loss",
    "held-out accuracy": "eval/accuracy",
    "held-out margin": "eval/margin",
    "held-out pairs": "eval/pairs",
    "elapsed time per iteration (ms)": "perf/step_time_ms",
    "tokens/s": "perf/tokens_per_s",
    "training tokens/s": "perf/training_tokens_per_s",
    "generation tokens/s": "perf/generation_tokens_per_s",
    "TFLOP/s per rank": "perf/tflops_per_rank",
    "MFU %": "perf/mfu_percent",
    "memory (MB)": "memory/peak_mb",
    "inference copy (MB)": "memory/inference_copy_mb",
    "comm sent (MB)": "comm/sent_mb",
    "cross-node sent (MB)": "comm/cross_node_sent_mb",
    "cross-node generation (MB)": "comm/cross_node_generation_mb",
    "cross-node training (MB)": "comm/cross_node_training_mb",
    "cross-node experience (MB)": "comm/cross_node_experience_mb",
    "waiting for gathers (ms)": "comm/wait_gather_ms",
    "waiting for reductions (ms)": "comm/wait_reduce_ms",
    "waiting for tp all-reduces (ms)": "comm/wait_tp_all_reduce_ms",
    "weight encode (ms)": "comm/weight_encode_ms",
    "weight decode (ms)": "comm/weight_decode_ms",
    "gradient compression (ms)": "comm/gradient_compression_ms",
}


def tag(name: str) -> str:
    """The trackers' tag of metric `name`: TAGS's, else train/<name> in lower case with "%" as
    percent, "/s" as per_s and any other run of non-alphanumerics as one underscore."""
    if name in TAGS:
        return TAGS[name]
    word = name.lower().replace("%", " percent").replace("/s", " per s")
    return "train/" + (re.sub(r"[^a-z0-9]+", "_", word).strip("_") or "unnamed")


def hparams(config) -> dict[str, int | float | str | bool]:
    """A config tree as dotted keys -> scalars (a list or None as it is written on the command line)."""
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value if isinstance(value, (bool, int, float, str)) else format_value(value)

    walk(dataclasses.asdict(config), "")
    return out


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
        return f"{value:.3E}"
    return f"{value:.4f}"


class TensorBoardWriter:
    """<out_dir>/tensorboard: scalars by tag, the hyperparameters in the HParams dashboard (with
    train/loss and eval/loss as its metric columns, read from the same run's scalars)."""

    def __init__(self, out: Path, params: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        self.writer = SummaryWriter(str(out / "tensorboard"))
        for summary in hparams_summaries(params, {"train/loss": math.nan, "eval/loss": math.nan}):
            self.writer.file_writer.add_summary(summary)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A Weights & Biases run in project `project`, named after the run's directory."""

    def __init__(self, project: str, out: Path, params: dict):
        wandb = importlib.import_module("wandb")  # installed: check_run_section checked
        self.run = wandb.init(project=project, name=out.resolve().name, dir=str(out), config=params)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowWriter:
    """An MLflow run at tracking URI `uri`, named after the run's directory; the hyperparameters as params."""

    def __init__(self, uri: str, out: Path, params: dict):
        self.mlflow = importlib.import_module("mlflow")  # installed: check_run_section checked
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.start_run(run_name=out.resolve().name)
        self.mlflow.log_params(params)

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class MetricsLogger:
    """The one logger of every training loop. config: the run's whole config tree, recorded as
    its hyperparameters (None: the train section alone)."""

    def __init__(self, cfg: TrainSection, enabled: bool, start_step: int = 0, config=None):
        self.enabled = enabled
        self.bar = None
        self.writers = []
        self.jsonl = None
        if not enabled:
            return
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "metrics.jsonl", "a")
        params = hparams(config) if config is not None else {f"train.{k}": v for k, v in hparams(cfg).items()}
        if cfg.tensorboard:
            self.writers.append(TensorBoardWriter(out, params))
        if cfg.wandb_project is not None:
            self.writers.append(WandbWriter(cfg.wandb_project, out, params))
        if cfg.mlflow_tracking_uri is not None:
            self.writers.append(MlflowWriter(cfg.mlflow_tracking_uri, out, params))
        if cfg.progress_bar and sys.stdout.isatty():
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
        tagged = {tag(name): value for name, value in values.items()}
        for writer in self.writers:
            writer.log(tagged, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        for writer in self.writers:
            writer.close()
        if self.jsonl:
            self.jsonl.close()
