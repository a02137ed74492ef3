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
peft itself is not needed here: the tests check these files against it. Reading an adapter
(`load_peft_adapter`) is in models/peft.py, since training loads one too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from models.config import ModelConfig
from models.hf import staged_directory
from models.lora import LoRALinear, apply_lora
# The layout and the reading side live in models/peft.py, below trainer/ (a fine-tune starts from an adapter).
from models.peft import _GPT2_QKV, _WRITTEN, ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, _check_arch, _hf_modules
from models.transformer import Transformer
from trainer.checkpoint import checkpoint_tensors, read_state, verify_checkpoint


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
