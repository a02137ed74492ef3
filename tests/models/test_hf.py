import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from models.config import PRESETS, ModelConfig, num_params
from models.hf import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from models.transformer import Transformer
from tests.models.conftest import KINDS, VOCAB, hf_config, make_hf_model, randomize

TOL = dict(atol=1e-5, rtol=0)


def hf_logits(model, tokens, **kw):
    with torch.no_grad():
        return model(tokens, **kw).logits


def ours_logits(model, tokens, **kw):
    with torch.no_grad():
        return model.eval()(tokens, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, hf_checkpoint):
    hf, path = hf_checkpoint(kind)
    model = load_hf_checkpoint(path)
    tokens = torch.randint(0, VOCAB, (2, 24))
    torch.testing.assert_close(ours_logits(model, tokens), hf_logits(hf, tokens), **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_logits_match_transformers(kind, hf_checkpoint):
    hf, path = hf_checkpoint(kind)
    model = load_hf_checkpoint(path)
    tokens = torch.randint(3, VOCAB, (3, 12))
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    mask[2, :11] = 0
    tokens = tokens.masked_fill(mask == 0, 0)
    # HF's convention in generate(): positions count real tokens only, padding gets 0.
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    ours = ours_logits(model, tokens, attention_mask=mask)
    ref = hf_logits(hf, tokens, attention_mask=mask, position_ids=position_ids)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], **TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_shard_size", [None, 20_000])
def test_saved_checkpoint_loads_in_transformers(kind, max_shard_size, tmp_path):
    torch.manual_seed(1)
    model = load_hf_checkpoint(*[make_and_save(kind, tmp_path / "src")])
    save_hf_checkpoint(model, tmp_path / "out", max_shard_size=max_shard_size)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    if max_shard_size:
        assert "model.safetensors.index.json" in files and len(files) > 3
    else:
        assert files == ["config.json", "model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(hf_logits(hf, tokens), ours_logits(model, tokens), **TOL)
    # ... and back into ours.
    torch.testing.assert_close(ours_logits(load_hf_checkpoint(tmp_path / "out"), tokens),
                               ours_logits(model, tokens), **TOL)


def make_and_save(kind, path):
    make_hf_model(kind, seed=1).save_pretrained(path)
    return path


@pytest.mark.parametrize("preset", ["gpt2-tiny", "opt-tiny", "llama-tiny", "llama3-tiny", "qwen2-tiny", "qwen3-tiny",
                                    "mistral-tiny"])
def test_presets_export_to_transformers(preset, tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB)).eval()
    save_hf_checkpoint(model, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(hf_logits(hf, tokens), ours_logits(model, tokens), **TOL)


def test_rope_theta_is_honoured(tmp_path):
    hf = make_hf_model("llama-theta")
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.rope_theta == 500000.0
    tokens = torch.randint(0, VOCAB, (1, 48))
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours_logits(model, tokens), ref, **TOL)
    model.config.rope_theta = 10000.0  # the test would notice a wrong theta
    assert (ours_logits(model, tokens) - ref).abs().max() > 1e-4


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16.0, "mscale": 0.9,
     "mscale_all_dim": 0.6, "truncate": False},
])
def test_rope_scaling_matches_transformers(rope, tmp_path):
    """llama3 is in KINDS; here the other scalings, over positions past original_max_position_embeddings."""
    config = hf_config("llama-theta")
    config.rope_parameters = dict(rope, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf, "llama3")
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.rope_scaling == rope
    tokens = torch.randint(0, VOCAB, (1, 48))
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours_logits(model, tokens), ref, **TOL)
    model.config.rope_scaling = None  # the test would notice the scaling being ignored
    assert (ours_logits(model, tokens) - ref).abs().max() > 1e-3


# config.json of the released checkpoints (Hugging Face hub, as published), with their parameter counts.
PUBLISHED_CONFIGS = {
    "llama3.1-8b": (8_030_261_248, """{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}, "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256}"""),
    "llama3.2-1b": (1_235_814_400, """{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0,
        "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}, "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256}"""),
    "qwen2.5-0.5b": (494_032_768, """{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
        "use_mrope": false, "use_sliding_window": false, "vocab_size": 151936}"""),
    "qwen3-0.6b": (596_049_920, """{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
        "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}"""),
    "mistral-7b": (7_241_732_096, """{"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0",
        "use_cache": true, "vocab_size": 32000}"""),
}


