"""Megatron-LM's memory-mapped `.bin`/`.idx` token files, and the tokenizer that writes them.

Same bytes as `megatron/core/datasets/indexed_dataset.py`, so files move both ways:

    .bin  the tokens of every sequence, concatenated, in the index's dtype
    .idx  b"MMIDIDX\\x00\\x00"            magic (9 bytes)
          <Q  version = 1
          <B  dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
          <Q  sequence count N
          <Q  document-index count D (= documents + 1)
          int32[N]  sequence lengths, in tokens
          int64[N]  sequence byte offsets into .bin
          int64[D]  document indices: 0, then the sequence index ending each document

Builders here write one sequence per document, so sequences and documents coincide.
"""

from __future__ import annotations

import multiprocessing
import os
import struct
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from data.sources import iter_documents
from data.tokenizer import Tokenizer, load_tokenizer

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {
    np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
    np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


class BadIndexedFile(OSError, ValueError):
    """A .bin/.idx file whose bytes are not what its index says (truncated, corrupt, or of another
    pair): a bad file on disk, an OSError as an unreadable one is, so an entry point reports it in
    one line naming the file; a ValueError as it always was."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDatasetBuilder:
    """Writes `<prefix>.bin` and `<prefix>.idx`, one document at a time.

    Both go to temporary names and are renamed only by `finalize()`, so an interrupted run
    never leaves a partial file under the final names. As a context manager it finalizes on
    success and deletes the temporary files on error.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; "
                             f"expected one of {sorted(map(str, DTYPE_CODES))}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = Path(f"{self.prefix}.bin{suffix}")
        self._idx_tmp = Path(f"{self.prefix}.idx{suffix}")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array("q")  # 8 bytes a document, not a Python int's 36: corpora of many short ones

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        if self._bin.closed:
            raise RuntimeError(f"builder for {self.prefix} is already finalized")
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise ValueError(f"token ids span [{low}, {high}], outside {self.dtype} [{info.min}, {info.max}]; "
                                 "use a wider dtype (best_dtype(vocab_size))")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(array.size)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {lengths.max()} tokens does not fit the format's int32 lengths")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.arange(lengths.size + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, DTYPE_CODES[self.dtype],
                                 lengths.size, document_indices.size))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(document_indices.tobytes())
        # .bin first: a reader finding the new .idx then always finds its .bin too.
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(self._idx_tmp, f"{self.prefix}.idx")

    def discard(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


class IndexedDataset:
    """Read-only, memory-mapped view of `<prefix>.bin`/`.idx`; item i is sequence i's tokens."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise FileNotFoundError(f"indexed dataset file not found: {p}")
        idx_size = idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise BadIndexedFile(f"{idx_path}: {idx_size} bytes, shorter than the {_HEADER.size}-byte header "
                                 "(truncated?)")
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
        magic, version, code, count, doc_count = _HEADER.unpack(raw[:_HEADER.size].tobytes())
        if magic != INDEX_MAGIC:
            raise BadIndexedFile(f"{idx_path}: bad magic {magic!r}, expected {INDEX_MAGIC!r} "
                                 "(not a Megatron .idx file)")
        if version != INDEX_VERSION:
            raise BadIndexedFile(f"{idx_path}: version {version}, expected {INDEX_VERSION}")
        if code not in CODE_DTYPES:
            raise BadIndexedFile(f"{idx_path}: dtype code {code}, expected one of {sorted(CODE_DTYPES)}")
        self.dtype = CODE_DTYPES[code]
        expected = _HEADER.size + count * (4 + 8) + doc_count * 8
        if idx_size != expected:
            raise BadIndexedFile(f"{idx_path}: {idx_size} bytes, expected {expected} for {count} sequences "
                                 f"and {doc_count} document indices (truncated or corrupted)")
        offset = _HEADER.size
        self.sequence_lengths = raw[offset:offset + 4 * count].view(np.int32)
        offset += 4 * count
        self.sequence_pointers = raw[offset:offset + 8 * count].view(np.int64)
        offset += 8 * count
        self.document_indices = raw[offset:].view(np.int64)

        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = bin_path.stat().st_size
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise BadIndexedFile(f"{bin_path}: {bin_size} bytes, but {idx_path} lists {self.num_tokens} tokens "
                                 f"of {self.dtype} = {self.num_tokens * self.dtype.itemsize} bytes "
                                 "(mismatched or truncated pair)")
        starts = np.concatenate(([0], np.cumsum(self.sequence_lengths[:-1], dtype=np.int64)))
        expected_pointers = starts * self.dtype.itemsize
        if count and not np.array_equal(self.sequence_pointers, expected_pointers):
            raise BadIndexedFile(f"{idx_path}: sequence pointers do not follow the sequence lengths "
                                 "(corrupted index)")
        if doc_count == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != count \
                or np.any(np.diff(self.document_indices) < 0):
            raise BadIndexedFile(f"{idx_path}: document indices must rise from 0 to the sequence count "
                                 f"{count} (corrupted index)")
        # np.memmap cannot map an empty file.
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.empty(0, dtype=self.dtype))

    def __reduce__(self):
        return IndexedDataset, (self.prefix,)  # pickle (e.g. to DataLoader workers) by path, not by contents

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {seq_len} tokens")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def _write_documents(prefix, dtype, token_arrays: Iterable[np.ndarray]) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for ids in token_arrays:
            builder.add_document(ids)


# Per-worker state: set by _init_worker in each pool process.
_worker_tokenizer: Tokenizer | None = None
_worker_append_eod = True


def _init_worker(tokenizer_path: str, append_eod: bool) -> None:
    global _worker_tokenizer, _worker_append_eod
    _worker_tokenizer = load_tokenizer(tokenizer_path)
    _worker_append_eod = append_eod


def _encode(text: str, tokenizer: Tokenizer, append_eod: bool) -> np.ndarray:
    ids = tokenizer.encode(text)
    if append_eod:
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=np.int64)


def _encode_in_worker(text: str) -> np.ndarray:
    return _encode(text, _worker_tokenizer, _worker_append_eod)


def tokenize_to_indexed(
    input_path: str | os.PathLike,
    tokenizer: Tokenizer | str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    json_key: str = "text",
    workers: int = 2,
    append_eod: bool = True,
    chunk_size: int = 64,
) -> IndexedDataset:
    """Tokenize every document of `input_path` into `<output_prefix>.bin/.idx`, one sequence each.

    Documents: for JSON / JSONL (optionally .gz) the `json_key` field of each record, like
    Megatron's preprocess_data.py; for any other file, blocks of text separated by blank lines
    (paragraphs, speeches, docstrings), which gives EOD boundaries at natural breaks and lets
    the work spread over processes. With `workers` > 1, a spawned pool re-loads the tokenizer
    from its path in each process and hands `chunk_size` documents at a time; results keep the
    input order, so the output is identical for any worker count.
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    if workers < 1:
        raise ValueError(f"workers={workers}; expected at least 1")
    documents = iter_documents(input_path, json_key)
    dtype = best_dtype(tokenizer.vocab_size)
    if workers == 1:
        _write_documents(output_prefix, dtype, (_encode(t, tokenizer, append_eod) for t in documents))
    else:
        # spawn, not fork: forking after tokenizers/torch started threads can deadlock.
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer.path), append_eod)) as pool:
            _write_documents(output_prefix, dtype, pool.imap(_encode_in_worker, documents, chunksize=chunk_size))
    return IndexedDataset(output_prefix)
