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

from data.datasets import ResumableBatchSampler
from rlhf.common import (ModelRuntime, StageCheckpoint, all_finite, comm_scalars, global_max, global_sum, load_model,
                         open_log, sequence_logprobs, tokenizer_of)
from rlhf.config import GRPOSection, RLHFConfig
from rlhf.data import load_prompts, task, write_samples
from rlhf.losses import entropy_from_logits, grpo_advantages, grpo_loss, kl_estimate
from rlhf.rollout import (RolloutBatch, generate, global_stats, logprobs, model_rewards,
                          response_text, task_rewards)
from trainer.distributed import DistEnv
from trainer.preemption import PreemptionSignal


def grpo_update(actor: ModelRuntime, batch: RolloutBatch, advantages: torch.Tensor, ref_logp: torch.Tensor | None,
                cfg: GRPOSection, first_step: int) -> tuple[dict[str, float], int]:
    """`cfg.iterations` optimizer steps on one generation; returns statistics and skipped steps."""
    mask = batch.mask
    n_tokens = global_sum(mask.sum().item())[0]
    old_logp = logprobs(actor, batch) if cfg.iterations > 1 else None
    sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, kl, entropy (token sums)
    skipped = 0
    for i in range(cfg.iterations):
        logp, logits = sequence_logprobs(actor, batch.tokens, batch.attention_mask, batch.prompt_len)
        old = old_logp if old_logp is not None else logp.detach()  # μ = 1: the ratio is 1, the gradient A
        loss, clipped = grpo_loss(logp, old, ref_logp, advantages, cfg.clip, cfg.beta)
        total = (loss * mask).sum() / n_tokens
        actor.runtime.backward(total)
        with torch.no_grad():
            kl = kl_estimate(logp, ref_logp, "k3") if ref_logp is not None else torch.zeros_like(logp)
            sums += torch.tensor([(loss * mask).sum().item(), (clipped * mask).sum().item(), (kl * mask).sum().item(),
                                  (entropy_from_logits(logits) * mask).sum().item()], dtype=torch.float64)
        if all_finite(total.item()):
            actor.step(first_step + i)
        else:
            actor.skip_step()
            skipped += 1
    loss, clipped, kl, entropy = (v / max(n_tokens, 1.0) / cfg.iterations for v in global_sum(*sums))
    return {"loss": loss, "clip fraction": clipped, "kl": kl, "entropy": entropy}, skipped


