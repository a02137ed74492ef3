import functools
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.datasets import (IGNORE_INDEX, PreferenceDataset, SFTCache, SFTDataset, alpaca_prompt, build_sft_cache,
                           collate_preference, collate_sft, split_hh_dialogue)
from data.indexed import BadIndexedFile

ROOT = Path(__file__).resolve().parents[2]


def load_hh(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def check_example(tok, tokens, labels, prompt, response):
    """Labels mask exactly [BOS] + prompt; the unmasked part decodes to the response, then EOS."""
    n_prompt = len(tok.encode(prompt)) + (tok.bos_id is not None)
    assert tokens.dtype == labels.dtype == torch.int64 and tokens.shape == labels.shape
    assert (labels[:n_prompt] == IGNORE_INDEX).all()
    assert (labels[n_prompt:] != IGNORE_INDEX).all()
    assert torch.equal(labels[n_prompt:], tokens[n_prompt:])
    if tok.bos_id is not None:
        assert tokens[0] == tok.bos_id
    assert tokens[-1] == tok.eos_id
    assert tok.decode(tokens[:n_prompt].tolist()) == prompt
    assert tok.decode(labels[n_prompt:].tolist()) == response


def test_alpaca_prompt_template():
    assert alpaca_prompt("Add.", "1+1") == "### Instruction:\nAdd.\n\n### Input:\n1+1\n\n### Response:\n"
    assert alpaca_prompt("Say hi.", "") == "### Instruction:\nSay hi.\n\n### Response:\n"


def test_sft_alpaca(alpaca_path, sp_tokenizer):
    records = json.loads(alpaca_path.read_text(encoding="utf-8"))
    ds = SFTDataset(alpaca_path, sp_tokenizer, max_len=16384)
    assert ds.format == "alpaca" and len(ds) == len(records) == 999 and ds.num_skipped == 0
    assert any(r["input"] for r in records) and any(not r["input"] for r in records)
    for item, record in zip(ds, records):
        check_example(sp_tokenizer, item["tokens"], item["labels"],
                      alpaca_prompt(record["instruction"], record["input"]), record["output"])


def test_sft_hh_with_hf_tokenizer(hh_path, hf_tokenizer):
    records = load_hh(hh_path)[:300]
    ds = SFTDataset(records, hf_tokenizer, max_len=100_000)
    assert ds.format == "hh" and len(ds) == 300
    for item, record in zip(ds, records):
        prompt, response = split_hh_dialogue(record["chosen"])
        assert prompt.endswith("\n\nAssistant:") and "\n\nAssistant:" not in response
        assert prompt + response == record["chosen"]
        check_example(hf_tokenizer, item["tokens"], item["labels"], prompt, response)


def test_sft_truncation_skips_examples_without_targets(alpaca_path, sp_tokenizer):
    ds = SFTDataset(alpaca_path, sp_tokenizer, max_len=64)
    assert len(ds) + ds.num_skipped == 999 and ds.num_skipped > 0
    for item in ds:
        assert len(item["tokens"]) <= 64 and (item["labels"][1:] != IGNORE_INDEX).any()


def test_preference_hh_shares_prompt(hh_path, sp_tokenizer):
    records = load_hh(hh_path)
    ds = PreferenceDataset(hh_path, sp_tokenizer, max_len=100_000)
    assert ds.format == "hh"
    kept = [r for r in records if split_hh_dialogue(r["chosen"])[0] == split_hh_dialogue(r["rejected"])[0]]
    assert ds.num_skipped == 5 and len(ds) == len(kept) == len(records) - 5
    for item, record in zip(ds, kept):
        prompt, chosen = split_hh_dialogue(record["chosen"])
        rejected = record["rejected"][len(prompt):]
        check_example(sp_tokenizer, item["chosen_tokens"], item["chosen_labels"], prompt, chosen)
        check_example(sp_tokenizer, item["rejected_tokens"], item["rejected_labels"], prompt, rejected)
        n = int((item["chosen_labels"] == IGNORE_INDEX).sum())
        assert n == int((item["rejected_labels"] == IGNORE_INDEX).sum())
        assert torch.equal(item["chosen_tokens"][:n], item["rejected_tokens"][:n])


def test_preference_explicit_pairs(sp_tokenizer):
    ds = PreferenceDataset([{"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}], sp_tokenizer, max_len=64)
    assert ds.format == "pairs"
    check_example(sp_tokenizer, ds[0]["chosen_tokens"], ds[0]["chosen_labels"], "Q: 2+2?\nA:", " 4")
    check_example(sp_tokenizer, ds[0]["rejected_tokens"], ds[0]["rejected_labels"], "Q: 2+2?\nA:", " 5")


def test_collate_sft_padding_and_shift(alpaca_path, sp_tokenizer):
    ds = SFTDataset(alpaca_path, sp_tokenizer, max_len=512)
    items = [ds[i] for i in range(4)]
    lengths = [len(x["tokens"]) for x in items]
    batch = collate_sft(items, pad_id=sp_tokenizer.pad_id)
    assert set(batch) == {"tokens", "labels", "attention_mask"}
    assert batch["tokens"].shape == batch["labels"].shape == (4, max(lengths))
    for row, (item, n) in enumerate(zip(items, lengths)):
        assert torch.equal(batch["tokens"][row, :n], item["tokens"])
        assert torch.equal(batch["labels"][row, :n], item["labels"])
        assert (batch["tokens"][row, n:] == sp_tokenizer.pad_id).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
    # the trainer's shift: inputs tokens[:, :-1], targets labels[:, 1:]
    inputs, targets = batch["tokens"][:, :-1], batch["labels"][:, 1:]
    first_target = (targets[0] != IGNORE_INDEX).nonzero()[0].item()
    assert targets[0, first_target] == inputs[0, first_target + 1]

    fixed = collate_sft(items, pad_id=sp_tokenizer.pad_id, max_len=32)
    assert fixed["tokens"].shape == (4, 32)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=functools.partial(collate_sft, pad_id=0))
    assert next(iter(loader))["tokens"].shape[0] == 3


def test_collate_preference(hh_path, sp_tokenizer):
    ds = PreferenceDataset(load_hh(hh_path)[:6], sp_tokenizer, max_len=4096)
    batch = collate_preference([ds[i] for i in range(len(ds))], pad_id=sp_tokenizer.pad_id)
    longest = max(max(len(x["chosen_tokens"]), len(x["rejected_tokens"])) for x in ds)
    for side in ("chosen", "rejected"):
        for key in ("tokens", "labels", "attention_mask"):
            assert batch[f"{side}_{key}"].shape == (len(ds), longest)
        assert batch[f"{side}_attention_mask"].sum() == sum(len(x[f"{side}_tokens"]) for x in ds)


def test_sft_errors(tmp_path, sp_tokenizer):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        SFTDataset(tmp_path / "absent.jsonl", sp_tokenizer, max_len=64)
    with pytest.raises(ValueError, match=r"keys \['answer', 'question'\]; supported formats alpaca"):
        SFTDataset([{"question": "q", "answer": "a"}], sp_tokenizer, max_len=64)
    with pytest.raises(KeyError, match="format 'alpaca' needs key 'instruction'"):
        SFTDataset([{"chosen": "x"}], sp_tokenizer, max_len=64, format="alpaca")
    with pytest.raises(ValueError, match="format='chat'"):
        SFTDataset([{"chosen": "x"}], sp_tokenizer, max_len=64, format="chat")
    with pytest.raises(ValueError, match="no '\\\\n\\\\nAssistant:'"):
        SFTDataset([{"chosen": "\n\nHuman: hi"}], sp_tokenizer, max_len=64)
    with pytest.raises(ValueError, match="record 1: key 'output' is None"):
        SFTDataset([{"instruction": "a", "output": "b"}, {"instruction": "c"}], sp_tokenizer, max_len=64)
    with pytest.raises(ValueError, match="supported formats pairs"):
        PreferenceDataset([{"chosen": "x"}], sp_tokenizer, max_len=64)
    # A JSON Lines file is read a line at a time: a broken line or a non-object is named by its number.
    path = tmp_path / "broken.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n')
    with pytest.raises(ValueError, match=r"cannot read .*broken.jsonl as JSON or JSON Lines: line 3: Expecting value"):
        SFTDataset(path, sp_tokenizer, max_len=64)
    path.write_text('{"instruction": "a", "output": "b"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"broken.jsonl as JSON or JSON Lines: line 2 is \[1, 2\], expected an object"):
        SFTDataset(path, sp_tokenizer, max_len=64)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer.json with ChatML's special tokens and template, made here."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["You are terse. What is two plus two? Four. And three? Three, twice over."] * 20, trainer)
    directory = tmp_path_factory.mktemp("chatml")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}))
    return directory


def test_messages_are_rendered_with_the_chat_template_and_train_assistant_turns_only(chatml_tokenizer, tmp_path):
    """Issue 37, item 6: TRL's conversational records, multi-turn; the tokens are the template's text
    (compared with a conversation written out by hand), and exactly the assistant turns (content and
    end of turn) are targets."""
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(chatml_tokenizer)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
            {"role": "assistant", "content": "Three, twice over."}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": chat[:3]}) + "\n")
    ds = SFTDataset(path, tok, max_len=512)
    assert ds.format == "messages" and len(ds) == 2
    pieces = [("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
               "<|im_start|>assistant\n", False), ("Four.<|im_end|>\n", True),
              ("<|im_start|>user\nAnd three?<|im_end|>\n<|im_start|>assistant\n", False),
              ("Three, twice over.<|im_end|>\n", True)]
    expected_tokens, expected_labels = [], []
    for text, trained in pieces:
        ids = tok.encode(text)
        expected_tokens += ids
        expected_labels += ids if trained else [IGNORE_INDEX] * len(ids)
    item = ds[0]
    assert item["tokens"].tolist() == tok.encode("".join(text for text, _ in pieces)) == expected_tokens
    assert item["labels"].tolist() == expected_labels
    assert tok.decode([t for t in item["labels"].tolist() if t != IGNORE_INDEX]) == "Four.\nThree, twice over.\n"
    # Truncated inside the first answer: still an example; before it: skipped and counted.
    first_answer = len(tok.encode(pieces[0][0]))
    assert len(SFTDataset(path, tok, max_len=first_answer + 2)) == 2
    short = SFTDataset(path, tok, max_len=first_answer)
    assert len(short) == 0 and short.num_skipped == 2


def test_bad_chat_records_and_templates_are_named(chatml_tokenizer, tmp_path):
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(chatml_tokenizer)
    path = tmp_path / "bad.jsonl"
    for messages, match in [([{"role": "user", "content": "hi"}], "record 0: no assistant message"),
                            ([{"role": "robot", "content": "hi"}], r"record 0: message 0 is .*expected \{'role'"),
                            ("hi", "record 0: 'messages' is 'hi', expected a non-empty list")]:
        path.write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(ValueError, match=match):
            SFTDataset(path, tok, max_len=64)
    # A template that rewrites earlier turns (here: it numbers turns from the end) cannot be masked.
    config = json.loads((chatml_tokenizer / "tokenizer_config.json").read_text())
    rewriting = tmp_path / "rewriting"
    rewriting.mkdir()
    (rewriting / "tokenizer.json").write_text((chatml_tokenizer / "tokenizer.json").read_text())
    (rewriting / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": (
        "{% for m in messages %}{{ messages|length - loop.index }}{{ m['content'] }}{% endfor %}")}))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(ValueError, match="does not render message 1 .* as a continuation"):
        SFTDataset(path, load_tokenizer(rewriting), max_len=64)
    no_template = tmp_path / "plain"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_text((chatml_tokenizer / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="has no chat template"):
        SFTDataset(path, load_tokenizer(no_template), max_len=64)


def assert_same_examples(cache, dataset):
    """The cache's examples are the in-memory tokenization's: same count, skips, tokens and labels."""
    assert (cache.format, len(cache), cache.num_skipped) == (dataset.format, len(dataset), dataset.num_skipped)
    for i in range(len(dataset)):
        cached, held = cache[i], dataset[i]
        assert cached["tokens"].dtype == cached["labels"].dtype == torch.int64
        assert torch.equal(cached["tokens"], held["tokens"]) and torch.equal(cached["labels"], held["labels"])


def test_sft_cache_holds_the_in_memory_examples(alpaca_path, sp_tokenizer, chatml_tokenizer, tmp_path):
    """Issue 37, item 6: examples tokenized record by record into memory-mapped files are the ones
    SFTDataset holds in memory, for Alpaca (with and without records truncated away) and for
    multi-turn chats (several assistant turns masked apart)."""
    from data.tokenizer import load_tokenizer

    for max_len in (64, 4096):
        cache = build_sft_cache(tmp_path / f"alpaca-{max_len}", alpaca_path, sp_tokenizer, max_len)
        assert_same_examples(cache, SFTDataset(alpaca_path, sp_tokenizer, max_len))
    assert cache.num_skipped == 0 and SFTCache(tmp_path / "alpaca-64").num_skipped > 0
    assert isinstance(cache.tokens.tokens, np.memmap) and isinstance(cache.targets.tokens, np.memmap)

    tok = load_tokenizer(chatml_tokenizer)
    turns = [("You are terse.", None), ("What is two plus two?", "Four."), ("And three?", "Three, twice over."),
             ("And four?", "Four, twice over.")]
    chats = []
    for i in range(12):
        messages = [{"role": "system", "content": turns[0][0]}] if i % 2 else []
        for question, answer in turns[1:2 + i % 3]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages})
    path = tmp_path / "chats.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(c) + "\n" for c in chats).encode()))
    # Cut inside the first answer of the chats without a system message, before it in the others.
    short = len(tok.encode("<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n")) + 2
    for max_len in (short, 512):
        cache = build_sft_cache(tmp_path / f"chats-{max_len}", path, tok, max_len)
        assert_same_examples(cache, SFTDataset(path, tok, max_len))
        assert cache.format == "messages" and len(cache) >= 6
    assert SFTCache(tmp_path / f"chats-{short}").num_skipped == 6


