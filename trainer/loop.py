"""The pretraining / fine-tuning stage: model, data, optimizer, schedule, eval, logging and checkpoints,
run by the one loop skeleton every stage shares (trainer.skeleton; `_TrainerStage` plugs this one in).

One loop for pretraining (a fresh `model.preset` on packed text) and fine-tuning
(`finetune.hf_checkpoint` on an SFT data set, prompts masked out of the loss, optionally
with LoRA adapters and the base weights frozen): they differ only in where the model and
the batches come from. Data parallelism is a runtime (zeropp.runtime.Runtime: plain DDP for
`zero_optimization.stage: 0`, our ZeRO-3 / ZeRO++ engine for `stage: 3`) applied to the model
from outside; the loop calls only the runtime interface and never asks which one it drives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from data.datasets import IGNORE_INDEX
from models.config import ModelConfig, flops_per_token
from models.hf import hf_model_on_meta
from models.lora import apply_lora
from models.peft import load_peft_adapter
from models.transformer import Transformer
from models.streaming import return_freed_memory_to_the_os
from models.weights import InitWeights, WeightSource, materialize
from trainer.activation_checkpointing import apply_activation_checkpointing, describe as describe_checkpointing
from trainer.checkpoint import (FULL, CheckpointError, export_hf, export_note, load_checkpoint, read_state,
                                recover, resolve_checkpoint, samples_per_step, save_checkpoint)
from trainer.config import (Config, ConfigError, LoraSection, check_held_out, check_lora_section, check_values,
                            pop_debug, to_dict)
from trainer.distributed import (DistEnv, LauncherError, PeerError, all_gather_objects, all_reduce_sum, barrier,
                                 init_distributed, is_peer_failure, is_timeout)
from trainer.finetune_data import FinetuneData, prepare_finetuning
from trainer.heartbeat import Heartbeat, start_heartbeat
from trainer.memory import baseline_bytes, peak_bytes, predicted_peak
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteError, NonFiniteSteps, nonfinite_tensors
from trainer.optim import build_optimizer, lr_at
from trainer.precision import autocast_for, compute_dtype
from trainer.run_dir import RunDir
from trainer.skeleton import Stage, run_stage
from trainer.pretrain_data import DataError, PretrainData, prepare_pretraining
from data.sources import MissingKeyError
from zeropp import build_runtime
from zeropp.autoplan import PlanError, StepTimeCheck, auto_plan
from zeropp.comm import world_comm
from zeropp.config import PlanConfig, ZeroConfig, ZeroConfigError
from zeropp.diloco import OUTER_TAG, DiLoCo
from zeropp.engine import UnsupportedModelError
from zeropp.topology import TopologyError, ranks_per_node_from_env


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (0: before training)
    val_loss: float = float("nan")  # at the end
    checkpoint: Path | None = None
    preempted: bool = False  # stopped early by the scheduler's warning signal
    skipped_steps: list[int] = field(default_factory=list)  # steps whose update was skipped (non-finite)
    peak_memory: tuple[int, int] | None = None  # this rank's (measured, predicted) peak bytes


def plan_zero_optimization(trained: list[tuple[Transformer, int, int]], rows: int, seq_len: int, zero: ZeroConfig,
                           plan: PlanConfig, precision: str, device: torch.device, checkpointed, baseline: int,
                           packing: bool, resumed: Path | None) -> tuple[ZeroConfig, dict, list[str]]:
    """plan.auto for a run (train.py's trainer, rlhf.py's stages; zeropp.autoplan.auto_plan) that trains
    `trained` on micro-batches of `rows` x `seq_len` tokens: priced with the trainer's predicted peak memory
    of the first model (its `checkpointed` blocks, the process' `baseline`), the plan of the checkpoint it
    resumes (`resumed`) reused on the same machine, else a new one within that checkpoint's stage.
    -> (the chosen zero_optimization, the plan a checkpoint keeps, the lines to log). Nothing fits: ConfigError."""
    dtype = compute_dtype(precision, device)
    config = trained[0][0].config

    def memory(candidate: ZeroConfig, states: dict[str, int], buffers: int) -> int:
        return sum(predicted_peak(states, buffers, None, config, rows, seq_len, dtype, set(checkpointed), baseline,
                                  device, candidate.compute_dtype, packing).values())
    saved = read_state(resumed) if resumed is not None else None
    try:
        return auto_plan(trained, rows, seq_len, device, dtype, zero, plan, memory, saved and saved.get("plan"),
                         saved["config"]["zero_optimization"]["stage"] if saved else None)  # its checkpoint format
    except PlanError as e:
        raise ConfigError(str(e)) from None


def build_model_config(cfg: Config, vocab_size: int) -> ModelConfig:
    m = cfg.model
    overrides = {
        k: getattr(m, k)
        for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len")
        if getattr(m, k) is not None
    }
    multiple = m.make_vocab_size_divisible_by
    overrides["vocab_size"] = -(-vocab_size // multiple) * multiple
    model_cfg = ModelConfig.from_preset(m.preset, **overrides)
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ConfigError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len} "
            f"(preset {m.preset!r}); lower data.seq_len or set model.max_seq_len"
        )
    return model_cfg


def _changed(section) -> list[str]:
    """Keys of a config section that differ from their defaults."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def _check_finetune(cfg: Config) -> None:
    """Keys that only mean something for one of pretraining and fine-tuning are errors in the other."""
    ft = cfg.finetune
    if ft.hf_checkpoint is None:
        if cfg.data.packing:
            raise ConfigError("data.packing: value True applies to fine-tuning; pretraining's samples are already "
                              "full rows of the token stream, with nothing to pad")
        stray = [f"finetune.{k}" for k in _changed(ft)]
        if stray:
            raise ConfigError(f"{stray[0]} applies to fine-tuning, but finetune.hf_checkpoint is not set; "
                              f"set it to a Hugging Face model directory or drop {', '.join(stray)}")
    else:
        if not Path(ft.hf_checkpoint).is_dir():
            raise ConfigError(f"finetune.hf_checkpoint {ft.hf_checkpoint!r}: no such directory (expected a Hugging "
                              f"Face model directory: config.json, model.safetensors and the tokenizer files)")
        stray = [f"model.{k}" for k in _changed(cfg.model)]
        stray += [f"data.{k}" for k in _changed(cfg.data) if k in ("json_key", "vocab_size")]
        if stray:
            raise ConfigError(f"{stray[0]} applies to pretraining from scratch, but finetune.hf_checkpoint is set: "
                              f"the model comes from its config.json, the tokenizer from the checkpoint (or "
                              f"data.tokenizer); drop {', '.join(stray)}")
    check_lora_section(ft.lora, "finetune.lora")


def add_lora_adapters(model: Transformer, lora: LoraSection, key: str) -> None:
    """With `lora.r` > 0: freeze `model` and wrap its target layers in fresh adapters (made in memory,
    small; from lora.init_from's PEFT adapter when set). `key` names the section in errors."""
    if not lora.r:
        return
    try:
        apply_lora(model, lora.targets, lora.r, lora.alpha, lora.dropout)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    materialize(model, InitWeights(model), only=lambda name: ".lora_" in name)
    if lora.init_from:
        try:
            load_peft_adapter(model, lora.init_from)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.init_from {lora.init_from!r}: {e}") from e


def lora_state(lora: LoraSection) -> dict | None:
    """What a checkpoint records of the adapters: resuming needs the same ones (not where they started:
    init_from only initialises a fresh run)."""
    if not lora.r:
        return None
    return {k: v for k, v in dataclasses.asdict(lora).items() if k != "init_from"}


def _check(cfg: Config) -> None:
    check_values(cfg)
    t = cfg.train
    for key, value in (("train.steps", t.steps), ("train.grad_accum", t.grad_accum),
                       ("data.seq_len", cfg.data.seq_len)):
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")
    check_held_out(cfg.data)
    try:
        cfg.zero_optimization.validate()
        cfg.plan.validate()
        if cfg.plan.auto and (cfg.tensor_parallel.size > 1 or cfg.diloco.enabled):
            raise ZeroConfigError("plan.auto plans zero_optimization alone, not tensor_parallel.size > 1 or "
                                  "diloco.enabled yet; set plan.auto false or drop those")
        cfg.tensor_parallel.validate()
        if cfg.data.packing and cfg.tensor_parallel.size > 1 and cfg.tensor_parallel.topk_keep_ratio < 1.0:
            raise ZeroConfigError(f"data.packing: value True cannot go with tensor_parallel.topk_keep_ratio "
                                  f"{cfg.tensor_parallel.topk_keep_ratio}: its token scores take each row as one "
                                  f"causal sequence, not packed documents; use data.packing false or topk_keep_ratio 1")
        if cfg.tensor_parallel.size > 1 and cfg.finetune.lora.r:
            raise ZeroConfigError("tensor_parallel.size > 1 does not slice LoRA adapters; use finetune.lora.r 0 or "
                                  "tensor_parallel.size 1")
        cfg.diloco.validate()
        if cfg.diloco.enabled and cfg.tensor_parallel.size > 1:
            raise ZeroConfigError(f"diloco.enabled runs DDP or ZeRO-3 inside each site; tensor_parallel.size "
                                  f"{cfg.tensor_parallel.size} is not supported with it yet: use 1")
    except ZeroConfigError as e:
        raise ConfigError(str(e)) from None
    _check_finetune(cfg)


def precision_line(precision: str, device: torch.device) -> str:
    bf16 = compute_dtype(precision, device) == torch.bfloat16
    what = "bf16 autocast, fp32 master weights" if bf16 else "fp32"
    why = {"auto": f" (train.precision auto: {'native' if bf16 else 'no native'} bf16 on this {device.type})"}
    return what + why.get(precision, f" (train.precision {precision})")


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None, build_runtime=build_runtime):
        """build_runtime(model, cfg.zero_optimization, device, cfg.tensor_parallel) -> zeropp.runtime.Runtime; the
        benchmarks pass their own to train the same model and data under FSDP2 or DeepSpeed."""
        _check(cfg)
        return_freed_memory_to_the_os()
        self.cfg = cfg
        self.heartbeat = None
        self.phase = "startup"
        self.notes: list[str] = []  # what startup repaired, moved or fell back to, logged by run()
        self.owns_group = env is None and not dist.is_initialized()
        self.env = env or init_distributed(cfg.train.dist_timeout)
        self.heartbeat = start_heartbeat(self.env.rank, self.env.world_size, cfg.train.dist_timeout,
                                         lambda: self.phase)
        self.ckpt_root = Path(cfg.train.out_dir) / "checkpoints"
        self.run_dir = RunDir(cfg.train.out_dir)
        self.run_dir.claim(cfg.resume, cfg.train.overwrite)
        torch.manual_seed(cfg.train.seed)
        if cfg.finetune.hf_checkpoint is None:
            self.data: PretrainData | FinetuneData = prepare_pretraining(
                cfg.data, cfg.data.seq_len, cfg.train.seed, self.env.rank)
        else:
            self.data = prepare_finetuning(cfg)
        self.model, weights = self._build_model()
        self.baseline_memory = baseline_bytes(self.model.config, cfg.train.precision, self.env.device)
        self.checkpointed = apply_activation_checkpointing(self.model, cfg.train.activation_checkpointing,
                                                           cfg.train.activation_checkpointing_every)
        self.model_cfg: ModelConfig = self.model.config
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.plan: dict | None = None  # plan.auto's choice (state.json "plan") and its step-time check
        self.plan_check: StepTimeCheck | None = None
        self.plan_seconds = 0.0  # what probing and planning took (issue 34's A4)
        if cfg.plan.auto:
            started = time.perf_counter()
            self._auto_plan()
            self.plan_seconds = time.perf_counter() - started
        # DiLoCo: the runtime over its site's ranks only (zeropp.diloco); the default builder's keyword,
        # so the benchmarks' builders see it only where DiLoCo is on.
        sites = {"site_size": cfg.diloco.site_size or ranks_per_node_from_env(self.env.world_size)} \
            if cfg.diloco.enabled else {}
        self.runtime = build_runtime(self.model, cfg.zero_optimization, self.env.device, cfg.tensor_parallel, weights,
                                     **sites)
        mesh = getattr(self.runtime, "mesh", None)
        self.sites = mesh.sites if mesh is not None else 1
        self.diloco = DiLoCo(self.runtime, cfg.diloco) if cfg.diloco.enabled else None
        # Data-parallel replicas read different batches; the ranks of a tensor-parallel group read
        # the same one, so world-wide sums of per-batch counts hold each `copies` times.
        self.dp_rank, self.dp_size = self.runtime.data_parallel
        self.copies = self.env.world_size // self.dp_size
        # The loss is the mean over the global batch's target tokens: gradients are summed over ranks.
        self.runtime.set_gradient_divide_factor(1.0)
        self.optimizer = self.runtime.attach_optimizer(build_optimizer(self.runtime.module, cfg.optim))
        self.predicted_memory = predicted_peak(
            self.model_state_bytes(), self.runtime.buffer_bytes(), self.optimizer, self.model_cfg,
            cfg.train.micro_batch_size, cfg.data.seq_len, compute_dtype(cfg.train.precision, self.env.device),
            set(self.checkpointed), self.baseline_memory, self.env.device, self.runtime.param_dtype, cfg.data.packing)
        # Only now, the config, data, model and topology all accepted, may train.overwrite move the old run.
        replaced = self.run_dir.take_over(self.env.is_main)
        if replaced and self.env.is_main:
            self.notes.append(replaced)
        self.step_comm: dict[str, dict] = {}  # the runtime ledger's totals of the last training step
        self.outer_cross_sent = [0, 0]  # DiLoCo's exchange: cross-node bytes this run sent, over how many steps
        self.stop_in_flight = None  # DiLoCo: the last step's stop flag, being all-reduced (_stop_agreed)
        self.step_timings: dict[str, float] = {}  # and the seconds it spent outside compute, by kind
        self.step = 0
        self.consumed_samples = 0
        # The one non-finite policy (trainer.nonfinite): skip, count, log, stop after max_nonfinite_steps in a row.
        self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps)
        self.last_step_skipped = False
        self.saved: Path | None = None  # the newest checkpoint of ckpt_root this run wrote or resumed
        self.saved_step = -1  # and its step
        self.resumed_from: Path | None = None
        if cfg.resume:
            self.phase = "resume"
            try:
                if self.env.is_main:
                    self.notes += recover(self.ckpt_root)
                barrier()
                path = resolve_checkpoint(cfg.resume, cfg.train.out_dir, say=self.notes.append)
                if path is not None:
                    self._resume(path)
            except BaseException:
                self.runtime.close()  # nobody else will: the caller gets no Trainer
                raise

    def _auto_plan(self) -> None:
        """plan.auto (plan_zero_optimization): zero_optimization becomes the plan's choice (the resumed
        checkpoint's own on the same machine), the plan's lines go to the log before the first step."""
        cfg = self.cfg
        self.phase = "plan.auto probes"
        path = resolve_checkpoint(cfg.resume, cfg.train.out_dir, say=lambda _: None) if cfg.resume else None
        cfg.zero_optimization, self.plan, lines = plan_zero_optimization(
            [(self.model, cfg.train.grad_accum, 1)], cfg.train.micro_batch_size, cfg.data.seq_len, cfg.zero_optimization,
            cfg.plan, cfg.train.precision, self.env.device, self.checkpointed, self.baseline_memory, cfg.data.packing,
            path)
        self.notes += lines
        self.plan_check = StepTimeCheck(self.plan["step_seconds"], cfg.plan.check_after_steps)
        self.phase = "startup"

    def _build_model(self) -> tuple[Transformer, WeightSource]:
        """A fresh model of model.preset, or finetune.hf_checkpoint's, with LoRA adapters when
        finetune.lora.r > 0, built on the meta device, and where its weights come from: the runtime
        reads from there only what this rank keeps (ZeRO-3: its shards). The adapters are small and
        made in memory. Identical on every rank and world size (one seed, per-parameter init)."""
        cfg, tokenizer = self.cfg, self.data.tokenizer
        torch.manual_seed(cfg.train.seed)
        path = cfg.finetune.hf_checkpoint
        if path is None:
            with torch.device("meta"):
                model = Transformer(build_model_config(cfg, tokenizer.vocab_size))
            weights: WeightSource = InitWeights(model)
        else:
            try:
                model, weights = hf_model_on_meta(path)
            except (OSError, ValueError) as e:
                raise ConfigError(f"finetune.hf_checkpoint: {e}") from e
            if tokenizer.vocab_size > model.config.vocab_size:
                raise ConfigError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                                  f"vocab_size {model.config.vocab_size} of {path}/config.json: it is not this "
                                  f"model's tokenizer")
            if cfg.data.seq_len > model.config.max_seq_len:
                raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds the max_position_embeddings "
                                  f"{model.config.max_seq_len} of {path}/config.json")
        add_lora_adapters(model, cfg.finetune.lora, "finetune.lora")
        return model, weights

    def _resume(self, path: Path) -> None:
        saved = read_state(path)
        ours = dataclasses.asdict(self.model_cfg)
        # Fields added since a checkpoint was written (e.g. num_labels) are missing from its dict:
        # they had their default then. Any other difference, unknown saved keys included, is refused.
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
        saved_cfg = {**defaults, **saved["model_config"]}
        if saved_cfg != ours:
            absent = "(absent)"  # a key only one side has (a misspelt one in an edited state.json), even if None
            diff = {k: (saved_cfg.get(k, absent), ours.get(k, absent)) for k in {**saved_cfg, **ours}
                    if saved_cfg.get(k, absent) != ours.get(k, absent)}
            raise ConfigError(f"resume: checkpoint {path} was made for another model; (saved, ours): {diff}")
        if saved.get("lora") != lora_state(self.cfg.finetune.lora):
            raise ConfigError(f"resume: checkpoint {path} has LoRA adapters {saved.get('lora')}, this run "
                              f"{lora_state(self.cfg.finetune.lora)} (finetune.lora); resume with the same ones")
        fmt, want = saved.get("format", FULL), self.runtime.checkpoint_format
        if "+tp" in fmt and "+tp" not in want:
            raise ConfigError(f"resume: checkpoint {path} was written with tensor parallelism; resume it with "
                              f"tensor_parallel.size > 1 (any size re-slices it), or consolidate it with "
                              f"scripts/consolidate.py")
        # A tensor-parallel runtime loads any tensor-parallel size, and plain checkpoints (size 1).
        if fmt.partition("+tp")[0] != want.partition("+tp")[0]:
            raise ConfigError(
                f"resume: checkpoint {path} is {fmt!r} but zero_optimization.stage {self.cfg.zero_optimization.stage} "
                f"needs {want!r}; resume with the stage it was written with, or convert it with scripts/consolidate.py")
        self._keep_global_batch(path, saved)
        if saved.get("diloco") != self.diloco_layout():
            raise ConfigError(f"resume: checkpoint {path} was written with DiLoCo sites {saved.get('diloco')}, this run "
                              f"has {self.diloco_layout()} (diloco.enabled, diloco.site_size); resume with the same")
        state = load_checkpoint(path, self.optimizer, lambda d: self.tensors.load(d, self.optimizer), self.env.rank)
        bad = self.nonfinite_tensors()
        if bad:
            raise CheckpointError(f"resume: checkpoint {path} holds non-finite values in {', '.join(bad[:5])}; "
                                  f"resume from an earlier checkpoint")
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.nonfinite.skipped = state.get("skipped", 0)  # written since the non-finite policy was shared
        self.resumed_from = path
        if path.parent.resolve() == self.ckpt_root.resolve():
            self.saved, self.saved_step = path, self.step

    def _keep_global_batch(self, path: Path, saved: dict) -> None:
        """A resume keeps the checkpoint's global batch (samples per step), whatever the world size:
        grad_accum is re-derived when micro_batch_size x the data-parallel ranks divides it, else the
        run is refused, naming the values. (Checkpoints from before state.json recorded it: the
        consumed samples per step.)"""
        want = samples_per_step(saved)
        t = self.cfg.train
        if want is None or want == self.global_batch:
            return
        per_accum = t.micro_batch_size * self.dp_size
        if want % per_accum:
            fix = (f"choose a train.micro_batch_size that divides {want // self.dp_size}" if want % self.dp_size == 0
                   else f"resume on a number of data-parallel ranks that divides {want}")
            raise ConfigError(
                f"resume: checkpoint {path} was trained with a global batch of {want} samples per step; this run's "
                f"is {self.global_batch} (micro_batch_size {t.micro_batch_size} x grad_accum {t.grad_accum} x "
                f"{self.dp_size} data-parallel ranks) and no grad_accum gives {want}: {fix}")
        self.notes.append(f"global batch {want} kept from the checkpoint: train.grad_accum {t.grad_accum} -> "
                          f"{want // per_accum} (micro-batch {t.micro_batch_size} x {self.dp_size} data-parallel ranks)")
        t.grad_accum = want // per_accum

    @property
    def tensors(self):
        """What writes and reads the checkpoint's tensors: the runtime, or DiLoCo around it."""
        return self.diloco or self.runtime

    def diloco_layout(self) -> dict | None:
        """The sites a checkpoint's files are laid out in (state.json "diloco"); None: no DiLoCo."""
        if self.diloco is None:
            return None
        return {"sites": self.sites, "site_size": self.env.world_size // self.sites}

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's model state by kind: the runtime's, and DiLoCo's outer state."""
        states = self.runtime.model_state_bytes(self.optimizer)
        return states if self.diloco is None else {**states, "diloco outer state": self.diloco.state_bytes()}

    def predicted_step_bytes(self) -> dict[str, dict[str, int]]:
        """The runtime's prediction for one step, with DiLoCo's outer exchange amortized over its H steps."""
        predicted = self.runtime.predicted_step_bytes(self.cfg.train.grad_accum)
        return predicted if self.diloco is None or not predicted else {**predicted,
                                                                        **self.diloco.predicted_step_bytes()}

    def nonfinite_tensors(self) -> list[str]:
        """Names of weights and optimizer states that hold a NaN or an infinity, on any rank
        (every rank calls it: one gather)."""
        return nonfinite_tensors([(self.runtime.module, self.optimizer)])

    @property
    def global_batch(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size * t.grad_accum * self.dp_size

    def train_step(self, batches, stop: bool = False) -> tuple[float, float, bool, int]:
        """One optimizer step over `grad_accum` micro-batches; returns (loss, grad norm, whether
        any rank asked to `stop`, input tokens of all ranks).

        The loss is the mean over the target tokens of the whole global batch, however it is
        split over ranks and micro-batches (fine-tuning examples differ in how many targets they
        have): each micro-batch's mean weighs by its share of the global target count, which one
        all-reduce at the start of the step provides; the stop flag and the token count ride on it.
        With DiLoCo each site trains its own replica and no step waits for another site: "global" is
        the site's batch (the counts and the loss are summed over the site's ranks), the loss logged
        is rank 0's site's, and the stop flag is agreed over the world one step late (`_stop_agreed`).
        """
        cfg, accum, runtime = self.cfg, self.cfg.train.grad_accum, self.runtime
        lr = lr_at(self.step, cfg.train.steps, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        runtime.ledger.reset()  # the ledger then holds exactly this step's traffic
        runtime.timings.clear()
        micro_batches = [self.data.batch(next(batches), self.env.device) for _ in range(accum)]
        targets = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in micro_batches]).tolist()  # one sync
        counts = torch.tensor([float(stop), sum(inputs["tokens"].numel() for inputs, _ in micro_batches),
                               sum(targets)], dtype=torch.float64, device=self.env.device)
        if self.diloco is None:
            stops, n_tokens, n_targets = all_reduce_sum(counts).tolist()
            anyone_stops = stops > 0
        else:  # the sites' batches are equal: the world's tokens are the site's times the sites
            _, n_tokens, n_targets = self._site_sum(counts).tolist()
            anyone_stops, n_tokens = self._stop_agreed(stop), n_tokens * self.sites
        n_tokens, n_targets = round(n_tokens / self.copies), round(n_targets / self.copies)
        total = torch.zeros((), device=self.env.device)
        for micro, (inputs, labels) in enumerate(micro_batches):
            with nullcontext() if micro == accum - 1 else runtime.no_sync():
                with autocast_for(cfg.train.precision, self.env.device):
                    logits = runtime(**inputs)
                loss = runtime.lm_loss(logits, labels) * (targets[micro] / n_targets)
                runtime.backward(loss)
            total += loss.detach()
        grad_norm = runtime.clip_grad_norm_(cfg.optim.clip_grad if cfg.optim.clip_grad > 0 else float("inf")).item()
        loss = (all_reduce_sum(total) if self.diloco is None else self._site_sum(total)).item() / self.copies
        # Both are global (DiLoCo: the site's), so every rank takes the same decision: a non-finite one skips the update
        # (the batch is consumed, the weights and optimizer state stay as they were); the policy
        # logs it, and raises NonFiniteError at train.max_nonfinite_steps in a row.
        self.last_step_skipped = not self.nonfinite.allow(self.step + 1, {"loss": loss, "grad norm": grad_norm})
        if not self.last_step_skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.diloco is not None:  # (a skipped step still counts as one of the cycle's H)
            self.diloco.after_inner_step(self.step + 1)
        self.step_comm = runtime.ledger.totals()  # before any evaluation adds its gathers
        if self.diloco is not None:  # sent every H / F steps: the end-of-run table shows its mean per step
            self.outer_cross_sent[0] += self.step_comm.get(OUTER_TAG, {}).get("cross_node_sent", 0)
            self.outer_cross_sent[1] += 1
        self.step_timings = dict(runtime.timings)
        self.step += 1
        self.consumed_samples += self.global_batch
        return loss, grad_norm, anyone_stops, n_tokens

    def _site_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over this rank's site (DiLoCo), through the site's runtime's Comm."""
        return all_reduce_sum(value, comm=self.runtime.comm, group="dp")

    def _stop_agreed(self, stop: bool) -> bool:
        """DiLoCo: whether any rank of any site asked to stop before the previous step. The flag's
        world all-reduce is issued now and waited for a step later, so no step waits on the slow
        link between sites (a step's worth of delay; every rank still stops at the same step)."""
        comm = world_comm()
        flag = torch.tensor([float(stop)], dtype=torch.float64, device=comm.device)
        issued = comm.all_reduce(flag, "world", "trainer stop flag", async_op=True)
        previous, self.stop_in_flight = self.stop_in_flight, (issued, flag)
        if previous is None:
            return False
        previous[0].wait()
        return previous[1].item() > 0

    def comm_scalars(self) -> dict[str, float]:
        """This rank's communication in the last step, from the runtime's ledger (MB sent), and
        the time the step waited for it or (de)quantized weights (ms; the rest is compute)."""
        totals = self.step_comm
        if not totals:
            return {}
        return {"comm sent (MB)": sum(e["sent"] for e in totals.values()) / 2**20,
                "cross-node sent (MB)": sum(e["cross_node_sent"] for e in totals.values()) / 2**20,
                **{f"{kind} (ms)": seconds * 1e3 for kind, seconds in sorted(self.step_timings.items())}}

    def validation_samples(self) -> list[int]:
        """The validation set: the first `eval_batches` global batches' worth of samples of the
        held-out split (all of it where it is smaller). It depends on the global batch only, not
        on how that is split over ranks, micro-batches and accumulation."""
        return [int(i) for i in self.data.valid_indices[:self.cfg.train.eval_batches * self.global_batch]]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token over `validation_samples()` (all ranks' tokens weigh the
        same; fine-tuning batches differ in size). Rank r takes slice r of each block of
        micro_batch_size x world samples; a rank left without samples in the last block runs a
        zero-weight forward, since a sharded runtime's forward is collective."""
        cfg, rank, world = self.cfg, self.dp_rank, self.dp_size
        self.phase = f"evaluation at step {self.step}"
        self.model.eval()
        samples, mbs = self.validation_samples(), cfg.train.micro_batch_size
        total = torch.zeros(2, device=self.env.device, dtype=torch.float64)  # summed loss, target tokens
        for start in range(0, len(samples), mbs * world):
            block = samples[start:start + mbs * world]
            mine = block[rank * mbs:(rank + 1) * mbs]
            inputs, labels = self.data.batch(mine or block[:1], self.env.device)
            with autocast_for(cfg.train.precision, self.env.device):
                logits = self.model(**inputs)
            if mine:
                targets = (labels != IGNORE_INDEX).sum().double()
                total += torch.stack([self.runtime.lm_loss(logits, labels).double() * targets, targets])
        self.model.train()
        loss_sum, count = all_reduce_sum(total).tolist()
        return loss_sum / count

    def save(self) -> Path:
        """Checkpoint this step (every rank calls it), unless `self.saved` already holds it: a step
        is never saved twice. Non-finite weights are refused, so `latest` keeps naming good ones."""
        if self.saved is not None and self.saved_step == self.step:
            return self.saved
        self.phase = f"checkpoint save at step {self.step}"
        bad = self.nonfinite_tensors()
        if bad:
            raise NonFiniteError(f"step {self.step}: non-finite values in {', '.join(bad[:5])}; not saving them "
                                 f"(the newest checkpoint stays {self.saved or 'the previous one'})")
        state = {
            "format": self.runtime.checkpoint_format,
            "consumed_samples": self.consumed_samples,
            "global_batch": self.global_batch,
            "skipped": self.nonfinite.skipped,
            "config": to_dict(self.cfg),
            "model_config": dataclasses.asdict(self.model_cfg),
            "world_size": self.env.world_size,
            "tokenizer": str(self.data.tokenizer.path),
            "lora": lora_state(self.cfg.finetune.lora),
            "plan": self.plan,
            "diloco": self.diloco_layout(),
        }
        self.saved = save_checkpoint(self.ckpt_root, self.step, state, self.optimizer,
                                     lambda d: self.tensors.save(d, self.optimizer), self.env.rank)
        self.saved_step = self.step
        self.run_dir.first_checkpoint_written(self.env.is_main)
        return self.saved

    def export(self, checkpoint: Path) -> Path:
        """Write the checkpoint as a Hugging Face directory, <out_dir>/hf (every rank calls it);
        LoRA adapters are merged into the base weights, so transformers loads a plain model."""
        out = Path(self.cfg.train.out_dir) / "hf"
        if self.env.is_main:
            export_hf(checkpoint, out, as_trained=True)
            note = export_note(checkpoint)
            if note:
                print(note, flush=True)
        barrier()
        return out

    @property
    def phase(self) -> str:
        """What the rank does now ("training step 5"): named when a collective fails, here and in
        the rank's heartbeat, which beats at each change."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.heartbeat is not None:
            self.heartbeat.wake()

    def close(self, after_failure: bool = False) -> None:
        """After a failure the runtime is left as it is: its pending collectives may wait for a
        peer that is gone (and then fail with errors of their own), while this rank's error must
        reach the log before the launcher stops the rank."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if not after_failure:
            if self.diloco is not None:  # its exchanges still in flight finish before the groups go
                self.diloco.settle()
                if self.stop_in_flight is not None:
                    self.stop_in_flight[0].wait()
            self.runtime.close()

    def run(self) -> TrainResult:
        """Train to train.steps (or to the preemption signal) through the one loop skeleton
        (trainer.skeleton.run_stage); save the last step, export it when train.export_hf asks."""
        stage = _TrainerStage(self)
        out = run_stage(stage, self.cfg.train)
        result = stage.result
        result.preempted = out.preempted
        # the last step: saved by the skeleton (not saved twice), or now (a run resumed from elsewhere)
        result.checkpoint = self.save() if out.started else self.saved
        return result

    def peak_memory_line(self, log: MetricsLogger) -> tuple[int, int]:
        """Log every rank's measured peak memory so far against its prediction (every rank calls it);
        returns this rank's (measured, predicted) bytes."""
        measured, predicted = peak_bytes(self.env.device), sum(self.predicted_memory.values())
        ranks = all_gather_objects((measured, predicted))
        ratios = [m / p for m, p in ranks]
        what = "max_memory_allocated" if self.env.device.type == "cuda" else "VmHWM"
        log.info(f"peak memory per rank ({what}): measured {min(m for m, _ in ranks) / 2**20:.0f}-"
                 f"{max(m for m, _ in ranks) / 2**20:.0f} MB, predicted {min(p for _, p in ranks) / 2**20:.0f}-"
                 f"{max(p for _, p in ranks) / 2**20:.0f} MB (measured / predicted {min(ratios):.2f}-{max(ratios):.2f})")
        return measured, predicted


class _TrainerStage(Stage):
    """Trainer.run's stage for the loop skeleton: its step is Trainer.train_step, its log line the
    Megatron-style one (averaged over the steps since the last line), its evaluation the validation
    loss, its checkpoint Trainer.save, its export the Hugging Face directory (train.export_hf)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.result = trainer, TrainResult()
        cfg = trainer.cfg
        self.steps = cfg.train.steps
        self.train_indices = trainer.data.train_indices
        self.data_parallel = (trainer.dp_rank, trainer.dp_size)
        self.samples_per_step = trainer.global_batch
        self.device = trainer.env.device
        self.evaluate_at_start = cfg.train.eval_at_start
        self.flops_per_input_token = flops_per_token(trainer.model_cfg, cfg.data.seq_len)
        self.stop = False  # whether the ranks agreed, in the last step's all-reduce, to stop

    def resume(self) -> dict:  # Trainer.__init__ resumed already
        tr = self.trainer
        self.newest_checkpoint = tr.saved
        return {"step": tr.step, "consumed_samples": tr.consumed_samples, "skipped": tr.nonfinite.skipped}

    def open_log(self, step: int) -> MetricsLogger:
        self.log = MetricsLogger(self.trainer.cfg.train, self.trainer.env.is_main, start_step=step,
                                 config=self.trainer.cfg)
        return self.log

    def start(self, log: MetricsLogger, step: int) -> None:
        tr, cfg, t = self.trainer, self.trainer.cfg, self.trainer.cfg.train
        if tr.env.is_main:
            name = cfg.finetune.hf_checkpoint or cfg.model.preset
            trainable = "" if tr.n_trainable == tr.n_params else \
                f" ({tr.n_trainable / 1e6:.3f}M trainable: LoRA r={cfg.finetune.lora.r})"
            log.info(
                f"model {name}: {tr.n_params / 1e6:.2f}M parameters{trainable} | data {tr.data.source}: "
                f"{len(tr.data.train_indices)} train / {len(tr.data.valid_indices)} valid samples of "
                f"{'at most ' if cfg.finetune.hf_checkpoint else ''}{cfg.data.seq_len} tokens | "
                f"world size {tr.env.world_size} | global batch {tr.global_batch}"
            )
            log.info(f"runtime: {tr.runtime.describe()}" + (f" | {tr.diloco.describe()}" if tr.diloco else ""))
            log.info(f"compute: {precision_line(t.precision, tr.env.device)}")
            if tr.checkpointed:
                log.info(describe_checkpointing(t.activation_checkpointing, t.activation_checkpointing_every,
                                                tr.checkpointed, len(tr.model.blocks)))
            for line in traffic_and_memory_lines(tr.predicted_step_bytes(), tr.model_state_bytes()):
                log.info(line)
            parts = ", ".join(f"{kind} {n / 2**20:.1f}" for kind, n in tr.predicted_memory.items())
            log.info(f"predicted peak memory per rank: {sum(tr.predicted_memory.values()) / 2**20:.1f} MB "
                     f"({parts}; micro-batch {t.micro_batch_size} x {cfg.data.seq_len} tokens)")
            for note in tr.notes:
                log.info(note)
            if tr.resumed_from is not None:
                log.info(f"resumed from checkpoint {tr.resumed_from} (step {tr.step}, {tr.consumed_samples} samples "
                         f"consumed; global batch {tr.global_batch} = micro-batch {t.micro_batch_size} x grad_accum "
                         f"{t.grad_accum} x {tr.dp_size} data-parallel ranks, as the checkpoint's: every step "
                         f"draws the same samples as it would have there)")
        tr.model.train()
        self._new_window()

    def _new_window(self) -> None:
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0

    def update(self, step, batches, nonfinite, stop_requested) -> dict[str, float]:
        tr = self.trainer
        tr.nonfinite = nonfinite  # the skeleton's policy (from the resumed count): train_step decides through it
        tr.phase = f"training step {tr.step + 1}"
        started = time.perf_counter()
        loss, grad_norm, self.stop, n_tokens = tr.train_step(batches, stop_requested)
        checked = tr.plan_check.add(time.perf_counter() - started) if tr.plan_check is not None else None
        if checked:
            self.log.info(checked)
        self.result.losses[tr.step] = loss
        for note in tr.runtime.take_notes():
            self.log.info(note)
        if tr.last_step_skipped:  # logged by the non-finite policy
            self.result.skipped_steps.append(tr.step)
        self.window_steps += 1
        self.window_tokens += n_tokens
        return {"lm loss": loss, "grad norm": grad_norm}

    def agree_to_stop(self, received: bool) -> bool:
        return self.stop  # agreed in the step's all-reduce, on the flags the ranks had before it

    def log_line(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        tr, cfg, t = self.trainer, self.trainer.cfg, self.trainer.cfg.train
        window = time.perf_counter() - self.window_start
        tflops = self.flops_per_input_token * self.window_tokens / window / 1e12 / tr.env.world_size
        line = {
            "lm loss": metrics["lm loss"],
            "learning rate": lr_at(step - 1, t.steps, cfg.optim),
            "grad norm": metrics["grad norm"],
            "consumed samples": tr.consumed_samples,
            "elapsed time per iteration (ms)": window / self.window_steps * 1e3,
            "tokens/s": self.window_tokens / window,
            "TFLOP/s per rank": tflops,
            "MFU %": 100 * tflops / t.peak_tflops,
            "memory (MB)": peak_bytes(tr.env.device) / 2**20,
            **tr.comm_scalars(),
            "skipped steps": metrics["skipped steps"],
        }
        self._new_window()
        return line

    def evaluate(self) -> dict[str, float] | None:
        tr = self.trainer
        self.result.val_loss = self.result.val_losses[tr.step] = tr.evaluate()
        self._new_window()
        return {"validation loss": self.result.val_loss,
                "validation perplexity": math.exp(min(self.result.val_loss, 50))}

    def save(self, step: int, state: dict) -> Path:
        path = self.trainer.save()  # its own state: the same data position and skipped steps
        interval = self.trainer.cfg.train.checkpoint_interval
        if interval and step % interval == 0 and step != self.steps:
            self.log.info(f"saved checkpoint {path}")
        return path

    def finish(self, log: MetricsLogger) -> None:
        tr, t = self.trainer, self.trainer.cfg.train
        if tr.step_comm and tr.env.world_size > 1:
            tp = tr.cfg.tensor_parallel
            runtime = tr.cfg.zero_optimization.describe() if tp.size == 1 else \
                f"{tp.describe()} x {tr.cfg.zero_optimization.describe()}"
            sent, steps = tr.outer_cross_sent
            log.info(cross_node_report(tr.step_comm, tr.runtime.zero3_cross_node_bytes(t.grad_accum), runtime,
                                       tr.predicted_step_bytes(), {OUTER_TAG: sent // steps} if steps else None))
        self.result.peak_memory = tr.peak_memory_line(log)

    def export(self) -> None:
        tr = self.trainer
        if tr.cfg.train.export_hf:
            hf_dir = tr.export(tr.save())
            if tr.env.is_main:
                print(f"Hugging Face checkpoint: {hf_dir}")


def cross_node_report(step: dict[str, dict], zero3: dict[str, int], runtime: str,
                      predicted: dict[str, dict] | None = None, amortized: dict[str, int] | None = None) -> str:
    """The last step's cross-node bytes of this rank by collective, next to what the runtime
    predicted from sizes alone and what plain ZeRO-3 sends for the same model and layout: the
    table the README's main job ends with. `amortized`: collectives not run every step (DiLoCo's
    exchange), their bytes per step over the run. On one node there is nothing to compare (no
    collective crosses a node): one line says so."""
    amortized = amortized or {}
    if not any(zero3.values()) and not any(e.get("cross_node_sent", 0) for e in step.values()) \
            and not any(amortized.values()):
        return f"cross-node bytes ({runtime}): single node: no cross-node traffic"
    predicted = predicted or {}
    cross = lambda table, tag: table.get(tag, {}).get("cross_node_sent")  # noqa: E731
    rows = [(tag, cross(step, tag) or 0, cross(predicted, tag), base) for tag, base in zero3.items()]
    rows += [(f"{tag} (mean)", sent, cross(predicted, tag), 0) for tag, sent in amortized.items()]
    known = all(r[2] is not None for r in rows)
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows) if known else None,
                 sum(r[3] for r in rows)))
    mb = lambda v: f"{v / 2**20:.3f}" if v is not None else "-"  # noqa: E731
    lines = [f"cross-node bytes sent by this rank in one training step (communication ledger): {runtime} "
             f"vs ZeRO-3 (bf16) on the same model and nodes",
             f"  {'collective':<20} {'this run (MB)':>14} {'predicted (MB)':>15} {'ZeRO-3 (MB)':>12} {'ratio':>6}"]
    for tag, ours, expected, base in rows:
        lines.append(f"  {tag:<20} {mb(ours):>14} {mb(expected):>15} {mb(base):>12} "
                     f"{f'{ours / base:.2f}' if base else '-':>6}")
    return "\n".join(lines)


def traffic_and_memory_lines(predicted: dict[str, dict], memory: dict[str, int]) -> list[str]:
    """The log's first word on the trade-off the configuration makes: the bytes this rank will
    send per step by collective (and how many cross nodes), and the model state it holds."""
    lines = []
    if predicted:
        parts = [f"{tag} {v['sent'] / 2**20:.2f} MB ({v['cross_node_sent'] / 2**20:.2f} cross-node)"
                 for tag, v in predicted.items()]
        lines.append("predicted traffic per step, this rank: " + ", ".join(parts))
    if memory:
        parts = [f"{kind} {n / 2**20:.2f} MB" for kind, n in memory.items()]
        lines.append(f"model state per rank: {sum(memory.values()) / 2**20:.2f} MB (" + ", ".join(parts) + ")")
    return lines


def train(cfg: Config) -> TrainResult:
    trainer = None
    try:
        trainer = Trainer(cfg)
        try:
            result = trainer.run()
        except Exception as e:
            error = peer_error(e, trainer.env.rank, trainer.phase, trainer.heartbeat, cfg.train.dist_timeout) \
                if is_peer_failure(e) else None
            trainer.close(after_failure=True)
            if error is not None:
                raise error from e
            raise
        trainer.close()
    except Exception as e:
        if isinstance(e, PeerError) or not is_peer_failure(e):
            raise
        raise peer_error(e, int(os.environ.get("RANK", "0")), "startup", None, cfg.train.dist_timeout) from e
    if trainer.env.is_main and not result.preempted:
        print(f"validation loss {result.val_loss:.4f} | perplexity {math.exp(min(result.val_loss, 50)):.2f}")
        print(f"checkpoint: {result.checkpoint}")
    barrier()
    if trainer.owns_group and dist.is_initialized():
        # Gloo's threads can abort the interpreter's exit ("terminate called without an active
        # exception") where the group outlives the run: a finished run would end with SIGABRT.
        dist.destroy_process_group()
    return result


def peer_error(e: Exception, rank: int, phase: str, heartbeat: Heartbeat | None, dist_timeout: float) -> PeerError:
    """A failed collective as one line: which rank stopped responding, where and when (from the
    ranks' heartbeats), or, without them, the possible causes."""
    cause = heartbeat.diagnosis(timed_out=is_timeout(e)) if heartbeat is not None else (
        f"another rank died, stopped responding for train.dist_timeout={dist_timeout:g} s, or failed "
        f"first (its own error names the cause)")
    text = str(e).strip()
    return PeerError(f"rank {rank}: a collective failed during {phase}: {cause}. "
                     f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")


# What an entry point reports in one line: the message names the key, file or rank at fault.
USER_ERRORS = (ConfigError, DataError, CheckpointError, LauncherError, TopologyError,
               ZeroConfigError, UnsupportedModelError, MissingKeyError, NonFiniteError, PeerError, OSError)


def run_main(prog: str, argv: list[str], parse, work) -> None:
    """An entry point's main. `parse(argv)` builds its config (None: nothing to run, e.g. help was
    printed), `work(cfg)` runs it. A config error, and any known failure of the work, exits 1 with
    one line (naming the rank when there are several, so on many ranks the failing rank's cause
    stands out among the others' PeerErrors) instead of a traceback; anything else is a bug and
    keeps its traceback. --debug (or ZEROPP_DEBUG=1) keeps every traceback."""
    debug, argv = pop_debug(argv)
    try:
        cfg = parse(argv)
    except ConfigError as e:
        if debug:
            raise
        sys.exit(f"{prog}: config error: {e}")
    if cfg is None:
        return
    if debug:
        work(cfg)
        return
    try:
        work(cfg)
    except USER_ERRORS as e:
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
        where = f" (rank {rank})" if rank is not None and world != "1" and not isinstance(e, PeerError) else ""
        line = f"{prog}{where}: error: {e}"
        record_for_torchrun(line)
        sys.exit(line)


def record_for_torchrun(line: str) -> None:
    """Under torchrun, the rank's error file (TORCHELASTIC_ERROR_FILE) gets the one line, so the
    agent's failure summary shows it instead of "To enable traceback see ...": its root cause (the
    first rank to exit) is often a survivor, whose line names the rank that stopped."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            # torch's own record: the summary shows "py_callstack", here the one line, not a traceback
            Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}))
