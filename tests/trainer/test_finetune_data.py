"""trainer/finetune_data.py: SFT sets tokenized once into an on-disk cache under data.cache_dir,
keyed by what decides their examples, reused by later runs and by the other ranks, rebuilt when
an input changes or the cache is damaged (issue 37, item 6)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import finetune
from data.datasets import SFTDataset, alpaca_prompt
from data.tokenizer import load_tokenizer
from trainer.config import parse_args
from trainer.finetune_data import prepare_finetuning
from trainer.spawn import run_ranks

WORDS = "apple river stone cloud green quick seven music paper light north table".split()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer.json with BOS / EOS / PAD, trained here."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([alpaca_prompt("Reverse the words.", " ".join(WORDS)) + " Repeat the words."] * 10, trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<s>", "pad_token": "<pad>"}))
    return directory


@pytest.fixture
def records(tmp_path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"instruction": "Reverse the words." if i % 2 else "Repeat the words.",
                                        "input": " ".join(WORDS[i % 9:i % 9 + 3]), "output": " ".join(WORDS[:i % 12])})
                            + "\n" for i in range(40)))
    return path


def config(tokenizer_dir, path, cache, *extra):
    return parse_args(["--finetune.hf_checkpoint", str(tokenizer_dir), "--data.path", str(path), "--data.seq_len", "64",
                       "--data.cache_dir", str(cache), *extra], finetune.defaults())


def examples(data) -> list[tuple[list[int], list[int]]]:
    return [(data.dataset[i]["tokens"].tolist(), data.dataset[i]["labels"].tolist()) for i in range(len(data.dataset))]


def in_memory(path, tokenizer_dir, seq_len=64) -> list[tuple[list[int], list[int]]]:
    dataset = SFTDataset(path, load_tokenizer(tokenizer_dir), max_len=seq_len + 1)
    return [(item["tokens"].tolist(), item["labels"].tolist()) for item in dataset]


def test_cache_is_built_once_reused_and_rebuilt_when_an_input_changes(tokenizer_dir, records, tmp_path):
    cache = tmp_path / "cache"
    first = prepare_finetuning(config(tokenizer_dir, records, cache))
    assert "tokenized into" in first.source and "(alpaca, 0 skipped" in first.source
    assert examples(first) == in_memory(records, tokenizer_dir)
    [directory] = cache.iterdir()
    assert directory.name.startswith("sft-sft.jsonl-")
    stamp = [(p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())]

    again = prepare_finetuning(config(tokenizer_dir, records, cache))
    assert f"cached in {directory}" in again.source
    assert [(p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())] == stamp
    assert examples(again) == examples(first)
    assert again.train_indices.tolist() == first.train_indices.tolist()
    # The tokenizer is keyed by its files' contents: a copy elsewhere finds the same cache.
    copy = tmp_path / "copy"
    shutil.copytree(tokenizer_dir, copy)
    assert "cached in" in prepare_finetuning(config(tokenizer_dir, records, cache, "--data.tokenizer", str(copy))).source

    # Another seq_len, another tokenizer (BOS changed), another file content: each its own cache.
    shorter = prepare_finetuning(config(tokenizer_dir, records, cache, "--data.seq_len", "52"))
    assert "tokenized into" in shorter.source and examples(shorter) == in_memory(records, tokenizer_dir, 52)
    assert examples(shorter) != examples(first)
    (copy / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<pad>", "pad_token": "<pad>"}))
    other_bos = prepare_finetuning(config(tokenizer_dir, records, cache, "--data.tokenizer", str(copy)))
    assert "tokenized into" in other_bos.source and examples(other_bos) == in_memory(records, copy)
    assert examples(other_bos) != examples(first)
    with open(records, "a") as f:
        f.write(json.dumps({"instruction": "Repeat the words.", "input": "north", "output": "north"}) + "\n")
    grown = prepare_finetuning(config(tokenizer_dir, records, cache))
    assert "tokenized into" in grown.source and examples(grown) == in_memory(records, tokenizer_dir)
    assert len(grown.dataset) == len(first.dataset) + 1
    assert len(list(cache.iterdir())) == 4


def test_damaged_cache_is_named_and_rebuilt(tokenizer_dir, records, tmp_path):
    cache = tmp_path / "cache"
    first = prepare_finetuning(config(tokenizer_dir, records, cache))
    [directory] = cache.iterdir()
    tokens = directory / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-3])
    with pytest.warns(UserWarning, match=r"data.path '.*sft.jsonl': the SFT cache is unusable, rebuilding it: "
                                         r".*tokens.bin: \d+ bytes, but .*tokens.idx lists \d+ tokens"):
        rebuilt = prepare_finetuning(config(tokenizer_dir, records, cache))
    assert "tokenized into" in rebuilt.source and examples(rebuilt) == examples(first)
    assert [p.name for p in cache.iterdir()] == [directory.name]


def _prepare_on_rank(rank, world_size, tokenizer_dir, records, cache):
    data = prepare_finetuning(config(tokenizer_dir, records, cache))
    return data.source, examples(data)


@pytest.mark.parametrize("ranks_per_node", [2, 1])
def test_one_rank_per_node_builds_the_others_wait(tokenizer_dir, records, tmp_path, ranks_per_node):
    """2 ranks on one node: local rank 0 builds, rank 1 opens its cache after the barrier. 2 nodes
    of one rank sharing a file system: both build, the first rename wins, both read the same."""
    cache = tmp_path / "cache"
    (source0, examples0), (source1, examples1) = run_ranks(_prepare_on_rank, 2, (tokenizer_dir, records, cache),
                                                           ranks_per_node=ranks_per_node)
    assert "tokenized into" in source0
    assert ("cached in" if ranks_per_node == 2 else "tokenized into") in source1
    assert examples0 == examples1 == in_memory(records, tokenizer_dir)
    assert len(list(cache.iterdir())) == 1  # nothing temporary left


def test_mixed_sets_are_cached_apart(tokenizer_dir, records, tmp_path):
    """finetune.mix sets get a cache each; the mixture indexes their examples, one after the other."""
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"Count to {i}:", "completion": " ".join(WORDS[:i])}) + "\n"
                             for i in range(2, 8)))
    data = prepare_finetuning(config(tokenizer_dir, records, tmp_path / "cache", "--finetune.mix", str(small),
                                     "--finetune.mix_weights", "1,1"))
    first, second = data.dataset.datasets
    assert (first.format, second.format) == ("alpaca", "completion") and len(list((tmp_path / "cache").iterdir())) == 2
    expected = in_memory(records, tokenizer_dir) + [
        (item["tokens"].tolist(), item["labels"].tolist())
        for item in SFTDataset(small, load_tokenizer(tokenizer_dir), max_len=65)]
    assert examples(data) == expected
    inputs, targets = data.batch(data.train_indices[:4].tolist(), torch.device("cpu"))
    assert inputs["tokens"].shape == targets.shape
