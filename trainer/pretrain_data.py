"""From a `data:` config section to a tokenizer and packed train/valid samples, cached on disk.

Rank 0 does the work (train a tokenizer when none is given, tokenize into a Megatron
.bin/.idx store) under a cache key made of the inputs, so a second run, or the other ranks
after a barrier, just open the files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.corpus import default_corpus
from data.datasets import PretrainDataset, split_train_valid
from data.indexed import IndexedDataset, tokenize_to_indexed
from data.sources import documents_as_text
from data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from trainer.config import DataSection
from trainer.distributed import barrier


class DataError(ValueError):
    """A data source that cannot be used; the message names it and says why."""


@dataclass
class PretrainData:
    tokenizer: Tokenizer
    dataset: PretrainDataset
    train_indices: np.ndarray
    valid_indices: np.ndarray
    source: str

    def batch(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of samples `indices`: each sample's first and last seq_len tokens."""
        samples = torch.stack([self.dataset[i] for i in indices]).to(device)
        return samples[:, :-1], samples[:, 1:]


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_indexed_prefix(path: str) -> bool:
    return Path(path + ".idx").is_file() and Path(path + ".bin").is_file()


def prepare_pretraining(cfg: DataSection, seq_len: int, seed: int, rank: int = 0) -> PretrainData:
    cache = Path(cfg.cache_dir)
    if cfg.path == "default":
        if rank == 0:
            default_corpus(cache)
        barrier()
        source = default_corpus(cache)
    elif _is_indexed_prefix(cfg.path):
        source = None
    else:
        source = Path(cfg.path)
        if not source.is_file():
            raise DataError(
                f"data.path {cfg.path!r}: no such file (expected a text/json/jsonl file, "
                f"a .bin/.idx prefix, or 'default')"
            )

    if source is None:  # a preprocessed token store: the tokenizer must come with it
        if cfg.tokenizer is None:
            raise DataError(
                f"data.path {cfg.path!r} is a preprocessed .bin/.idx store; set data.tokenizer to the "
                f"tokenizer it was made with"
            )
        tokenizer = load_tokenizer(cfg.tokenizer)
        indexed = IndexedDataset(cfg.path)
        name = cfg.path
    else:
        key = {"source": _fingerprint(source), "json_key": cfg.json_key}
        if cfg.tokenizer is None:
            key["sentencepiece_vocab"] = cfg.vocab_size
        else:
            key["tokenizer"] = _fingerprint(Path(cfg.tokenizer))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        work = cache / f"{source.stem}-{digest}"
        prefix = work / "tokens"
        spm_model = work / "tokenizer.model"
        if rank == 0 and not _is_indexed_prefix(str(prefix)):
            work.mkdir(parents=True, exist_ok=True)
            if cfg.tokenizer is None and not spm_model.is_file():
                spm_input = documents_as_text(source, cfg.json_key, work / "documents.txt")
                train_sentencepiece([str(spm_input)], str(work / "tokenizer"), cfg.vocab_size)
            tokenize_to_indexed(
                str(source), cfg.tokenizer or str(spm_model), str(prefix), json_key=cfg.json_key,
                workers=cfg.workers,
            )
        barrier()
        tokenizer = load_tokenizer(cfg.tokenizer or str(spm_model))
        indexed = IndexedDataset(str(prefix))
        name = str(source)

    dataset = PretrainDataset(indexed, seq_len)
    if len(dataset) < 2:
        raise DataError(
            f"data.path {cfg.path!r} holds {indexed.num_tokens} tokens: too few for even two samples of "
            f"seq_len {seq_len}"
        )
    train_idx, valid_idx = split_train_valid(len(dataset), cfg.valid_fraction, seed)
    return PretrainData(tokenizer, dataset, train_idx, valid_idx, name)
