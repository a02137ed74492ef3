"""Torch datasets for pretraining, SFT and preference pairs; the resumable sampler; collate functions.

Label convention, as Hugging Face's `labels`: `tokens` and `labels` have the same length and
are aligned, labels[i] being tokens[i] or IGNORE_INDEX (-100) where no loss is taken. The
trainer feeds `tokens[:, :-1]` and scores the logits against `labels[:, 1:]` (position t
predicts token t+1). A pretraining sample is a single tensor of seq_len + 1 tokens that plays
both roles: inputs `sample[:-1]`, targets `sample[1:]`.
"""

from __future__ import annotations

import os
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from data.chat import ChatTemplate, chat_example
from data.indexed import IndexedDataset
from data.sources import MissingKeyError, iter_json_records
from data.tokenizer import Tokenizer

IGNORE_INDEX = -100
ASSISTANT_MARKER = "\n\nAssistant:"


class PretrainDataset(torch.utils.data.Dataset):
    """The whole token stream cut into non-overlapping samples of seq_len + 1 tokens.

    Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]: consecutive samples share one
    token so every token is a target exactly once. Samples cross document boundaries, which
    the EOD tokens mark (as in nanoGPT and Megatron's GPT dataset).
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}; expected at least 1")
        self.indexed = indexed
        self.seq_len = seq_len
        self.num_samples = (indexed.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{indexed.prefix} has {indexed.num_tokens} tokens, too few for one sample "
                             f"of seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        start = i * self.seq_len
        return torch.from_numpy(self.indexed.tokens[start:start + self.seq_len + 1].astype(np.int64))


def split_train_valid(num_samples: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted (train, valid) sample ids; valid is a random `valid_fraction` fixed by `seed`.

    Pass the results to ResumableBatchSampler as `indices`.
    """
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction={valid_fraction}; expected 0 <= valid_fraction < 1")
    order = np.random.default_rng(seed).permutation(num_samples)
    num_valid = int(round(num_samples * valid_fraction))
    if valid_fraction > 0:
        num_valid = max(num_valid, 1)
    return np.sort(order[num_valid:]), np.sort(order[:num_valid])


