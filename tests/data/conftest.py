"""Fixtures for data tests: tokenizers built from the shared data sets (tests/conftest.py) and the default corpus."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFRustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from data.corpus import default_corpus
from data.tokenizer import load_tokenizer, train_sentencepiece

@pytest.fixture(scope="session")
def sp_tokenizer(shakespeare, tmp_path_factory):
    """A 2000-piece BPE SentencePiece model trained on tinyshakespeare (well under a second)."""
    return train_sentencepiece([shakespeare], tmp_path_factory.mktemp("sp") / "tokenizer", 2000)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return default_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(corpus, tmp_path_factory) -> Path:
    """A checkpoint-like directory with a small byte-level BPE tokenizer.json and its special tokens.

    Trained on the default corpus, so these tests run without ../shared/data.
    """
    tok = HFRustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    directory = tmp_path_factory.mktemp("hf")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": {"content": "<s>", "special": True}}))
    (directory / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    return directory


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_dir):
    return load_tokenizer(hf_tokenizer_dir)
