"""Tokenizers behind one small interface: SentencePiece models and Hugging Face `tokenizer.json`.

Every tokenizer remembers the `path` it was loaded from, so worker processes and
checkpoints can re-create it with `load_tokenizer(path)` instead of pickling it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

import numpy as np
import sentencepiece as spm
import tokenizers

# Ids SentencePiece models trained here reserve, in Llama's order plus a real pad.
SP_UNK_ID, SP_BOS_ID, SP_EOS_ID, SP_PAD_ID = 0, 1, 2, 3
SP_FIXED_PIECES = 4 + 256  # those four and byte_fallback's 256 byte pieces: every vocabulary holds them

# Names looked for when an HF checkpoint does not say which token ends a document.
_WELL_KNOWN_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer; `encode` never adds BOS/EOS."""

    path: Path

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens (BOS/EOS/PAD) decode to nothing."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int:
        """Padding id; EOS when the tokenizer has none (padding is always masked anyway)."""
        return self.eos_id

    @abstractmethod
    def save(self, directory: str | os.PathLike) -> None:
        """Write this tokenizer's files into `directory` so `load_tokenizer(directory)` reloads it."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file."""

    def __init__(self, model_file: str | os.PathLike):
        self.path = Path(model_file)
        if not self.path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {self.path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.path} is not a readable SentencePiece model: {e}") from e
        if self._sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {self.path} defines no EOS piece (eos_id=-1); "
                             "one is needed to separate documents")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / "tokenizer.model"
        if target.resolve() != self.path.resolve():
            shutil.copyfile(self.path, target)


