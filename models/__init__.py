"""GPT-2 / OPT / LLaMA / Qwen2 / Qwen3 / Mistral decoder models, Hugging Face checkpoint I/O and generation."""

from models.config import PRESETS, ModelConfig, flops_per_token, num_params
from models.generate import generate
from models.hf import (HFCheckpointWeights, config_from_hf, config_to_hf, hf_model_on_meta, load_hf_checkpoint,
                       save_hf_checkpoint, to_hf_state_dict)
from models.transformer import KVCache, Transformer, lm_loss

__all__ = [
    "PRESETS", "ModelConfig", "flops_per_token", "num_params", "generate", "config_from_hf",
    "config_to_hf", "HFCheckpointWeights", "hf_model_on_meta", "load_hf_checkpoint", "save_hf_checkpoint",
    "to_hf_state_dict", "KVCache", "Transformer", "lm_loss",
]