def run_grpo(cfg: RLHFConfig, env: DistEnv) -> dict:
    g = cfg.grpo
    sft_path = cfg.sft_path()
    tokenizer = tokenizer_of(sft_path)
    prompts = load_prompts(cfg, tokenizer, env)
    the_task = task(cfg)
    torch.manual_seed(cfg.train.seed)
    actor = ModelRuntime("actor", load_model(sft_path, "models.sft"), cfg, env, lr=g.lr, steps=g.steps * g.iterations)
    reference = ModelRuntime("reference", load_model(sft_path, "models.sft"), cfg, env, lr=None) if g.beta > 0 else None
    reward_model = None
    if cfg.reward.source == "model":
        reward_model = ModelRuntime("reward", load_model(cfg.reward_path(), "models.reward"), cfg, env, lr=None)
    models = [m for m in (actor, reference, reward_model) if m is not None]
    ckpt = StageCheckpoint(cfg, "grpo", env)
    step = consumed = skipped = 0
    path = ckpt.resume_path()
    if path is not None:
        state = ckpt.load(path, models)
        step, consumed, skipped = state["step"], state["consumed_samples"], state["skipped"]
    sampler = ResumableBatchSampler(prompts.train_indices, cfg.train.micro_batch_size, env.rank, env.world_size,
                                    cfg.train.seed, consumed_samples=consumed)
    batches = iter(sampler)
    log = open_log(cfg, "grpo", g.steps, env, step)
    if env.is_main:
        source = f"model {cfg.reward_path()}" if reward_model else f"task {cfg.data.task}"
        log.info(f"grpo: actor {sft_path}, reward {source} "
                 f"| {prompts.source} | world size {env.world_size} | {cfg.train.micro_batch_size * env.world_size} "
                 f"prompts x {g.group_size} samples per step | runtime: {actor.runtime.describe()}")
    preemption = PreemptionSignal(cfg.train.preempt_signal)
    history = []
    samples_file = cfg.stage_dir("grpo") / "samples.jsonl"
    while step < g.steps:
        start = time.perf_counter()
        for m in models:
            m.runtime.ledger.reset()
        indices = [i for i in next(batches) for _ in range(g.group_size)]
        batch, gen = generate(actor, [prompts.tokens[i] for i in indices], [prompts.texts[i] for i in indices],
                              cfg.generation, tokenizer)
        generation_mb = comm_scalars(models)["cross-node sent (MB)"]
        gen_seconds = time.perf_counter() - start
        rewards = model_rewards(reward_model, batch) if reward_model else task_rewards(the_task, batch, tokenizer)
        advantages = grpo_advantages(rewards, g.group_size, g.scale_rewards)
        ref_logp = logprobs(reference, batch) if reference is not None else None
        train_start = time.perf_counter()
        stats, bad = grpo_update(actor, batch, advantages, ref_logp, g, step * g.iterations)
        train_seconds = time.perf_counter() - train_start
        skipped += bad
        rows = global_sum(len(indices))[0]
        reward_mean, reward_std = global_stats(rewards)
        flat_groups = (rewards.view(-1, g.group_size).std(dim=1) == 0).sum().item() if g.group_size > 1 \
            else len(rewards)
        metrics = {"reward": reward_mean, "reward std": reward_std, **stats,
                   "zero-advantage groups": global_sum(flat_groups)[0] / (rows / g.group_size),
                   "response length": global_sum(batch.mask.sum().item())[0] / rows}
        if the_task is not None and reward_model is not None:
            metrics["task reward"] = global_stats(task_rewards(the_task, batch, tokenizer))[0]
        new_tokens, gen_max = global_sum(gen.new_tokens)[0], global_max(gen_seconds)
        metrics.update({
            "generation tokens/s": new_tokens / gen_max, "inference copy (MB)": gen.inference_bytes / 2**20,
            "training tokens/s": global_sum(batch.attention_mask.sum().item() * g.iterations)[0]
            / max(train_seconds, 1e-9),
            "elapsed time per iteration (ms)": (time.perf_counter() - start) * 1e3,
            "cross-node generation (MB)": generation_mb,
            "cross-node training (MB)": comm_scalars(models)["cross-node sent (MB)"] - generation_mb,
            "skipped steps": skipped})
        if not all_finite(reward_mean, metrics["loss"]):
            log.info(f"step {step + 1}: non-finite reward or loss (reward {reward_mean}, loss {metrics['loss']}): "
                     f"its update was skipped")
        step += 1
        consumed += cfg.train.micro_batch_size * env.world_size
        history.append(metrics)
        if step % cfg.train.log_interval == 0 or step == g.steps:
            log.scalars(step, metrics, total_steps=g.steps)
            if env.is_main:
                write_samples(samples_file, [{"step": step, "prompt": t, "response": response_text(tokenizer, r),
                                              "reward": float(s)} for t, r, s in
                                             zip(batch.prompt_texts[:2], batch.responses[:2], rewards[:2])])
        log.advance()
        stop = global_sum(float(preemption.received))[0] > 0
        interval = cfg.train.checkpoint_interval
        if (interval and step % interval == 0) or step == g.steps or stop:
            saved = ckpt.save(step, models, {"consumed_samples": consumed, "skipped": skipped})
            if stop and step != g.steps:
                log.info(f"preempted at step {step}: saved checkpoint {saved}")
                break
    preemption.close()
    log.close()
    if step == g.steps:
        actor.export(cfg.stage_dir("grpo") / "hf", sft_path, tokenizer)
    for m in models:
        m.close()
    return {"history": history}
