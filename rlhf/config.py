"""The `rlhf.py` configuration: the same dataclasses + YAML + CLI system as train.py.

One config describes the whole pipeline; each stage reads the sections it needs. Every
default below names where it comes from (DeepSpeed-Chat, TRL, OpenRLHF, the papers).
Stages hand their results to the next as Hugging Face directories under `train.out_dir`:
<out_dir>/sft/hf (a causal LM), <out_dir>/reward/hf (a *ForSequenceClassification), and
<out_dir>/<ppo|dpo|grpo>/hf (the trained actor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from trainer.config import (ConfigError, HeldOutSection, InputPath, LoraSection, ModelSection, OptimSection,
                            ResumeConfig, RunSection, check_held_out, check_lora_section, check_model_section,
                            check_optim_section, check_run_section)
from zeropp.config import PlanConfig, ZeroConfig, ZeroConfigError

STAGES = ("sft", "reward", "dpo", "ppo", "grpo")


@dataclass
class ModelsSection:
    # Where the SFT stage starts: a Hugging Face causal-LM directory, or None for a fresh model
    # of `model.preset` over the built-in character tokenizer (rlhf.tasks; CPU demos and tests).
    base: Annotated[str | None, InputPath()] = None
    # The SFT model the actor, the reference and (for the critic / reward model) the score
    # models start from; None: <out_dir>/sft/hf, made by the sft stage first when missing.
    sft: Annotated[str | None, InputPath()] = None
    # The reward model (a *ForSequenceClassification directory); None: <out_dir>/reward/hf,
    # made by the reward stage first when missing (unless the reward is a task's).
    reward: Annotated[str | None, InputPath()] = None


@dataclass
class DataSection(HeldOutSection):
    # A built-in verifiable task (rlhf.tasks: "arithmetic", "word", "math"): prompts, demonstrations,
    # preference pairs and the reward all come from code; no data files. "" uses the files below.
    task: str = ""
    task_samples: int = 2000  # records the task generates for the sft / reward / dpo stages
    # The task's own settings as name=value (math: steps, max_number; arithmetic: max_operand; both
    # format_reward), e.g. --data.task_options steps=1,max_number=5; none: the task's defaults.
    task_options: list[str] = field(default_factory=list)
    # Preference pairs (HH-RLHF .jsonl.gz or prompt/chosen/rejected records) for sft (its
    # chosen dialogues), reward and dpo; prompts for ppo / grpo when prompts is unset.
    preferences: Annotated[str | None, InputPath()] = None
    # Prompts for ppo / grpo: an Alpaca-format JSON (instruction + input), or None for the
    # prompts of `preferences`.
    prompts: Annotated[str | None, InputPath()] = None
    max_len: int = 256  # prompt + response tokens per sequence
    max_prompt_len: int = 128  # ppo / grpo prompts are cut to their last max_prompt_len tokens
    # Every stage's forwards over padded sequences (sft examples, preference pairs, rollouts) run packed:
    # the sequences side by side, positions restarting, attention within each; the same losses.
    packing: bool = False


@dataclass
class SFTSection:
    steps: int = 200  # optimizer steps of the sft stage
    lr: float = 1e-4  # learning rate; DeepSpeed-Chat step 1 (OPT-1.3b): 9.65e-6 at full scale; tiny models want more
    grad_accum: int = 1  # micro-batches accumulated per optimizer step


@dataclass
class RewardSection:
    steps: int = 200  # optimizer steps of the reward stage
    lr: float = 5e-5  # learning rate (DeepSpeed-Chat step 2, OPT-350m)
    # "last": the score at each response's last real token (TRL, OpenRLHF); "diverging":
    # DeepSpeed-Chat's mean over the tokens after chosen and rejected first differ.
    loss: Literal["last", "diverging"] = "last"
    # What scores ppo / grpo rollouts: "model" (the reward model), "task" (data.task's code) or
    # "functions" (reward.functions, the user's own). A task's reward is logged in every case.
    source: Literal["model", "task", "functions"] = "model"
    # The user's reward functions (reward.source functions; rlhf.rewards): 'module:callable' or
    # 'path/to/file.py:callable', called as fn(prompts=[...], completions=[...]) on decoded text,
    # returning one number (or None: does not apply) per completion, as TRL's reward_funcs.
    # On the command line: --reward.functions my_rewards:correct,checks.py:format
    functions: list[str] = field(default_factory=list)
    function_weights: list[float] = field(default_factory=list)  # one per function (TRL reward_weights); none: 1
    function_timeout: float = 60.0  # seconds one call may take; then the run stops, naming the function


@dataclass
class GenerationSection:
    max_new_tokens: int = 64  # longest response sampled per prompt (ppo, grpo)
    # No EOS among a response's first this many tokens (HF generate's min_new_tokens). Equal to max_new_tokens:
    # every response that long, as DeepSpeed-Chat's PPO samples (min_length = max_length) for its benchmarks.
    min_new_tokens: int = 0
    temperature: float = 1.0  # sampling temperature; 1: PPO / GRPO sample from the policy itself (TRL, OpenRLHF)
    top_k: int = 0  # sample among the k likeliest tokens only; 0: off
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability; 1: off
    # Bound on the memory of the gathered inference copy of the actor (MiB); 0: whole model.
    # Blocks beyond it are gathered per decoded token, as in training.
    max_gather_mb: float = 0.0
    # 0: each ppo / grpo step samples its rollout, then learns from it. 1: the rollout of the next step is
    # sampled while this one learns (a thread, from a copy of the weights before this step's update), so
    # each update learns from samples one update old, corrected by truncated importance sampling.
    staleness: int = 0
    # With staleness 1: sample the next rollout on a thread while this step learns (true), or on the training
    # thread before the update (false: the same samples and updates, nothing overlapped; what overlap buys).
    overlap: bool = True
    # That correction's cap C: each response token's loss weighs min(pi_old / pi_sampler, C), pi_old the
    # policy before the update, pi_sampler the one that sampled (TIS, Yao et al. 2025; verl's default 2).
    is_cap: float = 2.0


@dataclass
class PPOSection:
    steps: int = 100  # rollouts, each followed by ppo.epochs x ppo.mini_batches updates
    actor_lr: float = 1e-5  # the actor's learning rate (DeepSpeed-Chat step 3: 9.65e-6)
    critic_lr: float = 5e-6  # the critic's learning rate (DeepSpeed-Chat step 3: 5e-6)
    epochs: int = 1  # PPO epochs over each rollout (DeepSpeed-Chat ppo_epochs 1; OpenRLHF max_epochs 1)
    mini_batches: int = 1  # optimizer steps per epoch, the rollout split evenly
    kl_coef: float = 0.1  # β of the per-token k1 penalty (DeepSpeed-Chat kl_ctl 0.1)
    kl_target: float = 0.0  # > 0: adaptive β toward this KL per sequence (Ziegler et al. 2019: 6.0)
    kl_horizon: int = 10000  # steps over which the adaptive β moves toward kl_target (Ziegler et al. 2019)
    reward_clip: float = 5.0  # the reward is clipped to ±this (DeepSpeed-Chat clip_reward_value)
    gamma: float = 1.0  # discount of future rewards in the advantages (DeepSpeed-Chat)
    lam: float = 0.95  # GAE's lambda (DeepSpeed-Chat)
    clip: float = 0.2  # policy ratio clip (DeepSpeed-Chat cliprange)
    value_clip: float = 0.2  # clip of the critic's value update (DeepSpeed-Chat cliprange_value)
    # Normalize the advantages over the global batch (TRL, OpenRLHF; DeepSpeed-Chat does not).
    whiten_advantages: bool = True
    ema: float = 0.0  # > 0: keep an EMA of the actor (DeepSpeed-Chat --enable_ema uses 0.992)
    ptx_coef: float = 0.0  # > 0: mix in the SFT loss on SFT data (InstructGPT PPO-ptx; DeepSpeed-Chat 27.8)


@dataclass
class DPOSection:
    steps: int = 200  # optimizer steps of the dpo stage
    lr: float = 5e-7  # learning rate (TRL DPOConfig's default; 1e-6 in the DPO paper)
    beta: float = 0.1  # DPO's β: how far the policy may move from the reference (DPO paper, TRL)
    label_smoothing: float = 0.0  # assumed share of flipped labels (cDPO; TRL's sigmoid loss)
    # Reference log-probs computed once before training from the initial policy (which is the
    # reference), so no reference model is held; false keeps a frozen reference model.
    precompute_ref: bool = True


@dataclass
class GRPOSection:
    steps: int = 100  # optimizer steps of the grpo stage (one generation each)
    lr: float = 1e-6  # learning rate (TRL GRPOConfig's default)
    group_size: int = 8  # G samples per prompt (TRL num_generations 8)
    iterations: int = 1  # μ: optimizer passes per generation (TRL num_iterations 1)
    clip: float = 0.2  # policy ratio clip below, and above unless clip_high is set (TRL epsilon)
    clip_high: float | None = None  # upper ratio clip; None: = clip (DAPO's clip-higher 0.28; TRL epsilon_high)
    # k3 KL to the reference in the loss (TRL default 0.0; DeepSeekMath 0.04); with advantage
    # reinforce_pp it is the k1 penalty in the reward instead (REINFORCE++).
    beta: float = 0.0
    # How the loss is aggregated (TRL loss_type, default "dapo"): grpo (each sequence's token mean,
    # averaged over sequences), bnpo (token mean of each rank's batch), dr_grpo (token sum over
    # sequences x generation.max_new_tokens), dapo (token mean of the global batch), gspo (GSPO's
    # sequence-level ratio, aggregated as grpo). All but bnpo are global: N ranks equal one process.
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo"] = "dapo"
    # Advantages: group (GRPO, scaled by scale_rewards), rloo (leave-one-out baseline; TRL RLOOTrainer),
    # reinforce_pp (REINFORCE++: KL in the reward, returns normalized over the global batch).
    advantage: Literal["group", "rloo", "reinforce_pp"] = "group"
    # advantage group's divisor (TRL scale_rewards): the group's std ("group", DeepSeekMath), the
    # global batch's ("batch", PPO Lite) or none ("none", Dr. GRPO); true / false mean group / none.
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    # Drop the groups whose rewards are all equal from the loss and its normalization (DAPO's dynamic
    # sampling, without resampling); each step logs how many were dropped.
    dynamic_sampling: bool = False
    # Leave responses cut at generation.max_new_tokens (no EOS) out of the loss (DAPO's overlong
    # filtering; TRL mask_truncated_completions).
    mask_truncated_completions: bool = False
    # > 0: DAPO's soft overlong punishment over the last this many tokens before max_new_tokens
    # (verl overlong_buffer.len; TRL get_soft_overlong_punishment's soft_punish_cache); 0: off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the punishment at max_new_tokens (verl overlong_buffer.penalty_factor)


def _train_section() -> RunSection:
    """The trainer's shared keys (trainer.config.RunSection), with rlhf.py's own defaults where they
    differ: a log line per step (stages are short), an evaluation every 50 steps, its own out_dir."""
    return RunSection(log_interval=1, eval_interval=50, out_dir="runs/rlhf")


@dataclass
class RLHFConfig(ResumeConfig):
    model: ModelSection = field(default_factory=ModelSection)  # the shape of a fresh base (models.base unset) only
    models: ModelsSection = field(default_factory=ModelsSection)  # where each stage's models come from
    data: DataSection = field(default_factory=DataSection)  # a built-in task, or preference pairs and prompts
    # Batches, logging, evaluation, checkpoints: train.py's shared keys (each stage writes <out_dir>/<stage>/).
    train: RunSection = field(default_factory=_train_section)
    # AdamW and its schedule for every stage; the learning rate is each stage's own (sft.lr, ...).
    optim: OptimSection = field(default_factory=lambda: OptimSection(
        warmup_steps=0, decay="constant", weight_decay=0.0, beta2=0.95))
    # The runtime of every model of a stage: 0 plain DDP, 3 ZeRO-3, plus ZeRO++ (docs/zeropp.md).
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # zero_optimization chosen from the machine for each stage (its trained models' step priced; docs/autoplan.md).
    plan: PlanConfig = field(default_factory=PlanConfig)
    generation: GenerationSection = field(default_factory=GenerationSection)  # sampling the ppo / grpo rollouts
    # LoRA adapters (r > 0) on the model sft trains and on the policy of dpo / ppo / grpo, over a
    # frozen base (stored quantized under zero_optimization.zero_quantized_nontrainable_weights);
    # the reference is that policy with its adapters off, no second copy. The reward model and
    # the critic train every weight (their score head is new). Exports merge the adapters.
    lora: LoraSection = field(default_factory=LoraSection)
    sft: SFTSection = field(default_factory=SFTSection)  # stage 1: supervised fine-tuning
    reward: RewardSection = field(default_factory=RewardSection)  # stage 2: the reward model
    ppo: PPOSection = field(default_factory=PPOSection)  # PPO: actor, critic, reference and reward model
    dpo: DPOSection = field(default_factory=DPOSection)  # DPO on preference pairs
    grpo: GRPOSection = field(default_factory=GRPOSection)  # GRPO: groups of samples per prompt, no critic

    def stage_dir(self, stage: str) -> Path:
        return Path(self.train.out_dir) / stage

    def sft_path(self) -> Path:
        return Path(self.models.sft) if self.models.sft else self.stage_dir("sft") / "hf"

    def reward_path(self) -> Path:
        return Path(self.models.reward) if self.models.reward else self.stage_dir("reward") / "hf"


def check(cfg: RLHFConfig, stage: str) -> None:
    """Values no stage can use are errors that name the key."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    for key, value in (("sft.steps", cfg.sft.steps),
                       ("reward.steps", cfg.reward.steps), ("ppo.steps", cfg.ppo.steps),
                       ("dpo.steps", cfg.dpo.steps), ("grpo.steps", cfg.grpo.steps),
                       ("ppo.epochs", cfg.ppo.epochs), ("ppo.mini_batches", cfg.ppo.mini_batches),
                       ("grpo.group_size", cfg.grpo.group_size), ("grpo.iterations", cfg.grpo.iterations),
                       ("generation.max_new_tokens", cfg.generation.max_new_tokens),
                       ("data.max_len", cfg.data.max_len), ("data.max_prompt_len", cfg.data.max_prompt_len),
                       # checked again by check_run_section; rlhf.py's wording of it (tests pin it) first
                       ("train.activation_checkpointing_every", cfg.train.activation_checkpointing_every)):
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")
    check_run_section(cfg.train)  # the shared keys: checked as train.py checks them
    check_optim_section(cfg.optim)
    check_model_section(cfg.model)
    check_held_out(cfg.data)
    check_lora_section(cfg.lora, "lora")
    if cfg.data.max_prompt_len >= cfg.data.max_len:
        raise ConfigError(f"data.max_prompt_len {cfg.data.max_prompt_len} must be below data.max_len "
                          f"{cfg.data.max_len} (room for the response)")
    if cfg.generation.temperature < 0:
        raise ConfigError(f"generation.temperature must be >= 0, got {cfg.generation.temperature}")
    if not 0.0 < cfg.generation.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {cfg.generation.top_p}")
    if not 0 <= cfg.generation.min_new_tokens <= cfg.generation.max_new_tokens:
        raise ConfigError(f"generation.min_new_tokens must be in [0, generation.max_new_tokens = "
                          f"{cfg.generation.max_new_tokens}], got {cfg.generation.min_new_tokens}")
    if cfg.generation.staleness not in (0, 1):
        raise ConfigError(f"generation.staleness must be 0 (sample, then learn) or 1 (the next rollout sampled "
                          f"while this step learns), got {cfg.generation.staleness}")
    if cfg.generation.is_cap < 1:
        raise ConfigError(f"generation.is_cap must be >= 1 (a cap on the importance weight), got "
                          f"{cfg.generation.is_cap}")
    if cfg.generation.staleness and cfg.generation.max_gather_mb:
        raise ConfigError(f"generation.staleness 1 samples from a whole copy of the actor; it cannot go with "
                          f"generation.max_gather_mb {cfg.generation.max_gather_mb} (use 0)")
    check_grpo_section(cfg.grpo, cfg.generation.max_new_tokens)
    if cfg.ppo.mini_batches > cfg.train.micro_batch_size:
        raise ConfigError(f"ppo.mini_batches {cfg.ppo.mini_batches} exceeds train.micro_batch_size "
                          f"{cfg.train.micro_batch_size}: every mini-batch needs a rollout on each rank")
    if not cfg.data.task and not cfg.data.preferences and not (stage in ("ppo", "grpo") and cfg.data.prompts):
        raise ConfigError(f"rlhf.py {stage}: no data: set data.task (a built-in verifiable task) or "
                          f"data.preferences (HH-RLHF / prompt-chosen-rejected records)")
    if cfg.reward.source == "task" and not cfg.data.task:
        raise ConfigError("reward.source is 'task' but data.task is not set: name a built-in task or use "
                          "reward.source model")
    if (cfg.reward.source == "functions") != bool(cfg.reward.functions):
        raise ConfigError(f"reward.functions {cfg.reward.functions} with reward.source {cfg.reward.source!r}: "
                          f"the functions score the rollouts with reward.source functions, and only then")
    try:
        cfg.zero_optimization.validate()
        cfg.plan.validate()
    except ZeroConfigError as e:
        raise ConfigError(str(e)) from None


