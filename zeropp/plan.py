"""How a model splits into units, and the schedule's arithmetic that follows from their sizes.

Units: each transformer block is one; the embeddings with the LM head (and OPT's
project_in/out) form one; all norms form one (as in YaFSDP); frozen parameters of each form a
unit of their own (`partition_units`; `build_units` makes them, with their codecs). From their
element counts and the configuration: how many rotating buffers the blocks share, how often
each block is gathered in a step, the bytes a step sends, the cross-node bytes of a plain ZeRO-3
step (what the DDP runtime reports beside its own), and the model state a rank holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zeropp.config import DTYPES, ZeroConfig, ZeroConfigError
from zeropp.quantized import PlainCodec, QuantizedCodec
from zeropp.reducers import TAG as REDUCE_TAG
from zeropp.topology import Mesh
from zeropp.unit import Unit


class UnsupportedModelError(TypeError):
    """A model whose structure the runtime cannot split into units; the message says why."""


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")


FROZEN_SUFFIX = ".frozen"


def partition_units(model: nn.Module) -> dict[str, list]:
    """Group parameters into units: "embedding" (+ head), "norms", "blocks.<i>".

    Frozen parameters (requires_grad False) of a group form a unit of their own,
    "<group>.frozen": it is never reduced, never stepped, and may be stored quantized
    (`zero_quantized_nontrainable_weights`). Returns unit name -> [(qualified name, param,
    [(module, attr)], [alias names])] in model order.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UnsupportedModelError(
            f"zeropp shards models whose transformer blocks are a non-empty nn.ModuleList named `blocks` "
            f"(like models.transformer.Transformer); {type(model).__name__} has "
            f"{'no `blocks`' if blocks is None else type(blocks).__name__ + ' `blocks`'}"
        )
    block_of = {}
    for i, block in enumerate(blocks):
        for m in block.modules():
            block_of[m] = i
    first_name = {}
    aliases: dict[int, list] = {}
    for mod_name, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            qual = f"{mod_name}.{attr}" if mod_name else attr
            first_name.setdefault(id(p), (qual, p))
            aliases.setdefault(id(p), []).append((module, attr, qual))
    units: dict[str, list] = {}
    for pid, (qual, p) in first_name.items():
        owners = set()
        for module, _, _ in aliases[pid]:
            if _is_norm(module):
                owners.add("norms")
            elif module in block_of:
                owners.add(f"blocks.{block_of[module]}")
            else:
                owners.add("embedding")
        if len(owners) > 1:
            raise UnsupportedModelError(
                f"parameter {qual} is shared by modules in different units {sorted(owners)}; zeropp shards "
                f"a parameter within one unit only"
            )
        unit = owners.pop() + ("" if p.requires_grad else FROZEN_SUFFIX)
        units.setdefault(unit, []).append(
            (qual, p, [(m, a) for m, a, _ in aliases[pid]], [q for _, _, q in aliases[pid]]))
    return units


def build_units(model: nn.Module, cfg: ZeroConfig, mesh: Mesh, device: torch.device, weights) -> dict[str, Unit]:
    """One Unit per group of `partition_units`, with what its all-gather sends: the shard in the
    comm dtype, or qwZ's codes + scales. Frozen units under zero_quantized_nontrainable_weights
    are stored as codes: their wire shard is the only copy of the weights, gathered as it is,
    never requantized. With qwZ deltas trainable units gather their weights in the comm dtype
    from the node's references (every such unit keeps them, resident ones too); only the
    quantized change crosses nodes. With hpZ the blocks keep a secondary (the embeddings and
    norms are not re-gathered for the backward)."""
    wanted = cfg.zero_hpz_partition_size or mesh.ranks_per_node
    if cfg.hpz and wanted != mesh.secondary_size:
        raise ZeroConfigError(
            f"zero_optimization.zero_hpz_partition_size={cfg.zero_hpz_partition_size} asks for secondary groups "
            f"of {wanted} ranks, but the mesh was built with {mesh.secondary_size}; pass "
            f"secondary_size={wanted} to build_mesh (zeropp.topology.mesh_from_config does)")
    if cfg.zero_quantized_weights_delta and mesh.secondary_size != mesh.ranks_per_node:
        raise ZeroConfigError(
            f"zero_optimization.zero_quantized_weights_delta keeps each node's weights in hpZ's secondary "
            f"partition, which must be one node ({mesh.ranks_per_node} ranks), not "
            f"{mesh.secondary_size}: set zero_hpz_partition_size to 0")
    qwz = QuantizedCodec(cfg.zero_quantized_weights_bits, cfg.zero_quantization_block_size)
    plain = PlainCodec(cfg.comm_dtype)
    units = {}
    for name, params in partition_units(model).items():
        frozen = name.endswith(FROZEN_SUFFIX)
        stored_quantized = frozen and cfg.zero_quantized_nontrainable_weights
        deltas = cfg.zero_quantized_weights_delta and not frozen
        wire = qwz if cfg.zero_quantized_weights else plain
        codec = (qwz if stored_quantized else wire) if frozen else plain if deltas else wire
        units[name] = unit = Unit(name, params, mesh.world_size, mesh.rank, device, codec, stored_quantized,
                                  cfg.param_align(frozen), cfg.shard_align(frozen),
                                  delta_codec=wire if deltas else None, weights=weights,
                                  host=torch.device("cpu") if cfg.offload_optimizer == "cpu" else None)
        if deltas:
            unit.enable_secondary(mesh.ranks_per_node, mesh.node)
        elif cfg.hpz and mesh.secondary_size > 1 and name.startswith("blocks."):
            unit.enable_secondary(mesh.secondary_size)
    return units


