"""The runtime's configuration: the `zero_optimization` section, with DeepSpeed's key names.

The same dataclass is a section of every entry point's config (YAML / CLI, e.g.
``--zero_optimization.stage 3``) and what the engine is built from, so there is one place
where a knob is named, defaulted and checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from kernels import BITS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroConfigError(ValueError):
    """Keys of `zero_optimization` that contradict each other or the run; the message names them."""


@dataclass
class GradientCompression:
    """`zero_optimization.gradient_compression`: SEPARATE (seed 002, docs/separate.md) on the
    gradient reduce of ZeRO-3 / ZeRO++ (its projections reduce-scattered, or with
    zero_quantized_gradients sent through qgZ's quantized all-to-all) or of DDP (a comm hook);
    torch's PowerSGD hook under DDP as the low-rank baseline."""

    # none; separate (paper Algorithm 1); g-separate (Algorithm 3: per-unit ratio and beta adapted
    # from a measured cosine similarity); powersgd (DDP only: torch's PowerSGD hook).
    method: Literal["none", "separate", "g-separate", "powersgd"] = "none"
    # Compression ratio CR: each block of block_size elements travels as block_size / ratio
    # projections (the paper's default 16; it tried 8-128). A power of two for hadamard.
    ratio: int = 16
    # Moving-average error feedback e <- (1 - beta) e + beta (h - C(h)); 1 is plain error feedback,
    # 0 none. The paper's 0.95 (with reconstruction: contractive); measured best here: 0 (docs).
    beta: float = 0.0
    # The error is reset to zero every this many rounds (the paper's T = 128; 0 never resets).
    reset_interval: int = 128
    # Elements per projected block (blocks are cut inside each rank's shard, never across two).
    block_size: int = 1024
    # hadamard: random signs + a fast Walsh-Hadamard transform + a random subset of its rows (a
    # subsampled randomized Hadamard transform, O(b log b) per block, no Gaussian draws);
    # gaussian: the paper's N(0, I) directions, generated per block and round in chunks.
    projection: Literal["hadamard", "gaussian"] = "hadamard"
    # unbiased: the paper's reconstruction (E[P^T P] = I); contractive: that times 1/CR, a projection
    # that never lengthens the gradient, which error feedback needs (docs/separate.md: with the
    # unbiased one the error's expected square grows by (1 - beta)^2 + (CR - 1) beta^2 per round).
    reconstruction: Literal["unbiased", "contractive"] = "unbiased"
    # Adam's second moment averages each gradient element's square minus the variance the projection
    # added to it (estimated from its block's reconstructed norm), floored at the share of that variance
    # the first moment still carries, so the projection's noise does not shrink every step (docs/separate.md).
    # With the unbiased reconstruction under ZeRO (DDP's buckets are not the optimizer's parameters);
    # needs an optimizer with Adam's state (exp_avg_sq, betas): torch's Adam / AdamW. Off by default: it
    # restores Adam's step size, which helps where the lr is below uncompressed training's best and
    # costs where it is above; best lr against best lr it does not help (docs/separate.md).
    variance_correction: bool = False
    # Dtype of the per-rank error buffer (with beta > 0: one copy of the model per rank, not sharded).
    error_dtype: Literal["fp32", "bf16"] = "fp32"
    # The common seed of the random directions (every rank draws the same ones).
    seed: int = 0
    # Rounds of each unit (bucket) reduced exactly before compression starts: the steep first steps
    # (the lr warm-up) uncompressed, as torch's PowerSGD (start_powerSGD_iter) and DeepSpeed's 1-bit
    # Adam (freeze_step) do. 0: compressed from the first round. SEPARATE and G-SEPARATE.
    warmup_rounds: int = 0
    # G-SEPARATE: every adapt_interval rounds a unit also runs one exact reduce and measures the
    # cosine similarity of its reconstructed and exact mean gradient; above target_cosine its
    # ratio doubles (up to max_ratio) and beta grows, below it the ratio halves (down to
    # min_ratio) and beta shrinks; beta stays in [0.90, 0.99].
    adapt_interval: int = 200
    target_cosine: float = 0.3
    min_ratio: int = 4
    max_ratio: int = 128
    # PowerSGD's rank (method powersgd).
    powersgd_rank: int = 4

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def separate(self) -> bool:
        return self.method in ("separate", "g-separate")

    def describe(self) -> str:
        if self.method == "powersgd":
            return f"PowerSGD rank {self.powersgd_rank}"
        feedback = f"error feedback beta {self.beta}, reset {self.reset_interval}" if self.beta else "no error feedback"
        warmup = f", the first {self.warmup_rounds} rounds exact" if self.warmup_rounds else ""
        corrected = ", Adam's second moment without the projection's variance" if self.variance_correction else ""
        return (f"{'G-SEPARATE' if self.method == 'g-separate' else 'SEPARATE'} CR {self.ratio} "
                f"({self.projection}, {self.reconstruction}, {feedback}{warmup}{corrected})")

    def validate(self, stage: int) -> None:
        key = "zero_optimization.gradient_compression"
        if self.method == "none":
            return
        if self.variance_correction and (not self.separate or stage != 3 or self.reconstruction != "unbiased"):
            raise ZeroConfigError(f"{key}.variance_correction corrects Adam's second moment for SEPARATE's unbiased "
                                  f"reconstruction under ZeRO-3 (got method {self.method}, zero_optimization.stage "
                                  f"{stage}, reconstruction {self.reconstruction}): DDP's buckets are not the "
                                  f"optimizer's parameters, and the contractive reconstruction is no unbiased estimate")
        if self.method == "powersgd":
            if stage != 0:
                raise ZeroConfigError(f"{key}.method=powersgd is torch's DDP comm hook: it needs "
                                      f"zero_optimization.stage 0 (use separate or g-separate under ZeRO-3)")
            if self.powersgd_rank < 1:
                raise ZeroConfigError(f"{key}.powersgd_rank={self.powersgd_rank}: must be >= 1")
            return
        pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
        if self.ratio < 1:
            raise ZeroConfigError(f"{key}.ratio={self.ratio}: must be >= 1")
        if self.block_size < self.ratio:
            raise ZeroConfigError(f"{key}.block_size={self.block_size} is smaller than ratio={self.ratio}: "
                                  f"a block must keep at least one projection")
        if self.projection == "hadamard" and not (pow2(self.block_size) and pow2(self.ratio)):
            raise ZeroConfigError(f"{key}: projection hadamard needs a power-of-two block_size and ratio, got "
                                  f"block_size={self.block_size}, ratio={self.ratio}")
        if not 0.0 <= self.beta <= 1.0:
            raise ZeroConfigError(f"{key}.beta={self.beta}: must be in [0, 1] (0: no error feedback)")
        growth = (1 - self.beta) ** 2 + (self.ratio - 1) * self.beta ** 2
        if self.reconstruction == "unbiased" and self.beta > 0 and growth >= 1:
            raise ZeroConfigError(
                f"{key}: reconstruction=unbiased with beta={self.beta} at ratio={self.ratio} diverges (the error's "
                f"expected square grows {growth:.2f}x per round); use beta < {2 / self.ratio:.3g}, beta 0, or "
                f"reconstruction=contractive for the paper's beta 0.95")
        if self.reset_interval < 0:
            raise ZeroConfigError(f"{key}.reset_interval={self.reset_interval}: must be >= 0 (0: never reset)")
        if self.warmup_rounds < 0:
            raise ZeroConfigError(f"{key}.warmup_rounds={self.warmup_rounds}: must be >= 0 (0: compress from the "
                                  f"first round)")
        if self.method == "g-separate":
            if self.reconstruction != "contractive":
                raise ZeroConfigError(f"{key}.method=g-separate adapts beta in [0.90, 0.99], which needs "
                                      f"reconstruction=contractive (the unbiased one diverges with such beta)")
            if self.adapt_interval < 1:
                raise ZeroConfigError(f"{key}.adapt_interval={self.adapt_interval}: must be >= 1")
            if not 1 <= self.min_ratio <= self.ratio <= self.max_ratio <= self.block_size:
                raise ZeroConfigError(f"{key}: g-separate needs 1 <= min_ratio <= ratio <= max_ratio <= block_size, "
                                      f"got {self.min_ratio}, {self.ratio}, {self.max_ratio}, {self.block_size}")
            if self.projection == "hadamard" and not (pow2(self.min_ratio) and pow2(self.max_ratio)):
                raise ZeroConfigError(f"{key}: projection hadamard needs power-of-two min_ratio and max_ratio")
            if not 0.0 < self.target_cosine < 1.0:
                raise ZeroConfigError(f"{key}.target_cosine={self.target_cosine}: must be in (0, 1)")


@dataclass
class ZeroConfig:
    # 0: plain DDP (every rank holds everything); 3: parameters, gradients and optimizer
    # states partitioned, gathered unit by unit. Stages 1 and 2 are subsets of 3 we do not build.
    stage: int = 0
    # Issue gathers and reduce-scatters asynchronously and prefetch the next unit.
    overlap_comm: bool = True
    # Blocks gathered ahead of the one computing (with overlap_comm): more than 1 keeps a slow
    # link busy through a block whose compute is shorter than its gather; each costs one more
    # block's gathered weights of memory.
    prefetch_depth: int = 1
    # Issue the next forward's first gathers (embeddings, norms, first blocks) from the optimizer
    # step itself (with the runtime's attach_optimizer), not when the next forward starts.
    prefetch_across_steps: bool = True
    # Units with more elements than this are not prefetched (DeepSpeed's meaning: numel).
    stage3_prefetch_bucket_size: int = 50_000_000
    # Keep-gathered, DeepSpeed's meaning: a block is not released after its forward when it is
    # used again (by its backward) within this many gathered parameters (elements). The last
    # k blocks of the forward stay gathered for the backward, k = distance // (2 x block) + 1,
    # and are not gathered again there. 0 keeps only the prefetch buffers' last blocks (DeepSpeed
    # defaults to 1e9, which keeps a small model whole: ZeRO-3's memory saving on the weights lost).
    stage3_max_reuse_distance: int = 0
    # At most this many gathered block parameters (elements) live at once: caps the blocks kept
    # for the reuse distance (never below prefetch_depth + 1 blocks).
    stage3_max_live_parameters: int = 1_000_000_000
    # Dtype of the weight all-gather and the gradient reduce-scatter; the master weights,
    # optimizer states and the gradient accumulation stay fp32.
    communication_data_type: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Dtype the forward/backward computes with (gathered weights); fp32 on CPU. On CUDA,
    # fp32 with bf16 autocast is the default; "bf16" keeps the gathered weights in bf16.
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    # Ranks per node; unset takes the launcher's (LOCAL_WORLD_SIZE, Slurm). Set it to emulate
    # nodes on one machine (4 ranks as 2 nodes x 2).
    ranks_per_node: int | None = None
    # On gloo with several nodes of several ranks, the weight all-gather and the exact gradient
    # reduce-scatter go across nodes among same-local-rank peers and inside the node separately,
    # so each shard crosses the node boundary once per remote node (docs/zero3.md). NCCL
    # keeps its own algorithms.
    node_aware_collectives: bool = True

    # ZeRO++ (docs/zeropp.md). qwZ: block-quantized weight all-gather.
    zero_quantized_weights: bool = False
    zero_quantized_weights_bits: int = 8
    # qwZ deltas (ours, beyond the paper; docs/zeropp.md): the forward's cross-node gather sends
    # the block-quantized change of each shard since its last gather (closed loop: what a
    # quantization lost goes out with the next change) and every node keeps the weights in the
    # communication dtype, split over its ranks as hpZ's secondary partition. The forward then
    # computes with weights as exact as ZeRO-3's bf16 gather at zero_quantized_weights_bits
    # (4 recommended) on the slow link. Needs hpZ over one node; trainable units only.
    zero_quantized_weights_delta: bool = False
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
    # Error feedback for qgZ: each rank adds what its quantizations lost to the next step's input
    # of each hop (costs one fp32 copy of the model per rank; saved in checkpoints). LoCo's moving
    # average: error_beta is the previous error's weight (DeepSpeed's err_beta; 0: plain error
    # feedback), error_reset drops the error every that many reductions of a unit (0: never).
    zero_quantized_gradients_error_feedback: bool = False
    zero_quantized_gradients_error_beta: float = 0.0
    zero_quantized_gradients_error_reset: int = 0
    # Elements per quantization block (one scale each), for weights and gradients. Blocks never
    # straddle two parameters; a multiple of 32 keeps qwZ weights exportable to GGUF exactly.
    zero_quantization_block_size: int = 256
    # ZeRO-Offload (DeepSpeed's offload_optimizer.device): "cpu" keeps this rank's fp32 master
    # shard, its gradient shard and so the optimizer's states in host memory and steps there; each
    # unit's reduced gradient is copied out when its reduce lands, its weights copied back when it
    # is next gathered. Saves 16 bytes per element of the shard on the GPU (docs/memory.md).
    offload_optimizer: Literal["none", "cpu"] = "none"
    # Gradient compression on the reduce path (SEPARATE; PowerSGD under DDP): docs/separate.md.
    gradient_compression: GradientCompression = field(default_factory=GradientCompression)

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
            return "DDP" + (f" + {self.gradient_compression.describe()}" if self.gradient_compression.enabled else "")
        parts = ["ZeRO-3"]
        if self.zero_quantized_weights:
            deltas = " deltas" if self.zero_quantized_weights_delta else ""
            parts.append(f"qwZ int{self.zero_quantized_weights_bits}{deltas}")
        if self.hpz:
            parts.append("hpZ")
        if self.zero_quantized_gradients:
            parts.append(f"qgZ int{self.zero_quantized_gradients_bits}")
        if self.gradient_compression.enabled:
            parts.append(self.gradient_compression.describe())
        if self.zero_quantized_nontrainable_weights:
            parts.append(f"frozen weights int{self.zero_quantized_weights_bits}")
        if self.offload_optimizer != "none":
            parts.append(f"optimizer offloaded to {self.offload_optimizer}")
        return " + ".join(parts) + f" ({self.communication_data_type} communication)"

    def param_align(self, frozen: bool = False) -> int:
        """Parameters start at a multiple of this: qwZ's blocks never straddle two of them."""
        quantized = self.zero_quantized_weights or (frozen and self.zero_quantized_nontrainable_weights)
        return self.zero_quantization_block_size if quantized else 1

    def shard_align(self, frozen: bool = False) -> int:
        """Shard lengths are a multiple of this: whole blocks per rank (and per qgZ stage)."""
        align = self.param_align(frozen)
        if self.zero_quantized_gradients and not frozen and not self.gradient_compression.separate:
            align = math.lcm(align, self.zero_quantization_block_size * self.zero_quantized_gradients_stages)
        return align

    def validate(self) -> None:
        """Raise ZeroConfigError for values that are impossible or contradict each other."""
        if self.stage not in (0, 3):
            raise ZeroConfigError(
                f"zero_optimization.stage={self.stage} is not supported: use 0 (plain DDP) or 3 (ZeRO-3)")
        if self.prefetch_depth < 1:
            raise ZeroConfigError(f"zero_optimization.prefetch_depth must be >= 1, got {self.prefetch_depth} "
                                  f"(overlap_comm: false turns prefetching off)")
        for key in ("stage3_prefetch_bucket_size", "stage3_max_reuse_distance", "stage3_max_live_parameters"):
            if getattr(self, key) < 0:
                raise ZeroConfigError(f"zero_optimization.{key} must be >= 0, got {getattr(self, key)}")
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
        if self.zero_quantized_weights_delta and not (self.zero_quantized_weights and self.hpz):
            raise ZeroConfigError("zero_optimization.zero_quantized_weights_delta needs zero_quantized_weights: true "
                                  "and hpZ over one node (zero_hpz_partition_size: 0): each node keeps the weights "
                                  "the deltas update in its secondary partition")
        if self.zero_quantized_gradients_hops not in (0, 1, 2):
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_hops="
                                  f"{self.zero_quantized_gradients_hops}: use 0 (automatic), 1 or 2")
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ZeroConfigError("zero_optimization.zero_quantized_gradients_error_feedback applies to qgZ; set "
                                  "zero_quantized_gradients: true or drop it")
        if not 0.0 <= self.zero_quantized_gradients_error_beta < 1.0:
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_error_beta="
                                  f"{self.zero_quantized_gradients_error_beta}: must be in [0, 1) (the previous "
                                  f"error's weight; 0: plain error feedback)")
        if self.zero_quantized_gradients_error_reset < 0:
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_error_reset="
                                  f"{self.zero_quantized_gradients_error_reset}: must be >= 0 (0: never reset)")
        if (self.zero_quantized_gradients_error_beta or self.zero_quantized_gradients_error_reset) and \
                not self.zero_quantized_gradients_error_feedback:
            raise ZeroConfigError("zero_optimization.zero_quantized_gradients_error_beta / _error_reset shape qgZ's "
                                  "error feedback; set zero_quantized_gradients_error_feedback: true or drop them")
        if self.zero_quantized_gradients_stages < 1:
            raise ZeroConfigError(f"zero_optimization.zero_quantized_gradients_stages="
                                  f"{self.zero_quantized_gradients_stages}: must be >= 1")
        self.gradient_compression.validate(self.stage)
        if self.gradient_compression.separate and self.zero_quantized_gradients_error_feedback:
            raise ZeroConfigError("zero_optimization.zero_quantized_gradients_error_feedback: with "
                                  "gradient_compression, qgZ carries the projections and SEPARATE's own error "
                                  "feedback applies; drop zero_quantized_gradients_error_feedback")
        if self.offload_optimizer not in ("none", "cpu"):
            raise ZeroConfigError(f"zero_optimization.offload_optimizer={self.offload_optimizer!r}: use none or cpu")
        if self.stage == 0:
            changed = [f.name for f in fields(self)
                       if f.name not in ("stage", "ranks_per_node", "gradient_compression") and getattr(self, f.name) != f.default]
            if changed:
                raise ZeroConfigError(
                    f"zero_optimization.{changed[0]} applies to the sharded runtime, but zero_optimization.stage "
                    f"is 0 (plain DDP); set stage: 3 or drop {', '.join(changed)}")


