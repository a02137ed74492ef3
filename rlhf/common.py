"""What every rlhf.py stage shares: models under runtimes, sequence log-probs, checkpoints, logs.

Each model of a stage (actor, critic, reference, reward model) is a `ModelRuntime`: a plain
Transformer under its own runtime instance built from the one `zero_optimization` section
(ZeRO-3 / ZeRO++ or DDP), plus its optimizer when it trains. The stage loops call only the
runtime interface (zeropp.runtime.Runtime), as the pretraining loop does, so any runtime the
trainer can drive runs RLHF too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from data.packing import pack
from data.tokenizer import Tokenizer, load_tokenizer
from models.config import ModelConfig
from models.hf import hf_model_on_meta, save_hf_checkpoint
from models.lora import adapters_disabled, apply_lora, merge_lora
from models.transformer import Transformer, score_model_from
from models.weights import StateDictWeights, WeightSource, materialize
from rlhf.config import RLHFConfig
from rlhf.losses import token_logprobs
from trainer.activation_checkpointing import apply_activation_checkpointing
from trainer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_state,
    resolve_checkpoint,
    samples_per_step as saved_per_step,
    save_checkpoint,
)
from trainer.config import ConfigError, LoraSection, TrainSection, to_dict
from trainer.distributed import (
    DistEnv,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    init_distributed,
)
from trainer.loop import add_lora_adapters, lora_state
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteError, NonFiniteSteps, nonfinite_tensors
from trainer.optim import build_optimizer, lr_at
from trainer.precision import autocast_for
from zeropp import build_runtime


def setup_distributed(timeout: float) -> tuple[DistEnv, bool]:
    """Join the launcher's process group (collectives wait at most `timeout` seconds, the config's
    train.dist_timeout); one process gets a group of its own, so that every model's runtime
    shares it (the second return value: we made it, we destroy it)."""
    env = init_distributed(timeout)
    if dist.is_initialized():
        return env, False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return env, True


def load_model(path: str | Path, what: str) -> tuple[Transformer, WeightSource]:
    """A Hugging Face checkpoint as a model on the meta device and its weights: the model's runtime
    reads only what each rank keeps (ZeRO-3: its shards), so no rank holds the whole model."""
    try:
        return hf_model_on_meta(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path}: {e}") from e


def score_model(loaded: tuple[Transformer, WeightSource]) -> tuple[Transformer, WeightSource]:
    """load_model's model with a fresh scoring head (models.transformer.score_model_from), its other
    weights still read from the same source."""
    model, weights = loaded
    return score_model_from(model), weights


def prepare_trained(model: Transformer, cfg: RLHFConfig, trainable: bool,
                    lora: LoraSection | None) -> tuple[LoraSection | None, list[int]]:
    """Make `model` train as a stage trains it: every weight, or only LoRA adapters (`lora` with r > 0) over a
    frozen base, its blocks checkpointed per train.activation_checkpointing; or nothing (frozen). -> (the
    adapters' section or None, the checkpointed blocks). plan.auto prices a copy prepared the same way."""
    model.requires_grad_(trainable)
    lora = lora if trainable and lora is not None and lora.r else None
    if lora is not None:
        add_lora_adapters(model, lora, "lora")
    if not trainable:  # a frozen model's forwards keep no activations for a backward
        return lora, []
    return lora, apply_activation_checkpointing(model, cfg.train.activation_checkpointing,
                                                cfg.train.activation_checkpointing_every)


class ModelRuntime:
    """One model of a stage under its own runtime: trainable (with an optimizer and a learning
    rate schedule) or frozen (forward only; stored quantized under
    zero_quantized_nontrainable_weights)."""

    def __init__(self, name: str, loaded: tuple[Transformer, WeightSource], cfg: RLHFConfig, env: DistEnv,
                 lr: float | None, steps: int = 1, lora: LoraSection | None = None):
        """loaded: load_model's (model on the meta device, its weights), or (a model in memory, None).
        lora: adapters on a trainable model (rlhf.py's `lora` section; r 0: every weight trains)."""
        model, weights = loaded
        self.name, self.env = name, env
        self.packing = cfg.data.packing
        self.trainable = lr is not None
        self.config: ModelConfig = model.config
        self.lora, _ = prepare_trained(model, cfg, self.trainable, lora)
        if weights is None:
            model = model.to(env.device)
        self.runtime = build_runtime(model, cfg.zero_optimization, env.device, weights=weights)
        self.module = self.runtime.module
        self.precision = cfg.train.precision
        self.optimizer = None
        if self.trainable:
            # The loss is normalized over the global batch by the caller: reduce sums.
            self.runtime.set_gradient_divide_factor(1.0)
            self.optim_cfg = dataclasses.replace(cfg.optim, lr=lr)
            self.steps = steps
            self.optimizer = self.runtime.attach_optimizer(build_optimizer(self.module, self.optim_cfg))

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The outputs [B, T, ...] of padded rows. With data.packing, rows that have an attention mask
        go through packed: their real tokens side by side in rows of T (data.packing.pack), and the
        outputs are put back where the padded forward has them (0 at the padding), so every caller
        computes the padded path's losses."""
        with autocast_for(self.precision, self.env.device):
            if not self.packing or attention_mask is None:
                return self.runtime(tokens, attention_mask=attention_mask)
            real = attention_mask.bool()
            rows = pack(real.sum(-1).tolist(), tokens.shape[1])
            slots = tuple(index.to(tokens.device) for index in rows.slots())  # the real tokens' order
            packed = tokens.new_zeros(rows.shape)
            packed[slots] = tokens[real]
            out = self.runtime(packed, document_ids=rows.document_ids().to(tokens.device))
            result = out.new_zeros(*tokens.shape, *out.shape[2:])
            result[real] = out[slots]
            return result

    def clip_gradients(self) -> float:
        """Clip the gradients (optim.clip_grad); returns their global norm before clipping."""
        clip = self.optim_cfg.clip_grad
        return self.runtime.clip_grad_norm_(clip if clip > 0 else float("inf")).item()

    def apply(self, step: int) -> None:
        """Step at the schedule's learning rate of optimizer step `step`, zero the gradients."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.steps, self.optim_cfg)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Drop the gradients of a step that must not be taken (a non-finite loss or gradient norm)."""
        self.optimizer.zero_grad(set_to_none=True)

    def lora_state(self) -> dict | None:
        """What a checkpoint records of the adapters (None: none)."""
        return lora_state(self.lora) if self.lora is not None else None

    def without_adapters(self) -> AdaptersOff:
        """The frozen base of this LoRA-trained model: the reference of RLHF's KL terms."""
        return AdaptersOff(self)

    def full_model(self, weights: dict[str, torch.Tensor] | None = None) -> Transformer:
        """A plain copy of the model, adapters merged, with `weights` (runtime.rollout_weights' or
        full_state_dict's names; None: the current masters, full_state_dict); every rank calls it."""
        with torch.device("meta"):  # built on no storage: every parameter comes from the weights
            model = Transformer(self.config)
            if self.lora is not None:
                apply_lora(model, self.lora.targets, self.lora.r, self.lora.alpha)
        state = self.runtime.full_state_dict() if weights is None else weights
        return merge_lora(materialize(model, StateDictWeights(state, f"{self.name}'s runtime"), self.env.device))

    def export(self, path: Path, tokenizer_dir: str | Path | None, tokenizer: Tokenizer | None) -> None:
        """Write the current weights as a Hugging Face directory (every rank calls it)."""
        model = self.full_model()
        if self.env.is_main:
            ids = None if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                                                  "pad_token_id": tokenizer.pad_id}
            save_hf_checkpoint(model, path, tokenizer_dir=tokenizer_dir, token_ids=ids)
        barrier()

    def close(self) -> None:
        self.runtime.close()


