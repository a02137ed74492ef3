"""Dynamic NTK RoPE scaling (rope_type "dynamic") against transformers' LlamaForCausalLM: plain RoPE up to
max_position_embeddings, a base that grows with the running length beyond it, in one forward, in a
left-padded batch, and through a cached greedy generation that crosses max_position_embeddings."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.generate import generate
from models.hf import load_hf_checkpoint
from models.transformer import KVCache
from tests.models.conftest import VOCAB, hf_config, randomize
from tests.models.test_generate import hf_greedy

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
MAX_POS = 64  # the config's max_position_embeddings
TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = hf_config("llama-theta")  # GQA 4 / 1 heads, tied head
    config.rope_parameters = dict(DYNAMIC, rope_theta=10000.0)
    assert config.max_position_embeddings == MAX_POS
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf, "llama3")
    path = tmp_path_factory.mktemp("dynamic")
    hf.save_pretrained(path)
    return path


def fresh_hf(path):
    """transformers keeps the longest length it has seen (until a call shorter than max_position_embeddings):
    each check starts from a model that has seen none. Generation runs to max_new_tokens (no EOS)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def test_config_round_trip(checkpoint, tmp_path):
    from models.hf import save_hf_checkpoint

    model = load_hf_checkpoint(checkpoint)
    assert model.config.rope_scaling == DYNAMIC and model.config.max_seq_len == MAX_POS
    save_hf_checkpoint(model, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert again.config.rope_parameters == dict(DYNAMIC, rope_theta=10000.0)
    assert again.config.max_position_embeddings == MAX_POS


@pytest.mark.parametrize("length", [40, MAX_POS, MAX_POS + 1, 100, 160])
def test_logits_match_transformers(length, checkpoint):
    model = load_hf_checkpoint(checkpoint).eval()
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = fresh_hf(checkpoint)(tokens).logits
        ours = model(tokens)
        torch.testing.assert_close(ours, ref, **TOL)
        model.config.rope_scaling = None  # plain RoPE: equal up to max_position_embeddings, not beyond
        plain = model(tokens)
    if length <= MAX_POS:
        assert torch.equal(plain, ours)
    else:
        assert (plain - ref).abs().max() > 1e-3


def test_left_padded_batch_matches_transformers(checkpoint):
    """The running length is the longest row's: its positions count real tokens only."""
    model = load_hf_checkpoint(checkpoint).eval()
    tokens = torch.randint(0, VOCAB, (3, 90), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[1, :30] = 0  # 60 real tokens: shorter than max_position_embeddings, scaled by the batch's longest
    mask[2, :5] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = fresh_hf(checkpoint)(tokens, attention_mask=mask, position_ids=position_ids).logits
        ours = model(tokens, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], **TOL)


@pytest.mark.parametrize("prompt_len, new", [(50, 40), (80, 24)])
def test_cached_generation_matches_transformers(prompt_len, new, checkpoint):
    """Each decoding step's queries and new key take the frequencies of the length so far; the cached keys
    keep the ones they were rotated with. Greedy tokens equal generate's, and so do the logits of every step."""
    model = load_hf_checkpoint(checkpoint).eval()
    prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    out = fresh_hf(checkpoint).generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                        max_new_tokens=new, pad_token_id=0, output_logits=True,
                                        return_dict_in_generate=True)
    expected = out.sequences[0, prompt_len:].tolist()
    assert len(expected) == new and len(set(expected)) > 3
    with torch.no_grad():
        cache = KVCache(model.config.n_layer)
        logits = [model(prompt, kv_cache=cache)[:, -1]]
        for token in expected[:-1]:
            logits.append(model(torch.tensor([[token]]), kv_cache=cache)[:, -1])
    worst = max((a - b).abs().max().item() for a, b in zip(logits, out.logits))
    assert worst < 1e-5, worst
    assert generate(model, prompt.tolist(), new) == [expected]
    hf = fresh_hf(checkpoint)
    prompts = [prompt[0, :prompt_len - 7].tolist(), prompt[0].tolist()]  # left-padded, past MAX_POS together
    assert generate(model, prompts, new) == hf_greedy(hf, prompts, new)

    # Without a cache the whole sequence gets the final length's frequencies: a different computation.
    with torch.no_grad():
        uncached = model(out.sequences[:, :-1])[0, prompt_len - 1:]
    assert (uncached - torch.cat(logits)).abs().max() > 1e-4
