"""Where the stages' examples come from: HH pairs and prompts, Alpaca prompts, prompt/chosen/rejected files."""

import json
import pytest
import torch

from data.datasets import alpaca_prompt, prompt_ids, split_hh_dialogue
from data.sources import iter_json_records
from data.tokenizer import load_tokenizer
from rlhf.config import RLHFConfig
from rlhf.data import load_preferences, load_prompts, sft_file
from rlhf.tasks import save_task_tokenizer
from trainer.distributed import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_task_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer"))


def _cfg(tmp_path, **data) -> RLHFConfig:
    cfg = RLHFConfig()
    cfg.train.out_dir = str(tmp_path)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_hh_pairs_prompts_and_sft_side(tmp_path, tokenizer, hh_path):
    hh = hh_path
    cfg = _cfg(tmp_path, preferences=str(hh), max_len=512, max_prompt_len=64)
    prefs = load_preferences(cfg, tokenizer, ENV)
    assert len(prefs.train_indices) + len(prefs.valid_indices) == len(prefs.dataset)
    assert not set(prefs.train_indices) & set(prefs.valid_indices)
    prompts = load_prompts(cfg, tokenizer, ENV)
    records = list(iter_json_records(hh))
    expected = list(dict.fromkeys(split_hh_dialogue(r["chosen"])[0] for r in records))
    assert prompts.texts == expected  # every HH prompt once, in file order
    assert prompts.tokens[0] == prompt_ids(tokenizer, expected[0])[-64:]
    assert sft_file(cfg, ENV) == (hh, "hh")


def test_alpaca_prompts(tmp_path, tokenizer, alpaca_path):
    alpaca = alpaca_path
    prompts = load_prompts(_cfg(tmp_path, prompts=str(alpaca)), tokenizer, ENV)
    first = json.loads(alpaca.read_text())[0]
    assert prompts.texts[0] == alpaca_prompt(first["instruction"], first.get("input"))


def test_prompt_chosen_rejected_records_feed_sft_with_the_chosen_side(tmp_path, tokenizer):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}?", "chosen": f"yes {i}", "rejected": "no"}) + "\n"
                             for i in range(4)))
    path, fmt = sft_file(_cfg(tmp_path, preferences=str(pairs)), ENV)
    assert fmt == "completion"
    assert list(iter_json_records(path)) == [{"prompt": f"q{i}?", "completion": f"yes {i}"} for i in range(4)]
