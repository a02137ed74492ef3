"""One configuration system for every entry point: dataclasses, YAML presets, CLI overrides.

A run's configuration is a tree of dataclasses. It is filled in three layers, each
overriding the last: the dataclass defaults, a YAML file (``--config configs/x.yaml``), and
dotted command-line overrides (``--optim.lr 3e-4 --train.steps 100``). Every key is checked
against the dataclass it lands in, so a typo is an error that names the key and lists the
valid ones, and every value is converted to the field's declared type or rejected.

Each field is documented by the ``#`` comment block directly above it and any comment at the end
of its line; a field with neither shares the comment block above the run of fields it belongs to
(fields with no blank line between them). ``field_docs`` reads them from the source once;
``--help`` prints them, and a test requires one for every field.

Paths a run reads (fields annotated ``Annotated[str, InputPath()]``) are taken relative to the YAML
file that sets them, so a preset works from any directory; on the command line they are relative
to the current directory, as usual. Paths a run writes (``train.out_dir``, ``data.cache_dir``) are
relative to the current directory wherever they are set.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
import io
import math
import os
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal

import yaml

from data.tokenizer import SP_FIXED_PIECES
from models.config import PRESETS, ModelConfig
from models.lora import DEFAULT_TARGETS
from trainer.preemption import signal_number
from zeropp.config import DilocoConfig, PlanConfig, TensorParallelConfig, ZeroConfig

DEBUG_ENV = "ZEROPP_DEBUG"  # set to 1 (or pass --debug) to see the traceback of an error


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class InputPath:
    """Marks a string field as a path the run reads: ``Annotated[str, InputPath()]``. Set in a YAML
    file, a relative path is taken relative to that file's directory; `keywords` are values that
    are not paths (data.path's "default", resume's "latest" and "auto")."""

    keywords: tuple[str, ...] = ()


@dataclass
class ModelSection:
    preset: str = "gpt2-tiny"  # a name from models.config.PRESETS (gpt2-tiny, llama-tiny, qwen3-0.6b, ...)
    n_layer: int | None = None  # transformer blocks (None: the preset's)
    n_head: int | None = None  # attention (query) heads (None: the preset's)
    n_kv_head: int | None = None  # key/value heads, < n_head for grouped-query attention (None: the preset's)
    d_model: int | None = None  # hidden size (None: the preset's)
    d_ff: int | None = None  # MLP inner size (None: the preset's)
    max_seq_len: int | None = None  # longest sequence the model takes (None: the preset's)
    # The vocabulary follows the tokenizer, padded up to a multiple of this (as Megatron does)
    # so the embedding matmuls stay aligned.
    make_vocab_size_divisible_by: int = 64


@dataclass
class HeldOutSection:
    """The data key every entry point shares (train.py / finetune.py's data, rlhf.py's data)."""

    # Share of the data held out for evaluation: the validation loss (train.py, finetune.py), the
    # held-out pairs' accuracy / margin or the prompts held out (rlhf.py).
    valid_fraction: float = 0.05


@dataclass
class DataSection(HeldOutSection):
    # "default" (the embedded corpus), a text/json/jsonl(.gz) file, or a Megatron .bin/.idx
    # prefix made by scripts/preprocess_data.py; for a fine-tune, the SFT data set (docs/finetune.md).
    path: Annotated[str, InputPath(("default",))] = "default"
    json_key: str = "text"  # the text field of json/jsonl records
    # A SentencePiece .model or a Hugging Face checkpoint dir with tokenizer.json. When None,
    # a SentencePiece model of `vocab_size` is trained on the data and cached.
    tokenizer: Annotated[str | None, InputPath()] = None
    vocab_size: int = 4096  # of the SentencePiece model trained when data.tokenizer is None
    seq_len: int = 128  # tokens per training sample (a fine-tune: the longest example; longer ones are cut)
    cache_dir: str = "cache"  # tokenized data and trained tokenizers, reused by later runs
    workers: int = 2  # processes that tokenize the corpus
    # Fine-tuning: pack a micro-batch's examples side by side into rows of seq_len (positions restart
    # and attention stays within each example) instead of one padded row each; the same loss.
    packing: bool = False


@dataclass
class OptimSection:
    lr: float = 1e-3  # AdamW's peak learning rate, reached after the warmup
    min_lr: float = 1e-4  # where the decay ends, at the last step
    warmup_steps: int = 10  # linear warmup from 0 to lr
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # from lr to min_lr after the warmup
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    clip_grad: float = 1.0  # clip the global gradient norm to this; 0 disables clipping


@dataclass
class RunSection:
    """The keys every training loop shares (train.py / finetune.py's `train`, rlhf.py's `train` for
    every stage): declared, defaulted and checked (check_run_section) once. A program whose default
    differs sets it where it builds the section (rlhf.config.RLHFConfig.train)."""

    # Per rank and forward/backward: samples (train.py, finetune.py); rlhf.py: sequences (sft),
    # preference pairs (reward, dpo) or prompts (ppo, grpo).
    micro_batch_size: int = 8
    seed: int = 1234  # initial weights, data order, dropout and (rlhf.py) sampling
    # "auto": bf16 autocast where the hardware multiplies bf16 natively (CUDA; a CPU with
    # avx512_bf16 / amx_bf16 / Arm bf16), fp32 elsewhere; master weights stay fp32 (docs/training.md).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    log_interval: int = 10  # steps between log lines (console, metrics.jsonl, TensorBoard)
    eval_interval: int = 100  # steps between evaluations (validation loss, held-out pairs); also at the last step
    eval_batches: int = 10  # global batches of the fixed validation (held-out) set per evaluation
    checkpoint_interval: int = 0  # steps between checkpoints; 0: only at the end
    # checkpoints/, metrics.jsonl, tensorboard/ and hf/ go here (rlhf.py: each stage's under <out_dir>/<stage>/)
    out_dir: str = "runs/default"
    # Write TensorBoard scalars (grouped: train/, eval/, perf/, comm/, memory/) and the run's
    # hyperparameters to <out_dir>/tensorboard.
    tensorboard: bool = True
    # A tqdm bar on rank 0, only where stdout is a terminal: a Slurm log file or a pipe never gets one.
    progress_bar: bool = True
    # Also log to Weights & Biases (rank 0) in this project; the run is named after out_dir, the entity
    # and mode come from wandb's own settings (WANDB_ENTITY, WANDB_MODE=offline). Needs
    # `pip install wandb`. None: off.
    wandb_project: str | None = None
    # Also log to MLflow (rank 0) at this tracking URI (a server, or a local directory such as mlruns);
    # the experiment is MLFLOW_EXPERIMENT_NAME's (else MLflow's default), the run named after out_dir.
    # Needs `pip install mlflow`. None: off.
    mlflow_tracking_uri: str | None = None
    # Peak of the hardware in TFLOP/s per rank, for MFU. On CPU a rough figure suffices.
    peak_tflops: float = 1.0
    # The scheduler's warning signal (Slurm --signal): checkpoint at the end of the current
    # step and exit cleanly. "" disables.
    preempt_signal: str = "SIGUSR1"
    # A step whose loss or gradient norm is not finite (on any rank) is skipped (no update); this
    # many in a row stop the run with an error (the last checkpoint stays the newest). rlhf.py:
    # a step is one optimizer step of a stage (PPO / GRPO take several per rollout).
    max_nonfinite_steps: int = 5
    # Seconds a collective may wait for the other ranks before this rank fails and names what
    # it waited in: long enough for a checkpoint save or an evaluation on one rank, short
    # enough that a dead or frozen rank ends the job in minutes, not gloo's default 30.
    dist_timeout: float = 600.0
    # Recompute transformer blocks' activations in the backward instead of keeping them from the
    # forward (docs/activation_checkpointing.md): "none"; "full": every block; "every_k": every
    # k-th block (train.activation_checkpointing_every). Saves activation memory for one more
    # forward of those blocks; the loss and gradients are the same. Models a run does not train
    # (rlhf.py's reference, a given reward model) keep no activations anyway and run as they are.
    activation_checkpointing: Literal["none", "full", "every_k"] = "none"
    activation_checkpointing_every: int = 2  # every_k's k: blocks k, 2k, ... (counted from 1) are checkpointed
    # A fresh run (no `resume`) refuses an out_dir (rlhf.py: a stage's directory) that holds
    # another run's checkpoints or metrics; true replaces them (checkpoints/, metrics.jsonl,
    # tensorboard/, hf/), kept in <out_dir>/.overwritten until this run's first checkpoint.
    overwrite: bool = False


@dataclass
class TrainSection(RunSection):
    """train.py / finetune.py's `train`: the shared keys (RunSection) and the ones of one run of steps."""

    steps: int = 200  # optimizer steps of the whole run
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    # At the end, also write the final weights as a Hugging Face directory: <out_dir>/hf
    # (LoRA adapters merged into the weights).
    export_hf: bool = False
    # Also evaluate before the first step (step 0): the starting point of a fine-tune.
    eval_at_start: bool = False


