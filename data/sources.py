"""Reading raw data files: plain text split into documents, and JSON / JSON Lines records.

JSON Lines (`.jsonl`, `.jsonl.gz`, or a `.json` of one object a line) are read a line at a time,
so a file larger than memory streams through; a JSON list is parsed whole.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
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
    """Records of a JSON list or JSON Lines file (`.gz` allowed), as written (a key a record lacks
    is absent from it).

    JSON Lines are read a line at a time, so memory does not grow with the file; a JSON list (the
    first character `[`) is parsed whole. When `required_keys` are given, a file whose first record
    lacks one raises an error naming the key and the keys found, before any record is yielded.
    """
    path = require_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            first = f.read(1)
            while first.isspace():
                first = f.read(1)
            f.seek(0)
            records = ((f"record {i}", r) for i, r in enumerate(json.load(f))) if first == "[" else _json_lines(f)
            for i, (where, record) in enumerate(records):
                if not isinstance(record, dict):
                    raise ValueError(f"{where} is {record!r:.60}, expected an object")
                missing = [k for k in required_keys if k not in record] if i == 0 else []
                if missing:
                    raise MissingKeyError(f"{path}: key {missing[0]!r} not found; the records have keys "
                                          f"{sorted(record)}")
                yield record
    except (ValueError, EOFError, gzip.BadGzipFile, zlib.error) as e:  # UnicodeDecodeError and JSON's are ValueErrors
        raise ValueError(f"cannot read {path} as JSON or JSON Lines: {e}") from e


def _json_lines(f) -> Iterator[tuple[str, object]]:
    for n, line in enumerate(f, 1):
        if line.strip():
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {n}: {e}") from e


def iter_documents(path: str | os.PathLike, json_key: str = "text") -> Iterator[str]:
    """Document texts of a text file, or of `json_key` in each record of a JSON/JSONL file."""
    if not is_json(path):
        yield from iter_text_documents(path)
        return
    for i, record in enumerate(iter_json_records(path, required_keys=(json_key,))):
        text = record.get(json_key)
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