def train_sentencepiece(
    input_files: Sequence[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    *,
    input_sentence_size: int = 200_000,
    seed: int = 1234,
    num_threads: int = 2,
) -> SentencePieceTokenizer:
    """Train `<model_prefix>.model` on plain-text files (SentencePiece reads one sentence a line).

    Deterministic for fixed arguments. When the files hold more than `input_sentence_size`
    non-blank lines, that many are drawn here with `np.random.default_rng(seed)`, because
    SentencePiece's own sampling is not reproducible (0.2, even with set_random_generator_seed).
    `num_threads` is fixed because unigram results depend on it. Normalization is off and no
    dummy prefix is added, so `decode(encode(a) + encode(b)) == a + b` exactly (SFT tokenizes
    prompt and response separately); `byte_fallback` covers characters outside the vocabulary.
    Ids: unk 0, bos 1, eos 2, pad 3.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type={model_type!r}; expected 'bpe' or 'unigram'")
    for f in input_files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"tokenizer training file not found: {f}")
    Path(model_prefix).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spm-sample-") as tmp:
        sample = _sample_lines(input_files, input_sentence_size, seed, Path(tmp) / "sample.txt")
        try:
            spm.SentencePieceTrainer.train(
                input=[str(f) for f in sample],
                model_prefix=str(model_prefix),
                vocab_size=vocab_size,
                model_type=model_type,
                byte_fallback=True,
                character_coverage=1.0,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                unk_id=SP_UNK_ID, bos_id=SP_BOS_ID, eos_id=SP_EOS_ID, pad_id=SP_PAD_ID,
                shuffle_input_sentence=False,
                num_threads=num_threads,
                minloglevel=2,
            )
        except RuntimeError as e:
            need = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
            if need:
                raise ValueError(f"vocab_size {vocab_size} is too small for {[str(f) for f in input_files]}: "
                                 f"expected at least {need[1]} (4 special and 256 byte pieces, plus the text's "
                                 f"{int(need[1]) - SP_FIXED_PIECES} distinct characters)") from e
            raise ValueError(f"SentencePiece training on {[str(f) for f in input_files]} failed: {e}") from e
    return SentencePieceTokenizer(f"{model_prefix}.model")


def _sample_lines(input_files: Sequence[str | os.PathLike], max_lines: int, seed: int, out: Path) -> list:
    """`input_files` themselves if they hold at most `max_lines` non-blank lines, else [out] holding a seeded sample."""
    def lines():
        for f in input_files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield from (line for line in fh if line.strip())

    total = sum(1 for _ in lines())
    if total <= max_lines:
        return list(input_files)
    keep = np.zeros(total, dtype=bool)
    keep[np.random.default_rng(seed).choice(total, max_lines, replace=False)] = True
    with open(out, "w", encoding="utf-8") as fh:
        fh.writelines(line for line, k in zip(lines(), keep) if k)
    return [out]


class HFTokenizer(Tokenizer):
    """A Hugging Face checkpoint directory's `tokenizer.json`, read with the `tokenizers` library.

    Special tokens come from `tokenizer_config.json`, then `special_tokens_map.json`, then
    the ids in `config.json`; EOS falls back to a well-known name present in the vocabulary.
    """

    _CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory)
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {self.path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ValueError(f"{file} is not a readable tokenizers file: {e}") from e
        self._eos = self._special_id("eos")
        if self._eos is None:
            self._eos = next((self._tok.token_to_id(t) for t in _WELL_KNOWN_EOS
                              if self._tok.token_to_id(t) is not None), None)
        if self._eos is None:
            raise ValueError(
                f"cannot tell the EOS token of {self.path}: no eos_token in "
                f"{' / '.join(self._CONFIG_FILES)}, no eos_token_id in config.json, "
                f"and none of {list(_WELL_KNOWN_EOS)} in the vocabulary")
        self._bos = self._special_id("bos")
        self._pad = self._special_id("pad")

    def _read_json(self, name: str) -> dict:
        file = self.path / name
        if not file.is_file():
            return {}
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {file}: {e}") from e

    def _special_id(self, kind: str) -> int | None:
        for name in self._CONFIG_FILES:
            token = self._read_json(name).get(f"{kind}_token")
            if isinstance(token, dict):  # serialized AddedToken
                token = token.get("content")
            if isinstance(token, str):
                token_id = self._tok.token_to_id(token)
                if token_id is None:
                    raise ValueError(f"{self.path / name}: {kind}_token {token!r} is not in tokenizer.json")
                return token_id
        token_id = self._read_json("config.json").get(f"{kind}_token_id")
        if isinstance(token_id, list):  # e.g. Llama 3 lists several EOS ids; the first ends documents
            token_id = token_id[0] if token_id else None
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def pad_id(self) -> int:
        return self._pad if self._pad is not None else self._eos

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer as transformers' `AutoTokenizer.from_pretrained(path).save_pretrained`
        does (tokenizer_config.json naming the resolved special tokens, the chat template), plus the
        source's generation_config.json: a model exported with them is served as it was published.

        tokenizer.json stays this one's, the model's training tokenization: transformers 5 rebuilds
        some classes' pipelines (Qwen2Tokenizer's) from the vocabulary and its own defaults.
        config.json is left alone: in a checkpoint directory it belongs to the model.
        """
        from transformers import AutoTokenizer  # seconds to import: only where a tokenizer is saved

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        special = {f"{kind}_token": self._tok.id_to_token(token_id)
                   for kind, token_id in (("eos", self._eos), ("bos", self._bos), ("pad", self._pad))
                   if token_id is not None}
        try:
            auto = AutoTokenizer.from_pretrained(self.path, **special)
        except Exception as e:  # transformers raises whatever its tokenizer classes raise
            raise ValueError(f"{self.path}: transformers' AutoTokenizer cannot read this tokenizer "
                             f"({type(e).__name__}: {e}); expected a directory it loads, to save it with") from e
        auto.save_pretrained(directory)
        _name_the_class_both_transformers_read(directory / "tokenizer_config.json")
        self._tok.save(str(directory / "tokenizer.json"))
        generation = self.path / "generation_config.json"
        if generation.is_file() and generation.resolve() != (directory / generation.name).resolve():
            shutil.copyfile(generation, directory / generation.name)


def _name_the_class_both_transformers_read(config_path: Path) -> None:
    """transformers 5 saves its generic fast tokenizer as tokenizer_class "TokenizersBackend", a class that
    transformers 4 (what many serving stacks still pin) cannot resolve; "PreTrainedTokenizerFast" is the name
    both read. Other classes (GPT2Tokenizer, Qwen2Tokenizer, ...) are kept as saved."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `.model` file or a directory holding `tokenizer.json` (HF) or `tokenizer.model` (SentencePiece)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer(path / "tokenizer.model")
    state = "directory" if path.is_dir() else "file" if path.exists() else "missing path"
    raise FileNotFoundError(
        f"no tokenizer at {path} ({state}); expected a SentencePiece .model file, or a directory "
        "containing tokenizer.json (Hugging Face) or tokenizer.model (SentencePiece)")