@dataclass
class LoraSection:
    # Rank of the adapters; 0 fine-tunes every weight (no LoRA).
    r: int = 0
    alpha: float = 16.0  # the update B @ A is scaled by alpha / r
    dropout: float = 0.0  # on the adapters' input
    # Linear layers of the blocks to adapt (all others, embeddings and norms stay frozen): a name
    # (q_proj) or a suffix of the full name (blocks.0.attn.q_proj). The MLP's are up_proj and
    # down_proj, plus gate_proj for LLaMA. On the command line: --finetune.lora.targets q_proj,v_proj
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g. from
    # scripts/consolidate.py --peft-adapter) to start the adapters from instead of fresh ones, to
    # continue training it; its r, lora_alpha and layers must be the ones above. None: fresh adapters.
    init_from: Annotated[str | None, InputPath()] = None



def check_lora_section(lora: LoraSection, key: str) -> None:
    """`key`: where the section is (finetune.lora, rlhf.py's lora)."""
    if lora.r < 0:
        raise ConfigError(f"{key}.r must be >= 0 (0: no LoRA), got {lora.r}")
    default = LoraSection()
    changed = [f.name for f in dataclasses.fields(lora) if getattr(lora, f.name) != getattr(default, f.name)]
    if lora.r == 0 and changed:
        raise ConfigError(f"{key}.{changed[0]} applies to LoRA, but {key}.r is 0 (every weight is trained); set "
                          f"{key}.r or drop it")

