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

    def batch(self, indices: list[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's inputs and the targets of samples `indices`: each sample's first and last
        seq_len tokens."""
        samples = torch.stack([self.dataset[i] for i in indices])
        check_token_ids(samples, self.tokenizer.vocab_size, self.source, indices)
        samples = samples.to(device)
        return {"tokens": samples[:, :-1]}, samples[:, 1:]


def check_token_ids(samples: torch.Tensor, vocab_size: int, source: str, indices: list[int]) -> None:
    """Token ids outside the tokenizer's vocabulary (a .bin made with another tokenizer) are an
    error naming the data, the sample and the id, not an IndexError deep in the embedding."""
    if samples.numel() and (samples.max() >= vocab_size or samples.min() < 0):
        row = int(((samples >= vocab_size) | (samples < 0)).any(dim=1).nonzero()[0])
        bad = samples[row][(samples[row] >= vocab_size) | (samples[row] < 0)][0]
        raise DataError(f"data.path {source!r}: sample {indices[row]} holds token id {int(bad)}, outside the "
                        f"tokenizer's {vocab_size} ids: the token store was made with another tokenizer than "
                        f"data.tokenizer (preprocess it again, or set data.tokenizer to the one it was made with)")


def _explain(cfg: DataSection, error: ValueError) -> str:
    """SentencePiece's and the readers' failures, said in terms of the config."""
    text = str(error)
    if "sentences_.empty()" in text:
        return f"data.path {cfg.path!r} holds no text (only blank lines?): nothing to train a tokenizer on"
    if "Vocabulary size too high" in text:
        limit = text.rsplit("<=", 1)[-1].strip(" .")
        return (f"data.path {cfg.path!r} is too small (or too repetitive) for data.vocab_size {cfg.vocab_size}: "
                f"SentencePiece can make at most {limit} tokens of it; lower data.vocab_size or use more text")
    if "UTF-8" in text:
        return f"data.path {cfg.path!r} is not UTF-8 text (a binary file?): {text}"
    return f"data.path {cfg.path!r}: {text}"


def file_fingerprint(path: Path) -> dict:
    """What says a data file changed, for a cache key (pretraining's token store, the SFT caches): its resolved
    path, size and modification time; reading its bytes would cost every rank a pass over a large corpus."""
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
        if source.is_dir():
            prefixes = sorted(str(p.with_suffix("")) for p in source.glob("*.idx") if p.with_suffix(".bin").is_file())
            hint = f"; it holds the token store {prefixes[0]!r}: give that prefix" if prefixes else ""
            raise DataError(f"data.path {cfg.path!r} is a directory (expected a text/json/jsonl file, a .bin/.idx "
                            f"prefix, or 'default'){hint}")
        if not source.is_file():
            raise DataError(
                f"data.path {cfg.path!r}: no such file (expected a text/json/jsonl file, "
                f"a .bin/.idx prefix, or 'default')"
            )
        if source.stat().st_size == 0:
            raise DataError(f"data.path {cfg.path!r} is empty: there is no text to train on")

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
        key = {"source": file_fingerprint(source), "json_key": cfg.json_key}
        if cfg.tokenizer is None:
            key["sentencepiece_vocab"] = cfg.vocab_size
        else:
            key["tokenizer"] = file_fingerprint(Path(cfg.tokenizer))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        work = cache / f"{source.stem}-{digest}"
        prefix = work / "tokens"
        spm_model = work / "tokenizer.model"
        if rank == 0 and not _is_indexed_prefix(str(prefix)):
            work.mkdir(parents=True, exist_ok=True)
            try:
                if cfg.tokenizer is None and not spm_model.is_file():
                    spm_input = documents_as_text(source, cfg.json_key, work / "documents.txt")
                    train_sentencepiece([str(spm_input)], str(work / "tokenizer"), cfg.vocab_size)
                tokenize_to_indexed(
                    str(source), cfg.tokenizer or str(spm_model), str(prefix), json_key=cfg.json_key,
                    workers=cfg.workers,
                )
            except ValueError as e:
                raise DataError(_explain(cfg, e)) from e
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
