"""GRPO (DeepSeekMath): no critic; G samples per prompt, advantages relative to the group's.

Each rank samples `grpo.group_size` responses for each of its prompts, so a group never spans
ranks. The variants are TRL's and the papers' (docs/rlhf.md): the aggregation `grpo.loss_type`
(dapo by default: every response token of every rank weighs the same), GSPO's sequence-level
ratio, DAPO's clip-higher, dynamic sampling, overlong filtering and soft overlong punishment,
and the RLOO and REINFORCE++ advantages. Every normalizer except bnpo's is a global count over
the ranks, so N ranks take the one-process update. Rewards come from code (a task) or from the
reward model.
"""

from __future__ import annotations

import math
import time

import torch

from models.transformer import Transformer
from rlhf.common import (ModelRuntime, global_max, global_sum, load_model, optimizer_step, prepare_trained,
                         reference_of, sequence_logprobs, tokenizer_of, update_label)
from rlhf.config import GRPOSection, RLHFConfig, reward_scaling
from rlhf.losses import (entropy_from_logits, equal_reward_groups, grpo_advantages, grpo_loss, grpo_token_weights,
                         kl_estimate, reinforce_pp_returns, rloo_advantages, soft_overlong_penalty)
from rlhf.online import OnlineAlgorithm, run_online
from rlhf.rollout import RolloutBatch, global_masked_mean, global_whiten, importance_weights, logprobs
from trainer.config import RunSection
from trainer.distributed import DistEnv
from trainer.nonfinite import NonFiniteSteps


STATS = ("loss", "clip fraction", "clip-low fraction", "clip-high fraction", "kl", "entropy", "grad norm",
         "logprob gap")


def grpo_update(actor: ModelRuntime, batch: RolloutBatch, advantages: torch.Tensor, ref_logp: torch.Tensor | None,
                cfg: GRPOSection, first_step: int, nonfinite: NonFiniteSteps | None = None, *,
                old_logp: torch.Tensor | None = None, kept: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, max_len: int | None = None,
                is_cap: float | None = None) -> tuple[dict[str, float], int]:
    """`cfg.iterations` optimizer steps on one generation under the non-finite policy `nonfinite`
    (trainer.nonfinite; None: a fresh one with the default limit); returns statistics and skipped steps.

    advantages: [B] or per token [B, T]. old_logp: the sampling policy's log-probs (None: computed
    here when cfg.iterations > 1). kept: bool [B], the rows of the batch (None: all; dynamic sampling
    drops groups); loss_mask: the tokens that train (None: kept rows' response tokens; overlong
    filtering takes truncated rows out, which still count as sequences, as in TRL). max_len:
    dr_grpo's constant (None: the batch's response width). is_cap: the samples come from an older policy
    than the actor's (generation.staleness 1): each token's loss weighs min(p_old / p_sampler, is_cap),
    p_old the actor's before the first iteration (losses.truncated_is_weights)."""
    nonfinite = nonfinite or NonFiniteSteps(RunSection.max_nonfinite_steps)
    kept = torch.ones(batch.mask.shape[0], dtype=torch.bool, device=batch.mask.device) if kept is None else kept
    mask = batch.mask * kept.unsqueeze(1) if loss_mask is None else loss_mask
    n_tokens, n_sequences = global_sum(mask.sum().item(), kept.sum().item())
    if n_tokens == 0:  # every group dropped or every response masked: nothing to train on, no step
        return {key: 0.0 for key in STATS} | {"logprob gap": float("nan")}, 0
    weights = grpo_token_weights(mask, cfg.loss_type, n_sequences, n_tokens, max_len or mask.shape[1],
                                 actor.env.world_size)
    if old_logp is None and cfg.iterations > 1:
        old_logp = logprobs(actor, batch)
    beta = 0.0 if cfg.advantage == "reinforce_pp" else cfg.beta  # REINFORCE++ has its KL in the reward
    sums = torch.zeros(6, dtype=torch.float64)  # loss, clipped low, clipped high, kl, entropy, grad norm
    skipped = 0
    for i in range(cfg.iterations):
        logp, logits = sequence_logprobs(actor, batch.tokens, batch.attention_mask, batch.prompt_len)
        old = old_logp if old_logp is not None else logp.detach()  # μ = 1: the ratio is 1, the gradient A
        if i == 0:  # the trainer's log-probs against the ones recorded while sampling
            gap = global_masked_mean((logp.detach() - batch.generation_logp).abs(), batch.mask)
            if is_cap is not None:
                is_weights, is_stats = importance_weights(old, batch, mask, is_cap)
                weights = weights * is_weights
        loss, low, high = grpo_loss(logp, old, ref_logp, advantages, cfg.clip, beta, clip_high=cfg.clip_high,
                                    mask=mask, sequence=cfg.loss_type == "gspo")
        total = (loss * weights.to(loss.dtype)).sum()
        actor.runtime.backward(total)
        with torch.no_grad():
            kl = kl_estimate(logp, ref_logp, "k3") if ref_logp is not None else torch.zeros_like(logp)
            sums[:5] += torch.tensor([total.item(), (low * mask).sum().item(), (high * mask).sum().item(),
                                      (kl * mask).sum().item(), (entropy_from_logits(logits) * mask).sum().item()],
                                     dtype=torch.float64)
        global_loss = global_sum(total.item())[0]
        ok, norms = optimizer_step([actor], first_step + i, {"loss": global_loss}, nonfinite,
                                   update_label(first_step, i, cfg.iterations))
        sums[5] += norms[0]
        skipped += not ok
    loss, low, high, kl, entropy = global_sum(*sums[:5])
    per_token = [v / max(n_tokens, 1.0) / cfg.iterations for v in (low, high, kl, entropy)]
    values = (loss / cfg.iterations, per_token[0] + per_token[1], *per_token, sums[5].item() / cfg.iterations, gap)
    return dict(zip(STATS, values)) | (is_stats if is_cap is not None else {}), skipped


