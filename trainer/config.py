"""One configuration system for every entry point: dataclasses, YAML presets, CLI overrides.

A run's configuration is a tree of dataclasses. It is filled in three layers, each
overriding the last: the dataclass defaults, a YAML file (``--config configs/x.yaml``), and
dotted command-line overrides (``--optim.lr 3e-4 --train.steps 100``). Every key is checked
against the dataclass it lands in, so a typo is an error that names the key and lists the
valid ones, and every value is converted to the field's declared type or rejected.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from models.lora import DEFAULT_TARGETS
from zeropp.config import TensorParallelConfig, ZeroConfig


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message says which and why."""


@dataclass
class ModelSection:
    preset: str = "gpt2-tiny"  # a name from models.config.PRESETS
    # Optional overrides of the preset's shape; None keeps the preset's value.
    n_layer: int | None = None
    n_head: int | None = None
    n_kv_head: int | None = None
    d_model: int | None = None
    d_ff: int | None = None
    max_seq_len: int | None = None
    # The vocabulary follows the tokenizer, padded up to a multiple of this (as Megatron does)
    # so the embedding matmuls stay aligned.
    make_vocab_size_divisible_by: int = 64


@dataclass
class DataSection:
    # "default" (the embedded corpus), a text/json/jsonl(.gz) file, or a Megatron .bin/.idx
    # prefix made by scripts/preprocess_data.py.
    path: str = "default"
    json_key: str = "text"
    # A SentencePiece .model or a Hugging Face checkpoint dir with tokenizer.json. When None,
    # a SentencePiece model of `vocab_size` is trained on the data and cached.
    tokenizer: str | None = None
    vocab_size: int = 4096
    seq_len: int = 128
    valid_fraction: float = 0.05
    cache_dir: str = "cache"
    workers: int = 2


@dataclass
class OptimSection:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping


@dataclass
class TrainSection:
    steps: int = 200
    micro_batch_size: int = 8  # per rank
    grad_accum: int = 1
    seed: int = 1234
    # "auto": bf16 autocast on CUDA, fp32 on CPU (bf16 matmuls are slow on CPUs).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    log_interval: int = 10
    eval_interval: int = 100  # also evaluates at the last step
    eval_batches: int = 10
    checkpoint_interval: int = 0  # 0: only at the end
    out_dir: str = "runs/default"
    # A fresh run (no `resume`) refuses an out_dir that holds another run's checkpoints or
    # metrics; true deletes them first (checkpoints/, metrics.jsonl, tensorboard/, hf/).
    overwrite: bool = False
    tensorboard: bool = True
    progress_bar: bool = True
    # Peak of the hardware in TFLOP/s per rank, for MFU. On CPU a rough figure suffices.
    peak_tflops: float = 1.0
    # The scheduler's warning signal (Slurm --signal): checkpoint at the end of the current
    # step and exit cleanly. "" disables.
    preempt_signal: str = "SIGUSR1"
    # At the end, also write the final weights as a Hugging Face directory: <out_dir>/hf
    # (LoRA adapters merged into the weights).
    export_hf: bool = False
    # Also evaluate before the first step (step 0): the starting point of a fine-tune.
    eval_at_start: bool = False
    # A step whose loss or gradient norm is not finite is skipped (no update); this many in a
    # row stop the run with an error (the last checkpoint stays the newest).
    max_nonfinite_steps: int = 5
    # Seconds a collective may wait for the other ranks before this rank fails and names what
    # it waited in: long enough for a checkpoint save or an evaluation on one rank, short
    # enough that a dead or frozen rank ends the job in minutes, not gloo's default 30.
    dist_timeout: float = 600.0


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


@dataclass
class FinetuneSection:
    # A Hugging Face model directory (config.json + safetensors; GPT-2, OPT or LLaMA). When set,
    # the run fine-tunes it on the SFT data set at data.path (prompt tokens masked out of the
    # loss) instead of pretraining model.preset; the tokenizer is the directory's own unless
    # data.tokenizer names another.
    hf_checkpoint: str | None = None
    # Record format of data.path (docs/data.md): auto-detected from the first record's keys,
    # or alpaca (instruction / input / output), hh (HH-RLHF "chosen" dialogues) or completion
    # (prompt / completion, the prompt verbatim).
    data_format: Literal["auto", "alpaca", "hh", "completion"] = "auto"
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    # A checkpoint directory to continue from; "latest": out_dir's latest checkpoint;
    # "auto": the latest if there is one, else start fresh (requeued jobs).
    resume: str | None = None


# ----------------------------------------------------------------------------- values

def _ranges(cfg: Config) -> list[tuple[str, float, str, bool]]:
    """(key, value, what is expected, whether it holds) for every numeric key with a range."""
    o, t = cfg.optim, cfg.train
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
        ("train.eval_batches", t.eval_batches, "an integer >= 1", t.eval_batches >= 1),
        ("train.checkpoint_interval", t.checkpoint_interval, "an integer >= 0 (0: only at the end)",
         t.checkpoint_interval >= 0),
        ("train.peak_tflops", t.peak_tflops, "a finite number > 0", finite(t.peak_tflops) and t.peak_tflops > 0),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps, "an integer >= 1", t.max_nonfinite_steps >= 1),
        ("train.dist_timeout", t.dist_timeout, "a finite number of seconds > 0",
         finite(t.dist_timeout) and t.dist_timeout > 0),
    ]


def check_values(cfg: Config) -> None:
    """Refuse values of the right type that no run can use (a negative learning rate trains
    backwards, eval_batches 0 crashes after the last step, before the final save)."""
    for key, value, expected, ok in _ranges(cfg):
        if not ok:
            raise ConfigError(f"{key}: value {value!r} is out of range; expected {expected}")


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


def set_key(cfg, dotted: str, value: Any) -> None:
    """Set one dotted key (``optim.lr``) on a config tree, converting and checking it."""
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
                    set_key(cfg, f"{dotted}.{k}", v)
                return
            setattr(node, part, _convert(value, _hints(node)[part], dotted))
            return
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[:depth + 1])} has no sub-keys")
        node = child


def apply_dict(cfg, values: dict, prefix: str = "") -> None:
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        set_key(cfg, dotted, value)


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


def parse_args(argv: list[str], cfg=None):
    """Build a Config from ``--config FILE`` and ``--dotted.key value`` arguments.

    ``--key=value`` works too; a bare ``--flag`` followed by another option (or nothing)
    means ``true``. ``--help`` prints every key with its default and exits.
    """
    cfg = Config() if cfg is None else cfg
    pairs: list[tuple[str, Any]] = []
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: arguments are --key value pairs")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        i += 1
        if key == "help":
            print(describe(cfg))
            raise SystemExit(0)
        if key == "config":
            config_file = value
        else:
            pairs.append((key.replace("-", "_"), value))
    if config_file is not None:
        apply_dict(cfg, load_yaml(config_file))
    for key, value in pairs:
        set_key(cfg, key, value)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(values: dict, cls=Config):
    cfg = cls()
    apply_dict(cfg, values)
    return cfg


def describe(cfg, prefix: str = "") -> str:
    """Every key with its current value, one per line (what --help prints)."""
    lines = []
    for name in _fields(cfg):
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            lines.append(describe(value, f"{prefix}{name}."))
        else:
            lines.append(f"  --{prefix}{name} {value!r}")
    return "\n".join(lines)
