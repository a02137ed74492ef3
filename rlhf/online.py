"""The loop PPO and GRPO share: prompts -> rollout -> rewards -> the algorithm's update, with
the logging, checkpoints, preemption and export around it.

An `OnlineAlgorithm` (rlhf.ppo.PPO, rlhf.grpo.GRPO) owns its models and its update; this loop
owns everything else, so both stages log the same rollout statistics, resume the same way and
stop the same way on the scheduler's signal.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from data.datasets import ResumableBatchSampler
from data.tokenizer import Tokenizer
from rlhf.common import ModelRuntime, StageCheckpoint, all_finite, comm_scalars, global_max, global_sum, open_log
from rlhf.config import RLHFConfig
from rlhf.data import Prompts, write_samples
from rlhf.rollout import RolloutBatch, generate, global_stats, model_rewards, response_text, task_rewards
from rlhf.tasks import VerifiableTask
from trainer.distributed import DistEnv
from trainer.preemption import PreemptionSignal


class OnlineAlgorithm(ABC):
    """What a stage plugs into `run_online`."""

    name: str  # the stage: its directory under out_dir
    steps: int  # rollouts
    actor: ModelRuntime
    models: list[ModelRuntime]  # every model of the stage (checkpoints hold the trainable ones)
    samples_per_prompt: int = 1
    loss_keys: tuple[str, ...] = ()  # metrics that must be finite

    @abstractmethod
    def update(self, step: int, batch: RolloutBatch, rewards: torch.Tensor) -> tuple[dict[str, float], int]:
        """Train on one rollout; returns its metrics and how many optimizer steps were skipped."""

    def state_dict(self) -> dict:
        """What the stage's checkpoints hold besides the models (a KL controller, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_tensors(self, directory: Path) -> None:
        """This rank's extra tensors (an EMA) into a checkpoint directory."""

    def load_tensors(self, directory: Path) -> None:
        pass

    def resumed_at(self, step: int) -> None:
        """Called once before the first rollout with the step the run starts from."""

    def export(self, out_dir: Path, tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
        self.actor.export(out_dir / "hf", tokenizer_dir, tokenizer)


def run_online(algo: OnlineAlgorithm, cfg: RLHFConfig, env: DistEnv, prompts: Prompts, tokenizer: Tokenizer,
               task: VerifiableTask | None, reward_model: ModelRuntime | None, headline: str) -> dict:
    """`algo.steps` rollouts of `train.micro_batch_size` prompts per rank (each sampled
    `algo.samples_per_prompt` times), rewarded by the reward model or the task; returns the
    per-step metrics."""
    ckpt = StageCheckpoint(cfg, algo.name, env)
    step = consumed = skipped = 0
    path = ckpt.resume_path()
    if path is not None:
        state = ckpt.load(path, algo.models, algo.load_tensors)
        step, consumed, skipped = state["step"], state["consumed_samples"], state["skipped"]
        algo.load_state_dict(state)
    algo.resumed_at(step)
    micro = cfg.train.micro_batch_size
    batches = iter(ResumableBatchSampler(prompts.train_indices, micro, env.rank, env.world_size, cfg.train.seed,
                                         consumed_samples=consumed))
    log = open_log(cfg, algo.name, algo.steps, env, step)
    log.info(f"{algo.name}: {headline} | {prompts.source} | world size {env.world_size} | {micro * env.world_size} "
             f"prompts x {algo.samples_per_prompt} samples per step | runtime: {algo.actor.runtime.describe()}")
    preemption = PreemptionSignal(cfg.train.preempt_signal)
    samples_file = cfg.stage_dir(algo.name) / "samples.jsonl"
    history = []
    while step < algo.steps:
        start = time.perf_counter()
        for m in algo.models:
            m.runtime.ledger.reset()
        indices = [i for i in next(batches) for _ in range(algo.samples_per_prompt)]
        batch, gen = generate(algo.actor, [prompts.tokens[i] for i in indices], [prompts.texts[i] for i in indices],
                              cfg.generation, tokenizer)
        generation_mb = comm_scalars(algo.models)["cross-node sent (MB)"]
        generation_seconds = global_max(time.perf_counter() - start)
        rewards = model_rewards(reward_model, batch) if reward_model else task_rewards(task, batch, tokenizer)
        metrics, bad = algo.update(step, batch, rewards)
        skipped += bad
        rows = global_sum(len(indices))[0]
        reward_mean, reward_std = global_stats(rewards)
        metrics = {"reward": reward_mean, "reward std": reward_std, **metrics,
                   "response length": global_sum(batch.mask.sum().item())[0] / rows}
        if task is not None and reward_model is not None:
            metrics["task reward"] = global_stats(task_rewards(task, batch, tokenizer))[0]
        metrics.update({
            "generation tokens/s": global_sum(gen.new_tokens)[0] / generation_seconds,
            "inference copy (MB)": gen.inference_bytes / 2**20,
            "elapsed time per iteration (ms)": (time.perf_counter() - start) * 1e3,
            "cross-node generation (MB)": generation_mb,
            "cross-node training (MB)": comm_scalars(algo.models)["cross-node sent (MB)"] - generation_mb
            - metrics.get("cross-node experience (MB)", 0.0),
            "skipped steps": skipped})
        if not all_finite(reward_mean, *(metrics[k] for k in algo.loss_keys)):
            log.info(f"step {step + 1}: non-finite reward or loss ("
                     + ", ".join(f"{k} {metrics[k]}" for k in ("reward", *algo.loss_keys))
                     + "): its updates were skipped")
        step += 1
        consumed += micro * env.world_size
        history.append(metrics)
        if step % cfg.train.log_interval == 0 or step == algo.steps:
            log.scalars(step, metrics, total_steps=algo.steps)
            if env.is_main:
                write_samples(samples_file, [{"step": step, "prompt": t, "response": response_text(tokenizer, r),
                                              "reward": float(s)} for t, r, s in
                                             zip(batch.prompt_texts[:2], batch.responses[:2], rewards[:2])])
        log.advance()
        stop = global_sum(float(preemption.received))[0] > 0
        interval = cfg.train.checkpoint_interval
        if (interval and step % interval == 0) or step == algo.steps or stop:
            saved = ckpt.save(step, algo.models, {"consumed_samples": consumed, "skipped": skipped,
                                                  **algo.state_dict()}, algo.save_tensors)
            if stop and step != algo.steps:
                log.info(f"preempted at step {step}: saved checkpoint {saved}")
                break
    preemption.close()
    log.close()
    if step == algo.steps:
        algo.export(cfg.stage_dir(algo.name), cfg.sft_path(), tokenizer)
    for m in algo.models:
        m.close()
    return {"history": history}