def truncated_rows(batch: RolloutBatch, eos_id: int) -> torch.Tensor:
    """bool [B]: responses that stopped at generation.max_new_tokens without their EOS (TRL's test:
    the last token is not the EOS)."""
    return torch.tensor([bool(r) and r[-1] != eos_id for r in batch.responses], device=batch.mask.device)


def global_batch_std(rewards: torch.Tensor) -> float:
    """The unbiased std of every rank's `rewards` (TRL's scale_rewards="batch")."""
    n, total, squares = global_sum(rewards.numel(), rewards.sum().item(), (rewards * rewards).sum().item())
    return math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1)) if n else 0.0


def advantages_of(cfg: GRPOSection, rewards: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor,
                  old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None) -> torch.Tensor:
    """grpo.advantage's estimate over the rows the batch keeps (`kept`; `mask`: their response tokens):
    [B], or per token [B, T] for reinforce_pp (whose KL to the reference, when there is one, is in the reward)."""
    if cfg.advantage == "rloo":
        return rloo_advantages(rewards, cfg.group_size)
    if cfg.advantage == "reinforce_pp":
        returns = reinforce_pp_returns(rewards, mask, old_logp, ref_logp, cfg.beta if ref_logp is not None else 0.0)
        return global_whiten(returns, mask) if global_sum(mask.sum().item())[0] else returns
    scale = reward_scaling(cfg)
    std = global_batch_std(rewards[kept]) if scale == "batch" else None
    return grpo_advantages(rewards, cfg.group_size, scale, std)


