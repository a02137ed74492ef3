"""From the `data:` and `finetune:` config sections to a tokenizer and SFT train/valid examples.

Every rank tokenizes the SFT file itself, in memory: instruction sets are small (Alpaca's
999 records take about a second), so there is no cache to share between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.datasets import SFTDataset, collate_sft, split_train_valid
from data.sources import is_json
from data.tokenizer import Tokenizer, load_tokenizer
from trainer.config import Config
from trainer.pretrain_data import DataError


@dataclass
class FinetuneData:
    tokenizer: Tokenizer
    dataset: SFTDataset
    train_indices: np.ndarray
    valid_indices: np.ndarray
    source: str

    def batch(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of examples `indices`, right-padded to the longest: the target is
        -100 over the prompt and the padding, so the loss covers response tokens (and EOS) only.
        Right padding needs no attention mask: causal attention never looks ahead to it."""
        batch = collate_sft([self.dataset[i] for i in indices], pad_id=self.tokenizer.pad_id)
        return batch["tokens"][:, :-1].to(device), batch["labels"][:, 1:].to(device)


def prepare_finetuning(cfg: Config) -> FinetuneData:
    data, ft = cfg.data, cfg.finetune
    path = Path(data.path)
    if not (path.is_file() and is_json(path)):
        raise DataError(f"data.path {data.path!r}: {'not a JSON file' if path.is_file() else 'no such file'}; "
                        f"fine-tuning reads an SFT data set from a .json / .jsonl(.gz) file (docs/finetune.md)")
    tokenizer = load_tokenizer(data.tokenizer or ft.hf_checkpoint)
    try:
        # seq_len + 1 tokens give seq_len inputs and targets after the shift, as in pretraining.
        dataset = SFTDataset(path, tokenizer, max_len=data.seq_len + 1,
                             format=None if ft.data_format == "auto" else ft.data_format)
    except (KeyError, ValueError) as e:  # they name the file, the record and the key
        raise DataError(str(e)) from e
    if len(dataset) < 2:
        raise DataError(f"data.path {data.path!r}: {len(dataset)} usable examples ({dataset.num_skipped} had no "
                        f"response left within data.seq_len {data.seq_len}); need at least 2")
    train_idx, valid_idx = split_train_valid(len(dataset), data.valid_fraction, cfg.train.seed)
    source = f"{path} ({dataset.format}, {dataset.num_skipped} skipped)"
    return FinetuneData(tokenizer, dataset, train_idx, valid_idx, source)
