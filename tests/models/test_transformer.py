import math

import pytest
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.transformer import KVCache, Transformer, lm_loss

TINY = ["gpt2-tiny", "opt-tiny", "llama-tiny"]


def tiny(name, **kw):
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset(name, vocab_size=97, **kw)).eval()


def test_tied_embeddings():
    model = tiny("gpt2-tiny")
    assert model.head.weight is model.embed.tokens.weight
    assert tiny("llama-tiny").head.weight is not tiny("llama-tiny").embed.tokens.weight


def test_structure_names():
    model = tiny("opt-tiny", word_embed_proj_dim=32)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert model.embed.positions is not None and model.embed.project_in is not None
    assert model.project_out is not None and model.head.bias is None
    assert tiny("llama-tiny").embed.positions is None


def test_init_is_deterministic_and_scaled():
    a, b = tiny("gpt2-tiny"), tiny("gpt2-tiny")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    model = tiny("gpt2-tiny", n_layer=8, d_model=256, n_head=4, d_ff=1024)
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[0].mlp.up_proj.bias.abs().sum() == 0


@pytest.mark.parametrize("name", TINY)
def test_output_dtype_and_backward(name):
    model = tiny(name).train()
    tokens = torch.randint(0, 97, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, 97) and logits.dtype == torch.float32
    lm_loss(logits, torch.randint(0, 97, (2, 10))).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_kv_cache_matches_full_forward(name):
    model = tiny(name)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.config.n_layer)
        parts = [model(tokens[:, :7], kv_cache=cache)]
        parts += [model(tokens[:, t:t + 1], kv_cache=cache) for t in range(7, 12)]
    assert cache.seq_len == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_left_padding_does_not_change_real_tokens(name):
    model = tiny(name)
    tokens = torch.randint(3, 97, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(tokens)
        batched = model(padded, attention_mask=mask)
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[:, 3:], alone, atol=1e-5, rtol=0)


def test_lm_loss_ignores_masked_labels():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    keep = labels != -100
    expected = F.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(lm_loss(logits.bfloat16(), labels), lm_loss(logits.bfloat16().float(), labels))
    torch.testing.assert_close(lm_loss(logits, labels), expected)


def test_forward_errors():
    model = tiny("gpt2-tiny")
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\), expected \(2, 5\)"):
        model(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))
