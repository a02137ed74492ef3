"""Stage 3, PPO (InstructGPT / DeepSpeed-Chat step 3): actor, critic, reference and reward model.

Per rollout: the actor samples a response per prompt (weights gathered once), the reward
model (or the task's code) scores it, the frozen reference gives the per-token k1 KL penalty
that is added to the reward (the score, clipped, at the last response token), GAE turns
rewards and the critic's values into advantages and returns, and `ppo_update` runs
`ppo.epochs` passes of clipped policy and value updates over `ppo.mini_batches` splits.
Every loss is normalized by the global token count of its mini-batch, so an update does not
depend on how the rollout is split over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from data.datasets import ResumableBatchSampler, SFTDataset, collate_sft
from models.transformer import Transformer, lm_loss, score_model_from
from rlhf.common import (ModelRuntime, comm_scalars, global_max, global_sum, load_model, optimizer_step,
                         prepare_trained, reference_of, score_model, sequence_logprobs, tokenizer_of, update_label)
from rlhf.config import PPOSection, RLHFConfig
from rlhf.data import sft_file
from rlhf.losses import (approx_kl, entropy_from_logits, gae, kl_controller, ppo_policy_loss, shape_rewards,
                         value_loss)
from rlhf.online import OnlineAlgorithm, run_online
from rlhf.rollout import RolloutBatch, global_masked_mean, global_whiten, importance_weights, logprobs, values_of
from trainer.config import RunSection
from trainer.distributed import DistEnv
from trainer.nonfinite import NonFiniteSteps
from zeropp.checkpoint import read_safetensors


@dataclass
class Experience:
    """What the PPO update needs of a rollout, all [B, R] over the response tokens."""
    batch: RolloutBatch
    old_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def make_experience(batch: RolloutBatch, scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                    old_values: torch.Tensor, kl_coef: float, cfg: PPOSection) -> tuple[Experience, torch.Tensor]:
    """Shaped rewards -> GAE advantages (whitened over the global batch when asked) and returns;
    also returns the per-token k1 KL to the reference."""
    rewards, kl = shape_rewards(scores, old_logp, ref_logp, batch.mask, kl_coef, cfg.reward_clip)
    advantages, returns = gae(rewards, old_values, batch.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = global_whiten(advantages, batch.mask)
    return Experience(batch, old_logp, old_values, advantages, returns), kl


def ppo_update(actor: ModelRuntime, critic: ModelRuntime, exp: Experience, cfg: PPOSection, first_step: int,
               ptx=None, nonfinite: NonFiniteSteps | None = None,
               is_weights: torch.Tensor | None = None) -> tuple[dict[str, float], int]:
    """`cfg.epochs` passes over the rollout in `cfg.mini_batches` splits, one actor and one critic
    optimizer step each, under the non-finite policy `nonfinite` (trainer.nonfinite; None: a fresh one
    with the default limit); returns the statistics and how many steps were skipped (non-finite).
    is_weights [B, T]: each token's policy loss weighed (truncated importance sampling of samples from an
    older policy, losses.truncated_is_weights)."""
    B = exp.batch.tokens.shape[0]
    nonfinite = nonfinite or NonFiniteSteps(RunSection.max_nonfinite_steps)
    updates = cfg.epochs * cfg.mini_batches
    # token sums of the policy loss, value loss, clipped, approx kl, entropy; tokens
    sums = torch.zeros(6, dtype=torch.float64)
    skipped, step = 0, first_step
    for _ in range(cfg.epochs):
        for rows in torch.tensor_split(torch.arange(B), cfg.mini_batches):
            batch = exp.batch.rows(rows)
            mask = batch.mask
            n_tokens = global_sum(mask.sum().item())[0]
            logp, logits = sequence_logprobs(actor, batch.tokens, batch.attention_mask, batch.prompt_len)
            policy, clipped = ppo_policy_loss(logp, exp.old_logp[rows], exp.advantages[rows], cfg.clip)
            if is_weights is not None:
                policy = policy * is_weights[rows]
            actor_loss = (policy * mask).sum() / n_tokens
            if ptx is not None:
                tokens, labels = ptx()
                actor_loss = actor_loss + cfg.ptx_coef * lm_loss(actor(tokens), labels) / actor.env.world_size
            actor.runtime.backward(actor_loss)
            values = values_of(critic, batch)
            critic_loss = (value_loss(values, exp.old_values[rows], exp.returns[rows], cfg.value_clip) * mask).sum() \
                / n_tokens
            critic.runtime.backward(critic_loss)
            with torch.no_grad():
                sums += torch.tensor([(policy * mask).sum().item(), critic_loss.item() * n_tokens,
                                      (clipped * mask).sum().item(),
                                      (approx_kl(logp, exp.old_logp[rows]) * mask).sum().item(),
                                      (entropy_from_logits(logits) * mask).sum().item(), mask.sum().item()],
                                     dtype=torch.float64)
            losses = dict(zip(("actor loss", "critic loss"), global_sum(actor_loss.item(), critic_loss.item())))
            ok, _ = optimizer_step([actor, critic], step, losses, nonfinite,
                                   update_label(first_step, step - first_step, updates))
            skipped += not ok
            step += 1
    policy, value, clipped, kl, entropy, tokens = global_sum(*sums)
    tokens = max(tokens, 1.0)
    return {"policy loss": policy / tokens, "value loss": value / tokens, "clip fraction": clipped / tokens,
            "approx kl": kl / tokens, "entropy": entropy / tokens}, skipped


def _ptx_batches(cfg: RLHFConfig, tokenizer, env: DistEnv, consumed: int):
    """SFT batches for PPO-ptx (the pretraining/SFT loss mixed into the actor's)."""
    path, fmt = sft_file(cfg, env)
    dataset = SFTDataset(path, tokenizer, max_len=cfg.data.max_len, format=fmt)
    sampler = iter(ResumableBatchSampler(range(len(dataset)), cfg.train.micro_batch_size, env.rank, env.world_size,
                                         cfg.train.seed, consumed_samples=consumed))

    def next_batch():
        batch = collate_sft([dataset[i] for i in next(sampler)], pad_id=tokenizer.pad_id)
        return batch["tokens"][:, :-1].to(env.device), batch["labels"][:, 1:].to(env.device)

    return next_batch


class _EMA:
    """An exponential moving average of the actor's (local) parameters, as DeepSpeed-Chat keeps."""

    def __init__(self, actor: ModelRuntime, decay: float):
        self.actor, self.decay = actor, decay
        self.params = dict(actor.module.named_parameters())
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params.items():
            self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def save(self, directory) -> None:
        save_file({n: t.contiguous() for n, t in self.shadow.items()},
                  directory / f"ema_rank{self.actor.env.rank:05d}.safetensors")

    def load(self, directory) -> None:
        saved = read_safetensors(directory / f"ema_rank{self.actor.env.rank:05d}.safetensors")
        for n, t in self.shadow.items():
            t.copy_(saved[n])

    @torch.no_grad()
    def export(self, path, tokenizer_dir, tokenizer) -> None:
        """Swap the EMA in, write it as a Hugging Face directory, swap the weights back."""
        current = {n: p.detach().clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.copy_(self.shadow[n])
        self.actor.export(path, tokenizer_dir, tokenizer)
        for n, p in self.params.items():
            p.copy_(current[n])


class PPO(OnlineAlgorithm):
    """Actor and critic trained; reference and reward model (unless the reward is a task's) frozen."""

    name = "ppo"
    loss_keys = ("policy loss", "value loss")

    def __init__(self, cfg: RLHFConfig, env: DistEnv, tokenizer):
        super().__init__(cfg, env, tokenizer)
        cfg = self.cfg  # with plan.auto's zero_optimization
        self.p = cfg.ppo
        p, sft = cfg.ppo, cfg.sft_path()
        self.steps = p.steps
        self.updates_per_rollout = p.epochs * p.mini_batches
        torch.manual_seed(cfg.train.seed)
        self.actor = ModelRuntime("actor", load_model(sft, "models.sft"), cfg, env, lr=p.actor_lr,
                                  steps=p.steps * self.updates_per_rollout, lora=cfg.lora)
        self.reference = reference_of(self.actor, lambda: load_model(sft, "models.sft"), cfg, env)
        self.reward_model = None
        if cfg.reward.source == "model":
            self.reward_model = ModelRuntime("reward", load_model(cfg.reward_path(), "models.reward"), cfg, env,
                                             lr=None)
            critic_start = load_model(cfg.reward_path(), "models.reward")  # DeepSpeed-Chat: critic from the RM
        else:
            critic_start = score_model(load_model(sft, "models.sft"))
        self.critic = ModelRuntime("critic", critic_start, cfg, env, lr=p.critic_lr,
                                   steps=p.steps * self.updates_per_rollout)
        self.models = [m for m in (self.actor, self.critic, self.reference, self.reward_model)
                       if isinstance(m, ModelRuntime)]
        self.kl_ctl = kl_controller(p.kl_coef, p.kl_target or None, p.kl_horizon)
        self.ema = _EMA(self.actor, p.ema) if p.ema > 0 else None
        self.ptx = None

    def trained(self) -> tuple[list[tuple[Transformer, int, int]], int, list[int]]:
        """The actor and the critic: ppo.epochs x ppo.mini_batches optimizer steps each, every one on a
        mini-batch of the rank's rollouts."""
        cfg, p = self.cfg, self.cfg.ppo
        actor, _ = load_model(cfg.sft_path(), "models.sft")
        critic = load_model(cfg.reward_path(), "models.reward")[0] if cfg.reward.source == "model" else \
            score_model_from(load_model(cfg.sft_path(), "models.sft")[0])
        _, checkpointed = prepare_trained(actor, cfg, True, cfg.lora)
        prepare_trained(critic, cfg, True, None)
        updates = p.epochs * p.mini_batches
        return [(actor, 1, updates), (critic, 1, updates)], -(-cfg.train.micro_batch_size // p.mini_batches), \
            checkpointed

    def resumed_at(self, step: int) -> None:
        if self.p.ptx_coef > 0:  # the SFT batches consumed so far: one per rank per optimizer step
            consumed = step * self.updates_per_rollout * self.cfg.train.micro_batch_size * self.env.world_size
            self.ptx = _ptx_batches(self.cfg, self.tokenizer, self.env, consumed)

    def headline(self) -> str:
        source = self.reward_source()
        return f"actor and reference {self.cfg.sft_path()}, critic and reward from {source}"

    def learn(self, step: int, batch: RolloutBatch, rewards: torch.Tensor, nonfinite) -> dict[str, float]:
        before = comm_scalars(self.models)["cross-node sent (MB)"]
        old_logp = logprobs(self.actor, batch)
        ref_logp = logprobs(self.reference, batch)
        with torch.no_grad():
            old_values = values_of(self.critic, batch)
        exp, kl = make_experience(batch, rewards, old_logp, ref_logp, old_values, self.kl_ctl.coef, self.p)
        experience_mb = comm_scalars(self.models)["cross-node sent (MB)"] - before
        is_weights, extra = None, {}
        if self.is_cap is not None:  # the rollout came from the weights before the last update
            is_weights, extra = importance_weights(old_logp, batch, batch.mask, self.is_cap)
        start = time.perf_counter()
        stats, _ = ppo_update(self.actor, self.critic, exp, self.p, step * self.updates_per_rollout, self.ptx,
                              nonfinite, is_weights)
        seconds = global_max(time.perf_counter() - start)
        if self.ema is not None:
            self.ema.update()
        rows = global_sum(batch.tokens.shape[0])[0]
        kl_per_sequence = global_sum((kl * batch.mask).sum().item())[0] / rows
        coef = self.kl_ctl.coef
        self.kl_ctl.update(kl_per_sequence, int(rows))
        return {"kl": kl_per_sequence, "kl coef": coef, **stats, **extra,
                "logprob gap": global_masked_mean((old_logp - batch.generation_logp).abs(), batch.mask),
                "training tokens/s": global_sum(batch.attention_mask.sum().item() * self.p.epochs)[0] / seconds,
                "cross-node experience (MB)": experience_mb}

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_controller"])

    def save_tensors(self, directory) -> None:
        super().save_tensors(directory)
        if self.ema is not None:
            self.ema.save(directory)

    def load_tensors(self, directory) -> None:
        super().load_tensors(directory)
        if self.ema is not None:
            self.ema.load(directory)

    def export(self) -> None:
        super().export()
        if self.ema is not None:
            self.ema.export(self.stage_dir / "hf-ema", self.cfg.sft_path(), self.tokenizer)


def run_ppo(cfg: RLHFConfig, env: DistEnv) -> dict:
    return run_online(PPO(cfg, env, tokenizer_of(cfg.sft_path())))