@dataclass
class FinetuneSection:
    # A Hugging Face model directory (config.json + safetensors; a family docs/models.md lists).
    # When set, the run fine-tunes it on the SFT data set at data.path (prompt tokens
    # masked out of the loss) instead of pretraining model.preset; the tokenizer is the directory's
    # own unless data.tokenizer names another.
    hf_checkpoint: Annotated[str | None, InputPath()] = None
    # Record format of data.path (docs/data.md): auto-detected from the first record's keys,
    # or alpaca (instruction / input / output), hh (HH-RLHF "chosen" dialogues), completion
    # (prompt / completion, the prompt verbatim) or messages (multi-turn chats rendered with the
    # tokenizer's chat template, the loss on the assistant turns).
    data_format: Literal["auto", "alpaca", "hh", "completion", "messages"] = "auto"
    # More SFT data sets trained on together with data.path's, each in the format its records show
    # (paths relative to the working directory; on the command line --finetune.mix b.jsonl,c.json).
    mix: list[str] = field(default_factory=list)
    # The weight of data.path's set, then of each finetune.mix set: an epoch draws that share of its
    # examples from each (a small set repeated, a large one subsampled, in a seeded order a resume
    # continues exactly). Empty: every example of every set once.
    mix_weights: list[float] = field(default_factory=list)
    lora: LoraSection = field(default_factory=LoraSection)  # LoRA adapters instead of training every weight


@dataclass
class ResumeConfig:
    """The top-level key every entry point shares."""

    # A checkpoint directory to continue from; "latest": out_dir's latest checkpoint (rlhf.py:
    # the running stage's); "auto": the latest if there is one, else start fresh (requeued jobs).
    resume: Annotated[str | None, InputPath(("latest", "auto"))] = None


