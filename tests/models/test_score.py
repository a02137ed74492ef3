"""Score (reward / value) models: ModelConfig.num_labels, score_model_from, and Hugging Face
*ForSequenceClassification checkpoints, checked against transformers itself."""

import dataclasses
import json
import math
import re
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from models.config import ModelConfig, flops_per_token, num_params
from models.hf import config_from_hf, load_hf_checkpoint, save_hf_checkpoint
from models.lora import apply_lora
from models.transformer import Transformer, score_model_from
from tests.models.conftest import KINDS, SPECIAL, VOCAB, hf_config, randomize
from trainer.config import ConfigError, LoraSection
from trainer.loop import Trainer

TOL = dict(atol=1e-5, rtol=0)
PAD = SPECIAL["pad_token_id"]
SCORE_KINDS = KINDS + ["llama-theta"]  # llama-theta: tie_word_embeddings=True
CLASSES = {"gpt2": "GPT2ForSequenceClassification", "opt": "OPTForSequenceClassification",
           "llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
           "qwen3": "Qwen3ForSequenceClassification", "mistral": "MistralForSequenceClassification"}


def make_hf_score_model(kind: str, num_labels: int = 1, seed: int = 0):
    """Random HF *ForSequenceClassification (pad_token_id=0), matrices re-drawn like conftest's."""
    torch.manual_seed(seed)
    config = hf_config(kind)
    config.num_labels = num_labels
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    randomize(model, kind)
    return model


def right_padded(lengths=(12, 7, 1, 4), seed=0):
    """Right-padded tokens (real ids never equal PAD) with their 1/0 mask and lengths."""
    lengths = torch.tensor(lengths)
    T = int(lengths.max())
    tokens = torch.randint(3, VOCAB, (len(lengths), T), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return tokens.masked_fill(mask == 0, PAD), mask, lengths


def hf_scores(model, tokens, mask):
    with torch.no_grad():
        return model(tokens, attention_mask=mask).logits


def our_scores(model, tokens, mask, lengths):
    """Our per-token values read at each sequence's last real token."""
    with torch.no_grad():
        values = model.eval()(tokens, attention_mask=mask)
    assert values.dtype == torch.float32 and values.shape == (*tokens.shape, model.config.num_labels)
    return values[torch.arange(len(lengths)), lengths - 1]


@pytest.mark.parametrize("kind", SCORE_KINDS)
def test_hf_score_model_round_trip(kind, tmp_path):
    hf = make_hf_score_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config.num_labels == 1
    assert tuple(model.head.weight.shape) == (1, model.config.embed_dim)
    assert model.head.weight is not model.embed.tokens.weight  # never tied, even with tie_word_embeddings
    tokens, mask, lengths = right_padded()
    ref = hf_scores(hf, tokens, mask)
    assert ref.shape == (len(lengths), 1)
    torch.testing.assert_close(our_scores(model, tokens, mask, lengths), ref, **TOL)

    save_hf_checkpoint(model, tmp_path / "ours", token_ids={"pad_token_id": PAD})
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == [CLASSES[model.config.arch]]
    assert config["pad_token_id"] == PAD and len(config["id2label"]) == 1
    names = load_file(tmp_path / "ours" / "model.safetensors").keys()
    assert "score.weight" in names and "lm_head.weight" not in names
    back, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(hf_scores(back.eval(), tokens, mask), ref, **TOL)
    assert load_hf_checkpoint(tmp_path / "ours").config == model.config


def test_several_labels(tmp_path):
    hf = make_hf_score_model("llama-gqa", num_labels=3)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config.num_labels == 3
    tokens, mask, lengths = right_padded()
    torch.testing.assert_close(our_scores(model, tokens, mask, lengths), hf_scores(hf, tokens, mask), **TOL)
    save_hf_checkpoint(model, tmp_path / "ours", token_ids={"pad_token_id": PAD})
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    assert back.config.num_labels == 3
    torch.testing.assert_close(hf_scores(back, tokens, mask), hf_scores(hf, tokens, mask), **TOL)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "opt-tiny", "llama-tiny"])
