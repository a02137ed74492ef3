"""The runtime's configuration: the `zero_optimization` section, with DeepSpeed's key names.

The same dataclass is a section of every entry point's config (YAML / CLI, e.g.
``--zero_optimization.stage 3``) and what the engine is built from, so there is one place
where a knob is named, defaulted and checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch

from kernels import BITS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroConfigError(ValueError):
    """Keys of `zero_optimization` that contradict each other or the run; the message names them."""


@dataclass
class ZeroConfig:
    # 0: plain DDP (every rank holds everything); 3: parameters, gradients and optimizer
    # states partitioned, gathered unit by unit. Stages 1 and 2 are subsets of 3 we do not build.
    stage: int = 0
    # Issue gathers and reduce-scatters asynchronously and prefetch the next unit.
    overlap_comm: bool = True
    # Units with more elements than this are not prefetched (DeepSpeed's meaning: numel).
    stage3_prefetch_bucket_size: int = 50_000_000
    # Dtype of the weight all-gather and the gradient reduce-scatter; the master weights,
    # optimizer states and the gradient accumulation stay fp32.
    communication_data_type: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Dtype the forward/backward computes with (gathered weights); fp32 on CPU. On CUDA,
    # fp32 with bf16 autocast is the default; "bf16" keeps the gathered weights in bf16.
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    # Ranks per node; unset takes the launcher's (LOCAL_WORLD_SIZE, Slurm). Set it to emulate
    # nodes on one machine (4 ranks as 2 nodes x 2).
    ranks_per_node: int | None = None

    # ZeRO++ (docs/zeropp.md). qwZ: block-quantized weight all-gather.
    zero_quantized_weights: bool = False
    zero_quantized_weights_bits: int = 8
    # Frozen parameters (requires_grad=False, e.g. a LoRA base model) are kept only as qwZ codes
    # (zero_quantized_weights_bits, no fp32 copy) and gathered as such, never requantized.
    zero_quantized_nontrainable_weights: bool = False
    # hpZ: after a unit's forward, keep a secondary copy of its weights partitioned over a group
    # of this many ranks, so the backward gather stays inside that group. 1 disables (DeepSpeed's
    # default); 0 means one node (the launcher's ranks per node).
    zero_hpz_partition_size: int = 1
    # qgZ: gradients reduced by quantized all-to-all; 2 hops (inside the node, then across
    # nodes) on more than one node, 1 hop otherwise; `stages` > 1 pipelines the two hops.
    zero_quantized_gradients: bool = False
    zero_quantized_gradients_bits: int = 4
    zero_quantized_gradients_hops: int = 0  # 0: automatic (2 on several nodes), 1 or 2
    zero_quantized_gradients_stages: int = 1
    # Error feedback for qgZ: each rank adds its last step's local quantization error to the next
    # step's gradient (costs one fp32 copy of the model per rank; saved in checkpoints).
    zero_quantized_gradients_error_feedback: bool = False
    # Elements per quantization block (one scale each), for weights and gradients. Blocks never
    # straddle two parameters; a multiple of 32 keeps qwZ weights exportable to GGUF exactly.
    zero_quantization_block_size: int = 256

    @property
    def comm_dtype(self) -> torch.dtype:
        return DTYPES[self.communication_data_type]

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def hpz(self) -> bool:
        return self.zero_hpz_partition_size != 1

    def describe(self) -> str:
        """E.g. "ZeRO-3 + qwZ int8 + hpZ + qgZ int4 (bf16 communication)", or "DDP"."""
        if self.stage == 0:
            return "DDP"
        parts = ["ZeRO-3"]
        if self.zero_quantized_weights:
            parts.append(f"qwZ int{self.zero_quantized_weights_bits}")
        if self.hpz:
            parts.append("hpZ")
        if self.zero_quantized_gradients:
            parts.append(f"qgZ int{self.zero_quantized_gradients_bits}")
        if self.zero_quantized_nontrainable_weights:
            parts.append(f"frozen weights int{self.zero_quantized_weights_bits}")
        return " + ".join(parts) + f" ({self.communication_data_type} communication)"

    def param_align(self, frozen: bool = False) -> int:
        """Parameters start at a multiple of this: qwZ's blocks never straddle two of them."""
        quantized = self.zero_quantized_weights or (frozen and self.zero_quantized_nontrainable_weights)
        return self.zero_quantization_block_size if quantized else 1

    def shard_align(self, frozen: bool = False) -> int:
        """Shard lengths are a multiple of this: whole blocks per rank (and per qgZ stage)."""
        align = self.param_align(frozen)
        if self.zero_quantized_gradients and not frozen:
            align = math.lcm(align, self.zero_quantization_block_size * self.zero_quantized_gradients_stages)
        return align

    def validate(self) -> None:
        """Raise ZeroConfigError for values that are impossible or contradict each other."""
        if self.stage not in (0, 3):
            raise ZeroConfigError(
                f"zero_optimization.stage={self.stage} is not supported: use 0 (plain DDP) or 3 (ZeRO-3)")
        if self.stage3_prefetch_bucket_size < 0:
            raise ZeroConfigError(
                f"zero_optimization.stage3_prefetch_bucket_size must be >= 0, got {self.stage3_prefetch_bucket_size}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ZeroConfigError(f"zero_optimization.ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for key in ("zero_quantized_weights_bits", "zero_quantized_gradients_bits"):
            if getattr(self, key) not in BITS:
                raise ZeroConfigError(f"zero_optimization.{key}={getattr(self, key)}: supported bit widths are "
                                      f"{list(BITS)}")
        if self.zero_quantization_block_size < 8 or self.zero_quantization_block_size % 8:
            raise ZeroConfigError(f"zero_optimization.zero_quantization_block_size="
                                  f"{self.zero_quantization_block_size}: must be a positive multiple of 8")
        if self.zero_hpz_partition_size < 0:
            raise ZeroConfigError(f"zero_optimization.zero_hpz_partition_size={self.zero_hpz_partition_size}: "
                                  f"use 1 (off), 0 (one node) or a group size that divides the world size")
        if self.zero_quantized_gradients_hops not in (0, 1, 2):
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_hops="
                                  f"{self.zero_quantized_gradients_hops}: use 0 (automatic), 1 or 2")
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ZeroConfigError("zero_optimization.zero_quantized_gradients_error_feedback applies to qgZ; set "
                                  "zero_quantized_gradients: true or drop it")
        if self.zero_quantized_gradients_stages < 1:
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_stages="
                                  f"{self.zero_quantized_gradients_stages}: must be >= 1")
        if self.stage == 0:
            changed = [f.name for f in fields(self)
                       if f.name not in ("stage", "ranks_per_node") and getattr(self, f.name) != f.default]
            if changed:
                raise ZeroConfigError(
                    f"zero_optimization.{changed[0]} applies to the sharded runtime, but zero_optimization.stage "
                    f"is 0 (plain DDP); set stage: 3 or drop {', '.join(changed)}")