@dataclass
class Config(ResumeConfig):
    model: ModelSection = field(default_factory=ModelSection)  # the model to pretrain (a preset and its shape)
    data: DataSection = field(default_factory=DataSection)  # the corpus or SFT data set and its tokenizer
    optim: OptimSection = field(default_factory=OptimSection)  # AdamW and the learning-rate schedule
    train: TrainSection = field(default_factory=TrainSection)  # batches, steps, logging, evaluation, checkpoints
    # Sharded data parallelism: 0 plain DDP, 3 ZeRO-3, plus ZeRO++ (docs/zero3.md, docs/zeropp.md).
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # Megatron-style tensor parallelism with AccTFM (docs/tensor_parallel.md).
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    # DiLoCo: the runtime inside sites, an outer optimizer across them (docs/diloco.md).
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    # zero_optimization chosen from the machine: probes, a cost model, constraints (docs/autoplan.md).
    plan: PlanConfig = field(default_factory=PlanConfig)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)  # fine-tuning a Hugging Face model


# ----------------------------------------------------------------------------- values

def _optim_ranges(o: OptimSection) -> list[tuple[str, float, str, bool]]:
    """(key, value, what is expected, whether it holds) for every key of `optim` with a range."""
    finite = math.isfinite
    return [
        ("optim.lr", o.lr, "a finite number > 0", finite(o.lr) and o.lr > 0),
        ("optim.min_lr", o.min_lr, "a finite number >= 0", finite(o.min_lr) and o.min_lr >= 0),
        ("optim.warmup_steps", o.warmup_steps, "an integer >= 0", o.warmup_steps >= 0),
        ("optim.weight_decay", o.weight_decay, "a finite number >= 0", finite(o.weight_decay) and o.weight_decay >= 0),
        ("optim.beta1", o.beta1, "a number in [0, 1)", 0 <= o.beta1 < 1),
        ("optim.beta2", o.beta2, "a number in [0, 1)", 0 <= o.beta2 < 1),
        ("optim.eps", o.eps, "a finite number > 0", finite(o.eps) and o.eps > 0),
        ("optim.clip_grad", o.clip_grad, "a finite number >= 0 (0 disables clipping)",
         finite(o.clip_grad) and o.clip_grad >= 0),
    ]


def _run_ranges(t: RunSection) -> list[tuple[str, float, str, bool]]:
    """The same for the shared `train` keys (RunSection)."""
    finite = math.isfinite
    return [
        ("train.eval_batches", t.eval_batches, "an integer >= 1", t.eval_batches >= 1),
        ("train.checkpoint_interval", t.checkpoint_interval, "an integer >= 0 (0: only at the end)",
         t.checkpoint_interval >= 0),
        ("train.peak_tflops", t.peak_tflops, "a finite number > 0", finite(t.peak_tflops) and t.peak_tflops > 0),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps, "an integer >= 1", t.max_nonfinite_steps >= 1),
        ("train.dist_timeout", t.dist_timeout, "a finite number of seconds > 0",
         finite(t.dist_timeout) and t.dist_timeout > 0),
        ("train.activation_checkpointing_every", t.activation_checkpointing_every, "an integer >= 1",
         t.activation_checkpointing_every >= 1),
    ]


def _refuse(ranges: list[tuple[str, float, str, bool]]) -> None:
    for key, value, expected, ok in ranges:
        if not ok:
            raise ConfigError(f"{key}: value {value!r} is out of range; expected {expected}")


def check_optim_section(o: OptimSection) -> None:
    """The one check of `optim` (train.py, finetune.py and every rlhf.py stage)."""
    _refuse(_optim_ranges(o))


def check_run_section(t: RunSection) -> None:
    """The one check of the shared `train` keys (RunSection): train.py, finetune.py and rlhf.py call it."""
    for key, value in (("train.micro_batch_size", t.micro_batch_size), ("train.log_interval", t.log_interval),
                       ("train.eval_interval", t.eval_interval)):
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")
    _refuse(_run_ranges(t))
    try:
        if t.preempt_signal:
            signal_number(t.preempt_signal)
    except ValueError as e:
        raise ConfigError(f"train.preempt_signal: {e}") from None
    for key, package in (("wandb_project", "wandb"), ("mlflow_tracking_uri", "mlflow")):
        if getattr(t, key) is not None and not _installed(package):
            raise ConfigError(f"train.{key} is set but the {package} package is not installed: pip install {package}")


