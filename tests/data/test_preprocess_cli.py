import subprocess
import sys
from pathlib import Path

import numpy as np

from data.indexed import IndexedDataset, tokenize_to_indexed
from data.tokenizer import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_data.py"


def run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_with_existing_tokenizer(tmp_path, shakespeare, sp_tokenizer):
    source = tmp_path / "small.txt"
    source.write_text(shakespeare.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    result = run("--input", source, "--tokenizer", sp_tokenizer.path, "--output-prefix", tmp_path / "out" / "small",
                 "--workers", 2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(tmp_path / "out" / "small")
    assert f"{len(ds)} documents, {ds.num_tokens} tokens (uint16)" in result.stdout
    expected = tokenize_to_indexed(source, sp_tokenizer, tmp_path / "ref", workers=1)
    assert np.array_equal(ds.tokens, expected.tokens)
    assert np.array_equal(ds.sequence_lengths, expected.sequence_lengths)

    result = run("--input", source, "--tokenizer", sp_tokenizer.path, "--output-prefix", tmp_path / "noeod",
                 "--workers", 1, "--no-append-eod", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert IndexedDataset(tmp_path / "noeod").num_tokens == ds.num_tokens - len(ds)


def test_cli_trains_sentencepiece(tmp_path, shakespeare):
    source = tmp_path / "small.txt"
    source.write_text(shakespeare.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    result = run("--input", source, "--train-sentencepiece", 800, "--output-prefix", tmp_path / "out" / "small",
                 "--workers", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "trained SentencePiece (bpe, vocab 800)" in result.stdout
    tokenizer = load_tokenizer(tmp_path / "out")  # tokenizer.model beside the data
    ds = IndexedDataset(tmp_path / "out" / "small")
    assert tokenizer.decode(ds[0].tolist()) == source.read_text(encoding="utf-8").split("\n\n")[0]
    assert ds[0][-1] == tokenizer.eos_id
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "small.bin", "small.idx", "tokenizer.model", "tokenizer.vocab"]


def test_cli_errors(tmp_path, sp_tokenizer):
    result = run("--input", tmp_path / "absent.txt", "--tokenizer", sp_tokenizer.path, "--output-prefix",
                 tmp_path / "o", cwd=tmp_path)
    assert result.returncode == 1 and "error: input file not found: " in result.stderr
    source = tmp_path / "docs.jsonl"
    source.write_text('{"body": "hello"}\n', encoding="utf-8")
    result = run("--input", source, "--tokenizer", sp_tokenizer.path, "--output-prefix", tmp_path / "o", cwd=tmp_path)
    assert result.returncode == 1
    assert "error: " + f"{source}: key 'text' not found; the records have keys ['body']" in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: {source}: key 'text' not found; the records have keys ['body']"]
    result = run("--input", source, "--train-sentencepiece", 0, "--output-prefix", tmp_path / "o", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "preprocess_data.py: error: --train-sentencepiece: 0 is too small; expected a vocabulary above 260 "
        "(4 special and 256 byte pieces, plus the text's characters)")
