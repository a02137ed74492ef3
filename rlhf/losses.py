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


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """(weights, truncated) [B, T]: truncated importance sampling (TIS, Yao et al. 2025) for samples drawn by
    another policy than the one an update starts from: each token's loss weighs min(p_old / p_sampler, cap),
    detached; `truncated` marks the tokens the cap bounds."""
    ratio = torch.exp(old_logp.detach() - sampler_logp.detach())
    return ratio.clamp(max=cap), ratio > cap


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


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo")
REWARD_SCALINGS = ("group", "batch", "none")


def _check_groups(rewards: Tensor, group_size: int) -> Tensor:
    """rewards [N] as float groups [N / group_size, group_size], or a ValueError naming the shapes."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    return (rewards if rewards.is_floating_point() else rewards.float()).view(-1, group_size)


def equal_reward_groups(rewards: Tensor, group_size: int) -> Tensor:
    """bool [N / group_size]: groups whose rewards are all equal (no learning signal; DAPO's dynamic
    sampling drops them)."""
    groups = _check_groups(rewards, group_size)
    return (groups == groups[:, :1]).all(dim=1)


def grpo_advantages(rewards: Tensor, group_size: int, scale: str = "group", batch_std: float | None = None,
                    eps: float = 1e-6) -> Tensor:
    """Group-relative advantages [N] for rewards [N] laid out as consecutive groups of `group_size`
    completions of one prompt: (r - group mean) / (std + eps), DeepSeekMath's GRPO (Shao et al.
    2024) with TRL's unbiased std.

    scale (TRL scale_rewards): "group" divides by the group's std (the paper's and TRL's default);
    "batch" by `batch_std`, the std of the whole batch's rewards, which the caller computes over
    every rank (PPO Lite, Liu et al. 2025); "none" keeps r - mean only (Dr. GRPO, Liu et al. 2025,
    which drops the std that upweights nearly solved or unsolved prompts). eps only keeps tiny
    spreads finite (TRL adds 1e-4, OpenRLHF 1e-9): a group whose rewards are all equal, a group of
    one included, gets exactly 0.
    """
    if scale not in REWARD_SCALINGS:
        raise ValueError(f"scale={scale!r}; expected one of {list(REWARD_SCALINGS)}")
    if scale == "batch" and batch_std is None:
        raise ValueError('scale="batch" needs batch_std, the std of the global batch\'s rewards')
    groups = _check_groups(rewards, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        std = (advantages.pow(2).sum(dim=1, keepdim=True) / max(group_size - 1, 1)).sqrt()
        advantages = advantages / (std + eps)
    elif scale == "batch":
        advantages = advantages / (batch_std + eps)
    all_equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return advantages.masked_fill(all_equal, 0).view(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out advantages [N] (Kool et al. 2019; Ahmadian et al. 2024, TRL's
    RLOOTrainer): each completion's reward minus the mean reward of the other completions of its
    prompt, r_i - (sum_j r_j - r_i) / (G - 1). Needs group_size >= 2. A group of equal rewards gets
    exactly 0, not the rounding error of the leave-one-out sums."""
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a baseline from the other samples), got {group_size}")
    groups = _check_groups(rewards, group_size)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    all_equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return (groups - baseline).masked_fill(all_equal, 0).view(-1)


@torch.no_grad()
def reinforce_pp_returns(scores: Tensor, mask: Tensor, logp: Tensor | None = None, ref_logp: Tensor | None = None,
                         kl_coef: float = 0.0) -> Tensor:
    """REINFORCE++'s per-token returns [B, T] before its global-batch normalization (Hu 2025): the
    reward is -kl_coef * k1 KL on every real token plus the sequence score at the last one (the KL
    sits in the reward, not in the loss), and each token's return is the sum of the rewards from it
    on (gamma 1, no critic). kl_coef 0 needs no log-probs: every real token gets the score."""
    real = mask.bool()
    if kl_coef > 0:
        if logp is None or ref_logp is None:
            raise ValueError(f"kl_coef={kl_coef} > 0 needs logp and ref_logp for the KL in the reward")
        rewards, _ = shape_rewards(scores, logp, ref_logp, real, kl_coef, None)
    else:
        rewards = torch.zeros(real.shape, dtype=torch.float32, device=real.device)
        rows = real.any(dim=1).nonzero().squeeze(1)
        rewards[rows, _last_real_positions(real)[rows]] = scores[rows].to(rewards.dtype)
    return rewards.flip(1).cumsum(1).flip(1).masked_fill(~real, 0)