@dataclass
class TensorParallelConfig:
    """The `tensor_parallel` section: Megatron-style tensor parallelism (zeropp.tensor_parallel)
    inside each data-parallel replica, and AccTFM's (seed 004) three optimizations of its
    all-reduces. The data-parallel runtime (zero_optimization) then runs across the
    tensor-parallel groups. docs/tensor_parallel.md."""

    # Ranks per tensor-parallel group (consecutive ranks: inside a node). 1: no tensor parallelism.
    size: int = 1
    # AccTFM fine-grained pipelining: each attention / MLP sublayer splits its batch into this
    # many partitions, so a partition's all-reduce overlaps the next one's compute (forward and
    # backward). 1, 2 or 4 for every sublayer, or 0: chosen per sublayer by the paper's dynamic
    # program from the measured link (alpha, beta) and the profiled compute of each partition.
    partitions: int = 1
    # AccTFM token-level top-k: the fraction of each sequence's tokens whose sublayer outputs are
    # all-reduced in full (at quantize_bits), picked by the attention they receive; the others
    # are "pruned" and get what topk_pruned says. 1.0: every token (off).
    topk_keep_ratio: float = 1.0
    # What the pruned tokens receive from the sublayer (the paper does not say; docs/tensor_parallel.md):
    #   reduce  their rows are all-reduced too, in the same message, at topk_pruned_bits a value:
    #           every rank gets the same, coarser, sum;
    #   drop    nothing: their partial sums are dropped on every rank alike (the token skips the
    #           sublayer's update, keeps its residual stream and the sublayer's bias);
    #   local   each rank's own partial sum times the group size, with no traffic: the ranks'
    #           activations then differ and their replicated weights drift apart (measured, not advised).
    topk_pruned: Literal["reduce", "drop", "local"] = "reduce"
    # Bits a value of the pruned rows under topk_pruned reduce: 2..8 piecewise quantization as
    # quantize_bits, one scale per row; 1 is the sign with one scale per row (the row's mean |x|).
    # 3 by default: measured, 1 and 2 bits cost more validation loss than dropping the rows.
    topk_pruned_bits: int = 3
    # Which all-reduces top-k sparsifies: both (the paper: the backward's input-gradient all-reduce
    # reuses the forward's mask), forward (the backward sends every row at quantize_bits), backward.
    topk_passes: Literal["both", "forward", "backward"] = "both"
    # AccTFM piecewise quantization of what is all-reduced: bits per value (sign + N bits in N
    # clusters of doubling width; 4 is the paper's default). 0: off (the compute dtype travels).
    quantize_bits: int = 0

    @property
    def compressed(self) -> bool:
        return self.topk_keep_ratio < 1.0 or self.quantize_bits > 0

    def describe(self) -> str:
        if self.size == 1:
            return "no tensor parallelism"
        parts = [f"tensor parallel {self.size}"]
        if self.partitions != 1:
            parts.append("pipelined " + ("(planned per sublayer)" if self.partitions == 0 else f"x{self.partitions}"))
        if self.topk_keep_ratio < 1.0:
            pruned = {"reduce": f"pruned rows {self.topk_pruned_bits}-bit", "drop": "pruned rows dropped",
                      "local": "pruned rows local x size"}[self.topk_pruned]
            passes = "" if self.topk_passes == "both" else f", {self.topk_passes} only"
            parts.append(f"top-k tokens {self.topk_keep_ratio:g} ({pruned}{passes})")
        if self.quantize_bits:
            parts.append(f"piecewise int{self.quantize_bits}")
        return " + ".join(parts)

    def validate(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ZeroConfigError(f"tensor_parallel.size={self.size!r}: must be an int >= 1")
        if self.partitions not in (0, 1, 2, 4):
            raise ZeroConfigError(f"tensor_parallel.partitions={self.partitions!r}: use 1, 2, 4, or 0 (planned)")
        if not 0.0 < self.topk_keep_ratio <= 1.0:
            raise ZeroConfigError(f"tensor_parallel.topk_keep_ratio={self.topk_keep_ratio!r}: must be in (0, 1]")
        if self.quantize_bits not in (0, 2, 3, 4, 5, 6, 7, 8):
            raise ZeroConfigError(f"tensor_parallel.quantize_bits={self.quantize_bits!r}: use 0 (off) or 2..8 "
                                  f"(sign + 1..7 bits)")
        if self.topk_pruned not in ("reduce", "drop", "local"):
            raise ZeroConfigError(f"tensor_parallel.topk_pruned={self.topk_pruned!r}: use reduce, drop or local")
        if self.topk_pruned_bits not in range(1, 9):
            raise ZeroConfigError(f"tensor_parallel.topk_pruned_bits={self.topk_pruned_bits!r}: use 1 (sign and a "
                                  f"mean magnitude per row) or 2..8 (piecewise)")
        if self.topk_passes not in ("both", "forward", "backward"):
            raise ZeroConfigError(f"tensor_parallel.topk_passes={self.topk_passes!r}: use both, forward or backward")


COMPRESSIONS = {"none": None, "int8": 8, "int4": 4}  # diloco.compression -> bits


@dataclass
class DilocoConfig:
    """The `diloco` section: DiLoCo's outer loop (zeropp.diloco, docs/diloco.md). The world is cut
    into sites of `site_size` consecutive ranks; the runtime (zero_optimization) runs inside each
    site, and every `inner_steps` steps the sites average their pseudo-gradients (weights at the
    last sync - current weights) and take one outer Nesterov SGD step."""

    enabled: bool = False  # DiLoCo across sites (off: one runtime over the whole world)
    # H, the inner steps between outer syncs. The paper's 500 is for 150M-400M models over 88k
    # steps; at our scale (runs of hundreds to a few thousand steps) 50 keeps >= 10 outer steps
    # per run while cutting the cross-site traffic 50x (docs/diloco.md).
    inner_steps: int = 50
    # Ranks per site (consecutive ranks, whole nodes or part of one); sites = world / site_size.
    # 0: one site per node (the launcher's ranks per node: LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE).
    site_size: int = 0
    outer_lr: float = 0.7  # the outer SGD's learning rate (DiLoCo's 0.7)
    # Its Nesterov momentum. DiLoCo's 0.9 suits its hundreds of outer steps; in our runs of tens
    # of them it overshoots: 500 steps, 2 sites, H 25, int4 (docs/diloco.md): 0.9 ended +6.1% over
    # ZeRO-3's validation loss, 0.5 +2.7%, none (plain averaging, lr 1) +3.6%. 0: none.
    outer_momentum: float = 0.5
    nesterov: bool = True  # Nesterov momentum (DiLoCo's)
    # The pseudo-gradient on the wire between sites: none (fp32), int8 or int4 blockwise
    # quantization (kernels) with error feedback (the residual stays on its rank for the next sync).
    compression: Literal["none", "int8", "int4"] = "none"
    compression_block_size: int = 256  # elements per quantization block (one fp32 scale each)
    # Streaming DiLoCo (arXiv 2501.18512): the outer state cut into F fragments, fragment f synced
    # at the steps where (step - f * H // F) % H == 0, so a sync sends 1/F of the model and the
    # peak cross-site bandwidth drops F x (the bytes per cycle are the same). 1: DiLoCo's one sync.
    fragments: int = 1
    # Streaming DiLoCo's mixing factor alpha: after a sync the weights are alpha * local + (1 - alpha)
    # * the outer result (the anchor stays the outer result). 0: replaced by it, as DiLoCo.
    mixing: float = 0.0
    # Streaming DiLoCo's overlap tau: a fragment's exchange is sent after its sync step and applied
    # `delay` inner steps later, the wire hidden behind them (the paper's tau; with tau > 0 it mixes
    # the outer result into weights that moved on, so pair it with mixing, the paper's 0.5).
    # 0: applied at once (a blocking exchange).
    delay: int = 0

    @property
    def bits(self) -> int | None:
        return COMPRESSIONS[self.compression]

    def describe(self) -> str:
        momentum = f", {'Nesterov ' if self.nesterov else ''}momentum {self.outer_momentum:g}" \
            if self.outer_momentum else ""
        wire = "fp32" if self.bits is None else \
            f"int{self.bits} blocks of {self.compression_block_size} with error feedback"
        streaming = (f", {self.fragments} fragments staggered over H" if self.fragments > 1 else "") + \
            (f", mixing {self.mixing:g} of the local weights" if self.mixing else "") + \
            (f", each exchange overlapped with the next {self.delay} inner step{'s' * (self.delay > 1)}"
             if self.delay else "")
        return (f"H {self.inner_steps}{streaming}, outer SGD lr {self.outer_lr:g}{momentum}, "
                f"pseudo-gradient as {wire}")

    def validate(self) -> None:
        """Raise ZeroConfigError naming the key, its value and what is expected."""
        checks = [
            ("inner_steps", self.inner_steps, "an integer >= 1", isinstance(self.inner_steps, int)
             and self.inner_steps >= 1),
            ("site_size", self.site_size, "an integer >= 0 (0: the launcher's ranks per node)",
             isinstance(self.site_size, int) and self.site_size >= 0),
            ("outer_lr", self.outer_lr, "a finite number > 0", math.isfinite(self.outer_lr) and self.outer_lr > 0),
            ("outer_momentum", self.outer_momentum, "a number in [0, 1)", 0 <= self.outer_momentum < 1),
            ("compression", self.compression, f"one of {', '.join(COMPRESSIONS)}", self.compression in COMPRESSIONS),
            ("compression_block_size", self.compression_block_size, "an integer >= 8 and a multiple of 8",
             isinstance(self.compression_block_size, int) and self.compression_block_size >= 8
             and self.compression_block_size % 8 == 0),
            ("fragments", self.fragments, f"an integer in [1, inner_steps = {self.inner_steps}] (one sync per step "
             f"at most)", isinstance(self.fragments, int) and 1 <= self.fragments <= self.inner_steps),
            ("mixing", self.mixing, "a number in [0, 1) (0: the outer result replaces the weights)",
             0 <= self.mixing < 1),
            ("delay", self.delay, f"an integer in [0, inner_steps = {self.inner_steps}) (an exchange lands before "
             f"its fragment's next sync)", isinstance(self.delay, int) and 0 <= self.delay < self.inner_steps),
        ]
        for key, value, expected, ok in checks:
            if not ok:
                raise ZeroConfigError(f"diloco.{key}: value {value!r} is out of range; expected {expected}")


@dataclass
class PlanConfig:
    """The `plan` section: `auto` lets the machine choose zero_optimization's stage and ZeRO++
    settings (zeropp.autoplan, docs/autoplan.md): probed links, compute and memory price every
    candidate; the fastest that meets the constraints below replaces the section's planned keys."""

    auto: bool = False  # probe and plan at start-up (a resume on the same machine reuses the stored plan)
    # Fidelity floor: no candidate whose forward computes with weights of fewer bits (qwZ int4: 4;
    # qwZ deltas count as 8: closer to the masters than int8 qwZ, docs/zeropp.md). 0: no floor.
    min_weight_bits: int = 8
    # Predicted peak memory per rank allowed, in GiB; 0: the memory the probe found available.
    memory_cap_gb: float = 0.0
    # After this many steps (the first not counted) the measured mean step time is compared with the
    # plan's prediction; a miss beyond 25% is logged as a warning. 0: no check.
    check_after_steps: int = 5

    def validate(self) -> None:
        """Raise ZeroConfigError naming the key, its value and what is expected."""
        checks = [
            ("min_weight_bits", self.min_weight_bits, "an integer in [0, 32]",
             isinstance(self.min_weight_bits, int) and 0 <= self.min_weight_bits <= 32),
            ("memory_cap_gb", self.memory_cap_gb, "a finite number >= 0 (0: the probed memory)",
             math.isfinite(self.memory_cap_gb) and self.memory_cap_gb >= 0),
            ("check_after_steps", self.check_after_steps, "an integer >= 0 (0: no check)",
             isinstance(self.check_after_steps, int) and self.check_after_steps >= 0),
        ]
        for key, value, expected, ok in checks:
            if not ok:
                raise ZeroConfigError(f"plan.{key}: value {value!r} is out of range; expected {expected}")
