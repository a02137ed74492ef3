"""The tensor math of RLHF: masked statistics, log-probs, KL estimates, GAE and the PPO, DPO, GRPO
and reward-model losses. Pure PyTorch, no distributed code.

Conventions: per-token tensors are [B, T], aligned with the log-probs of the response tokens;
`mask` is 0/1 or bool [B, T] and marks real response tokens, a prefix of each row (right
padding; a row may have none). Per-token losses come back unreduced, so the caller can divide
by the token count of the whole global batch across ranks rather than by a local mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is set; masked-out entries may hold anything, even inf or NaN."""
    kept = x.masked_fill(~mask.bool(), 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask` is set; 0 (not NaN) where the mask is empty."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries, 0 elsewhere; shift_mean=False adds the mean back.

    Unbiased variance and eps = 1e-8 as TRL's masked_var / masked_whiten; with one entry or none
    the variance is taken as 0, so the result is 0 rather than NaN.
    """
    real = mask.bool()
    mean = masked_mean(x, real)
    centered = (x - mean).masked_fill(~real, 0)
    variance = centered.pow(2).sum() / (real.sum() - 1).clamp(min=1).to(x.dtype)
    whitened = centered * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.masked_fill(~real, 0)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """fp32 log-probability of `tokens` [B, T] under `logits` [B, T, V] (logits[:, t] predicts tokens[:, t]).

    log p = logit - logsumexp(logits), one row at a time, so bf16 logits never get a full fp32
    [B, T, V] copy nor a log_softmax of that size.
    """
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    normalizer = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])
    return picked - normalizer


def entropy_from_logits(logits: Tensor) -> Tensor:
    """fp32 entropy [B, T] of the categorical distributions `logits` [B, T, V], one row at a time."""
    entropies = []
    for row in logits:
        logp = torch.log_softmax(row.float(), dim=-1)
        entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(entropies)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman, "Approximating
    KL Divergence", 2020): k1 = log(p/q) (unbiased, high variance, can be negative),
    k2 = log(p/q)^2 / 2 (biased, low variance), k3 = q/p - 1 - log(q/p) (unbiased, low variance, >= 0)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"KL estimator kind={kind!r}; expected one of {list(KL_ESTIMATORS)}")


def _last_real_positions(real: Tensor) -> Tensor:
    """Index of the last set entry of each row of bool [B, T] (0 for an empty row)."""
    positions = torch.arange(real.shape[1], device=real.device)
    return (positions * real).amax(dim=1)


@torch.no_grad()
def shape_rewards(scores: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_coef: float,
                  reward_clip: float | None) -> tuple[Tensor, Tensor]:
    """(rewards, kl) [B, T]: -kl_coef * k1 KL on every real token plus the clipped sequence score
    at the last real token, as InstructGPT and DeepSpeed-Chat's compute_rewards shape them.

    The penalty is the k1 estimate because it is what the return sums (its expectation over the
    trajectory is the sequence KL). Rows with no real token get no reward; reward_clip None or
    <= 0 leaves the scores unclipped.
    """
    real = mask.bool()
    kl = (logp - ref_logp).masked_fill(~real, 0)
    rewards = -kl_coef * kl
    if reward_clip is not None and reward_clip > 0:
        scores = scores.clamp(-reward_clip, reward_clip)
    rows = real.any(dim=1).nonzero().squeeze(1)
    rewards[rows, _last_real_positions(real)[rows]] += scores[rows].to(rewards.dtype)
    return rewards, kl


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, T] by generalized advantage estimation (Schulman et al. 2016).

    Each row's real tokens are one episode: the value after its last real token is 0. Entries
    outside the mask are 0 in both outputs, whatever `rewards` and `values` hold there.
    """
    real = mask.bool()
    keep = real.to(values.dtype)
    rewards, values = rewards.masked_fill(~real, 0), values.masked_fill(~real, 0)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * keep[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, (advantages + values).masked_fill(~real, 0)


def ppo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """(loss, clipped) [B, T]: PPO's clipped surrogate -min(r A, clip(r, 1 - clip, 1 + clip) A), r = p/p_old.

    `clipped` marks tokens where the clipped term is the smaller objective (strictly), whose
    masked mean is the clip fraction TRL and OpenRLHF log.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - clip, 1 + clip)
    return torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Per-token 0.5 * max((v - R)^2, (v_old + clamp(v - v_old, -clip, clip) - R)^2), DeepSpeed-Chat's
    critic_loss_fn; clip None or <= 0 gives the plain 0.5 * (v - R)^2."""
    unclipped = (values - returns).pow(2)
    if clip is None or clip <= 0:
        return 0.5 * unclipped
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(unclipped, (clipped_values - returns).pow(2))


def approx_kl(logp: Tensor, old_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(old || new), detached: a diagnostic of how far an update moved.

    The tokens were sampled from the old policy, so the ratio is r = p_new/p_old and
    k3 = (r - 1) - log r, as CleanRL's ppo.py approx_kl (unbiased and >= 0, unlike k1).
    """
    return kl_estimate(old_logp.detach(), logp.detach(), "k3")


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op so callers treat both controllers alike."""

    def __init__(self, coef: float):
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])


class AdaptiveKLController(FixedKLController):
    """Steers the KL coefficient toward a target KL (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", eq. 2): error = clip(KL / target - 1, -0.2, 0.2),
    coef *= 1 + error * n_steps / horizon."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target={target}, horizon={horizon}; both must be > 0")
        super().__init__(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.coef *= 1 + error * n_steps / self.horizon


def kl_controller(coef: float, target: float | None = None,
                  horizon: float = 10000) -> FixedKLController | AdaptiveKLController:
    """Adaptive when a target KL is given, else fixed. horizon 10000: Ziegler et al. 2019 / TRL's PPOConfig."""
    if target is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target, horizon)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(losses, chosen_rewards, rejected_rewards) [B] of sigmoid DPO (Rafailov et al. 2023) from
    summed log-probs per sequence.

    label_smoothing eps > 0 is conservative DPO (Mitchell 2023, TRL's "sigmoid" loss):
    -(1 - eps) log sigmoid(beta D) - eps log sigmoid(-beta D); 0 is plain DPO, the paper's and
    TRL's default. The implicit rewards beta * (policy - ref) are detached, for logging.
    """
    chosen_log_ratio = policy_chosen - ref_chosen
    rejected_log_ratio = policy_rejected - ref_rejected
    margin = beta * (chosen_log_ratio - rejected_log_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return losses, beta * chosen_log_ratio.detach(), beta * rejected_log_ratio.detach()


def pairwise_reward_loss(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Per-pair Bradley-Terry loss -log sigmoid(chosen - rejected) (InstructGPT's reward model loss)."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def last_token_scores(values: Tensor, attention_mask: Tensor) -> Tensor:
    """values [B, T] at each row's last real position (attention_mask 1), never at padding."""
    real = attention_mask.bool()
    empty = (~real.any(dim=1)).nonzero()
    if len(empty):
        raise ValueError(f"row {empty[0].item()} of the attention mask has no real token to score")
    return values.gather(1, _last_real_positions(real).unsqueeze(1)).squeeze(1)


def diverging_reward_loss(chosen_values: Tensor, rejected_values: Tensor, chosen_mask: Tensor,
                          rejected_mask: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor) -> Tensor:
    """Per-pair DeepSpeed-Chat reward loss (RewardModel.forward, dschat/utils/model/reward_model.py):
    the mean of -log sigmoid(c_t - r_t) over positions t from the first where the pair differs to
    the end of the longer sequence (the shorter side's padding positions included, as there).

    Masks are attention masks with right padding. A pair that differs nowhere is scored at its
    last real token alone; DeepSpeed-Chat takes the last position of the padded tensor, a pad
    position unless the row is full, but for identical inputs the two values agree anyway.
    """
    chosen_real, rejected_real = chosen_mask.bool(), rejected_mask.bool()
    positions = torch.arange(chosen_values.shape[1], device=chosen_values.device)
    end = torch.maximum(chosen_real.sum(dim=1), rejected_real.sum(dim=1))
    empty = (end == 0).nonzero()
    if len(empty):
        raise ValueError(f"pair {empty[0].item()} has no real token on either side")
    differs = (chosen_tokens != rejected_tokens) | (chosen_real != rejected_real)
    differs &= positions < end.unsqueeze(1)
    first_difference = torch.where(differs.any(dim=1), differs.int().argmax(dim=1), end - 1)
    window = (positions >= first_difference.unsqueeze(1)) & (positions < end.unsqueeze(1))
    return masked_mean(-F.logsigmoid(chosen_values - rejected_values), window, dim=1)


def grpo_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages [N] for rewards [N] laid out as consecutive groups of `group_size`
    completions of one prompt: (r - group mean) / (group std + eps), DeepSeekMath's GRPO
    (Shao et al. 2024) with TRL's unbiased std.

    scale=True is the paper's and TRL's default; scale=False (r - mean only) is Dr. GRPO (Liu et
    al. 2025), which drops the std that upweights nearly solved or unsolved prompts. eps only
    keeps tiny spreads finite (TRL adds 1e-4, OpenRLHF 1e-9): a group whose rewards are all
    equal, a group of one included, gets exactly 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        std = (advantages.pow(2).sum(dim=1, keepdim=True) / max(group_size - 1, 1)).sqrt()
        advantages = advantages / (std + eps)
    all_equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return advantages.masked_fill(all_equal, 0).view(-1)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, clip: float,
              beta: float) -> tuple[Tensor, Tensor]:
    """(loss, clipped) [B, T]: GRPO's per-token objective (DeepSeekMath eq. 3): PPO's clipped
    surrogate with each row's advantage [B] on all its tokens, plus beta * k3 KL to the reference
    (eq. 4) when beta > 0 (ref_logp may then be None)."""
    loss, clipped = ppo_policy_loss(logp, old_logp, advantages.unsqueeze(1), clip)
    if beta > 0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} > 0 needs ref_logp for the KL penalty")
        loss = loss + beta * kl_estimate(logp, ref_logp, "k3")
    return loss, clipped
