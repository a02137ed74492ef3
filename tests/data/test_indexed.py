import os
import struct

import numpy as np
import pytest

from data.indexed import (IndexedDataset, IndexedDatasetBuilder, best_dtype, tokenize_to_indexed)

MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
                  np.uint16: 8}


def random_documents(rng, vocab, n=60):
    lengths = rng.integers(0, 300, n)
    lengths[:3] = [0, 1, 1000]  # empty, single-token and long documents
    return [rng.integers(0, vocab, size=int(k)) for k in lengths]


def build(prefix, documents, dtype):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for ids in documents:
            builder.add_document(ids)
    return IndexedDataset(prefix)


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 65_000), (np.int32, 200_000)])
def test_round_trip_and_megatron_header(tmp_path, dtype, vocab):
    docs = random_documents(np.random.default_rng(0), vocab)
    ds = build(tmp_path / "corpus", docs, dtype)
    assert len(ds) == len(docs)
    assert ds.num_tokens == sum(map(len, docs))
    assert ds.dtype == np.dtype(dtype)
    for i, doc in enumerate(docs):
        assert np.array_equal(ds[i], doc)
    assert np.array_equal(ds.get(2, offset=10, length=5), docs[2][10:15])
    assert np.array_equal(ds[-1], docs[-1])
    assert np.array_equal(ds.tokens, np.concatenate(docs))
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]  # no temp files left

    # Parse the .idx independently, following megatron/core/datasets/indexed_dataset.py.
    raw = (tmp_path / "corpus.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack_from("<Q", raw, 9)
    code, = struct.unpack_from("<B", raw, 17)
    seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
    assert (version, code, seq_count, doc_count) == (1, MEGATRON_CODES[dtype], len(docs), len(docs) + 1)
    offset = 34
    lengths = np.frombuffer(raw, np.int32, seq_count, offset)
    pointers = np.frombuffer(raw, np.int64, seq_count, offset + 4 * seq_count)
    doc_idx = np.frombuffer(raw, np.int64, doc_count, offset + 12 * seq_count)
    assert len(raw) == offset + 12 * seq_count + 8 * doc_count
    assert lengths.tolist() == [len(d) for d in docs]
    assert pointers.tolist() == (np.cumsum([0] + [len(d) for d in docs[:-1]]) * np.dtype(dtype).itemsize).tolist()
    assert doc_idx.tolist() == list(range(len(docs) + 1))
    assert (tmp_path / "corpus.bin").read_bytes() == np.concatenate(docs).astype(dtype).tobytes()


def test_best_dtype():
    assert best_dtype(32_000) == np.uint16
    assert best_dtype(65_499) == np.uint16
    assert best_dtype(65_500) == np.int32
    assert best_dtype(128_256) == np.int32


def corrupt(tmp_path, edit):
    ds = build(tmp_path / "c", [np.arange(10), np.arange(5)], np.uint16)
    del ds
    edit(tmp_path / "c.idx", tmp_path / "c.bin")
    return IndexedDataset(tmp_path / "c")


def patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("edit, message", [
    (lambda idx, bin_: patch(idx, 0, b"XXIDIDX"), "bad magic"),
    (lambda idx, bin_: patch(idx, 9, struct.pack("<Q", 2)), "version 2, expected 1"),
    (lambda idx, bin_: patch(idx, 17, b"\x09"), "dtype code 9"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "truncated or corrupted"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "shorter than the 34-byte header"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "28 bytes, but .* lists 15 tokens"),
    (lambda idx, bin_: patch(idx, 34 + 8 + 8, struct.pack("<q", 4)), "pointers do not follow"),
    (lambda idx, bin_: patch(idx, 34 + 8 + 16, struct.pack("<q", 1)), "document indices"),
    (lambda idx, bin_: bin_.unlink(), r"not found: .*c\.bin"),
    (lambda idx, bin_: idx.unlink(), r"not found: .*c\.idx"),
])
def test_corrupted_files_give_clear_errors(tmp_path, edit, message):
    """Errors in a file on disk: OSErrors, which an entry point reports in one line (trainer.loop.USER_ERRORS)."""
    with pytest.raises(OSError, match=message) as error:
        corrupt(tmp_path, edit)
    assert isinstance(error.value, (ValueError, FileNotFoundError))


def test_builder_is_atomic_and_checks_ids(tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        with IndexedDatasetBuilder(tmp_path / "x", np.uint16) as builder:
            builder.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    with IndexedDatasetBuilder(tmp_path / "y", np.uint16) as builder:
        with pytest.raises(ValueError, match=r"\[-1, 70000\], outside uint16"):
            builder.add_document([-1, 70000])
    with pytest.raises(ValueError, match="no Megatron code"):
        IndexedDatasetBuilder(tmp_path / "z", np.uint32)
    ds = IndexedDataset(tmp_path / "y")  # an empty data set is valid
    assert (len(ds), ds.num_tokens) == (0, 0)
    with pytest.raises(IndexError):
        ds.get(0)


def write_jsonl(path, texts, key="text"):
    import json
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_tokenize_text_file_same_for_any_worker_count(tmp_path, shakespeare, sp_tokenizer):
    text = shakespeare.read_text(encoding="utf-8")[:60_000]
    source = tmp_path / "small.txt"
    source.write_text(text, encoding="utf-8")
    documents = [d.strip("\n") for d in text.split("\n\n") if d.strip()]
    expected = [sp_tokenizer.encode(d) + [sp_tokenizer.eos_id] for d in documents]

    one = tokenize_to_indexed(source, sp_tokenizer, tmp_path / "w1", workers=1)
    two = tokenize_to_indexed(source, sp_tokenizer.path, tmp_path / "w2", workers=2, chunk_size=7)
    assert len(one) == len(two) == len(documents) > 50
    assert [one[i].tolist() for i in range(len(one))] == expected
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    assert (tmp_path / "w1.idx").read_bytes() == (tmp_path / "w2.idx").read_bytes()
    assert one.dtype == np.uint16

    no_eod = tokenize_to_indexed(source, sp_tokenizer, tmp_path / "n", workers=1, append_eod=False)
    assert no_eod.num_tokens == one.num_tokens - len(documents)
    assert sp_tokenizer.eos_id not in no_eod.tokens


def test_tokenize_jsonl_gz_with_hf_tokenizer(tmp_path, hf_tokenizer):
    import gzip
    texts = [f"Document {i}: " + "to be or not to be " * (i % 7) for i in range(100)] + [""]
    plain = write_jsonl(tmp_path / "docs.jsonl", texts, key="content")
    packed = tmp_path / "docs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    ds = tokenize_to_indexed(packed, hf_tokenizer.path, tmp_path / "out", json_key="content", workers=2, chunk_size=9)
    assert [ds[i].tolist() for i in range(len(ds))] == [hf_tokenizer.encode(t) + [hf_tokenizer.eos_id] for t in texts]


def test_tokenize_errors(tmp_path, sp_tokenizer):
    with pytest.raises(FileNotFoundError, match="data file not found: .*absent.txt"):
        tokenize_to_indexed(tmp_path / "absent.txt", sp_tokenizer, tmp_path / "o", workers=1)
    source = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"], key="body")
    with pytest.raises(KeyError, match=r"docs.jsonl: key 'text' not found; the records have keys \['body', 'id'\]"):
        tokenize_to_indexed(source, sp_tokenizer, tmp_path / "o", workers=2)
    with pytest.raises(ValueError, match=r"record 0: key 'id' is 0, expected a string"):
        tokenize_to_indexed(source, sp_tokenizer, tmp_path / "o", json_key="id", workers=2)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"text": "a"}, {"text": ', encoding="utf-8")
    with pytest.raises(ValueError, match="cannot read .*broken.json as JSON"):
        tokenize_to_indexed(broken, sp_tokenizer, tmp_path / "o", workers=1)
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())  # nothing half-written
