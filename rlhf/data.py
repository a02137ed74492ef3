"""Where each stage's model, tokenizer and examples come from.

Two sources: a built-in verifiable task (rlhf.tasks; its records are written once under
<out_dir>/data, and a fresh model of `model.preset` over the task's character tokenizer is
the base), or data files (HH-RLHF pairs, Alpaca prompts) with a Hugging Face base model.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.datasets import PreferenceDataset, alpaca_prompt, prompt_ids, split_hh_dialogue, split_train_valid
from data.sources import iter_json_records, require_file
from data.tokenizer import Tokenizer
from models.hf import save_hf_checkpoint
from models.transformer import Transformer
from rlhf.common import tokenizer_of
from rlhf.config import RLHFConfig
from rlhf.tasks import TASKS, VerifiableTask, get_task, save_task_tokenizer, task_records, write_jsonl
from trainer.config import Config, ConfigError
from trainer.loop import build_model_config
from trainer.distributed import DistEnv, barrier


def task_options(cfg: RLHFConfig) -> dict[str, int | float]:
    """data.task_options as keyword arguments of the task's class (numbers), each checked by name."""
    options = {}
    for item in cfg.data.task_options:
        name, sep, value = item.partition("=")
        try:
            options[name.strip()] = float(value) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"data.task_options: {item!r} is not name=number (e.g. steps=1)")
    if cfg.data.task not in TASKS:
        return options  # get_task names the task it does not know
    known = list(inspect.signature(TASKS[cfg.data.task]).parameters)
    unknown = [n for n in options if n not in known]
    if unknown:
        raise ConfigError(f"data.task_options: the {cfg.data.task!r} task has no option {unknown[0]!r}; its options "
                          f"are {known}")
    return options


def task(cfg: RLHFConfig) -> VerifiableTask | None:
    if not cfg.data.task:
        return None
    try:
        return get_task(cfg.data.task, **task_options(cfg))
    except ValueError as e:
        raise ConfigError(f"data.task: {e}") from None


