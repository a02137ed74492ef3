"""Models leaving training: quantized export (low-bit safetensors, GGUF) and the loaders the scripts
read any model location with.

A package of its own because it joins every layer below it: the model (models/), the tokenizer
(data/), our block quantization and qwZ's grid (kernels/: on_grid, WEIGHT_SCALE_DTYPE), PEFT adapters
(models/peft.py reads them) and training checkpoints (trainer/). models/ stays importable with torch alone.
"""

from export.quantized import (dequantized_state_dict, export_gguf, export_lowbit, gguf_qtype, is_lowbit_dir,
                              load_lowbit, lowbit_weights)
from export.sources import Grid, Source, load_source

__all__ = [
    "dequantized_state_dict", "export_gguf", "export_lowbit", "gguf_qtype", "is_lowbit_dir", "load_lowbit",
    "lowbit_weights",
    "Grid", "Source", "load_source",
]
