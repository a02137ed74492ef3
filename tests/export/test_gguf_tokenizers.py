"""The published tokenizers into GGUF and the HF export (issue 37, items 2 and 3).

Tokenizers in the published Qwen2 / Qwen3 and Llama 3 layouts are rebuilt here from their tokenizer.json
structure with the tokenizers library (scripts/check_llama_cpp.published_tokenizer; a small vocabulary, nothing
downloaded). Their GGUF export is read back with gguf-py's GGUFReader; that llama.cpp itself tokenizes alike is
scripts/check_llama_cpp.py's (it needs llama-cpp-python, not in the default suite; docs/export.md).
"""

import json
import re
from pathlib import Path

import gguf
import pytest
import torch

import finetune
from data.tokenizer import load_tokenizer
from export import export_gguf
from models.config import ModelConfig
from models.transformer import Transformer
from scripts.check_llama_cpp import CHAT, CHATML, LAYOUT_TEXTS, LLAMA3_CHAT, published_tokenizer
from trainer.config import parse_args
from trainer.loop import train

VOCAB = 416  # the model's vocabulary, padded past the tokenizer's as train.py pads it
LAYOUTS = {"qwen2": ("qwen2-tiny", "qwen2", CHATML), "llama3": ("llama3-tiny", "llama-bpe", LLAMA3_CHAT)}


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents() if key in reader.fields else None


@pytest.mark.parametrize("layout", ["qwen2", "llama3"])
def test_gguf_carries_a_published_bpe_tokenizer(layout, tmp_path):
    from tokenizers import Tokenizer

    preset, pre, template = LAYOUTS[layout]
    tok_dir = published_tokenizer(tmp_path / "tok", layout)
    model = Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB))
    reader = gguf.GGUFReader(export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", tok_dir, 64))

    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    by_id = {**{i: t for t, i in spec["model"]["vocab"].items()}, **{t["id"]: t["content"] for t in spec["added_tokens"]}}
    n = len(by_id)
    assert (field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")) == ("gpt2", pre)
    assert field(reader, "tokenizer.ggml.tokens") == [by_id[i] for i in range(n)] + [
        f"[PAD{i}]" for i in range(n, VOCAB)]
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(m) for m in spec["model"]["merges"]]
    types = field(reader, "tokenizer.ggml.token_type")
    added = {t["id"] for t in spec["added_tokens"]}
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted(added)
    assert field(reader, "tokenizer.chat_template") == template

    ids = {name: Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id(name)
           for name in ("<|endoftext|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>")}
    if layout == "qwen2":  # eos <|im_end|>, pad <|endoftext|>, no BOS, nothing added (as Qwen2.5's config says)
        expected = {"eos": ids["<|im_end|>"], "padding": ids["<|endoftext|>"], "bos": None, "add_bos": False}
    else:  # bos <|begin_of_text|>, added as its post-processor says; eos <|eot_id|>, also the pad (it has none)
        expected = {"eos": ids["<|eot_id|>"], "padding": ids["<|eot_id|>"], "bos": ids["<|begin_of_text|>"],
                    "add_bos": True}
    assert {k: field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "padding", "bos")} | {
        "add_bos": field(reader, "tokenizer.ggml.add_bos_token")} == expected
    assert field(reader, "tokenizer.ggml.add_eos_token") is False


