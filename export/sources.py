"""Sources: any model location the scripts export from or generate with.

A low-bit export, a Hugging Face directory or one of our training checkpoints, opened the same
way: its model config, its fp32 weights by our parameter names (read one tensor at a time when
looked up, so an export writes them without ever holding the model), its tokenizer and, where the
weights came from one, its quantization grid. `Source.model` builds the whole fp32 Transformer
(for generation), on first use.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path

import torch

from export.quantized import _fp32_weights, is_lowbit_dir, lowbit_weights
from models.config import ModelConfig
from models.lora import apply_lora
from models.streaming import LazyTensors
from models.transformer import Transformer
from trainer.checkpoint import checkpoint_weights, read_state, resolve_checkpoint
from zeropp.config import ZeroConfig


@dataclasses.dataclass(frozen=True)
class Grid:
    """A block-quantization grid that weights were trained (qwZ) or exported on."""

    bits: int
    block_size: int
    vectors: bool  # the 1-D tensors are on it too (qwZ quantizes every parameter)


@dataclasses.dataclass
class Source:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # fp32, our parameter names (a tied head once), read when looked up
    tokenizer: Path | None  # the tokenizer the source names, if any
    grid: Grid | None  # where the weights came from a quantized forward (qwZ) or export
    kind: str  # "lowbit", "hf" or "checkpoint"
    # Weights a LoRA adapter is merged into (W + B @ A * alpha / r): off the grid, since the run's
    # forward computed base(x) on it and the adapter beside it in full precision.
    merged: tuple[str, ...] = ()

    @functools.cached_property
    def model(self) -> Transformer:
        """The fp32 Transformer with these weights (all of them in memory), built on first use."""
        model = Transformer(self.config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(self.weights[name])
        return model


def _hf_weights(path: Path) -> tuple[ModelConfig, LazyTensors]:
    """A Hugging Face dir's config and its weights by our names, each read (and converted to fp32)
    when looked up; names and shapes are checked against config.json when it is opened."""
    try:
        from models.hf import hf_model_on_meta
    except ImportError:  # no slice reader: the whole model, loaded
        from models.hf import load_hf_checkpoint

        model = load_hf_checkpoint(path)
        return model.config, _fp32_weights(model, model.config)
    model, source = hf_model_on_meta(path)
    specs = {name: torch.empty(p.shape, device="meta") for name, p in model.named_parameters()}
    return model.config, LazyTensors(specs, lambda name: source.read(name, 0, specs[name].numel())
                                     .view(specs[name].shape).to(torch.float32))


def load_source(path) -> Source:
    """A low-bit export dir, a Hugging Face dir (config.json) or one of our training checkpoints
    (a step dir, or a run's checkpoints/ dir for its latest; full or ZeRO-3 sharded)."""
    path = Path(path)
    if is_lowbit_dir(path):
        config, meta, weights = lowbit_weights(path)
        return Source(config, weights, path, Grid(meta["bits"], meta["block_size"], meta["vectors_on_grid"]), "lowbit")
    if (path / "config.json").is_file():
        has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
        config, weights = _hf_weights(path)
        return Source(config, weights, path if has_tokenizer else None, None, "hf")
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
    config, weights = checkpoint_weights(ckpt)
    merged = ()
    if state.get("lora"):
        with torch.device("meta"), torch.random.fork_rng(devices=[]):  # names only: no draw
            lora = state["lora"]
            merged = tuple(f"{name}.weight" for name in
                           apply_lora(Transformer(config), lora["targets"], lora["r"], lora["alpha"]))
    return Source(config, weights, Path(tokenizer) if tokenizer else None, grid, "checkpoint", merged)
