"""PEFT adapters read back into our LoRA layers: `load_peft_adapter`, to continue training from one.

The layout (the `peft` library's): `adapter_config.json` and `adapter_model.safetensors`, whose keys
are `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]) with
<module> the layer's name in the transformers *ForCausalLM model (models/hf.py maps ours to it).
PEFT computes base(x) + lora_B(lora_A(dropout(x))) * lora_alpha / r, which is exactly `LoRALinear`.

Here, below trainer/, because a fine-tune starts from an adapter (finetune.lora.init_from);
writing one from a checkpoint is export's (export/peft.py, which shares these names and checks).
Refused on loading: score models, GPT-2's fused q/k/v (`c_attn`), and PEFT options our LoRALinear
does not compute (DoRA, rsLoRA, trained biases, per-layer ranks).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig
from models.hf import to_hf_state_dict
from models.lora import LoRALinear, apply_lora
from models.transformer import Transformer

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
