"""How tensor parallelism slices our models (Megatron-LM's layout): which module of a
models.transformer.Transformer becomes which parallel layer, for one rank of the group. The
counterpart of torchtitan's per-model parallelize.py; nothing here communicates (the layers do:
zeropp.tensor_parallel.layers, over zeropp.tensor_parallel.collectives).

Every family (GPT-2, OPT, LLaMA 3, Qwen2/3, Mistral) is the one Transformer class; the plan
differs only where the modules do:
  attention   q/k/v column-parallel by whole heads (k/v by whole key/value heads: GQA splits by
              kv head), o_proj row-parallel over the same heads; Qwen3's q/k norms are per head
              and stay whole;
  MLP         gate (SwiGLU families: LLaMA, Qwen, Mistral) and up column-parallel, down
              row-parallel, by d_ff (uneven sizes: the first ranks get one more);
  vocabulary  the token embedding and an LM head (tied to the embedding where the model ties,
              GPT-2) by vocabulary rows; a score head (num_labels) stays whole.
Replicated, everything else: norms, the biases of the row-parallel layers, positions, OPT's
project_in / project_out, a score head. Their inputs and output gradients are identical on every
rank of the group, so are their gradients: they stay equal without any communication.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from models.transformer import MLP, Attention, Transformer
from zeropp.tensor_parallel.collectives import TPComm
from zeropp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    parallel_sublayer,
)
from zeropp.topology import TopologyError

# module path -> (the parallel layer that replaces it, built from (module, start, end); the dim it
# splits: "heads", "kv_heads", "d_ff" or "vocab", see split_dims)
Plan = dict[str, tuple[Callable[..., nn.Module], str]]


def block_plan(activation: str) -> Plan:
    """The sliced modules of a block (attention by heads, MLP by d_ff), by path inside the block."""
    return {
        "attn.q_proj": (ColumnParallelLinear, "heads"),
        "attn.k_proj": (ColumnParallelLinear, "kv_heads"),
        "attn.v_proj": (ColumnParallelLinear, "kv_heads"),
        "attn.o_proj": (RowParallelLinear, "heads"),
        **({"mlp.gate_proj": (ColumnParallelLinear, "d_ff")} if activation == "swiglu" else {}),
        "mlp.up_proj": (ColumnParallelLinear, "d_ff"),
        "mlp.down_proj": (RowParallelLinear, "d_ff"),
    }


def vocabulary_plan(model: Transformer, tp: TPComm) -> Plan:
    """The token embedding and an LM head, by vocabulary rows (a score head stays whole)."""
    plan = {"embed.tokens": (partial(VocabParallelEmbedding, tp=tp), "vocab")}
    if model.config.num_labels == 0:
        plan["head"] = (partial(VocabParallelHead, tp=tp), "vocab")
    return plan


def split_bounds(n: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """This rank's [start, end) of n items in whole `unit`s, as torch.tensor_split cuts them
    (the first n/unit % size ranks get one unit more): uneven sizes pad nothing and need no assert."""
    units = n // unit
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


def split_dims(model: Transformer, size: int, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's [start, end) of each dim the plans split."""
    cfg, hd = model.config, model.config.head_dim
    return {"heads": split_bounds(cfg.n_head * hd, size, rank, hd),
            "kv_heads": split_bounds(cfg.n_kv_head * hd, size, rank, hd),
            "d_ff": split_bounds(cfg.d_ff, size, rank),
            "vocab": split_bounds(cfg.vocab_size, size, rank)}


def parallelize(model: Transformer, tp: TPComm) -> dict[str, tuple[int, int, int]]:
    """Slice `model` in place for this rank of `tp`'s group (parameter names stay the same); returns,
    per sliced parameter name, (dim, start, end) of the full tensor this rank holds (what
    consolidation concatenates)."""
    check_sliceable(model, tp.size)
    cfg, dims = model.config, split_dims(model, tp.size, tp.rank)
    sliced: dict[str, tuple[int, int, int]] = {}
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            raise TypeError(f"blocks.{i}: tensor parallelism expects models.transformer Attention and MLP")
        apply_plan(block, f"blocks.{i}", block_plan(mlp.activation), dims, sliced)
        attn.n_head, attn.n_kv_head = cfg.n_head // tp.size, cfg.n_kv_head // tp.size
        # Megatron's f and g around each sublayer; the MLP uses its block's attention's top-k mask.
        parallel_sublayer(attn, tp, attn.o_proj, mask_source=attn)
        parallel_sublayer(mlp, tp, mlp.down_proj, mask_source=attn)
    plan = vocabulary_plan(model, tp)
    apply_plan(model, "", plan, dims, sliced)
    if "head" in plan and cfg.tied_head:
        model.head.weight = model.embed.tokens.weight
    model.vocab_start = dims["vocab"][0]
    return sliced


def apply_plan(root: nn.Module, prefix: str, plan: Plan, dims: dict[str, tuple[int, int]],
               sliced: dict[str, tuple[int, int, int]]) -> None:
    """Replace each module the plan names under `root` by its parallel layer and record, in
    `sliced`, the slice each of the layer's sliced parameters holds (layer.SLICED)."""
    for path, (layer, dim) in plan.items():
        owner_path, _, attr = path.rpartition(".")
        owner = root.get_submodule(owner_path)
        start, end = dims[dim]
        new = layer(getattr(owner, attr), start, end)
        setattr(owner, attr, new)
        name = f"{prefix}.{path}" if prefix else path
        for param, param_dim in new.SLICED.items():
            if getattr(new, param) is not None:
                sliced[f"{name}.{param}"] = (param_dim, start, end)


def check_sliceable(model: Transformer, size: int) -> None:
    """A Transformer whose (key/value) heads `size` divides, without LoRA adapters."""
    if not isinstance(model, Transformer):
        raise TypeError(f"tensor parallelism slices a models.transformer.Transformer, not {type(model).__name__}")
    for name, count in (("n_head", model.config.n_head), ("n_kv_head", model.config.n_kv_head)):
        if count % size:
            raise TopologyError(f"tensor_parallel.size={size} must divide the model's {name}={count}: attention is "
                                f"split by whole (key/value) heads")
    if model.config.qk_norm and not model.config.qk_norm_per_head:
        raise TopologyError("tensor parallelism splits attention by heads, and this model's q/k RMSNorm (OLMo 2's) "
                            "normalizes over all heads together: use tensor_parallel.size 1")
    for mod_name, module in model.named_modules():
        if type(module).__name__.startswith("LoRA"):
            raise TopologyError(f"tensor parallelism does not slice LoRA adapters ({mod_name}); use size 1 with LoRA")
