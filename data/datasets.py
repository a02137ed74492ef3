"""Torch datasets for pretraining, SFT and preference pairs; the resumable sampler; collate functions.

Label convention, as Hugging Face's `labels`: `tokens` and `labels` have the same length and
are aligned, labels[i] being tokens[i] or IGNORE_INDEX (-100) where no loss is taken. The
trainer feeds `tokens[:, :-1]` and scores the logits against `labels[:, 1:]` (position t
predicts token t+1). A pretraining sample is a single tensor of seq_len + 1 tokens that plays
both roles: inputs `sample[:-1]`, targets `sample[1:]`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from data.chat import ChatTemplate, chat_example
from data.indexed import BadIndexedFile, IndexedDataset, IndexedDatasetBuilder, best_dtype
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


def _records(source, formats: dict, format: str | None) -> tuple[Iterator[dict], str, str]:
    """(records, format, name for messages) from a JSON/JSONL(.gz) path or a list of dicts. A path's
    records are streamed, one at a time: the format is told from the first."""
    if isinstance(source, (str, os.PathLike)):
        name, records = str(source), iter_json_records(source)
    else:
        name, records = "records", iter(source)
    first = next(records, None)
    if first is None:
        raise ValueError(f"{name}: no records")
    keys = set(first)
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
    return itertools.chain([first], records), format, name


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


def sft_examples(source: str | os.PathLike | Sequence[dict], tokenizer: Tokenizer, max_len: int,
                 format: str | None = None) -> tuple[str, Iterator[tuple[np.ndarray, np.ndarray] | None]]:
    """(format, examples): each record's (tokens, labels) in order, None for a record that gives
    none. One record at a time, so that an SFT cache can be written from a file larger than memory.

    Formats (auto-detected from the first record's keys, or given as `format=`):
    `alpaca`: instruction / input / output, prompt from `alpaca_prompt`;
    `hh`: HH-RLHF `chosen` dialogue, split by `split_hh_dialogue`;
    `completion`: TRL's prompt / completion records, the prompt verbatim;
    `messages`: TRL's conversational records, multi-turn, rendered with the tokenizer's chat
    template, the loss on every assistant turn (data/chat.py).
    An example is int64 tokens and labels truncated to `max_len`; a record whose response is
    truncated away entirely gives None.
    """
    if max_len < 2:
        raise ValueError(f"max_len={max_len}; expected at least 2")
    records, format, name = _records(source, SFT_FORMATS, format)
    template = ChatTemplate(tokenizer.path) if format == "messages" else None

    def examples():
        for i, record in enumerate(records):
            if template is not None:
                yield _truncated(*chat_example(template, tokenizer.encode, record.get("messages"),
                                               IGNORE_INDEX, f"{name}: record {i}"), max_len)
                continue
            if format == "alpaca":
                prompt = alpaca_prompt(_field(record, "instruction", i, name), record.get("input"))
                response = _field(record, "output", i, name)
            elif format == "completion":  # TRL's prompt-completion records: the prompt verbatim
                prompt, response = _field(record, "prompt", i, name), _field(record, "completion", i, name)
            else:
                prompt, response = split_hh_dialogue(_field(record, "chosen", i, name))
            yield _supervised(prompt_ids(tokenizer, prompt), response_ids(tokenizer, response), max_len)

    return format, examples()


class SFTDataset(_TokenizedRecords):
    """Supervised fine-tuning examples held in memory: [BOS] prompt response EOS, loss on response
    and EOS only (`sft_examples` says how each format is read). Items are {"tokens", "labels"}
    int64 tensors; records left without a target are skipped (counted in `num_skipped`).
    Fine-tuning reads its data sets through `SFTCache` instead, which keeps nothing in memory.
    """

    def __init__(self, source: str | os.PathLike | Sequence[dict], tokenizer: Tokenizer, max_len: int,
                 format: str | None = None):
        super().__init__(max_len)
        self.format, examples = sft_examples(source, tokenizer, max_len, format)
        for example in examples:
            if example is None:
                self.num_skipped += 1
            else:
                self.examples.append({"tokens": example[0], "labels": example[1]})


class SFTCache(torch.utils.data.Dataset):
    """SFT examples tokenized once into a directory (`build_sft_cache`) and read lazily through
    memory maps, so a rank's memory does not grow with the data set: Megatron `.bin/.idx` pairs
    (data/indexed.py), `tokens` (one sequence per example) and `targets` (uint8, 1 where the label
    is the token, 0 where it is -100), and `meta.json` (the key it was built for, the format, the
    counts), written last. Items equal `SFTDataset`'s for the same records.

    A directory that does not hold what its meta.json says (truncated, corrupt, another key) raises
    BadIndexedFile naming the file: the caller rebuilds it.
    """

    def __init__(self, directory: str | os.PathLike, key: dict | None = None):
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            self.format, self.num_skipped, count, num_tokens = (meta["format"], meta["skipped"], meta["examples"],
                                                                meta["tokens"])
        except FileNotFoundError:
            raise BadIndexedFile(f"{meta_path}: missing (an interrupted or foreign cache)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise BadIndexedFile(f"{meta_path}: unreadable ({type(e).__name__}: {e}; truncated?)") from None
        if key is not None and meta.get("key") != key:
            raise BadIndexedFile(f"{meta_path}: built for {meta.get('key')}, not {key}")
        try:
            self.tokens = IndexedDataset(self.directory / "tokens")
            self.targets = IndexedDataset(self.directory / "targets")
        except FileNotFoundError as e:
            raise BadIndexedFile(str(e)) from None
        if (len(self.tokens), self.tokens.num_tokens) != (count, num_tokens) or self.targets.dtype != np.uint8 \
                or not np.array_equal(self.tokens.sequence_lengths, self.targets.sequence_lengths):
            raise BadIndexedFile(f"{self.directory}: tokens ({len(self.tokens)} examples, {self.tokens.num_tokens} "
                                 f"tokens) and targets ({len(self.targets)} examples) do not match {meta_path} "
                                 f"({count} examples, {num_tokens} tokens)")

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[i].astype(np.int64)
        labels = np.where(self.targets[i] != 0, tokens, IGNORE_INDEX)
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels)}


def build_sft_cache(directory: str | os.PathLike, source: str | os.PathLike, tokenizer: Tokenizer, max_len: int,
                    format: str | None = None, key: dict | None = None) -> SFTCache:
    """Tokenize `source` record by record (`sft_examples`) into the SFTCache `directory`.

    Everything is written into a temporary directory beside it, renamed into place at the end: an
    interrupted build leaves nothing under the final name. Builders racing for one directory (the
    nodes of a run on a shared file system) each write their own; the first rename wins and the
    others keep it (same key, same bytes). A directory already there that does not open (corrupt,
    another key) is replaced.
    """
    directory = Path(directory)
    tmp = directory.with_name(f"{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        format, examples = sft_examples(source, tokenizer, max_len, format)
        counts = {"examples": 0, "skipped": 0, "tokens": 0}
        with IndexedDatasetBuilder(tmp / "tokens", best_dtype(tokenizer.vocab_size)) as tokens, \
                IndexedDatasetBuilder(tmp / "targets", np.uint8) as targets:
            for example in examples:
                if example is None:
                    counts["skipped"] += 1
                    continue
                tokens.add_document(example[0])
                targets.add_document((example[1] != IGNORE_INDEX).astype(np.uint8))
                counts["examples"] += 1
                counts["tokens"] += len(example[0])
        (tmp / "meta.json").write_text(json.dumps({"key": key, "format": format, **counts}, indent=1),
                                       encoding="utf-8")
        _move_into_place(tmp, directory, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return SFTCache(directory, key)


def _move_into_place(tmp: Path, directory: Path, key: dict | None) -> None:
    for attempt in range(3):  # bounded: racing builders settle within a round or two
        try:
            os.rename(tmp, directory)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        try:  # the name is taken: by a racing builder's cache (same key, same bytes: keep it), or a bad one
            SFTCache(directory, key)
            return
        except (OSError, ValueError):
            pass
        stale = directory.with_name(f"{directory.name}.stale-{socket.gethostname()}-{os.getpid()}-{attempt}")
        with contextlib.suppress(FileNotFoundError):  # another builder may have moved it already
            os.rename(directory, stale)  # out of the way first: readers never see a half-deleted cache
        shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"cannot rename {tmp} to {directory}: other processes keep replacing it")


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
        records, self.format, name = _records(source, PREFERENCE_FORMATS, format)
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
