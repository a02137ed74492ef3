"""From the `data:` and `finetune:` config sections to a tokenizer and SFT train/valid examples.

Each SFT file is tokenized once, record by record, into an `SFTCache` directory under
data.cache_dir, named by a key of what determines its examples (the file's path, size and mtime,
the tokenizer's files, seq_len, the format): local rank 0 of each node builds it while the other
ranks wait at a barrier (as pretraining's token store), later runs open it, and every rank reads
it through memory maps, so no rank holds a data set larger than memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.datasets import IGNORE_INDEX, SFTCache, build_sft_cache, collate_sft, split_train_valid
from data.packing import pack
from data.sources import is_json
from data.tokenizer import Tokenizer, load_tokenizer
from trainer.config import Config, ConfigError
from trainer.distributed import barrier
from trainer.pretrain_data import DataError, file_fingerprint


@dataclass
class FinetuneData:
    tokenizer: Tokenizer
    dataset: torch.utils.data.Dataset  # every set's examples, one after the other
    train_indices: np.ndarray  # an epoch's examples, as the mixture weighs them (ids may repeat)
    valid_indices: np.ndarray
    source: str
    seq_len: int
    packing: bool  # data.packing

    def batch(self, indices: list[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's inputs and the targets of examples `indices`: the target is -100 over the
        prompt and the padding, so the loss covers response tokens (and EOS) only.

        Padded: one row per example, right-padded to the longest (no attention mask needed: causal
        attention never looks ahead to the padding). Packed: the examples side by side in rows of
        seq_len with their document_ids; the same targets, so the same loss."""
        examples = [self.dataset[i] for i in indices]
        if not self.packing:
            batch = collate_sft(examples, pad_id=self.tokenizer.pad_id)
            return {"tokens": batch["tokens"][:, :-1].to(device)}, batch["labels"][:, 1:].to(device)
        rows = pack([len(x["tokens"]) - 1 for x in examples], self.seq_len)
        tokens = rows.scatter([x["tokens"][:-1] for x in examples], self.tokenizer.pad_id)
        labels = rows.scatter([x["labels"][1:] for x in examples], IGNORE_INDEX)
        return {"tokens": tokens.to(device), "document_ids": rows.document_ids().to(device)}, labels.to(device)


CACHE_VERSION = 1  # raised when what an SFTCache holds for the same key changes
# A tokenizer directory's files that decide how records are rendered and tokenized (not the weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json")


def _tokenizer_digest(tokenizer: Tokenizer) -> str:
    path = Path(tokenizer.path)
    files = [path] if path.is_file() else [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _sft_set(path: str, tokenizer: Tokenizer, cfg: Config, format: str | None, key: str) -> tuple[SFTCache, str]:
    """The SFTCache of one file, built if absent or unusable; and how it was come by, for the log."""
    if not (Path(path).is_file() and is_json(Path(path))):
        raise DataError(f"{key} {path!r}: {'not a JSON file' if Path(path).is_file() else 'no such file'}; "
                        f"fine-tuning reads an SFT data set from a .json / .jsonl(.gz) file (docs/finetune.md)")
    # seq_len + 1 tokens give seq_len inputs and targets after the shift, as in pretraining.
    max_len = cfg.data.seq_len + 1
    cache_key = {"version": CACHE_VERSION, "source": file_fingerprint(Path(path)),
                 "tokenizer": _tokenizer_digest(tokenizer), "max_len": max_len, "format": format or "auto"}
    digest = hashlib.sha256(json.dumps(cache_key, sort_keys=True).encode()).hexdigest()[:16]
    directory = Path(cfg.data.cache_dir) / f"sft-{Path(path).name}-{digest}"
    how = f"cached in {directory}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            SFTCache(directory, cache_key)
        except (OSError, ValueError) as e:
            if directory.exists():
                warnings.warn(f"{key} {path!r}: the SFT cache is unusable, rebuilding it: {e}", stacklevel=2)
            start = time.perf_counter()
            try:
                build_sft_cache(directory, path, tokenizer, max_len, format, cache_key)
            except (KeyError, ValueError) as e:  # they name the file, the record and the key
                raise DataError(str(e)) from e
            how = f"tokenized into {directory} in {time.perf_counter() - start:.1f} s"
    barrier()
    dataset = SFTCache(directory, cache_key)
    if len(dataset) < 2:
        raise DataError(f"{key} {path!r}: {len(dataset)} usable examples ({dataset.num_skipped} had no response "
                        f"left within data.seq_len {cfg.data.seq_len}); need at least 2")
    return dataset, how


def mixture(train_sets: list[np.ndarray], weights: list[float], seed: int) -> np.ndarray:
    """One epoch of the sets' training examples, as many as they hold together, each set drawing
    its weight's share: whole passes over it, then a seeded sample without replacement."""
    total = sum(len(ids) for ids in train_sets)
    rng = np.random.default_rng([seed, len(train_sets)])
    epoch = []
    for ids, weight in zip(train_sets, weights):
        count = max(1, round(total * weight / sum(weights)))
        passes, rest = divmod(count, len(ids))
        epoch += [np.tile(ids, passes), np.sort(rng.choice(ids, rest, replace=False))]
    return np.concatenate(epoch)


def prepare_finetuning(cfg: Config) -> FinetuneData:
    data, ft = cfg.data, cfg.finetune
    paths = [data.path, *ft.mix]
    if ft.mix_weights and (len(ft.mix_weights) != len(paths) or
                           not all(math.isfinite(w) and w > 0 for w in ft.mix_weights)):
        raise ConfigError(f"finetune.mix_weights: value {ft.mix_weights} does not fit; expected {len(paths)} "
                          f"weights > 0 (data.path's, then one per finetune.mix set), or none")
    tokenizer = load_tokenizer(data.tokenizer or ft.hf_checkpoint)
    sets, hows = zip(*[_sft_set(path, tokenizer, cfg,
                                (None if ft.data_format == "auto" else ft.data_format) if i == 0 else None,
                                "data.path" if i == 0 else "finetune.mix") for i, path in enumerate(paths)])
    train_sets, valid_sets, offset = [], [], 0
    for dataset in sets:
        train_idx, valid_idx = split_train_valid(len(dataset), data.valid_fraction, cfg.train.seed)
        train_sets.append(train_idx + offset)
        valid_sets.append(valid_idx + offset)
        offset += len(dataset)
    train_idx = mixture(train_sets, ft.mix_weights, cfg.train.seed) if ft.mix_weights else np.concatenate(train_sets)
    described = [f"{path} ({d.format}, {d.num_skipped} skipped, {how})" for path, d, how in zip(paths, sets, hows)]
    if ft.mix_weights:
        described = [f"{text} x {w / sum(ft.mix_weights):.0%}" for text, w in zip(described, ft.mix_weights)]
    dataset = sets[0] if len(sets) == 1 else torch.utils.data.ConcatDataset(sets)
    return FinetuneData(tokenizer, dataset, train_idx, np.concatenate(valid_sets), " + ".join(described),
                        data.seq_len, data.packing)
