"""Sources: any model location the scripts export from or generate with.

A low-bit export, a Hugging Face directory or one of our training checkpoints, loaded the same
way into an fp32 Transformer with its tokenizer and, where the weights came from one, its
quantization grid.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from export.quantized import is_lowbit_dir, load_lowbit
from models.hf import load_hf_checkpoint
from models.transformer import Transformer
from trainer.checkpoint import consolidated_model, read_state, resolve_checkpoint
from zeropp.config import ZeroConfig


@dataclasses.dataclass(frozen=True)
class Grid:
    """A block-quantization grid that weights were trained (qwZ) or exported on."""

    bits: int
    block_size: int
    vectors: bool  # the 1-D tensors are on it too (qwZ quantizes every parameter)


@dataclasses.dataclass
class Source:
    model: Transformer  # fp32
    tokenizer: Path | None  # the tokenizer the source names, if any
    grid: Grid | None  # where the weights came from a quantized forward (qwZ) or export
    kind: str  # "lowbit", "hf" or "checkpoint"


def load_source(path) -> Source:
    """A low-bit export dir, a Hugging Face dir (config.json) or one of our training checkpoints
    (a step dir, or a run's checkpoints/ dir for its latest; full or ZeRO-3 sharded)."""
    path = Path(path)
    if is_lowbit_dir(path):
        model, meta = load_lowbit(path)
        return Source(model, path, Grid(meta["bits"], meta["block_size"], meta["vectors_on_grid"]), "lowbit")
    if (path / "config.json").is_file():
        has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
        return Source(load_hf_checkpoint(path), path if has_tokenizer else None, None, "hf")
    if not ((path / "state.json").is_file() or (path / "latest").is_file()):
        raise FileNotFoundError(f"{path} is not a low-bit export (quantization.json), a Hugging Face model dir "
                                f"(config.json) or a training checkpoint (state.json, or a checkpoints/ dir with "
                                f"a 'latest' pointer)")
    ckpt = resolve_checkpoint(str(path), ".")
    state = read_state(ckpt)
    saved = (state.get("config") or {}).get("zero_optimization") or {}
    zero = ZeroConfig(**{f.name: saved[f.name] for f in dataclasses.fields(ZeroConfig) if f.name in saved})
    grid = None
    if zero.zero_quantized_weights:
        grid = Grid(zero.zero_quantized_weights_bits, zero.zero_quantization_block_size, True)
    tokenizer = state.get("tokenizer")
    return Source(consolidated_model(ckpt), Path(tokenizer) if tokenizer else None, grid, "checkpoint")