class AdaptersOff:
    """A LoRA-trained model with its adapters switched off: the frozen base it started from (B starts
    at zero), computed by the same runtime and weights. RLHF's reference this way costs no second
    copy of the model; it is not a stage model of its own (not checkpointed, closed with its owner)."""

    trainable = False

    def __init__(self, owner: ModelRuntime):
        self.owner, self.name, self.env, self.config = owner, "reference", owner.env, owner.config

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        with adapters_disabled(self.owner.module):
            return self.owner(tokens, attention_mask)


def reference_of(policy: ModelRuntime, loaded, cfg: RLHFConfig, env: DistEnv) -> ModelRuntime | AdaptersOff:
    """The frozen reference of `policy`: its own base with the adapters off when it trains LoRA
    adapters, else a second, frozen model from `loaded` (load_model's)."""
    if policy.lora is not None:
        return policy.without_adapters()
    return ModelRuntime("reference", loaded(), cfg, env, lr=None)


def sequence_logprobs(model: ModelRuntime, tokens: torch.Tensor, attention_mask: torch.Tensor,
                      start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of tokens[:, start:] [B, T-start], the logits they came from) in one forward:
    position t-1's logits predict token t."""
    logits = model(tokens, attention_mask)
    logits = logits[:, start - 1:-1]
    return token_logprobs(logits, tokens[:, start:]), logits


