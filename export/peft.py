"""PEFT adapters: our LoRA adapters alone, in the layout the `peft` library saves and loads.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`, whose keys
are `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]) with
<module> the layer's name in the transformers *ForCausalLM model (models/hf.py maps ours to
it). PEFT computes base(x) + lora_B(lora_A(dropout(x))) * lora_alpha / r, which is exactly
`LoRALinear`, so the tensors are ours as they are, also for GPT-2's Conv1D layers (PEFT's
lora_A / lora_B stay in nn.Linear layout; `fan_in_fan_out` only concerns the base weight).

Not expressible, and refused: GPT-2's q / k / v adapters (HF fuses them into one Conv1D,
`c_attn`: a PEFT adapter there is one rank-r update of the fused matrix, ours are three
separate ones), score models (PEFT's SEQ_CLS adapters also save the head), and on loading,
PEFT options our LoRALinear does not compute (DoRA, rsLoRA, trained biases, per-layer ranks).
peft itself is not needed here: the tests check these files against it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.hf import staged_directory, to_hf_state_dict
from models.lora import LoRALinear, apply_lora
from models.transformer import Transformer
from trainer.checkpoint import checkpoint_tensors, read_state, verify_checkpoint

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
_GPT2_QKV = re.compile(r"blocks\.\d+\.attn\.[qkv]_proj")
# adapter_config.json settings that change what PEFT computes, and the value our LoRALinear matches; the
# first ones are written (every peft release since 0.7 knows them), all are checked on loading.
_WRITTEN = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None}
_PLAIN_LORA = {**_WRITTEN, "lora_bias": False, "target_parameters": None, "trainable_token_indices": None,
               "use_qalora": False, "alora_invocation_tokens": None}


def _check_arch(config: ModelConfig, what: str) -> None:
    if config.num_labels:
        raise ValueError(f"{what}: a score model (num_labels={config.num_labels}) is not supported: PEFT's "
                         f"sequence-classification adapters also save the score head (modules_to_save)")


def _hf_modules(model: nn.Module) -> dict[str, str]:
    """Our name -> the transformers module name, for every Linear layer of the blocks that PEFT can adapt as is."""
    config, out = model.config, {}
    for name, module in model.blocks.named_modules():
        if isinstance(module, (nn.Linear, LoRALinear)) and not name.endswith(".base"):
            ours = f"blocks.{name}"
            if config.arch == "gpt2" and _GPT2_QKV.fullmatch(ours):
                continue  # fused into c_attn in HF
            (hf,) = to_hf_state_dict({f"{ours}.weight": torch.empty(0)}, config)  # names only (1-D: no transpose)
            out[ours] = hf.removesuffix(".weight")
    return out


def _gpt2_qkv_error(names: list[str]) -> ValueError:
    return ValueError(f"LoRA adapters on GPT-2's {names} cannot be saved as a PEFT adapter: transformers' GPT-2 fuses "
                      f"q, k and v into one Conv1D (attn.c_attn), where a PEFT adapter is one rank-r update of the "
                      f"fused matrix, while ours are separate rank-r updates of q, k and v. Target o_proj, up_proj "
                      f"or down_proj for a PEFT adapter, or export the merged model (scripts/consolidate.py)")


def _compact(modules: list[str], config: ModelConfig) -> list[str]:
    """target_modules for PEFT: a layer-independent suffix (self_attn.q_proj) where it names exactly the adapted
    modules of every layer, else the full module names (PEFT matches a name or a `.`-suffix of it)."""
    by_suffix: dict[str, set[str]] = {}
    for name in modules:
        layer = re.fullmatch(r"(.+)\.(\d+)\.(.+)", name)
        by_suffix.setdefault(layer[3], set()).add(name)
    out = []
    for suffix, names in sorted(by_suffix.items()):
        out.extend([suffix] if len(names) == config.n_layer else sorted(names))
    return out


def _write_dir(out_dir: Path, files) -> Path:
    """Write files (name -> callable(path)) into a temporary directory beside out_dir, then rename it into place."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    with staged_directory(out_dir) as tmp:
        for name, write in files.items():
            write(tmp / name)
    return out_dir