def base_model_dir(cfg: RLHFConfig, env: DistEnv) -> Path:
    """models.base, or a fresh model of model.preset over the built-in character tokenizer (the
    tasks'; it reads any English text too), saved once as a Hugging Face directory
    <out_dir>/base/hf (same seed: the same model on every rank and run)."""
    if cfg.models.base:
        return Path(cfg.models.base)
    out = cfg.stage_dir("base") / "hf"
    if env.is_main and not (out / "config.json").is_file():
        tokenizer_dir = save_task_tokenizer(cfg.stage_dir("base") / "tokenizer")
        tokenizer = tokenizer_of(tokenizer_dir)
        shape = Config(model=cfg.model)  # the model keys of train.py, checked the same way
        shape.data.seq_len = cfg.data.max_len - 1
        torch.manual_seed(cfg.train.seed)
        model = Transformer(build_model_config(shape, tokenizer.vocab_size))
        save_hf_checkpoint(model, out, tokenizer_dir=tokenizer_dir,
                           token_ids={"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                                      "pad_token_id": tokenizer.pad_id})
    barrier()
    return out


def task_file(cfg: RLHFConfig, kind: str, env: DistEnv) -> Path:
    """The task's records of `kind` ("sft": prompt / completion, "pairs": prompt / chosen /
    rejected), written once by rank 0."""
    options = "".join(f"_{name}{value}" for name, value in sorted(task_options(cfg).items()))  # its own file
    path = Path(cfg.train.out_dir) / "data" / f"{cfg.data.task}{options}_{kind}_{cfg.data.task_samples}.jsonl"
    if env.is_main and not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(task_records(task(cfg), cfg.data.task_samples, cfg.train.seed, kind), path)
    barrier()
    return path


def sft_file(cfg: RLHFConfig, env: DistEnv) -> tuple[Path, str]:
    """The SFT records and their format: a task's demonstrations, or the chosen dialogues of HH pairs."""
    if cfg.data.task:
        return task_file(cfg, "sft", env), "completion"
    path = require_file(cfg.data.preferences, "data.preferences file")
    if "prompt" not in next(iter_json_records(path)):
        return path, "hh"
    # prompt / chosen / rejected records: the chosen side as prompt / completion records
    derived = Path(cfg.train.out_dir) / "data" / f"{path.name.split('.')[0]}_chosen.jsonl"
    if env.is_main and not derived.is_file():
        derived.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl([{"prompt": r["prompt"], "completion": r["chosen"]} for r in iter_json_records(path)], derived)
    barrier()
    return derived, "completion"


def preference_file(cfg: RLHFConfig, env: DistEnv) -> Path:
    if cfg.data.preferences:
        return require_file(cfg.data.preferences, "data.preferences file")
    return task_file(cfg, "pairs", env)


@dataclass
class Preferences:
    dataset: PreferenceDataset
    train_indices: np.ndarray
    valid_indices: np.ndarray
    source: str


def load_preferences(cfg: RLHFConfig, tokenizer: Tokenizer, env: DistEnv) -> Preferences:
    path = preference_file(cfg, env)
    try:
        dataset = PreferenceDataset(path, tokenizer, max_len=cfg.data.max_len)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data.preferences: {e}") from e
    if len(dataset) < 2:
        raise ConfigError(f"{path}: {len(dataset)} usable pairs ({dataset.num_skipped} skipped); need at least 2")
    train, valid = split_train_valid(len(dataset), cfg.data.valid_fraction, cfg.train.seed)
    return Preferences(dataset, train, valid, f"{path} ({dataset.format}, {dataset.num_skipped} skipped)")


@dataclass
class Prompts:
    texts: list[str]  # what a task's reward reads
    tokens: list[list[int]]  # [BOS] + prompt, cut to its last max_prompt_len tokens
    train_indices: np.ndarray
    valid_indices: np.ndarray
    source: str

    def take(self, indices) -> tuple[list[list[int]], list[str]]:
        """The tokens and the texts of these prompts."""
        return [self.tokens[i] for i in indices], [self.texts[i] for i in indices]


def _prompt_texts(cfg: RLHFConfig, env: DistEnv) -> tuple[list[str], str]:
    if cfg.data.prompts:
        path = require_file(cfg.data.prompts, "data.prompts file")
        records = list(iter_json_records(path, required_keys=("instruction",)))
        return [alpaca_prompt(r["instruction"], r.get("input")) for r in records], f"{path} (alpaca)"
    if cfg.data.task:
        path = task_file(cfg, "sft", env)
        return [r["prompt"] for r in iter_json_records(path)], f"task {cfg.data.task}"
    path = require_file(cfg.data.preferences, "data.preferences file")
    texts = []
    for r in iter_json_records(path):
        texts.append(r["prompt"] if "prompt" in r else split_hh_dialogue(r["chosen"])[0])
    return texts, f"{path} (prompts of the pairs)"


def load_prompts(cfg: RLHFConfig, tokenizer: Tokenizer, env: DistEnv) -> Prompts:
    texts, source = _prompt_texts(cfg, env)
    if not cfg.data.task:
        texts = list(dict.fromkeys(texts))  # HH repeats prompts: each once (a task's repeat by design)
    limit = cfg.data.max_prompt_len
    tokens = [prompt_ids(tokenizer, t)[-limit:] for t in texts]
    if len(texts) < 2:
        raise ConfigError(f"{source}: {len(texts)} prompts; need at least 2")
    train, valid = split_train_valid(len(texts), cfg.data.valid_fraction, cfg.train.seed)
    return Prompts(texts, tokens, train, valid, f"{source}: {len(texts)} prompts")


def write_samples(path: Path, rows: list[dict]) -> None:
    """A few decoded rollouts per log interval: what the policy actually says."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
