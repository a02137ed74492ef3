"""ZeRO-3 / ZeRO++, applied to an unmodified model from outside: the scheduler over its units.

Units (zeropp.unit): each transformer block is one; the embeddings with the LM head (and
OPT's project_in/out) form one; all norms form one (as in YaFSDP); frozen parameters of each
form a unit of their own. The engine decides when each unit moves through its data flow:

Forward: a unit's wire is re-encoded just before its gather when its master changed (the
optimizer stepped, a checkpoint loaded). The model's pre-hook gathers the two resident units
(embeddings, norms) into buffers of their own, once per weight update, and issues the first
blocks' gathers behind theirs before it waits for anything. A block's pre-hook gathers it into
one of `prefetch_depth` + 1 preallocated, rotating buffers (more when
`stage3_max_reuse_distance` keeps the forward's last blocks gathered for the backward) and binds
its parameters as views of it; the next blocks' gathers (`prefetch_depth` of them) are issued first (prefetch in the
order recorded on the first forward), so communication overlaps compute.

Backward: an identity autograd function on each block's output (`_PreBackward`) fires
before the block's backward: it re-gathers the block (from the hpZ secondary when valid)
into the same buffer and prefetches the next ones. The parameters' gradients land in one
flat buffer per unit; the unit's gate fires when all are in, and the engine hands the flat
gradient to the reducer (zeropp.reducers), asynchronously. When the backward ends, a final
callback waits for every reduce, so each parameter's .grad (a view of the unit's fp32
gradient shard) holds the sum over ranks divided by the gradient divide factor.

Step: the caller's optimizer steps the registered shard pieces (`model.parameters()`);
the next forward re-encodes what changed.

Rollouts (`inference_weights`): every unit is gathered once (from the primary shards, the
wire as the training forward sends it; ledger tag "rollout gather") and decoded into buffers
of its own, so the no-grad forwards of generation run without any collective; blocks that do
not fit `max_bytes` go through the rotating training buffers as in training instead (gathered
where a buffer no longer holds them). On exit the copies go.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from zeropp.checkpoint import SHARDED, load_shards, load_unsharded, save_shards
from zeropp.comm import Comm
from zeropp.config import DTYPES, ZeroConfig, ZeroConfigError
from zeropp.quantized import PlainCodec, QuantizedCodec
from zeropp.reducers import TAG as REDUCE_TAG, ExactReduceScatter, ProjectedReduce, QuantizedReduce
from zeropp.runtime import InferenceWeights, Runtime, Timings, clip_by_norm_, squared_norm
from zeropp.separate import Separate
from zeropp.topology import Mesh, build_mesh
from zeropp.unit import Phase, Unit


class UnsupportedModelError(TypeError):
    """A model whose structure the runtime cannot split into units; the message says why."""


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs just before the units' own backward."""

    @staticmethod
    def forward(ctx, engine, units, *tensors):
        ctx.engine, ctx.units = engine, units
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._pre_backward(ctx.units)
        return (None, None, *grads)