def save_peft_adapter(model: Transformer, out_dir, base_model_name_or_path: str) -> Path:
    """Write `model`'s LoRA adapters (not the base weights) as a PEFT adapter directory, atomically.

    `base_model_name_or_path` is recorded for `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM`:
    the transformers model the adapter applies to (the fine-tune's finetune.hf_checkpoint).
    """
    config = model.config
    _check_arch(config, "PEFT adapter")
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not adapters:
        raise ValueError("the model has no LoRA adapters (models.lora.apply_lora) to save as a PEFT adapter")
    qkv = [name for name in adapters if config.arch == "gpt2" and _GPT2_QKV.fullmatch(name)]
    if qkv:
        raise _gpt2_qkv_error(qkv)
    settings = {(m.lora_A.shape[0], m.scaling, m.dropout.p) for m in adapters.values()}
    if len(settings) != 1:  # apply_lora gives every layer the same; a hand-built model might not
        raise ValueError(f"the adapters have different (rank, scaling, dropout) {sorted(settings)}; a PEFT adapter "
                         f"is written here with one setting for every layer")
    (r, scaling, dropout), = settings
    hf = _hf_modules(model)
    tensors = {}
    for name, m in adapters.items():
        tensors[f"{PREFIX}{hf[name]}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous()
        tensors[f"{PREFIX}{hf[name]}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous()
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model_name_or_path),
        "r": r, "lora_alpha": scaling * r, "lora_dropout": dropout,
        "target_modules": _compact([hf[name] for name in adapters], config),
        "fan_in_fan_out": config.arch == "gpt2",  # HF's GPT-2 layers are Conv1D ([in, out] weights)
        "init_lora_weights": True, "inference_mode": True, **_WRITTEN,
    }
    return _write_dir(Path(out_dir), {
        ADAPTER_CONFIG: lambda p: p.write_text(json.dumps(adapter_config, indent=2) + "\n"),
        ADAPTER_WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
    })