def test_score_model_from_preset_exports_to_transformers(preset, tmp_path):
    torch.manual_seed(0)
    model = score_model_from(Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB)))
    save_hf_checkpoint(model, tmp_path / "out", token_ids={"pad_token_id": PAD})
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tokens, mask, lengths = right_padded()
    torch.testing.assert_close(hf_scores(hf, tokens, mask), our_scores(model, tokens, mask, lengths), **TOL)


# --- score_model_from ---------------------------------------------------------------------


def test_score_model_from_copies_weights_and_leaves_the_lm_alone():
    torch.manual_seed(0)
    lm = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB)).train()
    assert lm.head.weight is lm.embed.tokens.weight
    before = {n: t.clone() for n, t in lm.state_dict().items()}
    torch.manual_seed(1)
    score = score_model_from(lm)
    torch.manual_seed(1)
    again = score_model_from(lm)

    assert score.config == dataclasses.replace(lm.config, num_labels=1) and score.config.tie_embeddings
    assert score.training
    lm_state, score_state = lm.state_dict(), score.state_dict()
    assert set(score_state) == set(lm_state)
    for name, tensor in lm_state.items():
        if name != "head.weight":
            assert torch.equal(score_state[name], tensor), name
            assert score_state[name].data_ptr() != tensor.data_ptr(), f"{name} shares storage with the LM"
    assert score.head.weight.shape == (1, 64) and score.head.weight is not score.embed.tokens.weight
    torch.testing.assert_close(again.head.weight, score.head.weight, rtol=0, atol=0)  # under the torch RNG
    # The LM is untouched: same weights, head still tied to its embedding, still an LM.
    assert lm.head.weight is lm.embed.tokens.weight and lm.config.num_labels == 0
    for name, tensor in lm.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    tokens = torch.randint(0, VOCAB, (2, 5))
    assert score(tokens).shape == (2, 5, 1) and lm(tokens).shape == (2, 5, VOCAB)


def test_score_head_init_std_uses_the_head_input_width():
    # OPT with project_out: the head reads embed_dim (32), not d_model (64).
    torch.manual_seed(0)
    lm = Transformer(ModelConfig.from_preset("opt-tiny", vocab_size=VOCAB, word_embed_proj_dim=32))
    score = score_model_from(lm, num_labels=256)
    w = score.head.weight
    assert w.shape == (256, 32)
    assert abs(w.std().item() / (1 / math.sqrt(33)) - 1) < 0.05
    assert abs(w.mean().item()) < 0.02


def test_score_model_from_keeps_dtype_and_rejects_bad_input():
    lm = Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB)).to(torch.bfloat16)
    score = score_model_from(lm, num_labels=2)
    assert {p.dtype for p in score.parameters()} == {torch.bfloat16}
    assert score.head.weight.shape == (2, 64)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="num_labels=.* must be an int >= 1"):
            score_model_from(lm, num_labels=bad)
    apply_lora(lm, ["q_proj"], r=2, alpha=4)
    with pytest.raises(ValueError, match="merge_lora"):
        score_model_from(lm)


# --- config ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_num_labels_validation(bad):
    with pytest.raises(ValueError, match=re.escape(f"ModelConfig.num_labels={bad!r} must be an int >= 0")):
        ModelConfig.from_preset("gpt2-tiny", num_labels=bad)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "opt-350m", "llama-tiny"])
def test_num_params_of_score_models(preset):
    config = ModelConfig.from_preset(preset, num_labels=2)
    with torch.device("meta"):
        model = Transformer(config)
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    lm = ModelConfig.from_preset(preset)
    head = (config.vocab_size - 2) * config.embed_dim
    # Non-embedding N: the score head replaces the LM head, the token table is only looked up.
    assert num_params(lm, include_embeddings=False) - num_params(config, include_embeddings=False) == head
    assert flops_per_token(lm, 64) - flops_per_token(config, 64) == 6 * head


