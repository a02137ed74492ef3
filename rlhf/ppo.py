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
from models.transformer import lm_loss, score_model_from
from rlhf.common import (ModelRuntime, StageCheckpoint, all_finite, comm_scalars, global_max, global_sum, load_model,
                         open_log, sequence_logprobs, tokenizer_of)
from rlhf.config import PPOSection, RLHFConfig
from rlhf.data import load_prompts, sft_file, task, write_samples
from rlhf.losses import (approx_kl, entropy_from_logits, gae, kl_controller, ppo_policy_loss, shape_rewards,
                         value_loss)
from rlhf.rollout import (RolloutBatch, generate, global_masked_mean, global_stats, global_whiten, logprobs,
                          model_rewards, response_text, task_rewards, values_of)
from trainer.distributed import DistEnv
from trainer.preemption import PreemptionSignal
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
               ptx=None) -> tuple[dict[str, float], int]:
    """`cfg.epochs` passes over the rollout in `cfg.mini_batches` splits, one actor and one critic
    optimizer step each; returns the statistics and how many steps were skipped (non-finite)."""
    B = exp.batch.tokens.shape[0]
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
            if all_finite(actor_loss.item(), critic_loss.item()):
                actor.step(step)
                critic.step(step)
            else:
                actor.skip_step()
                critic.skip_step()
                skipped += 1
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