def _read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file, weights_file = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            hint = " (adapter_model.bin: pickle files are not loaded, save with safe_serialization)" \
                if file == weights_file and (adapter_dir / "adapter_model.bin").is_file() else ""
            raise FileNotFoundError(f"{file} not found; expected a PEFT adapter directory{hint}")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON ({e})") from e
    try:
        with safe_open(weights_file, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{weights_file}: cannot read safetensors file ({e})") from e
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are loaded")
    for key, plain in _PLAIN_LORA.items():
        if cfg.get(key) and cfg[key] != plain:  # absent, null, false or empty: PEFT's plain default
            raise ValueError(f"{config_file}: {key}={cfg[key]!r} is not supported: our LoRALinear computes plain "
                             f"LoRA with one rank and alpha for every layer ({key}={plain!r})")
    return cfg, tensors


def load_peft_adapter(model: Transformer, adapter_dir) -> list[str]:
    """Initialise `model`'s LoRA adapters from a PEFT adapter directory, to continue training; returns their names.

    A model without adapters gets them (models.lora.apply_lora with the adapter's layers, rank, alpha and
    dropout); one that has them already (a fine-tune's finetune.lora) must have exactly the same layers, rank
    and scaling. Every tensor of the file must be a lora_A / lora_B of a block Linear layer of this model.
    """
    adapter_dir = Path(adapter_dir)
    config = model.config
    _check_arch(config, "PEFT adapter")
    cfg, tensors = _read_adapter(adapter_dir)
    source = adapter_dir / ADAPTER_WEIGHTS
    ours = {hf: name for name, hf in _hf_modules(model).items()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = re.fullmatch(rf"{re.escape(PREFIX)}(.+)\.(lora_[AB])(?:\.default)?\.weight", key)
        if found is None:
            raise ValueError(f"{source}: tensor {key!r} is not a LoRA weight "
                             f"('{PREFIX}<module>.lora_A.weight' / '.lora_B.weight')")
        module, which = found.groups()
        if module not in ours:
            fused = " (GPT-2's fused q/k/v: see export/peft.py)" if module.endswith(".attn.c_attn") else ""
            raise ValueError(f"{source}: tensor {key!r} adapts {module!r}, which is not a block Linear layer of this "
                             f"{config.arch} model{fused}; its layers are {sorted(ours)[:6]}...")
        pairs.setdefault(module, {})[which] = tensor
    if not pairs:
        raise ValueError(f"{source}: holds no LoRA weights")
    r, alpha, dropout = cfg.get("r", 8), float(cfg.get("lora_alpha", 8)), float(cfg.get("lora_dropout", 0.0))
    for module, pair in pairs.items():
        want = {"lora_A": (r, None), "lora_B": (None, r)}
        for which, (rows, cols) in want.items():
            t = pair.get(which)
            if t is None:
                raise ValueError(f"{source}: {module!r} has no {which}.weight")
            if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
                raise ValueError(f"{source}: {module}.{which}.weight has shape {tuple(t.shape)}; expected rank "
                                 f"r={r} from {ADAPTER_CONFIG} (lora_A: [r, in], lora_B: [out, r])")
    names = sorted(ours[m] for m in pairs)
    existing = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not existing:
        apply_lora(model, names, r, alpha, dropout)
        existing = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    elif sorted(existing) != names:
        raise ValueError(f"{adapter_dir}: the adapter adapts {names}, this model's LoRA adapters are "
                         f"{sorted(existing)}; set finetune.lora.targets to the adapter's layers")
    hf = _hf_modules(model)
    with torch.no_grad():
        for name, m in existing.items():
            a, b = pairs[hf[name]]["lora_A"], pairs[hf[name]]["lora_B"]
            if m.lora_A.shape != a.shape or m.lora_B.shape != b.shape or not math.isclose(m.scaling, alpha / r):
                raise ValueError(f"{adapter_dir}: {hf[name]} has r={r}, lora_alpha={alpha} (A {tuple(a.shape)}, "
                                 f"B {tuple(b.shape)}); this model's {name} has r={m.lora_A.shape[0]}, "
                                 f"alpha={m.scaling * m.lora_A.shape[0]}: set finetune.lora.r / alpha to the adapter's")
            m.lora_A.copy_(a)
            m.lora_B.copy_(b)
    return names


def export_peft_adapter(checkpoint, out_dir, base_model_name_or_path=None) -> Path:
    """A LoRA fine-tune's checkpoint (a step dir, either format) -> a PEFT adapter directory.

    The adapters are the fp32 values the run optimized; the base model defaults to the run's
    finetune.hf_checkpoint. Only the adapters are read (from the ranges of the checkpoint's files that
    hold them) and kept: the model is built on the meta device.
    """
    checkpoint = Path(checkpoint)
    verify_checkpoint(checkpoint)
    state = read_state(checkpoint)
    lora = state.get("lora")
    if not lora:
        raise ValueError(f"checkpoint {checkpoint} has no LoRA adapters (finetune.lora.r was 0): export the whole "
                         f"model with scripts/consolidate.py instead")
    base = base_model_name_or_path or ((state.get("config") or {}).get("finetune") or {}).get("hf_checkpoint")
    if not base:
        raise ValueError(f"checkpoint {checkpoint} names no base model (finetune.hf_checkpoint): pass one")
    weights = checkpoint_tensors(checkpoint, state)  # lazy: each tensor read when looked up
    with torch.device("meta"):
        model = Transformer(ModelConfig(**state["model_config"]))
        apply_lora(model, lora["targets"], lora["r"], lora["alpha"], lora.get("dropout", 0.0))
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for leaf in ("lora_A", "lora_B"):
                if f"{name}.{leaf}" not in weights:
                    raise ValueError(f"checkpoint {checkpoint} has no tensor {name}.{leaf} for its LoRA adapters")
                setattr(m, leaf, nn.Parameter(weights[f"{name}.{leaf}"], requires_grad=False))
    return save_peft_adapter(model, out_dir, base)
