"""Tiny random Hugging Face checkpoints, made with transformers itself (no downloads)."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config,
                          Qwen3Config)

VOCAB = 128
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(kind: str):
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, **SPECIAL)
    opt = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
               max_position_embeddings=64, **SPECIAL)
    if kind == "opt":
        return OPTConfig(**opt)
    if kind == "opt-proj":  # project_in/out, like opt-350m
        return OPTConfig(word_embed_proj_dim=32, **opt)
    if kind == "opt-post-ln":  # opt-350m layout: post-LN blocks, no final norm
        return OPTConfig(word_embed_proj_dim=32, do_layer_norm_before=False, **opt)
    if kind == "llama-gqa":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)
    if kind == "llama-theta":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                           rope_theta=500000.0, tie_word_embeddings=True, **SPECIAL)
    # The newer families, each with what sets it apart; head_dim 32 != 64 / 4 where the family allows it.
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)
    if kind == "llama3":  # Llama 3.1 RoPE scaling, one bias flag without the other, tied (as Llama 3.2)
        return LlamaConfig(head_dim=32, attention_bias=True, mlp_bias=False, tie_word_embeddings=True,
                           rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0), **small)
    if kind == "qwen2":  # q/k/v biases only, tied as the small Qwen2.5s
        return Qwen2Config(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           **small)
    if kind == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        return Qwen3Config(head_dim=32, tie_word_embeddings=False, **small)
    if kind == "mistral":  # sliding window shorter than the test sequences, explicit head_dim (Mistral-Nemo)
        return MistralConfig(head_dim=32, sliding_window=WINDOW, **small)
    raise KeyError(kind)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
WINDOW = 6
NEW_KINDS = ["llama3", "qwen2", "qwen3", "mistral"]
KINDS = ["gpt2", "opt", "opt-proj", "opt-post-ln", "llama-gqa", *NEW_KINDS]


def make_hf_model(kind: str, seed: int = 0):
    """Matrices are re-drawn with std 0.2: HF's 0.02 init makes greedy decoding repeat one token.
    The newer families' vectors move too (by N(0, 0.1)): HF starts biases at 0 and norm gains at 1,
    where a missing bias or a swapped q/k norm would go unnoticed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32).eval()
    randomize(model, kind)
    return model


@torch.no_grad()
def randomize(model, kind: str):
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.2)
        elif kind in NEW_KINDS:
            p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """kind -> (HF model, dir it was saved to with save_pretrained); built once per kind."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make_hf_model(kind)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            cache[kind] = (model, path)
        return cache[kind]

    return get
