import math

import pytest
import torch

from models.config import ModelConfig
from models.generate import decode, generate, top_k_top_p_filter
from models.hf import load_hf_checkpoint
from models.transformer import Transformer
from tests.models.conftest import KINDS

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23]]


def hf_greedy(hf, prompts, max_new_tokens, eos_token_id=None, min_new_tokens=0):
    """transformers' greedy continuation of a left-padded batch, cut at EOS like ours."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                      eos_token_id=eos_token_id, pad_token_id=0, min_new_tokens=min_new_tokens)
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


def test_min_new_tokens_matches_transformers(hf_checkpoint):
    """No EOS among the first min_new_tokens, as transformers' min_new_tokens; the log-probs stay the
    policy's own (a plain forward's), not those of the distribution with EOS taken out."""
    hf, path = hf_checkpoint("llama-gqa")
    model = load_hf_checkpoint(path)
    eos = generate(model, PROMPTS, 12)[0][1]  # greedy would stop prompt 0 after one token
    out = decode(model, PROMPTS, 12, eos_token_id=eos, min_new_tokens=5, logprobs=True)
    cut = [row[:-1] if row and row[-1] == eos else row for row in out.tokens]
    assert cut == hf_greedy(hf, PROMPTS, 12, eos_token_id=eos, min_new_tokens=5)
    assert len(cut[0]) >= 5 and cut[0] != generate(model, PROMPTS, 12, eos_token_id=eos)[0]
    sequence = torch.tensor([PROMPTS[0] + out.tokens[0]])
    with torch.no_grad():
        logp = torch.log_softmax(model(sequence).float(), dim=-1)[0, len(PROMPTS[0]) - 1:-1]
    expected = logp.gather(-1, torch.tensor(out.tokens[0])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), expected, rtol=1e-4, atol=1e-4)
    fixed = decode(model, PROMPTS, 9, eos_token_id=eos, min_new_tokens=9)  # min = max: every response 9 long
    assert [len(row) for row in fixed.tokens] == [9, 9, 9] and all(eos not in row for row in fixed.tokens)


def test_min_new_tokens_when_sampling():
    """Sampled with EOS the likeliest token: never among the first 3, often right after."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=101))
    eos = 7
    model.register_forward_hook(lambda module, args, logits: logits + 20.0 * (torch.arange(101) == eos))
    prompts = [[1 + i % 50, 2] for i in range(64)]
    out = decode(model, prompts, 8, temperature=1.0, eos_token_id=eos, min_new_tokens=3,
                 generator=torch.Generator().manual_seed(1))
    assert all(eos not in row[:3] for row in out.tokens)
    assert sum(len(row) == 4 and row[-1] == eos for row in out.tokens) > 0


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
    with pytest.raises(ValueError, match=r"min_new_tokens=6 must be in \[0, max_new_tokens=5\]"):
        decode(model, [[1]], 5, min_new_tokens=6)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        generate(model, [[1] * 100], 29)
