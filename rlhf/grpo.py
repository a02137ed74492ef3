"""GRPO (DeepSeekMath): no critic; G samples per prompt, advantages normalized within each group.

Each rank samples `grpo.group_size` responses for each of its prompts, so a group never spans
ranks. The loss is token-level over the global batch (every response token of every rank
weighs the same, as TRL's "dapo" / DAPO aggregation), with the ratio clipped at 0.2 and,
when `grpo.beta` > 0, the k3 KL to a frozen reference. Rewards come from code (a task) or
from the reward model.
"""

from __future__ import annotations

import time

import torch

from rlhf.common import (ModelRuntime, global_max, global_sum, load_model, optimizer_step, sequence_logprobs,
                         tokenizer_of, update_label)
from rlhf.config import GRPOSection, RLHFConfig
from rlhf.losses import entropy_from_logits, grpo_advantages, grpo_loss, kl_estimate
from rlhf.online import OnlineAlgorithm, run_online
from rlhf.rollout import RolloutBatch, global_masked_mean, logprobs
from trainer.config import RunSection
from trainer.distributed import DistEnv
from trainer.nonfinite import NonFiniteSteps


def grpo_update(actor: ModelRuntime, batch: RolloutBatch, advantages: torch.Tensor, ref_logp: torch.Tensor | None,
                cfg: GRPOSection, first_step: int, nonfinite: NonFiniteSteps | None = None
                ) -> tuple[dict[str, float], int]:
    """`cfg.iterations` optimizer steps on one generation under the non-finite policy `nonfinite`
    (trainer.nonfinite; None: a fresh one with the default limit); returns statistics and skipped steps."""
    nonfinite = nonfinite or NonFiniteSteps(RunSection.max_nonfinite_steps)
    mask = batch.mask
    n_tokens = global_sum(mask.sum().item())[0]
    old_logp = logprobs(actor, batch) if cfg.iterations > 1 else None
    sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, kl, entropy (token sums)
    skipped = 0
    for i in range(cfg.iterations):
        logp, logits = sequence_logprobs(actor, batch.tokens, batch.attention_mask, batch.prompt_len)
        old = old_logp if old_logp is not None else logp.detach()  # μ = 1: the ratio is 1, the gradient A
        if i == 0:  # the trainer's log-probs against the ones recorded while sampling
            gap = global_masked_mean((logp.detach() - batch.generation_logp).abs(), mask)
        loss, clipped = grpo_loss(logp, old, ref_logp, advantages, cfg.clip, cfg.beta)
        total = (loss * mask).sum() / n_tokens
        actor.runtime.backward(total)
        with torch.no_grad():
            kl = kl_estimate(logp, ref_logp, "k3") if ref_logp is not None else torch.zeros_like(logp)
            sums += torch.tensor([(loss * mask).sum().item(), (clipped * mask).sum().item(), (kl * mask).sum().item(),
                                  (entropy_from_logits(logits) * mask).sum().item()], dtype=torch.float64)
        ok, _ = optimizer_step([actor], first_step + i, {"loss": global_sum(total.item())[0]}, nonfinite,
                               update_label(first_step, i, cfg.iterations))
        skipped += not ok
    loss, clipped, kl, entropy = (v / max(n_tokens, 1.0) / cfg.iterations for v in global_sum(*sums))
    return {"loss": loss, "clip fraction": clipped, "kl": kl, "entropy": entropy, "logprob gap": gap}, skipped


class GRPO(OnlineAlgorithm):
    """The actor trained on group-normalized advantages; a frozen reference when beta > 0."""

    name = "grpo"
    loss_keys = ("loss",)

    def __init__(self, cfg: RLHFConfig, env: DistEnv, tokenizer):
        super().__init__(cfg, env, tokenizer)
        g, sft = cfg.grpo, cfg.sft_path()
        self.g, self.steps, self.samples_per_prompt = g, g.steps, g.group_size
        torch.manual_seed(cfg.train.seed)
        self.actor = ModelRuntime("actor", load_model(sft, "models.sft"), cfg, env, lr=g.lr,
                                  steps=g.steps * g.iterations)
        self.reference = ModelRuntime("reference", load_model(sft, "models.sft"), cfg, env, lr=None) \
            if g.beta > 0 else None
        self.reward_model = None
        if cfg.reward.source == "model":
            self.reward_model = ModelRuntime("reward", load_model(cfg.reward_path(), "models.reward"), cfg, env,
                                             lr=None)
        self.models = [m for m in (self.actor, self.reference, self.reward_model) if m is not None]

    def headline(self) -> str:
        source = f"the reward model {self.cfg.reward_path()}" if self.reward_model else f"task {self.cfg.data.task}"
        return f"actor {self.cfg.sft_path()}, reward from {source}"

    def learn(self, step: int, batch: RolloutBatch, rewards: torch.Tensor, nonfinite) -> dict[str, float]:
        g = self.g
        advantages = grpo_advantages(rewards, g.group_size, g.scale_rewards)
        ref_logp = logprobs(self.reference, batch) if self.reference is not None else None
        start = time.perf_counter()
        stats, _ = grpo_update(self.actor, batch, advantages, ref_logp, g, step * g.iterations, nonfinite)
        seconds = global_max(time.perf_counter() - start)
        groups = rewards.view(-1, g.group_size)
        flat = (groups == groups[:, :1]).all(dim=1).sum().item()
        return {**stats, "zero-advantage groups": global_sum(flat)[0] / global_sum(groups.shape[0])[0],
                "training tokens/s": global_sum(batch.attention_mask.sum().item() * g.iterations)[0] / seconds}


def run_grpo(cfg: RLHFConfig, env: DistEnv) -> dict:
    return run_online(GRPO(cfg, env, tokenizer_of(cfg.sft_path())))