# The stages' statistics are reduced over the world through trainer.distributed (zeropp.comm.world_comm),
# on the device the backend reduces on (NCCL takes no CPU tensor), under one ledger tag.
STATS_TAG = "rlhf statistics"


def global_sum(*values: float | torch.Tensor) -> list[float]:
    """Sum scalars over all ranks in one all-reduce (float64, exact for counts)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return all_reduce_sum(t, STATS_TAG).tolist()


def global_max(value: float) -> float:
    """The largest of every rank's `value`."""
    return all_reduce_max(torch.tensor([value], dtype=torch.float64), STATS_TAG).item()


def comm_scalars(models: list[ModelRuntime]) -> dict[str, float]:
    """MB this rank sent since the ledgers' last reset, over every model's runtime."""
    totals = [e for m in models for e in m.runtime.ledger.totals().values()]
    return {"comm sent (MB)": sum(e["sent"] for e in totals) / 2**20,
            "cross-node sent (MB)": sum(e["cross_node_sent"] for e in totals) / 2**20}


def optimizer_step(models: list[ModelRuntime], step: int, losses: dict[str, float], nonfinite: NonFiniteSteps,
                   label: int | str) -> tuple[bool, list[float]]:
    """One optimizer step of the trained `models` under the one non-finite policy (trainer.nonfinite),
    as trainer.loop takes it: every model's gradients clipped, then all of them step, or none does when
    a loss (`losses`: global values, the same on every rank) or a gradient norm is not finite. `label`:
    the step as the log names it. Returns (whether they stepped, their gradient norms)."""
    norms = [m.clip_gradients() for m in models]
    names = ["grad norm"] if len(models) == 1 else [f"{m.name} grad norm" for m in models]
    ok = nonfinite.allow(label, {**losses, **dict(zip(names, norms))})
    for m in models:
        if ok:
            m.apply(step)
        else:
            m.skip_step()
    return ok, norms


def update_label(first_step: int, i: int, updates: int) -> str:
    """How the log names update `i` of the rollout whose `updates` optimizer steps start at
    `first_step`: the rollout's step (counted from 1), and which of its updates."""
    rollout = first_step // updates + 1
    return str(rollout) if updates == 1 else f"{rollout} (update {i + 1} of {updates})"


# ----------------------------------------------------------------------------- checkpoints