def _wrap_outputs(output, engine, units):
    """Pass every grad-requiring tensor of a module's output through _PreBackward."""
    if isinstance(output, torch.Tensor):
        return _PreBackward.apply(engine, units, output)[0] if output.requires_grad else output
    if isinstance(output, tuple):
        idx = [i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return output
        wrapped = _PreBackward.apply(engine, units, *(output[i] for i in idx))
        out = list(output)
        for i, t in zip(idx, wrapped):
            out[i] = t
        return tuple(out)
    return output


# ---------------------------------------------------------------------------- unit discovery

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
        if not name.startswith("blocks."):  # resident: gathered once per step and kept
            return 1, 0
        return block_gathers(position[int(name.split(".")[1])], len(position), held, micro_batches)

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


# ---------------------------------------------------------------------------- the engine

def _aligned(nbytes: int) -> int:
    """Byte offsets inside the shared block buffers: 64-aligned, so any dtype can view them."""
    return -(-nbytes // 64) * 64


class Zero3Engine(Runtime):
    """A ZeRO-3 (+ ZeRO++) sharded model: call it like the model; its parameters are this rank's shards."""

    checkpoint_format = SHARDED

    def __init__(self, model: nn.Module, config: ZeroConfig | None = None, mesh: Mesh | None = None,
                 device: torch.device | None = None, weights=None):
        """`model` may be on the meta device (partly or wholly): then each rank reads just its shards
        of those parameters from `weights` (models.weights.WeightSource), unit by unit, and never
        holds the full model."""
        self.module = model
        self.config = cfg = config or ZeroConfig(stage=3)
        self.comm_dtype, self.param_dtype = cfg.comm_dtype, cfg.compute_dtype
        self.device = device or torch.device("cpu")
        self._own_group = not dist.is_initialized()
        if self._own_group:  # one process without a launcher: a group of one, so collectives work
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        # By default the layout the config asks for: its ranks per node, hpZ's secondary group size.
        self.mesh = mesh or build_mesh(ranks_per_node=cfg.ranks_per_node, secondary_size=(
            cfg.zero_hpz_partition_size if cfg.zero_hpz_partition_size > 1 else None))
        self.comm = Comm(self.mesh, node_aware=cfg.node_aware_collectives)
        self.ledger = self.comm.ledger
        self.timings = Timings()
        self.gradient_divide_factor = float(self.mesh.world_size)
        world, rank = self.mesh.world_size, self.mesh.rank

        wanted = cfg.zero_hpz_partition_size or self.mesh.ranks_per_node
        if cfg.hpz and wanted != self.mesh.secondary_size:
            raise ZeroConfigError(
                f"zero_optimization.zero_hpz_partition_size={cfg.zero_hpz_partition_size} asks for secondary groups "
                f"of {wanted} ranks, but the mesh was built with {self.mesh.secondary_size}; pass "
                f"secondary_size={wanted} to build_mesh")
        # What the weight all-gather sends: the shard in the comm dtype, or qwZ's codes + scales.
        # Frozen units under zero_quantized_nontrainable_weights are stored as codes: their wire
        # shard is the only copy of the weights, gathered as it is, never requantized.
        codec = (QuantizedCodec(cfg.zero_quantized_weights_bits, cfg.zero_quantization_block_size)
                 if cfg.zero_quantized_weights else PlainCodec(self.comm_dtype))
        frozen_codec = (QuantizedCodec(cfg.zero_quantized_weights_bits, cfg.zero_quantization_block_size)
                        if cfg.zero_quantized_nontrainable_weights else codec)
        # qwZ deltas: trainable units gather their weights in the comm dtype from the node's
        # references; only the quantized change crosses nodes.
        delta = cfg.zero_quantized_weights_delta
        if delta and self.mesh.secondary_size != self.mesh.ranks_per_node:
            raise ZeroConfigError(
                f"zero_optimization.zero_quantized_weights_delta keeps each node's weights in hpZ's secondary "
                f"partition, which must be one node ({self.mesh.ranks_per_node} ranks), not "
                f"{self.mesh.secondary_size}: set zero_hpz_partition_size to 0")
        units = partition_units(model)
        self._unit_numels = unit_numels(units)
        self.units: dict[str, Unit] = {}
        for name, params in units.items():
            frozen = name.endswith(FROZEN_SUFFIX)
            stored_quantized = frozen and cfg.zero_quantized_nontrainable_weights
            deltas = delta and not frozen
            self.units[name] = Unit(name, params, world, rank, self.device,
                                    frozen_codec if frozen else PlainCodec(self.comm_dtype) if deltas else codec,
                                    stored_quantized, cfg.param_align(frozen), cfg.shard_align(frozen),
                                    delta_codec=codec if deltas else None, weights=weights,
                                    host=torch.device("cpu") if cfg.offload_optimizer == "cpu" else None)
        self.reducer = self._build_reducer()
        # A block's units (trainable, then frozen) are gathered, computed and freed together.
        self.block_groups = [[self.units[n] for n in (f"blocks.{i}", f"blocks.{i}{FROZEN_SUFFIX}") if n in self.units]
                             for i in range(len(model.blocks))]
        self.blocks = [u for group in self.block_groups for u in group]
        self.resident = [self.units[n] for base in ("embedding", "norms") for n in (base, base + FROZEN_SUFFIX)
                         if n in self.units]
        self._slots = rotating_buffer_count([[u.padded_numel for u in group] for group in self.block_groups], cfg)
        for u in self.units.values():
            if u.delta_codec is not None:  # every unit (resident ones too) keeps its references
                u.enable_secondary(self.mesh.ranks_per_node, self.mesh.node)
            elif cfg.hpz and self.mesh.secondary_size > 1 and u in self.blocks:
                u.enable_secondary(self.mesh.secondary_size)  # resident units are not re-gathered for the backward
        self._allocate_buffers()

        # The block order of the first forward: prefetch follows it, and a block's position
        # picks which of the rotating buffers it uses.
        self._order: list[list[Unit]] = []
        self._order_known = False
        self._position: dict[int, int] = {}
        self._occupant: list[list[Unit] | None] = [None] * self._slots  # the block group each buffer holds
        self._phase = Phase.FORWARD
        self._rollout: InferenceWeights | None = None  # set inside inference_weights
        self._hooks = [model.register_forward_pre_hook(self._model_pre_forward),
                       model.register_forward_hook(self._model_post_forward)]
        for block, group in zip(model.blocks, self.block_groups):
            if group:
                self._hooks.append(block.register_forward_pre_hook(lambda m, a, g=group: self._block_pre_forward(g)))
                self._hooks.append(block.register_forward_hook(lambda m, a, o, g=group: self._block_post_forward(g, o)))
        for u in self.units.values():  # each module's trainable parameters bound again right before it runs
            # (after the engine's own hooks bound the unit)
            if u.trainable:
                self._hooks += [m.register_forward_pre_hook(lambda m, a, u=u: u.bind_module(m)) for m in u.slots_of]

    # ------------------------------------------------------------------ buffers

    def _new_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _decodes_in_place(self, unit: Unit) -> bool:
        """The gathered bytes are the weights themselves (wire dtype = compute dtype), unless a
        node-aware gather's shards must be put in place while decoding."""
        return unit.codec.dtype == self.param_dtype and unit.gather_order(self.comm) is None

    def _allocate_buffers(self) -> None:
        """The rotating byte buffers shared by the blocks (`rotating_buffer_count`), each holding one block's
        units side by side (gathered bytes, and decoded weights when those differ in dtype), and the
        gradient buffers: two with overlap_comm (a block's gradients are written while the one before
        is still being reduced from the other), else one; a resident unit has buffers of its own."""
        shared_compute = all(self._decodes_in_place(u) for u in self.blocks)
        gather_bytes = compute_numel = grad_numel = 0
        offsets = {}  # unit -> (byte offset in a gather buffer, element offset in a compute buffer)
        for group in self.block_groups:
            gather_at = compute_at = 0
            for u in group:
                offsets[u] = gather_at, compute_at
                gather_at += _aligned(u.gathered_numel * u.codec.dtype.itemsize)
                compute_at += u.padded_numel
                if u.trainable:
                    grad_numel = max(grad_numel, u.padded_numel)
            gather_bytes, compute_numel = max(gather_bytes, gather_at), max(compute_numel, compute_at)
        gather_bufs = [self._new_buffer(gather_bytes, torch.uint8) for _ in range(self._slots)]
        compute_bufs = [] if shared_compute else [self._new_buffer(compute_numel, self.param_dtype)
                                                  for _ in range(self._slots)]
        self._block_buffers = gather_bufs + compute_bufs
        self._grad_buffers = [self._new_buffer(grad_numel, self.param_dtype)
                              for _ in range(2 if self.config.overlap_comm else 1)]
        self._grad_owner: list[Unit | None] = [None] * len(self._grad_buffers)
        for u, (gather_at, compute_at) in offsets.items():
            for s in range(self._slots):
                gather = gather_bufs[s][gather_at:gather_at + u.gathered_numel * u.codec.dtype.itemsize] \
                    .view(u.codec.dtype)
                compute = gather if shared_compute else compute_bufs[s][compute_at:compute_at + u.padded_numel]
                u.buffers.append((gather, compute))
        for u in self.resident:
            gather = self._new_buffer(u.gathered_numel, u.codec.dtype)
            compute = gather if self._decodes_in_place(u) else self._new_buffer(u.padded_numel, self.param_dtype)
            u.buffers = [(gather, compute)]
            u.grad_buffer = self._new_buffer(u.padded_numel, self.param_dtype) if u.trainable else None

    # ------------------------------------------------------------------ gathering

    def _refresh(self, unit: Unit) -> None:
        with self.timings.timer("weight encode"):
            unit.refresh()

    def _issue_gather(self, unit: Unit, async_op: bool | None = None) -> None:
        """Gather the unit (its wire was re-encoded by `_holds_current` just before, so the
        encoding of later blocks overlaps the earlier gathers)."""
        unit.gather(self.comm, self._phase, async_op=self.config.overlap_comm if async_op is None else async_op)

    def _holds_current(self, unit: Unit) -> bool:
        """Whether the unit's buffer still holds its current weights (re-encoded first if its master
        changed): a block no later block has taken the buffer of since it was gathered, e.g. the
        last blocks of the forward when the backward starts, the first ones of the backward when
        the next micro-batch's forward starts. Those are not gathered again. A gather in flight
        that sends an older version (the weights changed after it left) is let land and dropped,
        so every caller sees either no gather or one of the current weights."""
        self._refresh(unit)
        if unit.pending_gather is not None and unit.gathering_version != unit.version:
            unit.pending_gather.wait()  # sent before the weights changed again: it will be sent anew
            unit.pending_gather = None
        return unit.pending_gather is None and unit.gathered_version == unit.version

    def _ensure_gathered(self, units: list[Unit]) -> None:
        """Wait for the units' prefetched gathers (issuing the missing ones) and decode them."""
        due = [u for u in units if not self._holds_current(u)]
        for unit in due:
            if unit.pending_gather is None:
                self._issue_gather(unit)
        for unit in due:
            unit.decode(self.comm, self._phase, self.timings)

    def _prefetch_from(self, pos: int, step: int) -> None:
        """Prefetch the prefetch_depth block groups from position `pos` on, in direction `step`
        (+1 forward, -1 backward); their buffers are those of blocks already done."""
        for k in range(self.config.prefetch_depth):
            at = pos + k * step
            if 0 <= at < len(self._order):
                self._prefetch(self._order[at])

    def _prefetch(self, group: list[Unit]) -> None:
        if group[0].inference is not None:  # a rollout holds it: nothing to gather
            return
        due = [u for u in group if self.config.overlap_comm and u.padded_numel <= self.config.stage3_prefetch_bucket_size
               and not self._holds_current(u) and u.pending_gather is None]
        if due:
            self._take_buffer(group)
        for unit in due:
            self._issue_gather(unit, async_op=True)

    def _take_buffer(self, group: list[Unit]) -> None:
        """The block group is about to be gathered into its buffer: its previous holder lets go."""
        s = group[0].slot
        previous = self._occupant[s]
        if previous is not group:
            for unit in previous or ():
                unit.release()
            self._occupant[s] = group

    # ------------------------------------------------------------------ hooks

    def _model_pre_forward(self, module, args):
        grad = torch.is_grad_enabled()
        if self._rollout is None:
            self._phase = Phase.FORWARD
        elif grad:
            raise RuntimeError("a forward inside Zero3Engine.inference_weights must run under torch.no_grad(): "
                               "the inference copy has no gradient path; train outside the context")
        # Own buffers: gathered once per weight update. Their gathers go out first, the first
        # blocks' right behind them, before anything waits (synchronous ones: in _ensure_gathered).
        stale = [u for u in self.resident if not self._holds_current(u)]
        for u in stale:
            if u.pending_gather is None and self.config.overlap_comm:  # else issued when the optimizer stepped
                self._issue_gather(u)
        if self._order_known:
            self._prefetch_from(0, +1)
        self._ensure_gathered(stale)
        if self._rollout is not None:  # weights edited inside the context: renew their copies
            held = [u for u in self.blocks if u.inference is not None]
            for u in held:
                self._refresh(u)
            self._gather_copies([u for u in held if u.gathered_version != u.version])
        for u in self.resident:
            u.bind(grad, self._reduce)

    def _block_pre_forward(self, group: list[Unit]):
        if not self._order_known and id(group[0]) not in self._position:
            for unit in group:
                self._position[id(unit)] = len(self._order)
                unit.slot = len(self._order) % self._slots
                unit.grad_slot = len(self._order) % len(self._grad_buffers)
            self._order.append(group)
        if group[0].inference is None:
            self._take_buffer(group)
            self._ensure_gathered(group)
        for unit in group:  # a held inference copy is only bound (again): no gather
            unit.bind(torch.is_grad_enabled(), self._reduce)
        if self._order_known:
            self._prefetch_from(self._position[id(group[0])] + 1, +1)

    def _block_post_forward(self, group: list[Unit], output):
        # Wrapped even when the block is frozen: the backward still needs its weights to carry
        # the gradient to the blocks below.
        if torch.is_grad_enabled():
            return _wrap_outputs(output, self, group)
        return output

    def _model_post_forward(self, module, args, output):
        self._order_known = True
        if torch.is_grad_enabled():
            return _wrap_outputs(output, self, self.resident)
        return output

    def _prefetch_next_forward(self) -> None:
        """Right after an optimizer step: re-encode and issue the next forward's first gathers
        (the embeddings and norms, then the first prefetch_depth blocks), so that they travel
        while the caller logs, evaluates or loads the next batch."""
        cfg = self.config
        if self._rollout is not None or not self._order_known or not (cfg.overlap_comm and cfg.prefetch_across_steps):
            return
        self._phase = Phase.FORWARD
        for u in self.resident:
            if not self._holds_current(u) and u.pending_gather is None:
                self._issue_gather(u)
        self._prefetch_from(0, +1)

    def _wait_gathers(self) -> None:
        """Let every gather in flight land (before the buffers are handed elsewhere, or closing)."""
        for u in self.units.values():
            if u.pending_gather is not None:
                u.pending_gather.wait()
                u.pending_gather = None

    # ------------------------------------------------------------------ backward

    def _set_grad_target(self, unit: Unit) -> None:
        """Pick and zero the buffer this unit's gradients are written to in this backward."""
        if unit in self.resident:
            buf, previous = unit.grad_buffer, unit
        else:
            s = unit.grad_slot
            previous = self._grad_owner[s]
            if previous is not None and previous is not unit and previous.writing_grads:
                # The previous owner's gate has not fired yet (autograd ordering): use a fresh buffer.
                buf, previous = None, None
            else:
                self._grad_owner[s] = unit
                buf = self._grad_buffers[s][:unit.padded_numel]
        if previous is not None and previous.pending_reduce is not None:
            self._wait_reduce(previous)
        if buf is None:
            buf = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=self.device)
        else:
            buf.zero_()
        unit.grad_target = buf
        unit.writing_grads = True
        unit.attach_grads()

    def _pre_backward(self, units) -> None:
        if self._phase is Phase.FORWARD:  # the first gate of this backward: the model's output
            self._phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        for unit in units:
            if unit.trainable:
                self._set_grad_target(unit)
        if units is self.resident:  # their buffers still hold the forward's weights
            self._prefetch_from(len(self._order) - 1, -1)
        else:
            self._take_buffer(units)
            self._ensure_gathered(units)
            # Bound again, as in the forward: an activation-checkpointed block's recompute
            # (trainer/activation_checkpointing.py) runs its forward without the hooks and must
            # see the gathered weights, not the pieces a release left. Its gates belong to the
            # recompute's graph, which autograd never runs backward: the forward's gates reduce.
            with torch.enable_grad():
                for unit in units:
                    unit.bind(True, self._reduce)
            self._prefetch_from(self._position[id(units[0])] - 1, -1)

    def _build_reducer(self):
        cfg = self.config
        qgz = None
        if cfg.zero_quantized_gradients:
            qgz = QuantizedReduce(self.comm, cfg.zero_quantized_gradients_bits, cfg.zero_quantization_block_size,
                                  cfg.zero_quantized_gradients_hops or (2 if self.mesh.num_nodes > 1 else 1),
                                  cfg.zero_quantized_gradients_stages, cfg.zero_quantized_gradients_error_feedback)
        if cfg.gradient_compression.separate:  # SEPARATE's projections, through qgZ when it is on
            return ProjectedReduce(self.comm, Separate(cfg.gradient_compression, self.device), self.comm_dtype,
                                   self.timings, qgz)
        return qgz or ExactReduceScatter(self.comm, self.comm_dtype)

    def _reduce(self, unit: Unit) -> None:
        if unit.pending_reduce is not None:  # a temporary buffer's earlier reduce (rare path)
            self._wait_reduce(unit)
        unit.reduce(self.reducer, self.gradient_divide_factor, async_op=self.config.overlap_comm)

    def _post_backward(self) -> None:
        """End of the backward: every reduce has landed in the gradient shards."""
        self._finish_reduces()
        self._phase = Phase.FORWARD

    def _wait_reduce(self, unit: Unit) -> None:
        with self.timings.timer("waiting for reductions"):
            unit.pending_reduce.wait()
            unit.pending_reduce = None

    def _finish_reduces(self) -> None:
        for u in self.units.values():
            if u.pending_reduce is not None:
                self._wait_reduce(u)

    # ------------------------------------------------------------------ rollouts

    def _gather_copies(self, units: list[Unit]) -> None:
        """Gather units into their inference copies: one all-gather each, the next one issued
        before the previous is decoded; the gathered bytes go once decoded."""
        def issue(u: Unit) -> None:
            _, compute = u.inference
            gather = compute if self._decodes_in_place(u) else self._new_buffer(u.gathered_numel, u.codec.dtype)
            u.hold_inference_copy(gather, compute)
            u.gather(self.comm, self._phase, async_op=True)

        for i, u in enumerate(units):
            if u.pending_gather is None:
                issue(u)
            if i + 1 < len(units):
                issue(units[i + 1])
            u.decode(self.comm, self._phase, self.timings)
            u.drop_gathered_bytes()

    @contextmanager
    def inference_weights(self, max_bytes: int | None = None):
        """Gather the model once for any number of no-grad forwards (see Runtime.inference_weights).

        On entry every unit is all-gathered once from its primary shards, in the wire format
        the training forward uses (qwZ codes + scales with qwZ), ledger tag "rollout gather":
        the embeddings and norms into their own buffers (skipped when they already hold the
        current weights), each block into a new buffer of the compute dtype. Blocks that do not
        fit `max_bytes` (in model order) instead go through the rotating training buffers, as in
        training (same tag): gathered where a buffer no longer holds them. Inside, forwards must run under no_grad. On exit the
        blocks' copies are freed; the next training forward and backward run as if there had
        been no rollout (only the embeddings' and norms' gather may already be done).
        """
        if self._rollout is not None:
            raise RuntimeError("Zero3Engine.inference_weights is already active; it does not nest")
        if self._phase is not Phase.FORWARD:
            raise RuntimeError("Zero3Engine.inference_weights entered during a backward")
        itemsize = torch.empty((), dtype=self.param_dtype).element_size()
        budget = math.inf if max_bytes is None else max_bytes
        held, streamed, used = [], [], 0
        for group in self.block_groups:  # a block's units are held or streamed together
            cost = sum(u.padded_numel for u in group) * itemsize
            if not streamed and used + cost <= budget:
                held += group
                used += cost
            else:
                streamed += group
        info = InferenceWeights(bytes=used, resident_units=len(self.resident) + len(held),
                                streamed_units=len(streamed), collectives_per_forward=bool(streamed))
        # The training buffers' occupants let go: a held block never takes a training buffer,
        # so nothing releases its copy's binding while the rollout runs.
        self._wait_gathers()  # e.g. the next forward's, issued when the optimizer stepped
        for s, group in enumerate(self._occupant):
            for unit in group or ():
                unit.release()
            self._occupant[s] = None
        self._rollout, self._phase = info, Phase.ROLLOUT
        try:
            with self.timings.timer("weight encode"):
                for u in self.units.values():
                    u.refresh()
            self._ensure_gathered(self.resident)
            for u in held:
                u.hold_inference_copy(None, self._new_buffer(u.padded_numel, self.param_dtype))
            self._gather_copies(held)
            for u in self.resident + held:  # the modules' attributes are the full weights from now on
                u.bind(False, self._reduce)
            yield info
        finally:
            self._wait_gathers()  # a forward that failed midway may leave a prefetch
            for u in held:
                u.drop_inference_copy()
            self._rollout, self._phase = None, Phase.FORWARD

    # ------------------------------------------------------------------ the Runtime interface

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = float(factor)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, with a step post-hook that sends the next forward's first gathers."""
        optimizer.register_step_post_hook(lambda *_: self._prefetch_next_forward())
        return optimizer

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad for u in self.units.values() for _, p, _ in u.params if p.grad is not None]
        squared = squared_norm(grads, self.device)
        self.comm.all_reduce(squared, tag="grad norm")
        return clip_by_norm_(grads, squared, max_norm)

    def unshard(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from per-parameter local pieces shaped like the registered parameters (the
        parameters themselves, an EMA of them, ...), by their names in `model.named_parameters()`;
        every rank calls it with the same names and gets them all."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for u in self.units.values():
            mine = {names[id(p)]: slot for slot, p, _ in u.params if names[id(p)] in tensors}
            if not mine:
                continue
            shard = torch.zeros(u.shard_numel, dtype=torch.float32, device=self.device)
            lo = u.shard_start
            for name, slot in mine.items():
                a = max(lo, slot.offset)
                piece = tensors[name].reshape(-1)
                shard[a - lo:a - lo + piece.numel()] = piece
            full = torch.empty(u.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, shard, tag="consolidate")
            for name, slot in mine.items():
                out[name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.units.values():
            full = torch.empty(u.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, u.master_shard(), tag="consolidate")
            for slot in u.slots:
                tensor = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                for name in slot.alias_names:
                    out[name] = tensor
        return out

    def save(self, directory, optimizer: torch.optim.Optimizer) -> None:
        for u in self.units.values():  # with qwZ deltas a gather in flight may be updating the references
            if u.pending_gather is not None:
                u.pending_gather.wait()
        save_shards(self, Path(directory), optimizer)

    def load(self, directory, optimizer: torch.optim.Optimizer) -> None:
        load_shards(self, Path(directory), optimizer)

    def load_unsharded(self, tensors, optimizer) -> None:
        load_unsharded(self, tensors, optimizer)

    def describe(self) -> str:
        buffers = sum(b.numel() * b.element_size() for b in self._block_buffers)
        return (f"{self.config.describe()}, gradients by {self.reducer.describe()}, {self._slots} of "
                f"{len(self.block_groups)} blocks gathered at once ({buffers / 2**20:.1f} MB of buffers) | "
                f"topology: {self.mesh.describe()}")

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        return zero3_cross_node_bytes(self._unit_numels, self.mesh, self.comm.node_aware, micro_batches)

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        """What this rank should send in one training step of `micro_batches` forward/backward
        passes, by ledger tag: {"sent", "cross_node_sent"} bytes, from the units' sizes and the
        configuration alone (the ledger of the step measures the same). The embeddings and norms
        are gathered once per step; the blocks per pass, the backward from the hpZ secondary.
        A reducer whose volume depends on the round (SEPARATE) leaves "gradient reduce" out."""
        totals: dict[str, list[int]] = {}

        def add(tag, volume, times=1):
            sent, cross = totals.setdefault(tag, [0, 0])
            totals[tag] = [sent + times * volume[0], cross + times * volume[1]]

        held = self._slots  # blocks the rotating buffers hold
        position = {id(u): i for i, group in enumerate(self.block_groups) for u in group}
        for u in self.units.values():
            i = position.get(id(u))  # None: a resident unit, gathered once per step and kept
            if u.delta_codec is not None:  # the change across nodes once per step, the references inside
                first = self.comm.volume(u.wire.numel() * u.wire.element_size(), "inter_node")
                add("forward gather", first)
                forward = backward = self.comm.volume(u.secondary.numel() * u.secondary.element_size(), "intra_node")
            else:
                forward = self.comm.volume(u.wire.numel() * u.wire.element_size(), "dp", node_aware=True)
                backward = forward if u.secondary is None else \
                    self.comm.volume(u.secondary.numel() * u.secondary.element_size(), "secondary")
            if i is None:
                add("forward gather", forward)
            else:
                forwards, backwards = block_gathers(i, len(self.block_groups), held, micro_batches)
                add("forward gather", forward, forwards)
                add("backward gather", backward, backwards)
            reduce = self.reducer.volume(u.padded_numel) if u.trainable else (0, 0)
            if reduce is not None:
                add(REDUCE_TAG, reduce, micro_batches)
        return {tag: {"sent": sent, "cross_node_sent": cross} for tag, (sent, cross) in totals.items()}

    def preallocated_buffers(self) -> list[torch.Tensor]:
        """The buffers made once at construction and reused every step: the units' gather and
        compute views, the resident units' gradient buffers and the blocks' alternating ones."""
        views = [t for u in self.units.values() for pair in u.buffers for t in pair]
        return views + [u.grad_buffer for u in self.resident if u.grad_buffer is not None] + self._grad_buffers

    def buffer_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.preallocated_buffers()}
        return sum(storages.values())

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Per-rank model-state memory by kind: master, comm copy, gradient shard, hpZ secondary,
        the reducer's error-feedback buffers, and the optimizer's states when given."""
        totals: dict[str, int] = {}
        for u in self.units.values():
            for k, v in u.model_state_bytes().items():
                totals[k] = totals.get(k, 0) + v
        for k, v in self.reducer.state_dict().items():  # qgZ's or SEPARATE's error feedback
            if v.dim() > 0:
                totals["gradient error feedback"] = totals.get("gradient error feedback", 0) + v.numel() * v.element_size()
        if optimizer is not None:
            totals["optimizer states" + (" (host)" if self.config.offload_optimizer != "none" else "")] = sum(
                t.numel() * t.element_size() for state in optimizer.state.values()
                for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        return totals

    def close(self) -> None:
        self._finish_reduces()
        self._wait_gathers()
        for h in self._hooks:
            h.remove()
        self.comm.close()
        if self._own_group:
            dist.destroy_process_group()