def _installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (the loggers import theirs on rank 0 only)."""
    return importlib.util.find_spec(package) is not None


def check_held_out(d: HeldOutSection) -> None:
    """The one check of data.valid_fraction (HeldOutSection)."""
    if not 0.0 < d.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction must be in (0, 1), got {d.valid_fraction}")


MODEL_SIZES = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len")  # ModelSection's shape keys


def _divides(fields: dict, given: set[str], preset: str, part: str, whole: str, why: str) -> None:
    """Refuse model.<part> that does not divide model.<whole>, naming the key the run set."""
    p, w = fields[part], fields[whole]
    if w % p == 0:
        return
    if part in given or whole not in given:
        note = "" if whole in given else f" (from preset {preset!r})"
        raise ConfigError(f"model.{part}: value {p} does not divide model.{whole} {w}{note}; "
                          f"expected a divisor of {w} ({why})")
    note = "" if part in given else f" (from preset {preset!r})"
    raise ConfigError(f"model.{whole}: value {w} is not a multiple of model.{part} {p}{note}; "
                      f"expected a multiple of {p} ({why})")


def check_model_section(m: ModelSection) -> None:
    """A model that cannot be built is refused before any data is read, naming the model.* key
    and value (ModelConfig's own checks speak of its fields, not of the run's keys)."""
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset: value {m.preset!r} is not a preset; expected one of {', '.join(PRESETS)}")
    _refuse([(f"model.{k}", getattr(m, k), "an integer >= 1 (unset: the preset's)",
              getattr(m, k) is None or getattr(m, k) >= 1) for k in MODEL_SIZES]
            + [("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by, "an integer >= 1",
                m.make_vocab_size_divisible_by >= 1)])
    given = {k for k in MODEL_SIZES if getattr(m, k) is not None}
    fields = ModelConfig.preset_fields(m.preset, **{k: getattr(m, k) for k in given})
    fields["n_kv_head"] = fields["n_kv_head"] or fields["n_head"]
    if fields["explicit_head_dim"] is None:
        _divides(fields, given, m.preset, "n_head", "d_model", "every head gets d_model / n_head of the width")
        head_dim = fields["d_model"] // fields["n_head"]
        if fields["positions"] == "rope" and head_dim % 2:
            raise ConfigError(f"model.n_head: value {fields['n_head']} gives an odd head width d_model / n_head = "
                              f"{fields['d_model']} / {fields['n_head']} = {head_dim}; expected an even one "
                              f"(preset {m.preset!r} rotates pairs of each head's dimensions: RoPE)")
    _divides(fields, given, m.preset, "n_kv_head", "n_head", "each key/value head serves as many query heads")
    try:
        ModelConfig(**fields)  # anything else ModelConfig refuses, in its own words
    except ValueError as e:
        raise ConfigError(f"model (preset {m.preset!r}): {e}") from None


def check_values(cfg: Config) -> None:
    """Refuse values of the right type that no run can use (a negative learning rate trains
    backwards, eval_batches 0 crashes after the last step, before the final save)."""
    check_optim_section(cfg.optim)
    check_run_section(cfg.train)
    check_model_section(cfg.model)
    if cfg.data.tokenizer is None and cfg.data.vocab_size <= SP_FIXED_PIECES:
        raise ConfigError(f"data.vocab_size: value {cfg.data.vocab_size} is out of range; expected an integer "
                          f"above {SP_FIXED_PIECES} (the SentencePiece model's 4 special and 256 byte pieces, plus "
                          f"the text's characters)")


# ----------------------------------------------------------------------------- conversion

_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Convert a YAML or CLI value to the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot convert {value!r}")
    if origin is list:
        # A YAML list, or on the command line one comma-separated string.
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: value {value!r} is not a list (expected a YAML list or comma-separated items)")
        return [_convert(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: value {value!r} is not one of {list(args)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key}: value {value!r} is not a boolean (expected true or false)")
    if annotation in (int, float):
        # YAML gives numbers, the CLI strings; a bool is never a number here, nor 1.5 an int.
        accepted = (int,) if annotation is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return annotation(value)
        if isinstance(value, str):
            try:
                return annotation(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: value {value!r} is not {'an integer' if annotation is int else 'a number'}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: value {value!r} is not a string")
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _hints(obj) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


@functools.cache
def _input_paths(cls) -> dict[str, InputPath]:
    """Fields of dataclass `cls` that are paths the run reads, with their markers."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: meta for name, hint in hints.items() if typing.get_origin(hint) is Annotated
            for meta in hint.__metadata__ if isinstance(meta, InputPath)}


