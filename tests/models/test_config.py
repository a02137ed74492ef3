import dataclasses

import pytest
import torch

from models.config import PRESETS, ModelConfig, flops_per_token, num_params
from models.transformer import Transformer

# Parameter counts of the released checkpoints.
PUBLISHED = {"gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "opt-125m": 125_239_296, "opt-350m": 331_196_416,
             "llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama3.1-8b": 8_030_261_248,
             "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "qwen2.5-0.5b": 494_032_768,
             "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
             "mistral-7b": 7_241_732_096}


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_model(name):
    with torch.device("meta"):  # no memory, so even the 13B preset is instant
        model = Transformer(PRESETS[name])
    assert num_params(PRESETS[name]) == sum(p.numel() for p in model.parameters())
    if name in PUBLISHED:
        assert num_params(PRESETS[name]) == PUBLISHED[name]


def test_num_params_without_embeddings():
    gpt2, llama = PRESETS["gpt2"], PRESETS["llama-7b"]
    # Tied: only the position table is dropped (the token table is the LM head matmul).
    assert num_params(gpt2) - num_params(gpt2, include_embeddings=False) == 1024 * 768
    # Untied: the input token table is dropped, the LM head stays.
    assert num_params(llama) - num_params(llama, include_embeddings=False) == 32000 * 4096


def test_flops_per_token():
    c = PRESETS["gpt2"]
    assert flops_per_token(c, 1024) == 6 * num_params(c, include_embeddings=False) + 12 * 12 * 768 * 1024


def test_presets_shape():
    tiny = PRESETS["llama-tiny"]
    assert tiny.n_kv_head < tiny.n_head
    assert PRESETS["opt-350m"].pre_norm is False and PRESETS["opt-350m"].word_embed_proj_dim == 512
    assert 5e6 < num_params(PRESETS["gpt2-small-cpu"], include_embeddings=False) < 2e7
    assert PRESETS["gpt2"].head_dim == 64


def test_from_preset_overrides():
    c = ModelConfig.from_preset("gpt2-tiny", vocab_size=4096, n_head=8, max_seq_len=256)
    assert (c.vocab_size, c.n_head, c.n_kv_head, c.max_seq_len) == (4096, 8, 8, 256)
    assert PRESETS["gpt2-tiny"].vocab_size == 50257  # the preset itself is untouched
    assert ModelConfig.from_preset("llama-tiny", n_head=8).n_kv_head == 2  # GQA stays as set


def test_d_model_override_scales_d_ff_unless_given():
    assert ModelConfig.from_preset("gpt2-tiny", d_model=384).d_ff == 1536  # 4x
    assert ModelConfig.from_preset("opt-tiny", d_model=96).d_ff == 384
    assert ModelConfig.from_preset("llama-7b", d_model=4096).d_ff == 11008  # LLaMA's rule, as published
    assert ModelConfig.from_preset("llama-tiny", d_model=384).d_ff == 1024  # 2/3 of 4x, up to a multiple of 256
    assert ModelConfig.from_preset("gpt2-tiny", d_model=384, d_ff=100).d_ff == 100  # given: kept
    assert ModelConfig.from_preset("gpt2-tiny", n_layer=3).d_ff == ModelConfig.from_preset("gpt2-tiny").d_ff


def test_from_preset_errors():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*gpt2-tiny"):
        ModelConfig.from_preset("gpt5")
    with pytest.raises(ValueError, match="n_layers.*valid fields: arch"):
        ModelConfig.from_preset("gpt2-tiny", n_layers=3)
    with pytest.raises(ValueError, match="ModelConfig.norm='batchnorm'"):
        ModelConfig.from_preset("gpt2-tiny", norm="batchnorm")
    with pytest.raises(ValueError, match="divisible by n_kv_head=3"):
        ModelConfig.from_preset("llama-tiny", n_kv_head=3)


def test_bias_groups_are_canonical():
    qwen2 = PRESETS["qwen2-tiny"]
    assert [qwen2.has_bias(p) for p in ("qkv", "o", "mlp")] == [True, False, False]
    # One model, one spelling: `bias` is what most groups have, whichever way the config was written.
    spelled = ModelConfig.from_preset("llama-tiny", bias=True, qkv_bias=True, o_bias=True, mlp_bias=False)
    assert spelled == ModelConfig.from_preset("llama-tiny", bias=False, qkv_bias=True, o_bias=True)
    assert (spelled.bias, spelled.qkv_bias, spelled.o_bias, spelled.mlp_bias) == (True, None, None, False)
    model = Transformer(spelled)
    assert model.blocks[0].attn.o_proj.bias is not None and model.blocks[0].mlp.up_proj.bias is None


def test_new_field_errors():
    with pytest.raises(ValueError, match="rope_type 'llama3' needs .*missing \['low_freq_factor'"):
        ModelConfig.from_preset("llama-tiny", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="rope_scaling=.*'longrope'.*expected None or a dict with rope_type one of"):
        ModelConfig.from_preset("llama-tiny", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive int or None"):
        ModelConfig.from_preset("mistral-tiny", sliding_window=0)
    with pytest.raises(ValueError, match="d_model=64 must be divisible by n_head=3 \(or set explicit_head_dim\)"):
        ModelConfig.from_preset("llama-tiny", n_head=3, n_kv_head=1)
    assert ModelConfig.from_preset("qwen3-tiny", n_head=6, n_kv_head=3).head_dim == 32  # explicit: any n_head


def test_config_is_plain_data():
    c = PRESETS["opt-tiny"]
    assert ModelConfig(**dataclasses.asdict(c)) == c