class StageCheckpoint:
    """A stage's checkpoints under <out_dir>/<stage>/checkpoints: every trainable model's shards and
    optimizer state in a sub-directory of its own, the stage's own state (KL controller, EMA, data
    position, counters) in state.json, each rank's RNG. Written atomically (trainer.checkpoint)."""

    def __init__(self, cfg: RLHFConfig, stage: str, env: DistEnv):
        self.cfg, self.stage, self.env = cfg, stage, env
        self.root = cfg.stage_dir(stage) / "checkpoints"

    def save(self, step: int, models: list[ModelRuntime], state: dict, extra_tensors=None) -> Path:
        """`extra_tensors(directory)` writes more of this rank's tensors (an EMA)."""
        trainable = [m for m in models if m.trainable]

        def write(directory: Path) -> None:
            for m in trainable:
                (directory / m.name).mkdir(exist_ok=True)
                m.runtime.save(directory / m.name, m.optimizer)
            if extra_tensors is not None:
                extra_tensors(directory)

        bad = nonfinite_tensors((m.module, m.optimizer) for m in trainable)
        if bad:
            raise NonFiniteError(f"step {step}: non-finite values in {', '.join(bad[:5])}; not saving them "
                                 f"(the newest checkpoint stays the previous one)")
        full = {**state, "stage": self.stage, "config": to_dict(self.cfg), "world_size": self.env.world_size,
                "format": trainable[0].runtime.checkpoint_format,
                "models": {m.name: dataclasses.asdict(m.config) for m in models},
                "lora": {m.name: m.lora_state() for m in trainable if m.lora is not None}}
        return save_checkpoint(self.root, step, full, trainable[0].optimizer, write, self.env.rank)

    def resume_path(self) -> Path | None:
        resume = self.cfg.resume
        return resolve_checkpoint(resume, self.cfg.stage_dir(self.stage)) if resume else None

    def _check_global_batch(self, path: Path, saved: dict, samples_per_step: int) -> None:
        """A resume keeps the checkpoint's samples per step (prompts, pairs or sequences of all ranks
        together), as train.py keeps its global batch: on another world size the run is refused,
        naming the micro-batch that keeps it (these stages accumulate no micro-batches)."""
        want, world = saved_per_step(saved), self.env.world_size
        if want is None or want == samples_per_step:
            return
        fix = (f"resume with --train.micro_batch_size {want // world}" if want % world == 0
               else f"resume on a number of ranks that divides {want}")
        raise ConfigError(f"resume: checkpoint {path} was trained with {want} samples per step; this run's is "
                          f"{samples_per_step} (train.micro_batch_size {self.cfg.train.micro_batch_size} x {world} "
                          f"ranks): {fix}")

    def load(self, path: Path, models: list[ModelRuntime], samples_per_step: int, read_extra=None) -> dict:
        saved = read_state(path)
        if saved.get("stage") != self.stage:
            raise ConfigError(f"resume: checkpoint {path} is of stage {saved.get('stage')!r}, not {self.stage!r}")
        self._check_global_batch(path, saved, samples_per_step)
        for m in models:
            want = dataclasses.asdict(m.config)
            if saved["models"].get(m.name) != want:
                raise ConfigError(f"resume: checkpoint {path} has another {m.name} model than this run "
                                  f"(saved {saved['models'].get(m.name)}, this run {want})")
        trainable = [m for m in models if m.trainable]
        adapters = {m.name: m.lora_state() for m in trainable if m.lora is not None}
        if saved.get("lora", {}) != adapters:
            raise ConfigError(f"resume: checkpoint {path} has LoRA adapters {saved.get('lora', {})}, this run "
                              f"{adapters} (the lora section); resume with the same ones")
        fmt = trainable[0].runtime.checkpoint_format
        if saved.get("format") != fmt:
            raise ConfigError(f"resume: checkpoint {path} is {saved.get('format')!r}, this runtime writes {fmt!r}; "
                              f"resume with the zero_optimization.stage it was written with")

        def read(directory: Path) -> None:
            for m in trainable:
                m.runtime.load(directory / m.name, m.optimizer)
            if read_extra is not None:
                read_extra(directory)

        state = load_checkpoint(path, trainable[0].optimizer, read, self.env.rank)
        bad = nonfinite_tensors((m.module, m.optimizer) for m in trainable)
        if bad:
            raise CheckpointError(f"resume: checkpoint {path} holds non-finite values in {', '.join(bad[:5])}; "
                                  f"resume from an earlier checkpoint")
        return state


def open_log(cfg: RLHFConfig, stage: str, steps: int, env: DistEnv, start_step: int) -> MetricsLogger:
    """The trainer's logger (log line, tqdm, TensorBoard, metrics.jsonl) under <out_dir>/<stage>."""
    shared = {f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(cfg.train)}  # loggers included
    section = TrainSection(**{**shared, "steps": steps, "out_dir": str(cfg.stage_dir(stage))})
    return MetricsLogger(section, env.is_main, start_step=start_step, config=cfg)


def tokenizer_of(path: str | Path) -> Tokenizer:
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer of {path}: {e}") from e