class ResumableBatchSampler:
    """Infinite, resumable micro-batches of sample ids for one data-parallel rank.

    One global order is defined for all ranks: epoch e is a permutation of `indices` drawn from
    `np.random.default_rng([seed, epoch])` (or `indices` as given when shuffle=False), read in
    global micro-batches of `micro_batch_size * world_size` samples, of which rank r takes
    `[r*micro_batch_size : (r+1)*micro_batch_size]`. So one process with micro_batch_size
    `mbs * world` sees exactly the union of what `world` ranks see, and a run can resume on a
    different world size. The tail of an epoch smaller than `samples_per_step` (one optimizer
    step's samples, the global batch; default a global micro-batch) is dropped, so that the
    samples of step N are the same set whatever the world size, micro-batch and accumulation
    that make up the same global batch, in every epoch.

    `consumed_samples` counts global samples; a sampler built with the value a checkpoint saved
    continues with exactly the next micro-batch. The sampler advances it as it yields, but a
    DataLoader prefetches ahead of training, so checkpoints should save the trainer's own count
    (steps * global batch size), as Megatron does.

    Use as `DataLoader(dataset, batch_sampler=sampler)`.
    """

    def __init__(self, indices: Sequence[int] | np.ndarray, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, consumed_samples: int = 0, shuffle: bool = True, samples_per_step: int | None = None):
        self.indices = np.asarray(indices, dtype=np.int64)
        if self.indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {self.indices.shape}")
        if micro_batch_size < 1 or world_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}, world_size={world_size}; both must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}; expected 0 <= rank < world_size={world_size}")
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.global_batch_size = micro_batch_size * world_size
        step = samples_per_step or self.global_batch_size
        if step % self.global_batch_size:
            raise ValueError(f"samples_per_step={step} is not a multiple of the global micro-batch of "
                             f"{micro_batch_size} x {world_size} ranks = {self.global_batch_size}")
        self.samples_per_epoch = len(self.indices) - len(self.indices) % step
        if self.samples_per_epoch == 0:
            raise ValueError(f"{len(self.indices)} samples are fewer than one step's {step} "
                             f"(micro-batch {micro_batch_size} x {world_size} ranks x {step // self.global_batch_size} "
                             f"accumulated)")
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = self._checked(consumed_samples)

    def _checked(self, consumed_samples: int) -> int:
        if consumed_samples < 0 or consumed_samples % self.global_batch_size:
            raise ValueError(f"consumed_samples={consumed_samples}; expected a non-negative multiple of the "
                             f"global micro-batch {self.global_batch_size}")
        return consumed_samples

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of sample ids in `epoch` (all of `indices`, before the tail is dropped)."""
        if not self.shuffle:
            return self.indices
        return self.indices[np.random.default_rng([self.seed, epoch]).permutation(len(self.indices))]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            epoch, start = divmod(self.consumed_samples, self.samples_per_epoch)
            order = self.epoch_order(epoch)
            for begin in range(start, self.samples_per_epoch, self.global_batch_size):
                first = begin + self.rank * self.micro_batch_size
                self.consumed_samples += self.global_batch_size
                yield order[first:first + self.micro_batch_size].tolist()

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: Mapping) -> None:
        self.seed = state["seed"]
        self.consumed_samples = self._checked(state["consumed_samples"])


def alpaca_prompt(instruction: str, input_text: str | None = None) -> str:
    """Alpaca-style prompt; the `### Input:` section appears only when `input_text` is non-empty."""
    if input_text:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def split_hh_dialogue(text: str) -> tuple[str, str]:
    """(prompt, response) of an HH-RLHF dialogue: the prompt runs through the last `\\n\\nAssistant:`."""
    end = text.rfind(ASSISTANT_MARKER)
    if end < 0:
        raise ValueError(f"no {ASSISTANT_MARKER!r} in dialogue {text[:80]!r}...")
    end += len(ASSISTANT_MARKER)
    return text[:end], text[end:]


# format name -> keys a record must have
SFT_FORMATS = {"alpaca": ("instruction", "output"), "hh": ("chosen",), "completion": ("prompt", "completion"),
               "messages": ("messages",)}
PREFERENCE_FORMATS = {"pairs": ("prompt", "chosen", "rejected"), "hh": ("chosen", "rejected")}


def _load_records(source, formats: dict, format: str | None) -> tuple[list[dict], str, str]:
    """(records, format, name for messages) from a JSON/JSONL(.gz) path or a list of dicts."""
    if isinstance(source, (str, os.PathLike)):
        name, records = str(source), list(iter_json_records(source))
    else:
        name, records = "records", list(source)
    if not records:
        raise ValueError(f"{name}: no records")
    keys = set(records[0])
    if format is None:
        format = next((f for f, required in formats.items() if set(required) <= keys), None)
        if format is None:
            raise ValueError(f"{name}: cannot tell the format from keys {sorted(keys)}; supported formats "
                             + ", ".join(f"{f} (keys {list(r)})" for f, r in formats.items()))
    elif format not in formats:
        raise ValueError(f"format={format!r}; expected one of {list(formats)}")
    missing = [k for k in formats[format] if k not in keys]
    if missing:
        raise MissingKeyError(f"{name}: format {format!r} needs key {missing[0]!r}; "
                              f"the records have keys {sorted(keys)}")
    return records, format, name


def _field(record: dict, key: str, i: int, name: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{name}: record {i}: key {key!r} is {value!r}, expected a string")
    return value


def _supervised(prompt_ids: list[int], response_ids: list[int],
                max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens, labels) truncated to max_len with the prompt masked; None if no target survives."""
    return _truncated(np.asarray(prompt_ids + response_ids, dtype=np.int64),
                      np.asarray([IGNORE_INDEX] * len(prompt_ids) + response_ids, dtype=np.int64), max_len)


def _truncated(tokens: np.ndarray, labels: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    tokens, labels = tokens[:max_len], labels[:max_len]
    if not np.any(labels[1:] != IGNORE_INDEX):  # labels[0] is never a target
        return None
    return tokens, labels


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A prompt's tokens as every data set (and rlhf.py's generation) feeds them: BOS first."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(prompt)


def response_ids(tokenizer: Tokenizer, response: str) -> list[int]:
    """A response's tokens, EOS last: the model learns to stop."""
    return tokenizer.encode(response) + [tokenizer.eos_id]


class _TokenizedRecords(torch.utils.data.Dataset):
    """Tokenized examples held in memory (no tokenizer kept: cheap to send to DataLoader workers).

    `num_skipped` counts records that gave no example.
    """

    def __init__(self, max_len: int):
        if max_len < 2:
            raise ValueError(f"max_len={max_len}; expected at least 2")
        self.max_len = max_len
        self.examples: list[dict[str, np.ndarray]] = []
        self.num_skipped = 0

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self.examples[i].items()}


class SFTDataset(_TokenizedRecords):
    """Supervised fine-tuning examples: [BOS] prompt response EOS, loss on response and EOS only.

    Formats (auto-detected from the first record's keys, or given as `format=`):
    `alpaca`: instruction / input / output, prompt from `alpaca_prompt`;
    `hh`: HH-RLHF `chosen` dialogue, split by `split_hh_dialogue`;
    `completion`: TRL's prompt / completion records, the prompt verbatim;
    `messages`: TRL's conversational records, multi-turn, rendered with the tokenizer's chat
    template, the loss on every assistant turn (data/chat.py).
    Items are {"tokens", "labels"} int64 tensors truncated to `max_len`; records whose response
    is truncated away entirely are skipped (counted in `num_skipped`).
    """

    def __init__(self, source: str | os.PathLike | Sequence[dict], tokenizer: Tokenizer, max_len: int,
                 format: str | None = None):
        super().__init__(max_len)
        records, self.format, name = _load_records(source, SFT_FORMATS, format)
        template = ChatTemplate(tokenizer.path) if self.format == "messages" else None
        for i, record in enumerate(records):
            if template is not None:
                example = _truncated(*chat_example(template, tokenizer.encode, record.get("messages"),
                                                   IGNORE_INDEX, f"{name}: record {i}"), max_len)
            else:
                if self.format == "alpaca":
                    prompt = alpaca_prompt(_field(record, "instruction", i, name), record.get("input"))
                    response = _field(record, "output", i, name)
                elif self.format == "completion":  # TRL's prompt-completion records: the prompt verbatim
                    prompt, response = _field(record, "prompt", i, name), _field(record, "completion", i, name)
                else:
                    prompt, response = split_hh_dialogue(_field(record, "chosen", i, name))
                example = _supervised(prompt_ids(tokenizer, prompt), response_ids(tokenizer, response), max_len)
            if example is None:
                self.num_skipped += 1
            else:
                self.examples.append({"tokens": example[0], "labels": example[1]})


