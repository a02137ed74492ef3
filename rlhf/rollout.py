"""Rollouts for the online stages (PPO, GRPO): generate, score, and lay out one batch.

A rollout batch is one tensor per quantity over [prompt | response]: prompts left-padded to
the batch's longest, responses right-padded, so that position P-1+t's logits predict
response token t for every row and one forward gives all the response log-probs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from data.tokenizer import Tokenizer
from models.generate import decode
from models.transformer import Transformer
from rlhf.common import ModelRuntime, global_sum, sequence_logprobs
from rlhf.config import GenerationSection
from rlhf.generation import generate_rollouts
from rlhf.losses import last_token_scores, truncated_is_weights
from rlhf.tasks import VerifiableTask


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, P+R] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # [B, P+R]
    prompt_len: int  # P
    mask: torch.Tensor  # [B, R] float: real response tokens (EOS included when generated)
    generation_logp: torch.Tensor  # [B, R] recorded while sampling
    responses: list[list[int]]
    prompt_texts: list[str]

    def rows(self, index: torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(self.tokens[index], self.attention_mask[index], self.prompt_len, self.mask[index],
                            self.generation_logp[index], [self.responses[i] for i in index.tolist()],
                            [self.prompt_texts[i] for i in index.tolist()])


@dataclass
class GenerationStats:
    new_tokens: int  # this rank
    seconds: float
    inference_bytes: int
    decode_steps: int


def _sampling(cfg: GenerationSection, tokenizer: Tokenizer) -> dict:
    return {"temperature": cfg.temperature, "top_k": cfg.top_k or None, "top_p": cfg.top_p if cfg.top_p < 1.0 else None,
            "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id, "min_new_tokens": cfg.min_new_tokens}


def generate(actor: ModelRuntime, prompts: list[list[int]], texts: list[str], cfg: GenerationSection,
             tokenizer: Tokenizer, generator: torch.Generator | None = None) -> tuple[RolloutBatch, GenerationStats]:
    """Sample one response per prompt from the actor, its weights gathered once for the rollout
    (`generator`: the draws' own random stream; None: torch's global one)."""
    out = generate_rollouts(actor.runtime, prompts, cfg.max_new_tokens, **_sampling(cfg, tokenizer),
                            generator=generator, max_bytes=int(cfg.max_gather_mb * 2**20) or None)
    batch = layout(prompts, out.responses, out.logprobs, texts, tokenizer.pad_id, actor.env.device)
    return batch, GenerationStats(out.new_tokens, out.seconds, out.inference_bytes, out.steps)


def sample(model: Transformer, prompts: list[list[int]], texts: list[str], cfg: GenerationSection, tokenizer: Tokenizer,
           generator: torch.Generator, device: torch.device) -> tuple[RolloutBatch, GenerationStats]:
    """Sample one response per prompt from a plain copy of the actor (ModelRuntime.full_model of
    runtime.rollout_weights: no runtime, no collective, so it may run on a thread beside training)."""
    start = time.perf_counter()
    out = decode(model, prompts, cfg.max_new_tokens, **_sampling(cfg, tokenizer), generator=generator, logprobs=True)
    batch = layout(prompts, out.tokens, out.logprobs, texts, tokenizer.pad_id, device)
    copy = sum(p.numel() * p.element_size() for p in model.parameters())
    return batch, GenerationStats(sum(len(r) for r in out.tokens), time.perf_counter() - start, copy, out.steps)


def layout(prompts: list[list[int]], responses: list[list[int]], logps: list[list[float]], texts: list[str],
           pad_id: int, device) -> RolloutBatch:
    """One batch over [prompt | response]: prompts left-padded to the longest, responses right-padded."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    tokens = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R))
    gen_logp = torch.zeros((B, R))
    for i, (prompt, response, logp) in enumerate(zip(prompts, responses, logps)):
        tokens[i, P - len(prompt):P] = torch.tensor(prompt)
        attention[i, P - len(prompt):P + len(response)] = 1
        if response:
            tokens[i, P:P + len(response)] = torch.tensor(response)
            mask[i, :len(response)] = 1
            gen_logp[i, :len(response)] = torch.tensor(logp)
    return RolloutBatch(tokens.to(device), attention.to(device), P, mask.to(device), gen_logp.to(device),
                        [list(r) for r in responses], list(texts))


def response_text(tokenizer: Tokenizer, response: list[int]) -> str:
    return tokenizer.decode([t for t in response if t != tokenizer.eos_id])


def task_rewards(task: VerifiableTask, batch: RolloutBatch, tokenizer: Tokenizer) -> torch.Tensor:
    return torch.tensor([task.reward(p, response_text(tokenizer, r)) for p, r in zip(batch.prompt_texts,
                                                                                    batch.responses)],
                        device=batch.tokens.device)


@torch.no_grad()
def model_rewards(reward_model: ModelRuntime, batch: RolloutBatch) -> torch.Tensor:
    """The reward model's score at each sequence's last real token (the EOS when generated)."""
    values = reward_model(batch.tokens, batch.attention_mask)[..., 0]
    return last_token_scores(values, batch.attention_mask).float()


@torch.no_grad()
def logprobs(model: ModelRuntime, batch: RolloutBatch) -> torch.Tensor:
    return sequence_logprobs(model, batch.tokens, batch.attention_mask, batch.prompt_len)[0] * batch.mask


def values_of(critic: ModelRuntime, batch: RolloutBatch) -> torch.Tensor:
    """The critic's value of the state before each response token: position P-1+t."""
    values = critic(batch.tokens, batch.attention_mask)[..., 0]
    return values[:, batch.prompt_len - 1:-1] * batch.mask


def global_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    total, count = global_sum((x * mask).sum().item(), mask.sum().item())
    return total / count if count else float("nan")


def importance_weights(old_logp: torch.Tensor, batch: RolloutBatch, mask: torch.Tensor,
                       cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The truncated importance weights of a rollout sampled by an older policy (losses.truncated_is_weights,
    against the log-probs recorded while sampling) and what is logged of them: their mean and the share the
    cap bounds, over `mask`'s tokens of every rank."""
    weights, truncated = truncated_is_weights(old_logp, batch.generation_logp, cap)
    return weights, {"is weight": global_masked_mean(weights, mask),
                     "is truncated fraction": global_masked_mean(truncated.to(weights.dtype), mask)}


def global_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over the masked entries of every rank's batch (one all-reduce), so the result does
    not depend on how the batch is split over ranks."""
    n, total, squares = global_sum(mask.sum().item(), (x * mask).sum().item(), (x * x * mask).sum().item())
    mean = total / n
    var = (squares - n * mean * mean) / max(n - 1, 1)
    return (x - mean) * (1.0 / math.sqrt(max(var, 0.0) + eps)) * mask


def global_stats(values: torch.Tensor) -> tuple[float, float]:
    """Mean and std over every rank's entries."""
    n, total, squares = global_sum(values.numel(), values.sum().item(), (values * values).sum().item())
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean * mean, 0.0))
