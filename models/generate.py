"""Batched autoregressive generation with left padding and a KV cache.

`decode` is the one decode loop (also under rlhf.generation's rollouts on a sharded runtime);
`generate` is its plain front end.
"""

from collections.abc import Callable
from dataclasses import dataclass

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


def _check_args(prompts, vocab_size, pad_token_id, max_new_tokens, temperature, top_k, top_p, min_new_tokens):
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
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens={min_new_tokens} must be in [0, max_new_tokens={max_new_tokens}]")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


@dataclass
class Decoded:
    """What the decode loop sampled, per prompt."""

    tokens: list[list[int]]  # the new tokens, up to and including EOS when one was sampled
    logprobs: list[list[float]] | None  # log_softmax of the raw (untempered) fp32 logits at each token
    steps: int  # sampling steps run (every row is sampled once per step)


@torch.no_grad()
def decode(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
           pad_token_id: int = 0, generator: torch.Generator | None = None, logprobs: bool = False,
           keep_going: Callable[[bool], bool] | None = None, min_new_tokens: int = 0) -> Decoded:
    """The one decode loop: left-padded prefill, then one token per step with a KV cache.

    A row is done once it samples eos_token_id (kept as its last token); its first
    min_new_tokens tokens are never EOS (HF generate's min_new_tokens: the EOS logit is -inf
    while sampling them; the log-probs stay the untouched policy's). Finished rows keep
    decoding with the batch, but their tokens are never returned. The loop ends after
    max_new_tokens steps, or when every row is done; `keep_going(all_done)`, if given, decides
    that instead (called once per step, after sampling, before the next forward): ranks whose
    forwards hold collectives use it to keep stepping together until all of them are done.
    `model` is called as it is (hooks included), in eval mode, under no_grad.
    """
    config = model.config
    _check_args(prompts, config.vocab_size, pad_token_id, max_new_tokens, temperature, top_k, top_p, min_new_tokens)
    longest = max(len(p) for p in prompts)
    if config.positions == "learned" and longest + max_new_tokens > config.max_seq_len:
        raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds "
                         f"max_seq_len={config.max_seq_len}")
    device = next(model.parameters()).device
    tokens = torch.tensor([[pad_token_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    if keep_going is None:
        keep_going = lambda all_done: not all_done  # noqa: E731

    was_training = model.training
    model.eval()
    outputs: list[list[int]] = [[] for _ in prompts]
    scores: list[list[float]] | None = [[] for _ in prompts] if logprobs else None
    steps = 0
    try:
        cache = KVCache(config.n_layer)
        logits = model(tokens, attention_mask=mask, kv_cache=cache)[:, -1]  # prefill
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            allowed = logits
            if step < min_new_tokens and eos_token_id is not None:
                allowed = logits.clone()
                allowed[:, eos_token_id] = float("-inf")
            next_tokens = sample_next(allowed, temperature, top_k, top_p, generator)
            steps += 1
            chosen = None
            if scores is not None:
                chosen = torch.log_softmax(logits.float(), dim=-1).gather(-1, next_tokens[:, None])[:, 0].tolist()
            for i, token in enumerate(next_tokens.tolist()):
                if done[i]:
                    continue
                outputs[i].append(token)
                if chosen is not None:
                    scores[i].append(chosen[i])
                if token == eos_token_id:
                    done[i] = True
            if step == max_new_tokens - 1 or not keep_going(all(done)):
                break
            # Finished rows keep decoding (batched), but their tokens are never returned.
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            logits = model(next_tokens[:, None], attention_mask=mask, kv_cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return Decoded(outputs, scores, steps)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             pad_token_id: int = 0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns only the new tokens.

    A sequence stops at eos_token_id (the EOS itself is not returned). Prompts of
    different lengths are left-padded with pad_token_id and masked out, so each
    continuation is the same as generating that prompt alone.
    """
    out = decode(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator)
    return [row[:-1] if eos_token_id is not None and row and row[-1] == eos_token_id else row
            for row in out.tokens]