# --- config.json / checkpoint errors ------------------------------------------------------


def test_num_labels_from_config_json():
    hf = hf_config("gpt2").to_dict()
    assert config_from_hf(hf, "c.json").num_labels == 0  # no *ForSequenceClassification: an LM
    hf["architectures"] = ["GPT2ForSequenceClassification"]
    hf["id2label"] = {"0": "bad", "1": "good", "2": "great"}
    assert config_from_hf(hf, "c.json").num_labels == 3
    del hf["id2label"]
    assert config_from_hf({**hf, "num_labels": 4}, "c.json").num_labels == 4
    assert config_from_hf(hf, "c.json").num_labels == 2  # transformers' default
    with pytest.raises(ValueError, match=re.escape("c.json: architectures=['LlamaForSequenceClassification'] is "
                                                   "not supported for model_type='gpt2'")):
        config_from_hf({**hf, "architectures": ["LlamaForSequenceClassification"]}, "c.json")
    with pytest.raises(ValueError, match=re.escape("c.json: id2label={} must be a non-empty mapping")):
        config_from_hf({**hf, "id2label": {}}, "c.json")


def test_score_weight_shape_mismatch_names_file_and_tensor(tmp_path):
    make_hf_score_model("gpt2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'model.safetensors'}: tensor 'score.weight' has "
                                                   f"shape (1, 64), expected (2, 64) from {tmp_path / 'config.json'}")):
        load_hf_checkpoint(tmp_path)


def test_lm_head_in_a_score_checkpoint_is_unexpected(tmp_path):
    make_hf_score_model("llama-gqa").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.zeros(VOCAB, 64)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("unexpected tensors ['lm_head.weight (in model.safetensors)']")):
        load_hf_checkpoint(tmp_path)


def test_saving_a_score_model_needs_a_pad_token(tmp_path):
    model = score_model_from(Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB)))
    for token_ids in (None, {"eos_token_id": 2}, {"pad_token_id": None}):
        with pytest.raises(ValueError, match=r"needs token_ids\['pad_token_id'\]"):
            save_hf_checkpoint(model, tmp_path / "out", token_ids=token_ids)
    assert not any(tmp_path.iterdir())  # nothing written


# --- resuming training checkpoints written before num_labels existed ----------------------


def _resume_stub(tmp_path, saved_model_config: dict, ours: ModelConfig):
    """Trainer._resume on a fake trainer; a format mismatch right after the model and LoRA checks
    stops it before any tensor is read, so reaching it means the model_config was accepted."""
    (tmp_path / "state.json").write_text(json.dumps({"model_config": saved_model_config, "format": "full"}))
    trainer = types.SimpleNamespace(
        model_cfg=ours, runtime=types.SimpleNamespace(checkpoint_format="zero3-sharded"),
        cfg=types.SimpleNamespace(finetune=types.SimpleNamespace(lora=LoraSection()),
                                  zero_optimization=types.SimpleNamespace(stage=3)))
    Trainer._resume(trainer, tmp_path)


def test_resume_treats_missing_model_config_keys_as_defaults(tmp_path):
    ours = ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB)
    old = dataclasses.asdict(ours)
    del old["num_labels"]  # a checkpoint from before num_labels
    with pytest.raises(ConfigError, match="is 'full' but zero_optimization.stage 3"):
        _resume_stub(tmp_path, old, ours)
    with pytest.raises(ConfigError, match=re.escape("another model; (saved, ours): {'num_labels': (0, 1)}")):
        _resume_stub(tmp_path, old, dataclasses.replace(ours, num_labels=1))
    with pytest.raises(ConfigError, match=re.escape("(saved, ours): {'n_layer': (3, 2)}")):
        _resume_stub(tmp_path, {**old, "n_layer": 3}, ours)
    with pytest.raises(ConfigError, match=re.escape("(saved, ours): {'future_field': (1, '(absent)')}")):
        _resume_stub(tmp_path, {**old, "future_field": 1}, ours)
