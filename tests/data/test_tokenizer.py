import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece

SAMPLE = "First Citizen:\nBefore we proceed  any further, hear me speak.\n\n\tcafé — 😀 1234 "


def test_sentencepiece_round_trip_and_special_ids(sp_tokenizer, shakespeare):
    assert isinstance(sp_tokenizer, SentencePieceTokenizer)
    assert sp_tokenizer.vocab_size == 2000
    assert (sp_tokenizer.bos_id, sp_tokenizer.eos_id, sp_tokenizer.pad_id) == (1, 2, 3)
    text = shakespeare.read_text(encoding="utf-8")[:20000] + SAMPLE
    ids = sp_tokenizer.encode(text)
    assert sp_tokenizer.eos_id not in ids and sp_tokenizer.bos_id not in ids
    assert sp_tokenizer.decode(ids) == text
    # No dummy prefix: separately encoded pieces concatenate exactly (SFT relies on it).
    assert sp_tokenizer.decode(sp_tokenizer.encode("Hello") + sp_tokenizer.encode(" world")) == "Hello world"
    assert sp_tokenizer.decode([sp_tokenizer.bos_id, *sp_tokenizer.encode("Hi"), sp_tokenizer.eos_id]) == "Hi"
    assert len(ids) < len(text) / 2.5  # it learned real merges


def test_sentencepiece_training_is_deterministic(shakespeare, tmp_path):
    """Same pieces in another process; 10k of the 40k lines, so the seeded sampling is exercised."""
    options = dict(vocab_size=1000, model_type="unigram", input_sentence_size=10_000)
    a = train_sentencepiece([shakespeare], tmp_path / "a" / "tokenizer", **options)
    code = ("from data.tokenizer import train_sentencepiece; "
            f"train_sentencepiece([{str(shakespeare)!r}], {str(tmp_path / 'b' / 'tokenizer')!r}, **{options!r})")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True, timeout=120)
    b = load_tokenizer(tmp_path / "b" / "tokenizer.model")
    c = train_sentencepiece([shakespeare], tmp_path / "c" / "tokenizer", **options, seed=1)
    pieces = lambda t: [t._sp.id_to_piece(i) for i in range(t.vocab_size)]  # noqa: E731
    assert pieces(a) == pieces(b) != pieces(c)
    assert a.decode(a.encode(SAMPLE)) == SAMPLE


def test_sentencepiece_save_and_load_paths(sp_tokenizer, tmp_path):
    assert load_tokenizer(sp_tokenizer.path).encode(SAMPLE) == sp_tokenizer.encode(SAMPLE)
    sp_tokenizer.save(tmp_path / "ckpt")
    reloaded = load_tokenizer(tmp_path / "ckpt")
    assert isinstance(reloaded, SentencePieceTokenizer)
    assert reloaded.encode(SAMPLE) == sp_tokenizer.encode(SAMPLE)


def test_hf_tokenizer_round_trip_and_special_tokens(hf_tokenizer, hf_tokenizer_dir, tmp_path):
    assert isinstance(hf_tokenizer, HFTokenizer)
    assert hf_tokenizer.vocab_size == 600
    assert (hf_tokenizer.eos_id, hf_tokenizer.bos_id, hf_tokenizer.pad_id) == (0, 1, 2)
    ids = hf_tokenizer.encode(SAMPLE)
    assert hf_tokenizer.decode(ids) == SAMPLE
    assert hf_tokenizer.decode([hf_tokenizer.bos_id, *ids, hf_tokenizer.eos_id]) == SAMPLE

    hf_tokenizer.save(tmp_path / "ckpt")
    reloaded = load_tokenizer(tmp_path / "ckpt")
    assert reloaded.encode(SAMPLE) == ids
    assert (reloaded.eos_id, reloaded.bos_id, reloaded.pad_id) == (0, 1, 2)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template_in", ["tokenizer_config.json", "chat_template.jinja"])