def test_gguf_tokens_and_merges_tokenize_as_the_tokenizer(tmp_path):
    """The GGUF's vocabulary and merges, rebuilt as a BPE with the Split regex of the pre-tokenizer the file
    names, tokenize every text as the source tokenizer does (llama.cpp's own check: scripts/check_llama_cpp.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from scripts.check_llama_cpp import LLAMA3_SPLIT, QWEN2_SPLIT

    for layout, split in (("qwen2", QWEN2_SPLIT), ("llama3", LLAMA3_SPLIT)):
        preset, _, _ = LAYOUTS[layout]
        tok_dir = published_tokenizer(tmp_path / layout, layout)
        model = Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB))
        reader = gguf.GGUFReader(export_gguf(model, model.config, tmp_path / f"{layout}.gguf", "Q8_0", tok_dir, 64))
        tokens = field(reader, "tokenizer.ggml.tokens")
        types = field(reader, "tokenizer.ggml.token_type")
        vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == gguf.TokenType.NORMAL}
        merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
        rebuilt = Tokenizer(models.BPE(vocab, merges, ignore_merges=field(reader, "tokenizer.ggml.pre") == "llama-bpe"))
        rebuilt.normalizer = normalizers.NFC()  # a no-op on these texts: they are in NFC
        rebuilt.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                         pre_tokenizers.ByteLevel(False, use_regex=False)])
        rebuilt.decoder = decoders.ByteLevel()
        ours = load_tokenizer(tok_dir)
        for text in LAYOUT_TEXTS:
            assert rebuilt.encode(text).ids == ours.encode(text), (layout, text)


def test_gguf_refuses_a_pre_tokenizer_llama_cpp_does_not_name(tmp_path):
    model = Transformer(ModelConfig.from_preset("qwen2-tiny", vocab_size=VOCAB))
    tok_dir = published_tokenizer(tmp_path / "tok", "qwen2")
    file = tok_dir / "tokenizer.json"
    spec = json.loads(file.read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+"
    file.write_text(json.dumps(spec))
    with pytest.raises(ValueError) as err:
        export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", tok_dir, 64)
    message = str(err.value)
    assert "\n" not in message
    assert re.fullmatch(re.escape(f"{file}: GGUF export supports SentencePiece models and GPT-2-style byte-level BPE "
                                  "tokenizer.json files with a pre-tokenizer llama.cpp names (") + ".*" + re.escape(
        "); this one has model 'BPE', pre_tokenizer Sequence[Split({'Regex': '\\\\p{L}+|\\\\p{N}+|[^\\\\s\\\\p{L}"
        "\\\\p{N}]+|\\\\s+'}), ByteLevel(use_regex=False)], decoder 'ByteLevel'"), message), message

    # The Qwen2 regex with Llama 3's ignore_merges, or a normalizer llama.cpp does not apply: refused too.
    for key, value, expected in [
            ("model", {"ignore_merges": True}, "model.ignore_merges is True; llama.cpp's 'qwen2' pre-tokenizer runs "
                                               "with ignore_merges False"),
            ("normalizer", {"type": "Lowercase"}, "normalizer 'Lowercase': llama.cpp's 'qwen2' pre-tokenizer "
                                                  "normalizes nothing")]:
        tok_dir = published_tokenizer(tmp_path / key, "qwen2")
        spec = json.loads((tok_dir / "tokenizer.json").read_text())
        spec[key] = {**(spec[key] or {}), **value} if key == "model" else value
        (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
        with pytest.raises(ValueError, match=re.escape(f"{tok_dir / 'tokenizer.json'}: {expected}")):
            export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", tok_dir, 64)


# ------------------------------------------------------------------------------ the HF export of a fine-tune


def qwen2_checkpoint(directory: Path) -> Path:
    """A random transformers Qwen2 with the Qwen2-layout tokenizer (its chat template in chat_template.jinja, as
    transformers 5 saves it) and a generation_config.json of Qwen2.5-Instruct's kind."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    published_tokenizer(directory, "qwen2", template_file=True)
    tok = load_tokenizer(directory)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    endoftext = tok.pad_id
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True, "eos_token_id": [tok.eos_id, endoftext],
         "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}, indent=2))
    return directory


def test_the_hf_export_of_a_fine_tune_keeps_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    source = qwen2_checkpoint(tmp_path / "qwen2")
    records = [{"instruction": "Repeat the words.", "input": f"apple {i} river", "output": f"apple {i} river"}
               for i in range(16)]
    (tmp_path / "sft.json").write_text(json.dumps(records))
    cfg = parse_args(["--finetune.hf_checkpoint", str(source), "--data.path", str(tmp_path / "sft.json"),
                      "--data.seq_len", "128", "--train.micro_batch_size", "4", "--train.steps", "1",
                      "--train.eval_interval", "1", "--train.eval_batches", "1", "--train.out_dir", str(tmp_path / "run"),
                      "--train.tensorboard", "false", "--train.progress_bar", "false",
                      "--train.precision", "fp32"], finetune.defaults())
    train(cfg)

    out = tmp_path / "run" / "hf"
    theirs, ours = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(out)
    assert ours.chat_template == theirs.chat_template == CHATML
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == rendered
    assert ours(rendered)["input_ids"] == theirs(rendered)["input_ids"]
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (source / "generation_config.json").read_text())
    assert load_tokenizer(out).encode(rendered) == load_tokenizer(source).encode(rendered)

    # A GGUF from the export's directory carries the template too.
    model = Transformer(ModelConfig.from_preset("qwen2-tiny", vocab_size=384))
    reader = gguf.GGUFReader(export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", out, 64))
    assert field(reader, "tokenizer.chat_template") == CHATML