def soft_overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward: 0 up to
    max_len - buffer tokens, then falling linearly to -factor at max_len, -factor beyond."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"buffer={buffer} must be in [1, max_len={max_len}]")
    over = (lengths.double() - (max_len - buffer)).clamp(min=0) / buffer
    return -factor * over.clamp(max=1.0)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, clip: float,
              beta: float, clip_high: float | None = None, mask: Tensor | None = None,
              sequence: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, clipped_low, clipped_high) [B, T]: GRPO's per-token objective (DeepSeekMath eq. 3):
    PPO's clipped surrogate with each row's advantage ([B], or per token [B, T]) on all its tokens,
    plus beta * k3 KL to the reference (eq. 4) when beta > 0 (ref_logp may then be None).

    clip_high (DAPO's clip-higher, TRL epsilon_high; None: = clip) bounds the ratio at
    1 + clip_high above and 1 - clip below. sequence=True is GSPO (Zheng et al. 2025; TRL
    importance_sampling_level="sequence"): one ratio per sequence, exp of the mean token log-ratio
    over `mask` (the geometric mean of the token ratios), clipped at the sequence level; the
    sequence's surrogate and its clip flags are repeated on each of its tokens. The flags mark
    where the clipped term is the smaller objective at the lower (A < 0) or upper (A > 0) bound.
    """
    high = clip if clip_high is None else clip_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if sequence:
        if mask is None:
            raise ValueError("sequence=True (GSPO) needs the response mask")
        log_ratio = masked_mean(logp - old_logp, mask, dim=1).unsqueeze(1)
    else:
        log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - clip, 1 + high)
    loss = torch.maximum(unclipped_loss, clipped_loss).expand_as(logp)
    clipped = (clipped_loss > unclipped_loss).expand_as(logp)
    above = (ratio > 1).expand_as(logp)
    if beta > 0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} > 0 needs ref_logp for the KL penalty")
        loss = loss + beta * kl_estimate(logp, ref_logp, "k3")
    return loss, clipped & ~above, clipped & above


def grpo_token_weights(mask: Tensor, loss_type: str, sequences: float, tokens: float, max_len: int,
                       world: int) -> Tensor:
    """Per-token weights [B, T] of this rank's rows such that the update's loss is the sum over every
    rank of weights * per-token loss, with TRL's aggregations (GRPOConfig loss_type):

    - "grpo", "gspo": each sequence's token mean, averaged over the `sequences` of the global batch;
    - "dapo": every token of the global batch weighs the same: 1 / `tokens` (global);
    - "dr_grpo": the token sum over `sequences` x `max_len` (Dr. GRPO's constant, TRL's
      max_completion_length: generation.max_new_tokens);
    - "bnpo": each rank's own token mean (its local batch), averaged over the `world` ranks: the one
      aggregation that depends on how the batch is split over ranks, as TRL says of it.

    `mask` is the loss mask (rows that train, 0/1); `sequences` and `tokens` are global counts.
    """
    real = mask.to(torch.float64)
    if loss_type in ("grpo", "gspo"):
        return real / (real.sum(dim=1, keepdim=True).clamp(min=1) * max(sequences, 1.0))
    if loss_type == "dapo":
        return real / max(tokens, 1.0)
    if loss_type == "dr_grpo":
        return real / (max(sequences, 1.0) * max_len)
    if loss_type == "bnpo":
        return real / (real.sum().clamp(min=1) * world)
    raise ValueError(f"loss_type={loss_type!r}; expected one of {list(GRPO_LOSS_TYPES)}")