def _resolve_path(value: Any, marker: InputPath, base: Path) -> Any:
    """A relative path read from a YAML file in `base`, made absolute from there."""
    if not isinstance(value, str) or not value or value in marker.keywords or value.lower() in ("none", "null"):
        return value
    path = os.path.expanduser(value)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(os.path.abspath(base), path))


def set_key(cfg, dotted: str, value: Any, base: str | Path | None = None) -> None:
    """Set one dotted key (``optim.lr``) on a config tree, converting and checking it.

    base: the directory of the YAML file the value comes from; relative input paths resolve there.
    """
    node = cfg
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        fields = _fields(node)
        if part not in fields:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(
                f"unknown config key {dotted!r}: {part!r} is not a key of {where}; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
        child = getattr(node, part)
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(child):
                if not isinstance(value, dict):
                    raise ConfigError(f"{dotted}: expected a mapping of keys, got {value!r}")
                for k, v in value.items():
                    set_key(cfg, f"{dotted}.{k}", v, base)
                return
            marker = _input_paths(type(node)).get(part)
            if marker is not None and base is not None:
                value = _resolve_path(value, marker, Path(base))
            setattr(node, part, _convert(value, _hints(node)[part], dotted))
            return
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[:depth + 1])} has no sub-keys")
        node = child


def apply_dict(cfg, values: dict, prefix: str = "", base: str | Path | None = None) -> None:
    """Set every key of a (nested) mapping; base: as set_key's, for values read from a YAML file."""
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        set_key(cfg, dotted, value, base)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(values).__name__}")
    return values


