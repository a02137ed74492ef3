"""GGUF export of the families of issue 37 to llama.cpp's own architectures (granite, olmo2, smollm3, gemma2,
gemma3), read back with gguf-py: every tensor is our quantized model's weight once the converter's transforms
are undone (q/k rows un-permuted by transformers' GGUF loader for the NORM-RoPE architectures; Gemma's norms
stored as 1 + weight), the metadata carries the family's hyperparameters, and what llama.cpp cannot compute
is refused with the switch named. The checkpoints are transformers' own, random and tiny (made by
tests/models/test_families.py's helper); llama.cpp itself runs them in scripts/check_llama_cpp.py."""

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from transformers import Gemma2Config, Gemma3TextConfig, GraniteConfig, Olmo2Config, SmolLM3Config
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from export import export_gguf, quantized
from models.config import ModelConfig
from models.hf import config_from_hf, load_hf_checkpoint, to_hf_state_dict
from models.transformer import Transformer
from tests.export.test_export import TOKENS, grid, train_tokenizer
from tests.models.test_families import NEW_FAMILIES, SMALL, WINDOW, make_new_family

VOCAB, HEADS = TOKENS + 16, (4, 2)
# 256 wide (whole K-quant super-blocks), GQA 4 / 2 heads of 64, every switch of the family away from its default
# where llama.cpp's architecture has a key for it; what it hard-codes (SmolLM3's RoPE-less every 4th layer, Gemma's
# attention scale 1 / sqrt(head_dim)) as it computes it.
GGUF_SIZE = {**SMALL, "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 256}
GGUF_FAMILIES = {
    "granite": lambda: GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                     logits_scaling=3.0, attention_bias=True, mlp_bias=True, **GGUF_SIZE),
    "olmo2": lambda: Olmo2Config(**GGUF_SIZE),
    "smollm3": lambda: SmolLM3Config(**{**GGUF_SIZE, "num_hidden_layers": 4}, no_rope_layer_interval=4),
    "gemma2": lambda: Gemma2Config(**{**GGUF_SIZE, "num_hidden_layers": 3}, head_dim=64, query_pre_attn_scalar=64,
                                   sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(**{**GGUF_SIZE, "num_hidden_layers": 3}, head_dim=64, query_pre_attn_scalar=64,
                                       sliding_window=WINDOW, sliding_window_pattern=3, final_logit_softcapping=7.0,
                                       rope_parameters={
                                           "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
ARCH = {"granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3", "gemma2": "gemma2", "gemma3": "gemma3"}
QTYPES = {"Q8_0": (8, 64), "Q4_0": (4, 32), "Q4_K_M": (4, 256), "Q6_K": (6, 256)}  # the grid each holds exactly


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def family(monkeypatch, tmp_path):
    """Our model of a transformers checkpoint of the family (test_families.py's random weights)."""
    def make(kind: str):
        monkeypatch.setitem(NEW_FAMILIES, f"{kind}-gguf", GGUF_FAMILIES[kind])
        make_new_family(f"{kind}-gguf").save_pretrained(tmp_path / kind)
        return load_hf_checkpoint(tmp_path / kind).eval()
    return make


def read_gguf(path, permuted: bool) -> tuple[dict[str, tuple[torch.Tensor, gguf.GGMLQuantizationType]], dict]:
    """Every tensor dequantized by gguf-py (q/k rows and biases un-permuted by transformers' GGUF loader where
    `permuted`), and the metadata."""
    heads = LlamaTensorProcessor(config=dict(zip(("num_attention_heads", "num_key_value_heads"), HEADS)))
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        values = gguf_dequantize(t.data, t.tensor_type)
        if permuted:
            values = heads.process(weights=values, name=t.name).weights
        tensors[t.name] = torch.from_numpy(np.array(values)), t.tensor_type
    return tensors, {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def expected_gguf(model: Transformer, bits: int, block: int) -> dict[str, torch.Tensor]:
    """Our quantized model by GGUF name, as convert_hf_to_gguf.py would write it unpermuted: matrices on the grid,
    Gemma's norms plus 1, vectors as they are."""
    c = model.config
    names = gguf.get_tensor_name_map(quantized.GGUF_ARCHS[c.arch], c.n_layer)
    out = {}
    for hf_name, w in to_hf_state_dict(dict(model.named_parameters()), c).items():
        w = w.detach()
        if w.dim() == 2:
            w = grid(w, bits, block)
        elif c.norm_unit_offset and hf_name.endswith("norm.weight"):
            w = w + 1
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = w
    return out


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", GGUF_FAMILIES)
def test_family_gguf_holds_our_quantized_model(kind, qtype, family, tokenizer_dir, tmp_path):
    model = family(kind)
    c = model.config
    bits, block = QTYPES[qtype]
    kquant = qtype in quantized.GGUF_MIXES
    path = export_gguf(model, c, tmp_path / "m.gguf", qtype, tokenizer_dir, block, grid_bits=bits if kquant else None)
    tensors, meta = read_gguf(path, permuted=kind in ("granite", "smollm3"))
    assert meta["general.architecture"] == ARCH[kind]
    want = expected_gguf(model, bits, block)
    assert tensors.keys() == want.keys()
    for name, (values, qt) in tensors.items():
        assert torch.equal(values, want[name]), name
        if want[name].dim() == 1:
            assert qt == gguf.GGMLQuantizationType.F32, name
        elif not kquant:
            assert qt == gguf.GGMLQuantizationType[qtype], name
    matrices = {qt.name for values, qt in tensors.values() if values.dim() == 2}
    assert matrices == {"Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"}, "Q4_K_M": {"Q4_K", "Q6_K"}, "Q6_K": {"Q6_K"}}[qtype]

    arch = ARCH[kind]
    assert meta[f"{arch}.block_count"] == c.n_layer and meta[f"{arch}.embedding_length"] == 256
    assert meta[f"{arch}.attention.head_count_kv"] == HEADS[1]
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == np.float32(c.norm_eps)
    if kind == "granite":  # convert_hf_to_gguf.py's names for the multipliers
        assert [meta[f"granite.{key}"] for key in ("attention.scale", "embedding_scale", "residual_scale",
                                                   "logit_scale")] == [np.float32(v) for v in (0.1, 4.0, 0.5, 3.0)]
        assert "blk.0.attn_output.bias" in tensors and "blk.0.ffn_down.bias" in tensors
    if kind == "olmo2":  # its q/k norms span the whole projections
        assert tensors["blk.0.attn_q_norm.weight"][0].shape == (256,)
        assert tensors["blk.0.attn_k_norm.weight"][0].shape == (128,)
    if kind == "smollm3":  # llama.cpp's smollm3 has no key for it: layer 3 of 4 without RoPE, as ours
        assert c.layers_without_rope == [3]
    if kind in ("gemma2", "gemma3"):
        assert meta[f"{arch}.attention.sliding_window"] == WINDOW
        assert meta[f"{arch}.attention.sliding_window_pattern"] == [c.layer_window(i) is not None for i in range(3)]
        assert meta[f"{arch}.attention.sliding_window_pattern"] == ([True, False, True] if kind == "gemma2"
                                                                   else [True, True, False])
        assert "output.weight" not in tensors  # tied: llama.cpp's gemma2 has no output tensor
    if kind == "gemma2":
        assert (meta["gemma2.attn_logit_softcapping"], meta["gemma2.final_logit_softcapping"]) == (5.0, 3.0)
    if kind == "gemma3":
        assert tensors["blk.0.attn_q_norm.weight"][0].shape == (64,)  # per head
        assert (meta["gemma3.rope.freq_base"], meta["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
        assert (meta["gemma3.rope.scaling.type"], meta["gemma3.rope.scaling.factor"]) == ("linear", 4.0)
        assert meta["gemma3.final_logit_softcapping"] == 7.0 and "gemma3.attn_logit_softcapping" not in meta


def _refused(config: ModelConfig, match: str, tmp_path) -> None:
    """Refused before anything is written (nothing under tmp_path / "out"), the weights and tokenizer unread."""
    with torch.device("meta"):
        model = Transformer(config)
    (tmp_path / "out").mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=match):
        export_gguf(model, config, tmp_path / "out" / "m.gguf", "Q8_0", tmp_path / "no-tokenizer")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("kind, match", [
    # test_families.py's checkpoints: the switches llama.cpp's architecture of the family does not compute
    ("qwen2-window", r"ModelConfig.sliding_window_layers=\[1, 2\] cannot be written as llama.cpp's qwen2, which "
                     r"computes with one attention span for every layer"),
    ("qwen3-window", r"ModelConfig.sliding_window_layers=\[0, 2\] cannot be written as llama.cpp's qwen3"),
    ("llama-gelu", r"ModelConfig.gate_activation='gelu_tanh' cannot be written as llama.cpp's llama, which computes "
                   r"with SwiGLU"),
    ("mistral-gelu", r"ModelConfig.gate_activation='gelu' cannot be written as llama.cpp's llama"),
    ("smollm3", r"smollm3 model has linear biases \(qkv, o, mlp\) = \(True, True, False\); llama.cpp's smollm3 "
                r"architecture has \(optional, False, False\)"),
    ("olmo2", r"olmo2 model has linear biases \(qkv, o, mlp\) = \(True, True, False\); llama.cpp's olmo2 "
              r"architecture has \(optional, False, False\)"),
    ("gemma2", r"gemma2 model has linear biases"),
    ("gemma3", r"ModelConfig.attention_multiplier=0.204.* cannot be written as llama.cpp's gemma3, which computes "
               r"with the attention scale 1 / sqrt\(head_dim\)"),
])
def test_what_llama_cpp_cannot_compute_is_refused(kind, match, tmp_path):
    config = config_from_hf(make_new_family(kind).config.to_dict(), kind)
    _refused(config, match, tmp_path)


def test_family_refusals_by_config(family, tmp_path):
    olmo2, smollm3, gemma2, gemma3 = (family(kind).config for kind in ("olmo2", "smollm3", "gemma2", "gemma3"))
    refused = [
        (replace(smollm3, layers_without_rope=[1, 3]), r"ModelConfig.layers_without_rope=\[1, 3\] cannot be written "
                                                       r"as llama.cpp's smollm3, which computes with RoPE on every "
                                                       r"layer but \[3\] \(every 4th, hard-coded\)"),
        (replace(smollm3, sliding_window=4, sliding_window_layers=[3]), r"sliding_window_layers=\[3\] .*smollm3"),
        (replace(olmo2, explicit_head_dim=32), r"explicit_head_dim=32 .*head_dim = d_model / n_head"),
        (replace(olmo2, tie_embeddings=True), r"tie_embeddings=True .*an output tensor"),
        (replace(gemma2, tie_embeddings=False), r"tie_embeddings=False .*the head as token_embd"),
        (replace(gemma2, attn_logit_softcapping=None), r"attn_logit_softcapping=None .*soft-capped"),
        (replace(gemma2, gate_activation="gelu"), r"gate_activation='gelu' .*GELU's tanh form"),
        # Gemma 3's windowed layers scaled like its global ones: llama.cpp's gemma3 leaves them unscaled
        (replace(gemma3, sliding_rope_theta=None), r"rope_scaling=.*'linear'.* windowed layers' RoPE unscaled"),
        # llama.cpp's qwen2 (as olmo2, smollm3, the Gemmas) loads no rope_freqs tensor: the file would not load
        (ModelConfig.from_preset("qwen2-tiny", vocab_size=VOCAB, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}), r"rope_scaling=.*'llama3'.* cannot be written as llama.cpp's "
                                                       r"qwen2, which computes with no rope_freqs tensor"),
    ]
    for config, match in refused:
        _refused(config, match, tmp_path)