class PreferenceDataset(_TokenizedRecords):
    """Preference pairs: a shared prompt with a chosen and a rejected response, prompt masked.

    Formats: `pairs`: explicit prompt / chosen / rejected keys; `hh`: HH-RLHF `chosen` /
    `rejected` dialogues, each split by `split_hh_dialogue`. HH pairs whose two dialogues do
    not share the prompt (5 malformed records in the harmless-base test split) are skipped, as
    are pairs where truncation to `max_len` leaves a side with no response; `num_skipped`
    counts them. Items hold chosen_tokens, chosen_labels, rejected_tokens, rejected_labels.
    """

    def __init__(self, source: str | os.PathLike | Sequence[dict], tokenizer: Tokenizer, max_len: int,
                 format: str | None = None):
        super().__init__(max_len)
        records, self.format, name = _load_records(source, PREFERENCE_FORMATS, format)
        for i, record in enumerate(records):
            chosen, rejected = _field(record, "chosen", i, name), _field(record, "rejected", i, name)
            if self.format == "pairs":
                prompt = _field(record, "prompt", i, name)
            else:
                prompt, chosen = split_hh_dialogue(chosen)
                rejected_prompt, rejected = split_hh_dialogue(rejected)
                if rejected_prompt != prompt:
                    self.num_skipped += 1
                    continue
            prompt = prompt_ids(tokenizer, prompt)
            sides = [_supervised(prompt, response_ids(tokenizer, r), max_len) for r in (chosen, rejected)]
            if any(side is None for side in sides):
                self.num_skipped += 1
                continue
            (chosen_tokens, chosen_labels), (rejected_tokens, rejected_labels) = sides
            self.examples.append({"chosen_tokens": chosen_tokens, "chosen_labels": chosen_labels,
                                  "rejected_tokens": rejected_tokens, "rejected_labels": rejected_labels})


def _pad(tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], pad_id: int,
         length: int) -> dict[str, torch.Tensor]:
    out = {"tokens": torch.full((len(tokens), length), pad_id, dtype=torch.long),
           "labels": torch.full((len(tokens), length), IGNORE_INDEX, dtype=torch.long),
           "attention_mask": torch.zeros((len(tokens), length), dtype=torch.long)}
    for row, (t, l) in enumerate(zip(tokens, labels)):
        n = min(len(t), length)
        out["tokens"][row, :n] = t[:n]
        out["labels"][row, :n] = l[:n]
        out["attention_mask"][row, :n] = 1
    return out


def collate_sft(batch: Sequence[Mapping[str, torch.Tensor]], pad_id: int,
                max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad SFT items into {"tokens", "labels", "attention_mask"} of shape [batch, length].

    length is the longest item, or exactly `max_len` when given (longer items are truncated;
    fixed shapes suit compiled models). Padding has labels -100 and attention_mask 0. Feed
    `tokens[:, :-1]` and predict `labels[:, 1:]`. For a DataLoader:
    `collate_fn=functools.partial(collate_sft, pad_id=tokenizer.pad_id)`.
    """
    length = max_len if max_len is not None else max(len(x["tokens"]) for x in batch)
    return _pad([x["tokens"] for x in batch], [x["labels"] for x in batch], pad_id, length)


def collate_preference(batch: Sequence[Mapping[str, torch.Tensor]], pad_id: int,
                       max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad preference items into chosen_* and rejected_* tokens / labels / attention_mask.

    Both sides are padded to one length (the longest of either, or `max_len`) so the trainer
    can `torch.cat` them into one forward pass of 2 x batch rows. Same shift convention as
    `collate_sft`.
    """
    length = max_len if max_len is not None else max(
        max(len(x["chosen_tokens"]), len(x["rejected_tokens"])) for x in batch)
    out = {}
    for side in ("chosen", "rejected"):
        padded = _pad([x[f"{side}_tokens"] for x in batch], [x[f"{side}_labels"] for x in batch], pad_id, length)
        out.update({f"{side}_{k}": v for k, v in padded.items()})
    return out