def pop_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether errors should keep their traceback, argv without --debug): --debug anywhere, or
    ZEROPP_DEBUG set to anything but "" / 0 / false."""
    rest = [arg for arg in argv if arg != "--debug"]
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    return env or len(rest) != len(argv), rest


def parse_args(argv: list[str], cfg=None, *, usage: str | None = None, hide: Iterable[str] = ()):
    """Build a Config from ``--config FILE`` and ``--dotted.key value`` arguments.

    ``--key=value`` works too; a bare ``--flag`` followed by another option (or nothing)
    means ``true``. ``-h`` / ``--help`` prints `usage` and every key (``help_text``, without the
    keys and sections in `hide`) and exits. Relative input paths in the YAML file are taken
    relative to its directory (InputPath).
    """
    cfg = Config() if cfg is None else cfg
    pairs: list[tuple[str, Any]] = []
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text(cfg, usage, hide))
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: arguments are --key value pairs (--help lists the keys)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        i += 1
        if key == "config":
            config_file = value
        else:
            pairs.append((key.replace("-", "_"), value))
    if config_file is not None:
        apply_dict(cfg, load_yaml(config_file), base=Path(config_file).parent)
    for key, value in pairs:
        set_key(cfg, key, value)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(values: dict, cls=Config):
    cfg = cls()
    apply_dict(cfg, values)
    return cfg


# ----------------------------------------------------------------------------- help


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Field name -> description, for dataclass `cls` (and its bases): the ``#`` comment block
    directly above the field plus a comment at the end of its line; a field with neither takes
    the comment block above the run of fields it belongs to (no blank line in between)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            docs.update(_own_field_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _own_field_docs(klass) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # no source (frozen app, interactive): no descriptions
        return {}
    lines = source.splitlines()
    comments: dict[int, tuple[bool, str]] = {}  # line (1-based) -> (a line of its own, text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            own = not lines[tok.start[0] - 1][:tok.start[1]].strip()
            comments[tok.start[0]] = (own, tok.string.lstrip("#").strip())
    (node,) = ast.parse(source).body
    docs, group, previous_end = {}, "", None
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            previous_end = None  # a method or a docstring ends a run of fields
            continue
        above, line = [], stmt.lineno - 1
        while line in comments and comments[line][0]:
            above.insert(0, comments[line][1])
            line -= 1
        trailing = [text for n in range(stmt.lineno, stmt.end_lineno + 1)
                    for own, text in [comments.get(n, (True, ""))] if not own and text]
        if above:
            group = " ".join(above)
        elif previous_end is None or line != previous_end:  # a blank line (or nothing) above: a new run
            group = ""
        own_text = " ".join(above + trailing)
        docs[stmt.target.id] = own_text or group
        previous_end = stmt.end_lineno
    return docs


def type_name(annotation: Any) -> str:
    """How --help shows a field's type: int, float, str, bool, path, {a,b}, list[str], or X | none."""
    if typing.get_origin(annotation) is Annotated:
        base = type_name(typing.get_args(annotation)[0])
        return base.replace("str", "path") if any(isinstance(m, InputPath) for m in annotation.__metadata__) else base
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | none" if type(None) in args else "")
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def format_value(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(format_value(v) for v in value)
    if isinstance(value, str):
        return value if value and value.strip() == value and "," not in value else repr(value)
    return repr(value)


def _section_doc(parent_doc: str, section) -> str:
    if parent_doc:
        return parent_doc
    doc = inspect.getdoc(type(section)) or ""
    if doc.startswith(type(section).__name__ + "("):  # the signature dataclasses puts where there is no docstring
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def help_text(cfg, usage: str | None = None, hide: Iterable[str] = (), width: int = 100) -> str:
    """`usage`, then every key of the config tree `cfg`, section by section: its type, its default
    (the value in `cfg`) and its description (field_docs); keys and sections named in `hide` are left out."""
    hide = set(hide)
    out = [usage.strip("\n")] if usage else []
    out += ["", "options:",
            "  --config FILE        a YAML file of keys (configs/*.yaml); keys given on the command line win",
            "  --debug              show the full traceback of an error (also: ZEROPP_DEBUG=1)",
            "  -h, --help           this help",
            "", "keys (--section.key value, or --section.key=value; YAML: the same nesting):"]
    wrap = functools.partial(textwrap.fill, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)

    def keys(node, prefix: str) -> list[str]:
        lines, docs, hints = [], field_docs(type(node)), typing.get_type_hints(type(node), include_extras=True)
        leaves = [f for f in dataclasses.fields(node) if not dataclasses.is_dataclass(getattr(node, f.name))
                  and f"{prefix}{f.name}" not in hide]
        for i, f in enumerate(leaves):
            lines.append(f"  --{prefix}{f.name} {type_name(hints[f.name])}  "
                         f"(default: {format_value(getattr(node, f.name))})")
            nxt = leaves[i + 1] if i + 1 < len(leaves) else None
            if nxt is None or docs[nxt.name] != docs[f.name]:  # a description shared by a run of keys: once, after it
                lines.append(wrap(docs[f.name]) if docs[f.name] else "")
        return [line for line in lines if line]

    def sections(node, prefix: str) -> list[str]:
        lines, docs = [], field_docs(type(node))
        for f in dataclasses.fields(node):
            child, name = getattr(node, f.name), f"{prefix}{f.name}"
            if not dataclasses.is_dataclass(child) or name in hide:
                continue
            about = _section_doc(docs[f.name], child)
            header = textwrap.fill(f"{name}: {about}", width=width, subsequent_indent="    ") if about else f"{name}:"
            lines += ["", header, *keys(child, f"{name}.")]
            lines += sections(child, f"{name}.")
        return lines

    top = keys(cfg, "")
    if top:
        out += ["", "top level:", *top]
    out += sections(cfg, "")
    return "\n".join(out)


def all_fields(cfg, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, dataclass, description) of every leaf key of the config tree `cfg`."""
    out = []
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        child = getattr(cfg, f.name)
        if dataclasses.is_dataclass(child):
            out += all_fields(child, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", type(cfg), docs[f.name]))
    return out