def test_hf_tokenizer_save_keeps_the_chat_template_and_generation_config(template_in, hf_tokenizer_dir, tmp_path):
    """save() writes what transformers' save_pretrained writes (the chat template wherever the source kept it:
    tokenizer_config.json as published, or chat_template.jinja as transformers 5 saves it), the resolved special
    tokens and the source's generation_config.json; tokenizer.json encodes as before."""
    from transformers import AutoTokenizer

    source = tmp_path / "source"
    shutil.copytree(hf_tokenizer_dir, source)
    config = {"eos_token": "<|endoftext|>", "bos_token": "<s>"}  # transformers 5 reads no bare-dict AddedToken
    if template_in == "chat_template.jinja":
        (source / template_in).write_text(CHATML)
    else:
        config["chat_template"] = CHATML
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    generation = {"eos_token_id": [0, 2], "temperature": 0.7, "top_p": 0.8, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(generation))

    load_tokenizer(source).save(tmp_path / "out")
    out = tmp_path / "out"
    assert "config.json" not in {p.name for p in out.iterdir()}  # the model's, not the tokenizer's
    theirs, ours = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": SAMPLE}, {"role": "assistant", "content": "Speak, speak."}]
    assert ours.chat_template == CHATML
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert json.loads((out / "generation_config.json").read_text()) == generation
    reloaded = load_tokenizer(out)
    assert reloaded.encode(SAMPLE) == load_tokenizer(source).encode(SAMPLE)
    assert (reloaded.eos_id, reloaded.bos_id, reloaded.pad_id) == (0, 1, 2)  # pad from special_tokens_map.json
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == ("<|endoftext|>", "<s>", "<pad>")


@pytest.mark.parametrize("published, saved", [(None, "PreTrainedTokenizerFast"),
                                               ("PreTrainedTokenizerFast", "PreTrainedTokenizerFast"),
                                               ("GPT2Tokenizer", "GPT2Tokenizer")])
def test_hf_tokenizer_save_names_a_class_older_transformers_resolve(published, saved, hf_tokenizer_dir, tmp_path):
    """transformers 5 saves its generic fast tokenizer as "TokenizersBackend", which transformers 4 cannot
    resolve: save() writes "PreTrainedTokenizerFast" there, keeps a specific class, and the result still loads
    and encodes as the source does."""
    from transformers import AutoTokenizer

    source = tmp_path / "source"
    shutil.copytree(hf_tokenizer_dir, source)
    config = {"eos_token": "<|endoftext|>", **({"tokenizer_class": published} if published else {})}
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    load_tokenizer(source).save(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] == saved
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert ours(SAMPLE)["input_ids"] == load_tokenizer(source).encode(SAMPLE)


def test_hf_special_tokens_from_config_json_and_fallbacks(hf_tokenizer_dir, tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", directory)
    tok = load_tokenizer(directory)  # no config at all: EOS found by its well-known name
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, None, 0)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    tok = load_tokenizer(directory)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, 2)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in tokenizer.json"):
        load_tokenizer(directory)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing path"):
        load_tokenizer(tmp_path / "absent")
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable SentencePiece model"):
        load_tokenizer(bogus)
    with pytest.raises(FileNotFoundError, match="tokenizer training file not found"):
        train_sentencepiece([tmp_path / "absent.txt"], tmp_path / "t", 500)
    text = tmp_path / "abc.txt"
    text.write_text("abc cab\n" * 50)
    with pytest.raises(ValueError, match=r"vocab_size 263 is too small for .*abc.txt.*: expected at least 264 "
                                         r"\(4 special and 256 byte pieces, plus the text's 4 distinct characters\)"):
        train_sentencepiece([text], tmp_path / "t", 263)  # SentencePiece's own words: "required_chars. 263 vs 264"
    assert train_sentencepiece([text], tmp_path / "t", 264).vocab_size == 264
