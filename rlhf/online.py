"""The step PPO and GRPO share: prompts -> rollout -> rewards -> the algorithm's update.

An `OnlineAlgorithm` (rlhf.ppo.PPO, rlhf.grpo.GRPO) owns its models and its `learn`; this class
owns the rest of the step, and the one loop skeleton (trainer.skeleton.run_stage) the logging,
checkpoints, the non-finite policy, preemption and the export around it, as for every stage.
"""

from __future__ import annotations

import dataclasses
import math
import time
from abc import abstractmethod

import torch

from data.datasets import ResumableBatchSampler
from data.tokenizer import Tokenizer
from models.config import num_params
from models.lora import LoRALinear
from rlhf.common import ModelRuntime, comm_scalars, global_max, global_sum
from rlhf.config import RLHFConfig
from rlhf.data import Prompts, load_prompts, task, write_samples
from rlhf.rewards import RewardFunctions
from rlhf.rollout import RolloutBatch, generate, global_stats, model_rewards, response_text, task_rewards
from rlhf.stage import RLHFStage
from rlhf.tasks import VerifiableTask
from trainer.distributed import DistEnv
from trainer.memory import peak_bytes
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteSteps
from trainer.skeleton import run_stage


class OnlineAlgorithm(RLHFStage):
    """A stage that learns from its own rollouts (rlhf.ppo.PPO, rlhf.grpo.GRPO), run by the one loop
    skeleton (trainer.skeleton.run_stage). Each step samples `samples_per_prompt` responses to
    `train.micro_batch_size` prompts per rank, rewards them (the reward model, or the task's code)
    and hands them to the algorithm's `learn`; this class owns everything else of the step, so both
    stages log the same rollout statistics."""

    steps: int  # rollouts
    actor: ModelRuntime
    reward_model: ModelRuntime | None = None  # None: the task's code rewards
    samples_per_prompt: int = 1
    loss_keys: tuple[str, ...] = ()  # metrics that must be finite
    unpriced = "the rollout (generation) and the frozen models' forwards"
    priced = "the learning from a rollout"

    def __init__(self, cfg: RLHFConfig, env: DistEnv, tokenizer: Tokenizer):
        super().__init__(cfg, env)
        self.tokenizer = tokenizer
        self.prompts: Prompts = load_prompts(cfg, tokenizer, env)
        self.train_indices = self.prompts.train_indices
        self.task: VerifiableTask | None = task(cfg)
        r = cfg.reward
        self.reward_functions = RewardFunctions.from_config(r.functions, r.function_weights, r.function_timeout) \
            if r.source == "functions" else None
        self.samples_file = self.stage_dir / "samples.jsonl"
        self.last: tuple[RolloutBatch, torch.Tensor] | None = None  # the last step's rollout and rewards

    @abstractmethod
    def learn(self, step: int, batch: RolloutBatch, rewards: torch.Tensor,
              nonfinite: NonFiniteSteps) -> dict[str, float]:
        """Train on one rollout (its optimizer steps decided by `nonfinite`); returns its metrics."""

    @abstractmethod
    def headline(self) -> str:
        """Where the stage's models come from, for the first log line."""

    def reward_source(self) -> str:
        """What scores the rollouts, for the headline."""
        if self.reward_model is not None:
            return f"the reward model {self.cfg.reward_path()}"
        if self.reward_functions is not None:
            return "reward functions " + ", ".join(f"{spec} x {w:g}" for spec, w in
                                                   zip(self.reward_functions.specs, self.reward_functions.weights))
        return f"task {self.cfg.data.task}"

    def rewards(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Each rollout's reward (the reward model's, the user's functions' or the task's) and, for the
        functions, each one's mean over every rank's completions it applied to."""
        if self.reward_model is not None:
            return model_rewards(self.reward_model, batch), {}
        if self.reward_functions is None:
            return task_rewards(self.task, batch, self.tokenizer), {}
        completions = [response_text(self.tokenizer, r) for r in batch.responses]
        total, applied_to = self.reward_functions.score(batch.prompt_texts, completions)
        sums = global_sum(*(v for pair in applied_to.values() for v in pair))
        means = {f"reward {spec}": sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else float("nan")
                 for i, spec in enumerate(applied_to)}
        return total.to(batch.tokens.device), means

    def resumed_at(self, step: int) -> None:
        """Called once before the first rollout with the step the run starts from."""

    def start(self, log: MetricsLogger, step: int) -> None:
        self.resumed_at(step)
        micro, world = self.cfg.train.micro_batch_size, self.env.world_size
        log.info(f"{self.name}: {self.headline()} | {self.prompts.source} | world size {world} | {micro * world} "
                 f"prompts x {self.samples_per_prompt} samples per step | runtime: {self.actor.runtime.describe()}")
        log.info(f"{self.name}: model states per rank (before the optimizer's first step): " + ", ".join(
            f"{m.name} {sum(m.runtime.model_state_bytes(m.optimizer).values()) / 2**20:.1f} MB" for m in self.models)
            + self.lora_note())

    def lora_note(self) -> str:
        """How the actor trains: its LoRA adapters (trainable / all parameters) and its reference."""
        lora = self.actor.lora
        if lora is None:
            return ""
        adapters = [m for m in self.actor.module.modules() if isinstance(m, LoRALinear)]
        trainable = sum(lora.r * (m.base.in_features + m.base.out_features) for m in adapters)
        return (f"; the actor trains LoRA r={lora.r} on {', '.join(lora.targets)} ({trainable / 1e6:.3f}M of "
                f"{num_params(self.actor.config) / 1e6:.3f}M parameters), its reference is its base (adapters off)")

    def finish(self, log: MetricsLogger) -> None:
        log.info(f"{self.name}: peak memory of rank {self.env.rank}: {peak_bytes(self.env.device) / 2**20:.0f} MB")

    def update(self, step: int, batches, nonfinite: NonFiniteSteps, stop_requested: bool) -> dict[str, float]:
        prompts, tokenizer, task_ = self.prompts, self.tokenizer, self.task
        start = time.perf_counter()
        indices = [i for i in next(batches) for _ in range(self.samples_per_prompt)]
        batch, gen = generate(self.actor, [prompts.tokens[i] for i in indices], [prompts.texts[i] for i in indices],
                              self.cfg.generation, tokenizer)
        generation_mb = comm_scalars(self.models)["cross-node sent (MB)"]
        generation_seconds = global_max(time.perf_counter() - start)
        rewards, per_function = self.rewards(batch)
        learning = time.perf_counter()
        metrics = self.learn(step, batch, rewards, nonfinite)
        self.priced_work_took(time.perf_counter() - learning)
        rows = global_sum(len(indices))[0]
        reward_mean, reward_std = global_stats(rewards)
        metrics = {"reward": reward_mean, "reward std": reward_std, **per_function, **metrics,
                   "response length": global_sum(batch.mask.sum().item())[0] / rows}
        if task_ is not None and self.cfg.reward.source != "task":
            metrics["task reward"] = global_stats(task_rewards(task_, batch, tokenizer))[0]
        metrics.update({
            "generation tokens/s": global_sum(gen.new_tokens)[0] / generation_seconds,
            "inference copy (MB)": gen.inference_bytes / 2**20,
            "elapsed time per iteration (ms)": (time.perf_counter() - start) * 1e3,
            "cross-node generation (MB)": generation_mb,
            "cross-node training (MB)": comm_scalars(self.models)["cross-node sent (MB)"] - generation_mb
            - metrics.get("cross-node experience (MB)", 0.0)})
        if not all(math.isfinite(v) for v in (reward_mean, *(metrics[k] for k in self.loss_keys))):
            # what made the updates non-finite (each skipped update has its own line: trainer.nonfinite)
            self.log.info(f"step {step + 1}: non-finite reward or loss ("
                     + ", ".join(f"{k} {metrics[k]}" for k in ("reward", *self.loss_keys))
                     + "): its updates were skipped")
        self.last = (batch, rewards)
        return metrics

    def evaluate(self) -> dict[str, float] | None:
        """The actor on (at most train.eval_batches global batches of) the held-out prompts: the mean
        reward of its greedy responses and of sampled ones (the generation.* settings), and the task's
        reward where there is a task. The sampled draws have their own generator, seeded alike at every
        evaluation: the same draws each time, and the training's random stream untouched (a resumed run
        stays bit-exact)."""
        cfg, env, valid = self.cfg, self.env, self.prompts.valid_indices
        if not len(valid):
            return None
        per_rank = min(cfg.train.micro_batch_size, max(1, len(valid) // env.world_size))
        batches = iter(ResumableBatchSampler(valid, per_rank, env.rank, env.world_size, cfg.train.seed, shuffle=False))
        n = min(cfg.train.eval_batches, max(1, len(valid) // (per_rank * env.world_size)))
        generator = torch.Generator(device=env.device).manual_seed(cfg.train.seed + env.rank)
        greedy = dataclasses.replace(cfg.generation, temperature=0.0)
        sums = torch.zeros(5, dtype=torch.float64)  # greedy, sampled, greedy task reward, response tokens, rows
        for _ in range(n):
            indices = next(batches)
            tokens, texts = [self.prompts.tokens[i] for i in indices], [self.prompts.texts[i] for i in indices]
            for column, settings in ((0, greedy), (1, cfg.generation)):
                batch, _ = generate(self.actor, tokens, texts, settings, self.tokenizer, generator)
                sums[column] += self.rewards(batch)[0].double().sum().item()
                if column == 0:
                    if self.task is not None and cfg.reward.source != "task":  # else it is column 0 itself
                        sums[2] += task_rewards(self.task, batch, self.tokenizer).double().sum().item()
                    sums[3] += batch.mask.sum().item()
            sums[4] += len(indices)
        greedy_sum, sampled_sum, task_sum, length, rows = global_sum(*sums)
        metrics = {"held-out reward (greedy)": greedy_sum / rows, "held-out reward (sampled)": sampled_sum / rows,
                   "held-out response length (greedy)": length / rows, "held-out prompts": rows}
        if self.task is not None and cfg.reward.source != "task":
            metrics["held-out task reward (greedy)"] = task_sum / rows
        return metrics

    def logged(self, step: int) -> None:
        if self.env.is_main and self.last is not None:
            batch, rewards = self.last
            write_samples(self.samples_file, [{"step": step, "prompt": t, "response": response_text(self.tokenizer, r),
                                               "reward": float(s)} for t, r, s in
                                              zip(batch.prompt_texts[:2], batch.responses[:2], rewards[:2])])

    def export(self) -> None:
        self.actor.export(self.stage_dir / "hf", self.cfg.sft_path(), self.tokenizer)


def run_online(algo: OnlineAlgorithm) -> dict:
    """`algo.steps` rollouts through the loop skeleton; returns the per-step metrics."""
    return {"history": run_stage(algo, algo.cfg.train).history}
