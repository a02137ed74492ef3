"""Reading raw data files: plain text split into documents, and JSON / JSON Lines records.

JSON, JSONL and their `.gz` forms are read with `datasets.load_dataset("json", streaming=True)`:
records are streamed, so a large file is never converted into an Arrow cache.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path
from typing import Iterator

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


class MissingKeyError(KeyError):
    """A record lacks a required key. Plain str(), where KeyError's would quote the message."""

    def __str__(self) -> str:
        return str(self.args[0])


def require_file(path: str | os.PathLike, what: str = "data file") -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{what} is not readable: {path}")
    return path


def is_json(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(JSON_SUFFIXES)


def iter_text_documents(path: str | os.PathLike) -> Iterator[str]:
    """Documents of a plain-text file (`.gz` allowed): blocks of lines separated by blank lines.

    Lines inside a block keep their newlines, except the block's last one; blank lines
    (empty or whitespace only) only separate documents and are dropped.
    """
    path = require_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            block: list[str] = []
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block).rstrip("\n")
                    block = []
            if block:
                yield "".join(block).rstrip("\n")
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise ValueError(f"cannot read {path} as UTF-8 text: {e}") from e


def iter_json_records(path: str | os.PathLike, required_keys: tuple[str, ...] = ()) -> Iterator[dict]:
    """Records of a JSON list or JSON Lines file (`.gz` allowed).

    Records missing a key the file has elsewhere come back with it set to None. When
    `required_keys` are given, a file whose columns lack one raises an error naming the key
    and the keys found, before any record is yielded.
    """
    import datasets  # heavy: imported only by the processes that read JSON

    path = require_file(path)
    # A throwaway cache dir: streaming still writes lock files, which belong nowhere in ~.
    with tempfile.TemporaryDirectory(prefix="json-records-") as cache_dir:
        try:
            records = datasets.load_dataset("json", data_files=str(path), split="train",
                                            streaming=True, cache_dir=cache_dir)
            it = iter(records)
            first = next(it, None)
        except Exception as e:  # pyarrow / datasets raise many types for malformed JSON
            raise ValueError(f"cannot read {path} as JSON or JSON Lines: {type(e).__name__}: {e}") from e
        if first is None:
            return
        missing = [k for k in required_keys if k not in first]
        if missing:
            raise MissingKeyError(f"{path}: key {missing[0]!r} not found; the records have keys {sorted(first)}")
        yield first
        try:
            yield from it
        except Exception as e:
            raise ValueError(f"cannot read {path} as JSON or JSON Lines: {type(e).__name__}: {e}") from e


def iter_documents(path: str | os.PathLike, json_key: str = "text") -> Iterator[str]:
    """Document texts of a text file, or of `json_key` in each record of a JSON/JSONL file."""
    if not is_json(path):
        yield from iter_text_documents(path)
        return
    for i, record in enumerate(iter_json_records(path, required_keys=(json_key,))):
        text = record[json_key]
        if not isinstance(text, str):
            raise ValueError(f"{path}: record {i}: key {json_key!r} is {text!r}, expected a string")
        yield text


def documents_as_text(path: str | os.PathLike, json_key: str, target: str | os.PathLike) -> Path:
    """A plain-text file of `path`'s documents, for SentencePiece (which reads a sentence a
    line): `path` itself when it is text; for JSON/JSONL, the documents streamed into `target`."""
    if not is_json(path):
        return Path(path)
    with open(target, "w", encoding="utf-8") as out:
        for document in iter_documents(path, json_key):
            out.write(document + "\n")
    return Path(target)
