import hashlib

from data.corpus import default_corpus
from data.sources import iter_text_documents


def test_default_corpus_is_deterministic_and_cached(tmp_path):
    first = default_corpus(tmp_path / "a")
    second = default_corpus(tmp_path / "b")
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert first.name == second.name and digest(first) == digest(second)
    assert 500_000 < first.stat().st_size < 5_000_000
    assert [p.name for p in (tmp_path / "a").iterdir()] == [first.name]  # no temp file left

    mtime = first.stat().st_mtime_ns
    assert default_corpus(tmp_path / "a") == first and first.stat().st_mtime_ns == mtime  # cached, not rebuilt

    text = first.read_text(encoding="utf-8")
    documents = list(iter_text_documents(first))
    assert documents == text.rstrip("\n").split("\n\n")  # one document per docstring
    assert len(documents) == len(set(documents)) > 3000
    assert any(d.startswith("Serialize ``obj`` to a JSON formatted ``str``.") for d in documents)
