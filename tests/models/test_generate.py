import math

import pytest
import torch

from models.config import ModelConfig
from models.generate import generate, top_k_top_p_filter
from models.hf import load_hf_checkpoint
from models.transformer import Transformer
from tests.models.conftest import KINDS

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23]]


def hf_greedy(hf, prompts, max_new_tokens, eos_token_id=None):
    """transformers' greedy continuation of a left-padded batch, cut at EOS like ours."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                      eos_token_id=eos_token_id, pad_token_id=0)
    new = out[:, longest:].tolist()
    return [row[:row.index(eos_token_id)] if eos_token_id in row else row for row in new]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind, hf_checkpoint):
    hf, path = hf_checkpoint(kind)
    model = load_hf_checkpoint(path)
    for prompt in PROMPTS:  # one at a time, then as a left-padded batch
        assert generate(model, [prompt], 20) == hf_greedy(hf, [prompt], 20)
    expected = hf_greedy(hf, PROMPTS, 20)
    assert generate(model, PROMPTS, 20) == expected
    assert all(len(row) == 20 for row in expected)


def test_stops_at_eos(hf_checkpoint):
    hf, path = hf_checkpoint("llama-gqa")
    model = load_hf_checkpoint(path)
    free = generate(model, PROMPTS, 12)
    eos = free[0][4]
    out = generate(model, PROMPTS, 12, eos_token_id=eos)
    assert out[0] == free[0][:free[0].index(eos)]
    assert out == hf_greedy(hf, PROMPTS, 12, eos_token_id=eos)


def test_top_k_1_sampling_equals_greedy():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=101))
    greedy = generate(model, PROMPTS, 15)
    gen = torch.Generator().manual_seed(123)
    assert generate(model, PROMPTS, 15, temperature=1.3, top_k=1, generator=gen) == greedy


def test_sampling_is_reproducible_with_a_generator():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=101))
    a = generate(model, PROMPTS, 10, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b = generate(model, PROMPTS, 10, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    assert a == b and all(len(row) == 10 for row in a)
    assert model.training  # generate restores the mode it found


def test_top_p_filter_hand_computed():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    logits = probs.log()
    kept = lambda **kw: torch.isfinite(top_k_top_p_filter(logits, **kw))[0].nonzero().flatten().tolist()
    assert kept(top_p=0.4) == [1]  # 0.5 alone already covers 0.4
    assert kept(top_p=0.75) == [1, 3]  # 0.5 + 0.3 = 0.8 >= 0.75
    assert kept(top_p=0.9) == [0, 1, 3]  # 0.95 >= 0.9
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=3, top_p=0.4) == [1]
    # Renormalised: sampling within {1, 3} follows 0.5/0.8 and 0.3/0.8.
    filtered = torch.softmax(top_k_top_p_filter(logits, top_p=0.75), dim=-1)[0]
    torch.testing.assert_close(filtered, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    draws = torch.multinomial(filtered, 4000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert math.isclose((draws == 1).float().mean().item(), 0.625, abs_tol=0.03)


def test_generate_argument_errors():
    model = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=101))
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[1], []], 5)
    with pytest.raises(ValueError, match=r"prompt 1 has token ids \[101, 500\] outside the vocabulary \[0, 101\)"):
        generate(model, [[1], [2, 101, 500]], 5)
    with pytest.raises(ValueError, match="top_p=1.5"):
        generate(model, [[1]], 5, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        generate(model, [[1] * 100], 29)