def test_corrupt_or_truncated_sft_cache_is_named_and_rebuilt(alpaca_path, sp_tokenizer, tmp_path):
    key = {"for": "this test"}
    directory = tmp_path / "cache"
    source = tmp_path / "alpaca.jsonl"  # 100 records: each rebuild is quick
    source.write_text("".join(json.dumps(r) + "\n" for r in json.loads(alpaca_path.read_text())[:100]))
    fresh = build_sft_cache(directory, source, sp_tokenizer, 128, key=key)
    reference = [fresh[i] for i in range(len(fresh))]

    def truncate(name):
        file = directory / name
        file.write_bytes(file.read_bytes()[:-7])

    for damage, match in [(lambda: truncate("tokens.bin"), r"tokens.bin: \d+ bytes, but .*tokens.idx lists"),
                          (lambda: truncate("targets.idx"), r"targets.idx: \d+ bytes, expected"),
                          (lambda: truncate("meta.json"), r"meta.json: unreadable \(JSONDecodeError"),
                          (lambda: (directory / "meta.json").unlink(), r"meta.json: missing"),
                          (lambda: (directory / "targets.bin").unlink(), r"not found: .*targets.bin")]:
        damage()
        with pytest.raises(BadIndexedFile, match=match):
            SFTCache(directory, key)
        rebuilt = build_sft_cache(directory, source, sp_tokenizer, 128, key=key)
        assert all(torch.equal(rebuilt[i]["labels"], reference[i]["labels"]) for i in range(len(reference)))
    # A builder that lost the race to a valid cache keeps that one (same key, same bytes).
    inode = (directory / "tokens.bin").stat().st_ino
    build_sft_cache(directory, source, sp_tokenizer, 128, key=key)
    assert (directory / "tokens.bin").stat().st_ino == inode
    with pytest.raises(BadIndexedFile, match=r"meta.json: built for \{'for': 'this test'\}, not \{'other': 1\}"):
        SFTCache(directory, {"other": 1})
    # A targets file from another build (other lengths) is caught too.
    other = build_sft_cache(tmp_path / "other", source, sp_tokenizer, 64, key=key)
    for suffix in (".bin", ".idx"):
        (directory / f"targets{suffix}").write_bytes((other.directory / f"targets{suffix}").read_bytes())
    with pytest.raises(BadIndexedFile, match=r"cache: tokens \(\d+ examples, .*\) and targets \(\d+ examples\) do not match .*meta.json"):
        SFTCache(directory, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alpaca.jsonl", "cache", "other"]  # no temporary one left


MEMORY_PROBE = """
import json, sys
from data.datasets import build_sft_cache
from data.tokenizer import load_tokenizer

def peak():  # bytes
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) * 1024

tokenizer = load_tokenizer(sys.argv[1])
out = []
for path in sys.argv[2:]:
    cache = build_sft_cache(path + ".cache", path, tokenizer, max_len=4096)
    out.append({"peak": peak(), "examples": len(cache), "tokens": cache.tokens.num_tokens})
print(json.dumps(out))
"""


def test_sft_cache_build_memory_does_not_grow_with_the_records(hf_tokenizer_dir, tmp_path):
    """A process tokenizing a JSON Lines file of N records, then one of 8N, peaks (VmHWM) no higher
    for the second: it holds a record at a time, not the data set. Holding the 8N records' tokens
    and labels as int64 alone, as SFTDataset does, would cost 16 bytes a token more (plus each
    example's array headers): over 10 MB here."""
    words = "apple river stone cloud green quick seven music paper light north table".split()
    rng = np.random.default_rng(0)
    paths = []
    for n in (200, 1600):
        paths.append(tmp_path / f"{n}.jsonl")
        with open(paths[-1], "w") as f:
            for _ in range(n):
                f.write(json.dumps({"instruction": " ".join(rng.choice(words, 20)), "input": "",
                                    "output": " ".join(rng.choice(words, 130))}) + "\n")
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(hf_tokenizer_dir), *map(str, paths)],
                            capture_output=True, text=True, timeout=300, check=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    small, large = json.loads(result.stdout)
    assert (small["examples"], large["examples"]) == (200, 1600)
    holding = 16 * (large["tokens"] - small["tokens"])
    assert holding > 10e6
    print(f"peak RSS: {small['examples']} records {small['peak'] / 2**20:.1f} MiB, {large['examples']} records "
          f"{large['peak'] / 2**20:.1f} MiB; holding the extra tokens: {holding / 2**20:.1f} MiB")
    assert large["peak"] - small["peak"] < holding / 8, (small, large)
