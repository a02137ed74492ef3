"""Batched autoregressive generation with left padding and a KV cache."""

import torch

from models.transformer import KVCache, Transformer


def top_k_top_p_filter(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. logits: [B, V].

    top_p keeps the smallest set of most likely tokens whose probability sums
    to at least top_p (always at least one token).
    """
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]; temperature 0 is greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = top_k_top_p_filter(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _check_args(prompts, vocab_size, pad_token_id, max_new_tokens, temperature, top_k, top_p):
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id={pad_token_id} is outside the vocabulary [0, {vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             pad_token_id: int = 0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns only the new tokens.

    A sequence stops at eos_token_id (the EOS itself is not returned). Prompts of
    different lengths are left-padded with pad_token_id and masked out, so each
    continuation is the same as generating that prompt alone.
    """
    config = model.config
    _check_args(prompts, config.vocab_size, pad_token_id, max_new_tokens, temperature, top_k, top_p)
    longest = max(len(p) for p in prompts)
    if config.positions == "learned" and longest + max_new_tokens > config.max_seq_len:
        raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds "
                         f"max_seq_len={config.max_seq_len}")
    device = next(model.parameters()).device
    tokens = torch.tensor([[pad_token_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)

    was_training = model.training
    model.eval()
    try:
        cache = KVCache(config.n_layer)
        logits = model(tokens, attention_mask=mask, kv_cache=cache)[:, -1]  # prefill
        outputs = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            next_tokens = sample_next(logits, temperature, top_k, top_p, generator)
            for i, token in enumerate(next_tokens.tolist()):
                if done[i]:
                    continue
                if token == eos_token_id:
                    done[i] = True
                else:
                    outputs[i].append(token)
            if all(done) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding (batched), but their tokens are never returned.
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            logits = model(next_tokens[:, None], attention_mask=mask, kv_cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return outputs
