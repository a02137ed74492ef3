import functools
import gzip
import json

import pytest
import torch

from data.datasets import (IGNORE_INDEX, PreferenceDataset, SFTDataset, alpaca_prompt, collate_preference,
                           collate_sft, split_hh_dialogue)


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
