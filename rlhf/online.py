"""The step PPO and GRPO share: prompts -> rollout -> rewards -> the algorithm's update.

An `OnlineAlgorithm` (rlhf.ppo.PPO, rlhf.grpo.GRPO) owns its models and its `learn`; this class
owns the rest of the step, and the one loop skeleton (trainer.skeleton.run_stage) the logging,
checkpoints, the non-finite policy, preemption and the export around it, as for every stage.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from abc import abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.datasets import ResumableBatchSampler
from data.tokenizer import Tokenizer
from models.config import num_params
from models.lora import LoRALinear
from rlhf.common import ModelRuntime, comm_scalars, global_max, global_sum
from rlhf.config import RLHFConfig
from rlhf.data import Prompts, load_prompts, task, write_samples
from rlhf.rewards import RewardFunctions
from rlhf.rollout import (GenerationStats, RolloutBatch, generate, global_stats, model_rewards, response_text, sample,
                          task_rewards)
from rlhf.stage import RLHFStage
from rlhf.tasks import VerifiableTask
from trainer.config import ConfigError
from trainer.distributed import DistEnv
from trainer.memory import peak_bytes
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteSteps
from trainer.skeleton import run_stage


class RolloutAhead(threading.Thread):
    """The next step's rollout (generation.staleness 1), sampled on a thread while this step learns, or
    here and now (`overlap` false)."""

    def __init__(self, work, overlap: bool):
        super().__init__(name="rollout ahead", daemon=True)
        self.work, self.result, self.error = work, None, None
        if overlap:
            self.start()
        else:
            self.run()

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as e:  # raised again on the training thread, by collect
            self.error = e

    def collect(self):
        if self.ident is not None:  # started: a thread
            self.join()
        if self.error is not None:
            raise self.error
        return self.result


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
        # generation.staleness 1: the next step's rollout (its prompt indices, batch, statistics), sampled while
        # this step learned, from the weights before its update; learned from with truncated importance weights.
        self.ahead: tuple[list[int], RolloutBatch, GenerationStats] | None = None
        self.is_cap = cfg.generation.is_cap if cfg.generation.staleness else None
        self.next_draw = 1  # the step (from 1) whose prompts the sampler yields next

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
        self.next_draw = step + 1
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

    def _draw(self, batches) -> list[int]:
        """The next step's prompts from the sampler, each repeated samples_per_prompt times."""
        self.next_draw += 1
        return [i for i in next(batches) for _ in range(self.samples_per_prompt)]

    def _sampler(self):
        """A plain copy of the actor with the weights a rollout would sample with now (every rank together)."""
        return self.actor.full_model(self.actor.runtime.rollout_weights()).eval()

    def _sample(self, model, indices: list[int], step: int) -> tuple[list[int], RolloutBatch, GenerationStats]:
        """Step `step`'s rollout (from 1) from `model`, with draws of its own: the same on a resume."""
        generator = torch.Generator(device=self.env.device).manual_seed(
            hash((self.cfg.train.seed, self.env.rank, step)) % 2**63)
        return (indices, *sample(model, *self.prompts.take(indices), self.cfg.generation, self.tokenizer, generator,
                                 self.env.device))

    def _rollout(self, step: int, batches) -> tuple[RolloutBatch, GenerationStats, RolloutAhead | None]:
        """This step's rollout (from step + 1's prompts) and, under generation.staleness 1, the thread
        sampling the next one from the weights before this step's update."""
        if not self.cfg.generation.staleness:
            return (*generate(self.actor, *self.prompts.take(self._draw(batches)), self.cfg.generation,
                              self.tokenizer), None)
        model = self._sampler() if self.ahead is None or step + 1 < self.steps else None
        if self.ahead is None:  # the run's first step: its own rollout, sampled here from the same weights
            _, batch, gen = self._sample(model, self._draw(batches), step + 1)
        else:
            indices, batch, gen = self.ahead
            if self.next_draw == step + 1:  # resumed: the sampler first yields the prompts sampled ahead
                drawn = self._draw(batches)
                if drawn != indices:
                    raise ConfigError(f"resume: the checkpoint's rollout sampled ahead has other prompts than step "
                                      f"{step + 1}'s on rank {self.env.rank}; resume with the checkpoint's "
                                      f"train.seed and ranks, or with generation.staleness 0")
        thread = None
        if step + 1 < self.steps:
            indices = self._draw(batches)
            thread = RolloutAhead(lambda: self._sample(model, indices, step + 2), self.cfg.generation.overlap)
        return batch, gen, thread

    def update(self, step: int, batches, nonfinite: NonFiniteSteps, stop_requested: bool) -> dict[str, float]:
        tokenizer, task_ = self.tokenizer, self.task
        start = time.perf_counter()
        stale = self.ahead is not None  # this step's rollout was sampled before the last update
        batch, gen, ahead = self._rollout(step, batches)
        generation_mb = comm_scalars(self.models)["cross-node sent (MB)"]
        generation_seconds = global_max(gen.seconds if self.cfg.generation.staleness else time.perf_counter() - start)
        rewards, per_function = self.rewards(batch)
        learning = time.perf_counter()
        try:
            metrics = self.learn(step, batch, rewards, nonfinite)
        except BaseException:
            if ahead is not None and ahead.ident is not None:
                ahead.join()
            raise
        self.priced_work_took(time.perf_counter() - learning)
        self.ahead = ahead.collect() if ahead is not None else None
        rows = global_sum(batch.tokens.shape[0])[0]
        reward_mean, reward_std = global_stats(rewards)
        metrics = {"reward": reward_mean, "reward std": reward_std, **per_function, **metrics,
                   "response length": global_sum(batch.mask.sum().item())[0] / rows}
        if task_ is not None and self.cfg.reward.source != "task":
            metrics["task reward"] = global_stats(task_rewards(task_, batch, tokenizer))[0]
        if self.cfg.generation.staleness:
            metrics["rollout staleness"] = float(stale)
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

    # --- a rollout sampled ahead is part of the checkpoint: a resume learns from the same samples

    def _ahead_file(self, directory: Path) -> Path:
        return Path(directory) / f"rollout_ahead_rank{self.env.rank}.safetensors"

    def save_tensors(self, directory) -> None:
        if self.ahead is None:
            return
        indices, batch, gen = self.ahead
        meta = {"indices": indices, "prompt_len": batch.prompt_len, "responses": batch.responses,
                "prompt_texts": batch.prompt_texts, "stats": dataclasses.asdict(gen), "world_size": self.env.world_size}
        save_file({k: getattr(batch, k).cpu().contiguous() for k in AHEAD_TENSORS}, self._ahead_file(directory),
                  metadata={"rollout": json.dumps(meta)})

    def load_tensors(self, directory) -> None:
        path = self._ahead_file(directory)
        if not self.cfg.generation.staleness or not path.is_file():
            return
        with safe_open(path, framework="pt", device=str(self.env.device)) as f:
            meta = json.loads(f.metadata()["rollout"])
            tensors = {k: f.get_tensor(k) for k in AHEAD_TENSORS}
        if meta["world_size"] != self.env.world_size:
            raise ConfigError(f"resume: {path} holds a rollout sampled ahead on {meta['world_size']} ranks, this run "
                              f"has {self.env.world_size}; resume on as many ranks, or with generation.staleness 0")
        batch = RolloutBatch(tensors["tokens"], tensors["attention_mask"], meta["prompt_len"], tensors["mask"],
                             tensors["generation_logp"], meta["responses"], meta["prompt_texts"])
        self.ahead = (meta["indices"], batch, GenerationStats(**meta["stats"]))

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
            tokens, texts = self.prompts.take(indices)
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


AHEAD_TENSORS = ("tokens", "attention_mask", "mask", "generation_logp")  # RolloutBatch's tensors


def run_online(algo: OnlineAlgorithm) -> dict:
    """`algo.steps` rollouts through the loop skeleton; returns the per-step metrics."""
    return {"history": run_stage(algo, algo.cfg.train).history}