@pytest.mark.parametrize("preset", list(PUBLISHED_CONFIGS))
def test_published_configs_parse_into_the_presets(preset):
    count, text = PUBLISHED_CONFIGS[preset]
    config = config_from_hf(json.loads(text), f"{preset}/config.json")
    assert config == PRESETS[preset] and num_params(config) == count
    assert config_from_hf(config_to_hf(config), "x") == config
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(config)))
    assert sum(p.numel() for p in hf.parameters()) == count  # transformers builds the same model from our config


def test_tied_weights_load_and_save_once(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("gpt2")
    model = load_hf_checkpoint(path)
    assert model.head.weight is model.embed.tokens.weight
    save_hf_checkpoint(model, tmp_path / "out")
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names


def test_base_model_layout_with_old_buffers(hf_checkpoint, tmp_path):
    """The original gpt2 repo saves GPT2Model (no 'transformer.' prefix) plus attn.bias buffers."""
    hf, path = hf_checkpoint("gpt2")
    state = {k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tokens = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(ours_logits(load_hf_checkpoint(tmp_path), tokens), hf_logits(hf, tokens), **TOL)


def test_load_dtype(hf_checkpoint):
    model = load_hf_checkpoint(hf_checkpoint("llama-gqa")[1], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert ours_logits(model, torch.randint(0, VOCAB, (1, 4))).dtype == torch.float32


def test_config_round_trip():
    for kind in KINDS:
        hf = hf_config(kind).to_dict()
        config = config_from_hf(hf, "config.json")
        assert config_from_hf(config_to_hf(config), "x") == config
    assert config_to_hf(config, torch.bfloat16)["dtype"] == "bfloat16"


def test_config_to_hf_rejects_inexpressible():
    config = ModelConfig.from_preset("gpt2-tiny", norm="rmsnorm")
    with pytest.raises(ValueError, match="cannot be written as a Hugging Face gpt2 config.*norm"):
        config_to_hf(config)


# --- errors -------------------------------------------------------------------------------


def write_config(path, config: dict):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_unsupported_model_type(tmp_path):
    write_config(tmp_path, {"model_type": "bert", "vocab_size": 10})
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ".*model_type='bert'"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("kind, key, value", [
    ("llama-gqa", "rope_scaling", {"rope_type": "longrope", "factor": 8.0}),
    ("llama-gqa", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}),  # low/high_freq_factor missing
    ("llama-gqa", "partial_rotary_factor", 0.5),
    ("qwen2", "layer_types", ["full_attention", "sliding_attention"]),  # sliding layers without a window
    ("qwen2", "layer_types", ["full_attention", "chunked_attention"]),
    ("qwen2", "sliding_window", -4),
    ("mistral", "layer_types", ["full_attention", "sliding_attention"]),
    ("llama-gqa", "hidden_act", "quick_gelu"),
    ("gpt2", "activation_function", "gelu"),
    ("opt", "do_layer_norm_before", "yes"),
])
def test_unsupported_config_values(kind, key, value):
    hf = hf_config(kind).to_dict()
    hf.pop("rope_parameters", None)
    hf[key] = value
    with pytest.raises(ValueError, match=f"cfg.json: {key}"):
        config_from_hf(hf, "cfg.json")


def test_missing_key():
    hf = hf_config("opt").to_dict()
    del hf["ffn_dim"]
    with pytest.raises(ValueError, match="cfg.json: required key 'ffn_dim' is missing"):
        config_from_hf(hf, "cfg.json")


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_checkpoint(tmp_path)
    write_config(tmp_path, hf_config("gpt2").to_dict())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*pickle"):
        load_hf_checkpoint(tmp_path)


def test_truncated_safetensors(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("gpt2")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=re.escape(str(file)) + ".*truncated or corrupt"):
        load_hf_checkpoint(tmp_path)


def copy_with_state(path, dest, edit):
    (dest / "config.json").write_text((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_missing_unexpected_and_misshaped_tensors(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("llama-gqa")
    name = "model.layers.1.mlp.up_proj.weight"
    for sub in ("missing", "unexpected", "shape"):
        (tmp_path / sub).mkdir()
    copy_with_state(path, tmp_path / "missing", lambda s: s.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors \\['{name}'\\]"):
        load_hf_checkpoint(tmp_path / "missing")
    copy_with_state(path, tmp_path / "unexpected", lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.extra \(in model.safetensors\)'\]"):
        load_hf_checkpoint(tmp_path / "unexpected")
    copy_with_state(path, tmp_path / "shape", lambda s: s.update({name: torch.zeros(96, 32)}))
    with pytest.raises(ValueError, match=f"model.safetensors: tensor '{name}' has shape \\(96, 32\\), "
                                         "expected \\(96, 64\\)"):
        load_hf_checkpoint(tmp_path / "shape")


def test_sharded_index_pointing_at_missing_shard(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("opt")
    save_hf_checkpoint(load_hf_checkpoint(path), tmp_path / "out", max_shard_size=50_000)
    shard = sorted((tmp_path / "out").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard {shard.name}, which does not exist"):
        load_hf_checkpoint(tmp_path / "out")


# --- atomic save --------------------------------------------------------------------------


def test_save_replaces_existing_dir_atomically(hf_checkpoint, tmp_path):
    model = load_hf_checkpoint(hf_checkpoint("gpt2")[1])
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    save_hf_checkpoint(model, target, tokenizer_dir=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tok"]  # no temp or old dirs left
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_failed_save_leaves_target_untouched(tmp_path):
    model = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB, activation="swiglu"))
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match="activation_function='swiglu' is not supported"):
        save_hf_checkpoint(model, target)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        save_hf_checkpoint(Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB)), target,
                           tokenizer_dir=tmp_path / "empty")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


# --- tokenizer files and special ids in exports ---------------------------------------------

FAMILIES = ["gpt2-tiny", "opt-tiny", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny"]
ALPACA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "alpaca_en_demo.json"
EDGE_CASES = ["", " ", "   ", "a  b   c    ", "\tx\t\ty\n\n z", "1234567 89.5", "héllo wörld 你好 🙂 ½ ﬁ",
              "  leading and trailing  ", "▁▁x▁", "</s> <s> <pad> <unk> literally", "def f(x):\n    return x  # ok"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    """A few hundred strings: Alpaca's fields where ../shared/data has it, else the embedded corpus's
    paragraphs; plus whitespace runs, digits, characters outside the vocabulary and special-token text."""
    if ALPACA.is_file():
        records = json.loads(ALPACA.read_text())[:120]
        found = [r[key] for r in records for key in ("instruction", "input", "output") if r.get(key)]
    else:
        from data.corpus import default_corpus

        found = default_corpus(tmp_path_factory.mktemp("cache")).read_text().split("\n\n")[:300]
    return found + EDGE_CASES


@pytest.fixture(scope="module")
def sentencepiece_dirs(tmp_path_factory) -> dict[str, Path]:
    """kind -> a directory holding only a tokenizer.model: "ours" as data/tokenizer.py trains them (BPE,
    identity normalization, no dummy prefix, whitespace-only pieces, byte fallback, pad), "default"
    SentencePiece's defaults (nmt_nfkc, dummy prefix, extra whitespace removed, no byte fallback)."""
    import sentencepiece as spm

    from data.corpus import default_corpus
    from data.tokenizer import train_sentencepiece

    work = tmp_path_factory.mktemp("spm")
    lines = default_corpus(work / "cache").read_text().splitlines()[:20000]
    (work / "sample.txt").write_text("\n".join(lines))
    dirs = {kind: work / kind for kind in ("ours", "default")}
    for directory in dirs.values():
        directory.mkdir()
    train_sentencepiece([work / "sample.txt"], dirs["ours"] / "tokenizer", 1000)
    spm.SentencePieceTrainer.train(input=str(work / "sample.txt"), model_prefix=str(dirs["default"] / "tokenizer"),
                                   vocab_size=1000, model_type="bpe", minloglevel=2, num_threads=1)
    for directory in dirs.values():
        (directory / "tokenizer.vocab").unlink()
    return dirs


@pytest.mark.parametrize("preset", FAMILIES)
def test_sentencepiece_export_reads_the_same_in_auto_tokenizer(preset, sentencepiece_dirs, texts, tmp_path):
    """An export with a SentencePiece tokenizer also holds tokenizer.json + tokenizer_config.json, so
    that AutoTokenizer encodes and decodes exactly as SentencePiece does, and config.json names the
    tokenizer's special ids. transformers 5 gives model_type qwen2 its byte-level Qwen2Tokenizer
    whatever tokenizer_config.json says: there the class that file names reads it (docs/models.md)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from data.tokenizer import SentencePieceTokenizer, load_tokenizer

    for kind, directory in sentencepiece_dirs.items():
        ours = SentencePieceTokenizer(directory / "tokenizer.model")
        model = Transformer(ModelConfig.from_preset(preset, vocab_size=1024))
        out = tmp_path / kind
        save_hf_checkpoint(model, out, tokenizer_dir=directory)
        assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
        auto = (PreTrainedTokenizerFast if preset == "qwen2-tiny" else AutoTokenizer).from_pretrained(out)
        reloaded = load_tokenizer(out)  # our own reading of the export (tokenizer.json first)
        for text in texts:
            ids = ours.encode(text)
            assert auto(text)["input_ids"] == ids, (kind, text)
            if auto.unk_token_id not in ids:  # SentencePiece decodes <unk> as " \u2047 "
                assert auto.decode(ids, skip_special_tokens=True) == ours.decode(ids), (kind, text)
            if "</s>" not in text:  # our tokenizers.Tokenizer reads special-token text as the special token
                assert reloaded.encode(text) == ids, (kind, text)
        config = json.loads((out / "config.json").read_text())
        expected = {"bos_token_id": ours.bos_id, "eos_token_id": ours.eos_id, "pad_token_id": ours.pad_id}
        assert {k: config[k] for k in expected} == expected
        assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id)
        assert (reloaded.bos_id, reloaded.eos_id, reloaded.pad_id, reloaded.vocab_size) == \
            (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size)


def test_token_ids_default_to_the_tokenizers(tmp_path):
    """save_hf_checkpoint(tokenizer_dir=...) without token_ids writes the tokenizer's BOS / EOS / pad
    ids into config.json (a tokenizer.json directory; the SentencePiece case is checked above)."""
    from tokenizers import Tokenizer, models

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<s>": 2, "<pad>": 3, "a": 4}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tok_dir / "tokenizer.json"))
    model = Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=64))
    save_hf_checkpoint(model, tmp_path / "a", tokenizer_dir=tok_dir)  # EOS by its well-known name, pad = EOS
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config.get("bos_token_id")) == (1, 1, None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "pad_token": "<pad>"}))
    save_hf_checkpoint(model, tmp_path / "b", tokenizer_dir=tok_dir)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 3)
    save_hf_checkpoint(model, tmp_path / "c", tokenizer_dir=tok_dir, token_ids={"eos_token_id": 4})  # given: kept
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["eos_token_id"] == 4 and "bos_token_id" not in config


def test_llama_bias_flags_each_on_its_own(hf_checkpoint, tmp_path):
    """attention_bias=True with mlp_bias=False (conftest's llama3 kind) loads, matches transformers and
    saves back with the same flags."""
    hf, path = hf_checkpoint("llama3")
    assert (hf.config.attention_bias, hf.config.mlp_bias) == (True, False)
    model = load_hf_checkpoint(path)
    assert (model.config.has_bias("qkv"), model.config.has_bias("o"), model.config.has_bias("mlp")) == \
        (True, True, False)
    tokens = torch.randint(0, VOCAB, (2, 12))
    torch.testing.assert_close(ours_logits(model, tokens), hf_logits(hf, tokens), **TOL)
    save_hf_checkpoint(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["attention_bias"], config["mlp_bias"]) == (True, False)


# --- the families of issue 37 (parity: tests/models/test_families.py) ------------------------


@pytest.mark.parametrize("config, key, value", [
    (dict(model_type="smollm3", num_hidden_layers=2), "no_rope_layers", [1, 0, 1]),
    (dict(model_type="smollm3", num_hidden_layers=2), "no_rope_layer_interval", 0),
    (dict(model_type="qwen3", num_hidden_layers=2, use_sliding_window=True, sliding_window=8), "layer_types",
     ["sliding_attention"]),
    (dict(model_type="qwen3-moe", num_hidden_layers=2), "model_type", "qwen3_moe"),
    (dict(model_type="gemma3", num_hidden_layers=2), "model_type", "gemma3"),  # the multimodal wrapper
    (dict(model_type="phi3", num_hidden_layers=2), "model_type", "phi3"),
    (dict(model_type="gemma2", num_hidden_layers=2, sliding_window=None), "layer_types",
     ["sliding_attention", "full_attention"]),
    (dict(model_type="gemma2", num_hidden_layers=2), "use_bidirectional_attention", True),
])
def test_issue_37_refusals_name_the_key_and_value(config, key, value):
    hf = {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 max_position_embeddings=64), **config, key: value}
    with pytest.raises(ValueError, match=re.escape(f"cfg.json: {key}={value!r}")):
        config_from_hf(hf, "cfg.json")


def test_windowed_layers_and_layers_without_rope_read_as_transformers_5_builds_them():
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                max_position_embeddings=64, num_hidden_layers=4)
    qwen2 = dict(base, model_type="qwen2", sliding_window=8, max_window_layers=2)
    assert config_from_hf(qwen2, "x").sliding_window is None  # use_sliding_window false: transformers drops it
    config = config_from_hf(dict(qwen2, use_sliding_window=True), "x")
    assert (config.sliding_window, config.sliding_window_layers) == (8, [2, 3])
    assert [config.layer_window(i) for i in range(4)] == [None, None, 8, 8]
    assert config_from_hf(dict(qwen2, use_sliding_window=True, max_window_layers=0), "x").sliding_window_layers is None
    smol = dict(base, model_type="smollm3", no_rope_layer_interval=2, sliding_window=8)
    config = config_from_hf(smol, "x")
    assert (config.layers_without_rope, config.sliding_window) == ([1, 3], None)
    assert [config.layer_has_rope(i) for i in range(4)] == [True, False, True, False]
    config = config_from_hf(dict(smol, use_sliding_window=True), "x")
    assert config.sliding_window_layers == [1, 3]  # the window on the layers without RoPE
    for config in (config, config_from_hf(dict(qwen2, use_sliding_window=True), "x")):
        assert config_from_hf(config_to_hf(config), "y") == config


@pytest.mark.parametrize("arch, fields", [
    ("llama", dict(embedding_multiplier=2.0)),
    ("qwen3", dict(qk_norm_per_head=False)),
    ("mistral", dict(sliding_window_layers=[1])),
    ("qwen2", dict(layers_without_rope=[0])),
    ("llama", dict(pre_norm=False, output_norm=True)),
])
def test_config_to_hf_refuses_what_the_family_has_not(arch, fields):
    preset = {"llama": "llama-tiny", "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny", "mistral": "mistral-tiny"}[arch]
    config = ModelConfig.from_preset(preset, vocab_size=VOCAB, **fields)
    with pytest.raises(ValueError, match=f"cannot be written as a Hugging Face {arch} config.*{next(iter(fields))}"):
        config_to_hf(config)


def test_granite_score_model_is_refused_on_save():
    config = config_from_hf(dict(model_type="granite", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                 num_attention_heads=4, max_position_embeddings=64, num_hidden_layers=2), "x")
    score = ModelConfig(**{**vars(config), "num_labels": 1})
    with pytest.raises(ValueError, match="arch='granite'.*no sequence-classification class"):
        config_to_hf(score, token_ids={"pad_token_id": 0})


GEMMA3_1B = """{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144}"""


def test_gemma3_published_layout_parses_as_transformers_reads_it():
    """The older config.json layout (rope_theta, rope_local_base_freq, sliding_window_pattern) of Gemma 3 1B, read
    by us and by transformers' config class (whose to_dict is the per-layer-type layout) into the same model."""
    from transformers import Gemma3TextConfig

    hf = json.loads(GEMMA3_1B)
    config = config_from_hf(hf, "gemma-3-1b/config.json")
    assert config == config_from_hf(Gemma3TextConfig(**hf).to_dict(), "to_dict")
    assert (config.rope_theta, config.sliding_rope_theta, config.sliding_window) == (1e6, 1e4, 512)
    assert [config.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert config_from_hf(config_to_hf(config), "x") == config
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(config)))
    assert num_params(config) == sum(p.numel() for p in ref.parameters())
    hf["rope_parameters"] = {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="rope_parameters\\['sliding_attention'\\]=.* must be unscaled"):
        config_from_hf(hf, "cfg.json")
