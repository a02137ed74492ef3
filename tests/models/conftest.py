"""Tiny random Hugging Face checkpoints, made with transformers itself (no downloads)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

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
    raise KeyError(kind)


KINDS = ["gpt2", "opt", "opt-proj", "opt-post-ln", "llama-gqa"]


def make_hf_model(kind: str, seed: int = 0):
    """Matrices are re-drawn with std 0.2: HF's 0.02 init makes greedy decoding repeat one token."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


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