def reward_scaling(g: GRPOSection) -> str:
    """grpo.scale_rewards as one of "group", "batch", "none" (true / false: TRL's aliases of group / none)."""
    return {True: "group", False: "none"}.get(g.scale_rewards, g.scale_rewards)


def check_grpo_section(g: GRPOSection, max_new_tokens: int) -> None:
    """The grpo keys' ranges and combinations, each error naming its key."""
    for key, value in (("grpo.clip", g.clip), ("grpo.clip_high", g.clip_high)):
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if g.clip >= 1:
        raise ConfigError(f"grpo.clip must be below 1 (the ratio's lower bound 1 - clip stays positive), got {g.clip}")
    if g.beta < 0:
        raise ConfigError(f"grpo.beta must be >= 0, got {g.beta}")
    if g.advantage == "rloo" and g.group_size < 2:
        raise ConfigError(f"grpo.advantage rloo needs grpo.group_size >= 2 (a leave-one-out baseline), got "
                          f"{g.group_size}")
    if g.advantage != "group" and reward_scaling(g) != "group":
        raise ConfigError(f"grpo.scale_rewards {g.scale_rewards!r} applies to grpo.advantage group only, not "
                          f"{g.advantage!r}: leave it at its default")
    if not 0 <= g.overlong_buffer <= max_new_tokens:
        raise ConfigError(f"grpo.overlong_buffer must be in [0, generation.max_new_tokens = {max_new_tokens}], got "
                          f"{g.overlong_buffer}")
    if g.overlong_penalty < 0:
        raise ConfigError(f"grpo.overlong_penalty must be >= 0 (it is subtracted), got {g.overlong_penalty}")