def run_ppo(cfg: RLHFConfig, env: DistEnv) -> dict:
    p = cfg.ppo
    sft_path = cfg.sft_path()
    tokenizer = tokenizer_of(sft_path)
    prompts = load_prompts(cfg, tokenizer, env)
    the_task = task(cfg)
    optimizer_steps = p.steps * p.epochs * p.mini_batches
    torch.manual_seed(cfg.train.seed)
    actor = ModelRuntime("actor", load_model(sft_path, "models.sft"), cfg, env, lr=p.actor_lr, steps=optimizer_steps)
    reference = ModelRuntime("reference", load_model(sft_path, "models.sft"), cfg, env, lr=None)
    reward_model = None
    if cfg.reward.source == "model":
        reward_model = ModelRuntime("reward", load_model(cfg.reward_path(), "models.reward"), cfg, env, lr=None)
        critic_start = load_model(cfg.reward_path(), "models.reward")  # DeepSpeed-Chat: critic from the RM
    else:
        critic_start = score_model_from(load_model(sft_path, "models.sft"))
    critic = ModelRuntime("critic", critic_start, cfg, env, lr=p.critic_lr, steps=optimizer_steps)
    models = [m for m in (actor, critic, reference, reward_model) if m is not None]
    kl_ctl = kl_controller(p.kl_coef, p.kl_target or None, p.kl_horizon)
    ema = _EMA(actor, p.ema) if p.ema > 0 else None
    ckpt = StageCheckpoint(cfg, "ppo", env)
    step = consumed = skipped = 0
    path = ckpt.resume_path()
    if path is not None:
        state = ckpt.load(path, models, ema.load if ema else None)
        step, consumed, skipped = state["step"], state["consumed_samples"], state["skipped"]
        kl_ctl.load_state_dict(state["kl_controller"])
    ptx = _ptx_batches(cfg, tokenizer, env, step * cfg.train.micro_batch_size * env.world_size * p.epochs *
                       p.mini_batches) if p.ptx_coef > 0 else None
    sampler = ResumableBatchSampler(prompts.train_indices, cfg.train.micro_batch_size, env.rank, env.world_size,
                                    cfg.train.seed, consumed_samples=consumed)
    batches = iter(sampler)
    log = open_log(cfg, "ppo", p.steps, env, step)
    if env.is_main:
        source = f"from {cfg.reward_path()}" if reward_model else f"task {cfg.data.task}"
        log.info(f"ppo: actor/reference {sft_path}, critic and reward {source} | "
                 f"{prompts.source} | world size {env.world_size} | {cfg.train.micro_batch_size * env.world_size} "
                 f"rollouts per step | runtime: {actor.runtime.describe()}")
    preemption = PreemptionSignal(cfg.train.preempt_signal)
    history = []
    samples_file = cfg.stage_dir("ppo") / "samples.jsonl"
    while step < p.steps:
        start = time.perf_counter()
        for m in models:
            m.runtime.ledger.reset()
        indices = next(batches)
        batch, gen = generate(actor, [prompts.tokens[i] for i in indices], [prompts.texts[i] for i in indices],
                              cfg.generation, tokenizer)
        generation_mb = comm_scalars(models)["cross-node sent (MB)"]
        gen_seconds = time.perf_counter() - start
        scores = model_rewards(reward_model, batch) if reward_model else task_rewards(the_task, batch, tokenizer)
        old_logp = logprobs(actor, batch)
        ref_logp = logprobs(reference, batch)
        with torch.no_grad():
            old_values = values_of(critic, batch)
        exp, kl = make_experience(batch, scores, old_logp, ref_logp, old_values, kl_ctl.coef, p)
        experience_mb = comm_scalars(models)["cross-node sent (MB)"] - generation_mb
        train_start = time.perf_counter()
        stats, bad = ppo_update(actor, critic, exp, p, step * p.epochs * p.mini_batches, ptx)
        train_seconds = time.perf_counter() - train_start
        skipped += bad
        if ema is not None:
            ema.update()
        rows = global_sum(len(indices))[0]
        kl_per_sequence = global_sum((kl * batch.mask).sum().item())[0] / rows
        kl_ctl.update(kl_per_sequence, int(rows))
        score_mean, score_std = global_stats(scores)
        metrics = {"reward": score_mean, "reward std": score_std, "kl": kl_per_sequence, "kl coef": kl_ctl.coef,
                   **stats,
                   "response length": global_sum(batch.mask.sum().item())[0] / rows,
                   "logprob gap": global_masked_mean((old_logp - batch.generation_logp).abs(), batch.mask)}
        if the_task is not None and reward_model is not None:
            metrics["task reward"] = global_stats(task_rewards(the_task, batch, tokenizer))[0]
        new_tokens, gen_max = global_sum(gen.new_tokens)[0], global_max(gen_seconds)
        metrics.update({
            "generation tokens/s": new_tokens / gen_max, "inference copy (MB)": gen.inference_bytes / 2**20,
            "training tokens/s": global_sum(batch.attention_mask.sum().item() * p.epochs)[0] / max(train_seconds, 1e-9),
            "elapsed time per iteration (ms)": (time.perf_counter() - start) * 1e3,
            "cross-node generation (MB)": generation_mb, "cross-node experience (MB)": experience_mb,
            "cross-node training (MB)": comm_scalars(models)["cross-node sent (MB)"] - generation_mb - experience_mb,
            "skipped steps": skipped})
        if not all_finite(score_mean, metrics["policy loss"], metrics["value loss"]):
            log.info(f"step {step + 1}: non-finite reward or loss (reward {score_mean}, policy loss "
                     f"{metrics['policy loss']}, value loss {metrics['value loss']}): its updates were skipped")
        step += 1
        consumed += len(indices) * env.world_size
        history.append(metrics)
        if step % cfg.train.log_interval == 0 or step == p.steps:
            log.scalars(step, metrics, total_steps=p.steps)
            if env.is_main:
                write_samples(samples_file, [{"step": step, "prompt": t, "response": response_text(tokenizer, r),
                                              "reward": float(s)} for t, r, s in
                                             zip(batch.prompt_texts[:2], batch.responses[:2], scores[:2])])
        log.advance()
        stop = global_sum(float(preemption.received))[0] > 0
        interval = cfg.train.checkpoint_interval
        if (interval and step % interval == 0) or step == p.steps or stop:
            saved = ckpt.save(step, models, {"consumed_samples": consumed, "skipped": skipped,
                                             "kl_controller": kl_ctl.state_dict()}, ema.save if ema else None)
            if stop and step != p.steps:
                log.info(f"preempted at step {step}: saved checkpoint {saved}")
                break
    preemption.close()
    log.close()
    if step == p.steps:
        actor.export(cfg.stage_dir("ppo") / "hf", sft_path, tokenizer)
        if ema is not None:
            ema.export(cfg.stage_dir("ppo") / "hf-ema", sft_path, tokenizer)
    for m in models:
        m.close()
    return {"history": history}