def grpo_step(actor: ModelRuntime, reference: ModelRuntime | None, batch: RolloutBatch, rewards: torch.Tensor,
              cfg: GRPOSection, max_len: int, eos_id: int, first_step: int,
              nonfinite: NonFiniteSteps | None = None, is_cap: float | None = None) -> dict[str, float]:
    """One generation's rewards to its updates: the soft overlong punishment, dynamic sampling's
    dropped groups, overlong filtering's masked rows, the advantages, then grpo_update. `max_len`:
    generation.max_new_tokens; is_cap: grpo_update's (samples from an older policy); returns the statistics,
    the new ones included."""
    extra = {}
    if cfg.overlong_buffer:
        lengths = torch.tensor([len(r) for r in batch.responses], device=rewards.device)
        penalty = soft_overlong_penalty(lengths, max_len, cfg.overlong_buffer, cfg.overlong_penalty)
        rewards = rewards + penalty.to(rewards.dtype)
        total, rows = global_sum(penalty.sum().item(), len(lengths))
        extra["overlong penalty"] = total / rows
    equal = equal_reward_groups(rewards, cfg.group_size)
    kept = (~equal if cfg.dynamic_sampling else torch.ones_like(equal)).repeat_interleave(cfg.group_size)
    truncated = truncated_rows(batch, eos_id) & kept
    loss_mask = batch.mask * kept.unsqueeze(1)
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * ~truncated.unsqueeze(1)
    ref_logp = logprobs(reference, batch) if reference is not None else None
    old_logp = None
    if cfg.iterations > 1 or (cfg.advantage == "reinforce_pp" and ref_logp is not None):
        old_logp = logprobs(actor, batch)
    advantages = advantages_of(cfg, rewards, kept, batch.mask * kept.unsqueeze(1), old_logp, ref_logp)
    stats, _ = grpo_update(actor, batch, advantages, ref_logp, cfg, first_step, nonfinite, old_logp=old_logp,
                           kept=kept, loss_mask=loss_mask, max_len=max_len, is_cap=is_cap)
    groups, flat, rows, masked = global_sum(equal.numel(), equal.sum().item(), kept.sum().item(),
                                            truncated.sum().item() if cfg.mask_truncated_completions else 0)
    return {**stats, **extra, "zero-advantage groups": flat / groups,
            "dropped groups": flat if cfg.dynamic_sampling else 0.0, "overlong-masked share": masked / max(rows, 1)}


class GRPO(OnlineAlgorithm):
    """The actor trained on grpo.advantage's advantages; a frozen reference when beta > 0."""

    name = "grpo"
    loss_keys = ("loss",)

    def __init__(self, cfg: RLHFConfig, env: DistEnv, tokenizer):
        super().__init__(cfg, env, tokenizer)
        cfg = self.cfg  # with plan.auto's zero_optimization
        g, sft = cfg.grpo, cfg.sft_path()
        self.g, self.steps, self.samples_per_prompt = g, g.steps, g.group_size
        torch.manual_seed(cfg.train.seed)
        self.actor = ModelRuntime("actor", load_model(sft, "models.sft"), cfg, env, lr=g.lr,
                                  steps=g.steps * g.iterations, lora=cfg.lora)
        self.reference = reference_of(self.actor, lambda: load_model(sft, "models.sft"), cfg, env) \
            if g.beta > 0 else None
        self.reward_model = None
        if cfg.reward.source == "model":
            self.reward_model = ModelRuntime("reward", load_model(cfg.reward_path(), "models.reward"), cfg, env,
                                             lr=None)
        self.models = [m for m in (self.actor, self.reference, self.reward_model) if isinstance(m, ModelRuntime)]

    def trained(self) -> tuple[list[tuple[Transformer, int, int]], int, list[int]]:
        """The actor: grpo.iterations optimizer steps, each on every sample of the rank's prompts."""
        cfg = self.cfg
        actor, _ = load_model(cfg.sft_path(), "models.sft")
        _, checkpointed = prepare_trained(actor, cfg, True, cfg.lora)
        return [(actor, 1, cfg.grpo.iterations)], cfg.train.micro_batch_size * cfg.grpo.group_size, checkpointed

    def headline(self) -> str:
        source = self.reward_source()
        return f"actor {self.cfg.sft_path()}, reward from {source}"

    def learn(self, step: int, batch: RolloutBatch, rewards: torch.Tensor, nonfinite) -> dict[str, float]:
        g = self.g
        start = time.perf_counter()
        stats = grpo_step(self.actor, self.reference, batch, rewards, g, self.cfg.generation.max_new_tokens,
                          self.tokenizer.eos_id, step * g.iterations, nonfinite, self.is_cap)
        seconds = global_max(time.perf_counter() - start)
        return {**stats, "training tokens/s": global_sum(batch.attention_mask.sum().item() * g.iterations)[0] / seconds}


def run_grpo(cfg: RLHFConfig, env: DistEnv) -> dict:
    return run_online(GRPO(cfg, env, tokenizer_of(cfg.sft_path())))