def schedule_groups(units: dict[str, Unit], blocks: int) -> tuple[list[list[Unit]], list[Unit]]:
    """(block groups, resident units): each block's units (trainable, then frozen), gathered,
    computed and freed together in the rotating buffers; the embeddings' and norms' units,
    gathered once per weight update into buffers of their own."""
    groups = [[units[n] for n in (f"blocks.{i}", f"blocks.{i}{FROZEN_SUFFIX}") if n in units] for i in range(blocks)]
    resident = [units[n] for base in ("embedding", "norms") for n in (base, base + FROZEN_SUFFIX) if n in units]
    return groups, resident


def unit_numels(units: dict[str, list]) -> dict[str, int]:
    """Elements of each of `partition_units`' units."""
    return {name: sum(p.numel() for _, p, _, _ in params) for name, params in units.items()}


def zero3_cross_node_bytes(numels: dict[str, int], mesh: Mesh, node_aware: bool,
                           micro_batches: int = 1) -> dict[str, int]:
    """Cross-node bytes a rank sends in one training step of `micro_batches` forward/backward
    passes under plain ZeRO-3 (bf16 wire, no qwZ, hpZ or qgZ, the default prefetch depth) for
    units of these sizes and this node layout, by the rules of `Zero3Engine.predicted_step_bytes`."""
    world = mesh.world_size
    # per shard: once to each remote node (node-aware), else to each peer on another node
    remote = mesh.num_nodes - 1 if node_aware else world - mesh.ranks_per_node
    position = {b: i for i, b in enumerate(sorted({int(n.split(".")[1]) for n in numels if n.startswith("blocks.")}))}
    held = rotating_buffer_count([[numels[n] for n in numels if n.split(".")[:2] == ["blocks", str(b)]]
                                  for b in position], ZeroConfig(stage=3))  # blocks the buffers hold

    def passes(name: str) -> tuple[int, int]:
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        return unit_gathers(position.get(block), len(position), held, micro_batches, name.endswith(FROZEN_SUFFIX))

    def cross(name: str) -> int:
        return remote * -(-max(1, numels[name]) // world) * DTYPES["bf16"].itemsize

    return {"forward gather": sum(passes(n)[0] * cross(n) for n in numels),
            "backward gather": sum(passes(n)[1] * cross(n) for n in numels),
            "gradient reduce": micro_batches * sum(cross(n) for n in numels if not n.endswith(FROZEN_SUFFIX))}


def rotating_buffer_count(blocks: list[list[int]], cfg: ZeroConfig) -> int:
    """Rotating weight buffers for blocks whose units have these element counts (a list per block):
    the computing block's and the prefetched ones (none are prefetched without overlap_comm, or
    when no unit fits stage3_prefetch_bucket_size), or more to keep the last blocks of the forward
    gathered for the backward (stage3_max_reuse_distance: block p of n is used again after
    2 (n - 1 - p) blocks' parameters), within stage3_max_live_parameters. Never more than the blocks."""
    block = max((sum(units) for units in blocks), default=1)
    prefetched = cfg.overlap_comm and any(n <= cfg.stage3_prefetch_bucket_size for units in blocks for n in units)
    kept = min(cfg.stage3_max_reuse_distance // (2 * block) + 1, cfg.stage3_max_live_parameters // block)
    return max(1, min(len(blocks), max(cfg.prefetch_depth + 1 if prefetched else 1, kept)))


def block_gathers(i: int, blocks: int, held: int, micro_batches: int) -> tuple[int, int]:
    """(forward, backward) gathers of the i-th of `blocks` blocks in a step of `micro_batches`
    passes when the rotating buffers hold `held` blocks: the first `held` stay from one pass's
    backward to the next forward, the last `held` from each forward to its backward."""
    return 1 + (micro_batches - 1) * (i >= held), micro_batches * (i < blocks - held)


def unit_gathers(i: int | None, blocks: int, held: int, micro_batches: int, frozen: bool) -> tuple[int, int]:
    """(forward, backward) gathers of a unit in a training step that follows one: the i-th
    block's (`block_gathers`), or (i None) a resident unit's, gathered once per weight update
    and kept. A frozen unit's weights never change, so what stays gathered across the optimizer
    step is not gathered again: a resident frozen unit never, the first `held` blocks' frozen
    units not in the first forward (they stay from the last backward)."""
    if i is None:
        return int(not frozen), 0
    forward, backward = block_gathers(i, blocks, held, micro_batches)
    return forward - (frozen and i < held), backward


def predicted_step_bytes(units: dict, block_groups: list[list], held: int, comm, reducer,
                         micro_batches: int = 1) -> dict[str, dict[str, int]]:
    """What a rank of a Zero3Engine with these units (block groups, `held` of them in the rotating
    buffers) should send in one training step of `micro_batches` forward/backward passes, by
    ledger tag: {"sent", "cross_node_sent"} bytes, from the units' sizes and the configuration
    alone (the ledger of a step that follows a training step measures the same). The embeddings
    and norms are gathered once per step; the blocks per pass, with hpZ from the secondary but for
    the first forward after the weight update (a frozen unit's always: its weights never change);
    frozen units not again where they stay gathered (`unit_gathers`).
    A reducer whose volume depends on the round (SEPARATE) leaves "gradient reduce" out."""
    totals: dict[str, list[int]] = {}

    def add(tag, volume, times=1):
        sent, cross = totals.setdefault(tag, [0, 0])
        totals[tag] = [sent + times * volume[0], cross + times * volume[1]]

    position = {id(u): i for i, group in enumerate(block_groups) for u in group}
    for u in units.values():
        i = position.get(id(u))  # None: a resident unit
        forwards, backwards = unit_gathers(i, len(block_groups), held, micro_batches, not u.trainable)
        if u.delta_codec is not None:  # the change across nodes once per step, the references inside
            first = comm.volume(u.wire.numel() * u.wire.element_size(), "inter_node")
            add("forward gather", first)
            forward = backward = comm.volume(u.secondary.numel() * u.secondary.element_size(), "intra_node")
        else:
            forward = comm.volume(u.wire.numel() * u.wire.element_size(), "dp", node_aware=True)
            backward = forward if u.secondary is None else \
                comm.volume(u.secondary.numel() * u.secondary.element_size(), "secondary")
            if u.secondary is not None and forwards:  # hpZ: one forward from every rank after the update,
                if u.trainable:                       # the rest (and a frozen unit's) inside the group
                    add("forward gather", forward)
                    forwards -= 1
                forward = backward
        add("forward gather", forward, forwards)
        if i is not None:
            add("backward gather", backward, backwards)
        reduce = reducer.volume(u.padded_numel) if u.trainable else (0, 0)
        if reduce is not None:
            add(REDUCE_TAG, reduce, micro_batches)
    return {tag: {"sent": sent, "cross_node_sent": cross} for tag, (sent, cross) in totals.items()}


def model_state_bytes(units, reducer, optimizer=None, offloaded: bool = False) -> dict[str, int]:
    """Per-rank model-state memory by kind: each unit's master, comm copy, gradient shard, hpZ
    secondary (Unit.model_state_bytes), the reducer's error-feedback buffers, and the optimizer's
    states when given (on the host when `offloaded`)."""
    totals: dict[str, int] = {}
    for u in units:
        for k, v in u.model_state_bytes().items():
            totals[k] = totals.get(k, 0) + v
    for v in reducer.state_dict().values():  # qgZ's or SEPARATE's error feedback
        if v.dim() > 0:
            totals["gradient error feedback"] = totals.get("gradient error feedback", 0) + v.numel() * v.element_size()
    if optimizer is not None:
        totals["optimizer states" + (" (host)" if offloaded else "")] = sum(
            t.numel() * t.element_size() for state in optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return totals
