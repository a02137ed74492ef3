"""ZeRO-3, applied to an unmodified model from outside.

Units: each transformer block is one; the embeddings with the LM head (and OPT's
project_in/out) form one; all norms form one (as in YaFSDP). Each unit is a `FlatUnit`:
per rank an fp32 master shard, the optimizer states of that shard, the shard as sent on
the wire (comm dtype, or qwZ codes) and a gradient shard.

Forward: a block's shard is all-gathered into one of two preallocated, alternating gather
buffers; its parameters become views into it. The two resident units (embeddings, norms)
have buffers of their own that nothing else overwrites, so they are gathered once per
weight update and serve every forward and backward until the next step. The next block's
gather is issued before the current block computes (prefetch in the execution order
recorded on the first forward), so communication overlaps compute.

Backward: an identity autograd function on each block's output (`_PreBackward`) fires
before the block's backward: it re-gathers the block into the same buffer (the saved
tensors are views of it) and prefetches the next one. Parameters are views made by
`_Narrow`, whose backward writes the gradient straight into the unit's gradient buffer; all
of them feed one `_WeightGate` (YaFSDP's GateGradFlow), whose backward therefore runs
exactly when every gradient of the unit is in place. It issues the unit's reduce-scatter,
asynchronously, accumulating into the fp32 gradient shard. Gradients are divided once, at
the step, by world size x micro-batches (post-divide).

Step: global gradient norm over the shards, clipping, AdamW on the local shards, re-encoding
of the wire shards.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
import torch.nn as nn

from zeropp.comm import Comm
from zeropp.config import DTYPES, ZeroConfig, ZeroConfigError
from zeropp.flat import FlatUnit
from zeropp.quantized import PlainCodec, QuantizedCodec
from zeropp.topology import Topology, build_topology


class UnsupportedModelError(TypeError):
    """A model whose structure the runtime cannot split into units; the message says why."""


# ---------------------------------------------------------------------------- autograd gates

class _WeightGate(torch.autograd.Function):
    """Identity on the unit's flat weights; its backward runs once all the unit's grads are written."""

    @staticmethod
    def forward(ctx, flat, engine, unit):
        ctx.set_materialize_grads(False)
        ctx.engine, ctx.unit = engine, unit
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, _):
        ctx.engine._reduce(ctx.unit)
        return None, None, None


class _Narrow(torch.autograd.Function):
    """A parameter as a view of the flat weights; backward adds its grad into the unit's grad buffer."""

    @staticmethod
    def forward(ctx, flat, offset, shape, unit):
        ctx.offset, ctx.numel, ctx.unit = offset, shape.numel(), unit
        return flat.detach()[offset:offset + shape.numel()].view(shape)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.unit.grad_target[ctx.offset:ctx.offset + ctx.numel].add_(grad.reshape(-1))
        return None, None, None, None


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
    [(module, attr)], [alias names])].
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


# ---------------------------------------------------------------------------- the engine

def _aligned(nbytes: int) -> int:
    """Byte offsets inside the shared block buffers: 64-aligned, so any dtype can view them."""
    return -(-nbytes // 64) * 64


class Zero3Engine:
    """A ZeRO-3 sharded model + AdamW. Call it like the model; then backward(), step()."""

    def __init__(self, model: nn.Module, optimizer_factory, config: ZeroConfig | None = None,
                 topo: Topology | None = None, comm: Comm | None = None, device: torch.device | None = None):
        """optimizer_factory([(shard piece, decayed)]) -> torch optimizer over the shard pieces."""
        self.model = model
        self.config = config or ZeroConfig(stage=3)
        self.comm_dtype, self.param_dtype = self.config.comm_dtype, self.config.compute_dtype
        self.device = device or torch.device("cpu")
        cfg = self.config
        # By default the layout the config asks for: its ranks per node, hpZ's secondary group size.
        self.topo = topo or build_topology(ranks_per_node=cfg.ranks_per_node, secondary_size=(
            cfg.zero_hpz_partition_size if cfg.zero_hpz_partition_size > 1 else None))
        self.comm = comm or Comm(self.topo)
        self.ledger = self.comm.ledger
        world, rank = self.topo.world_size, self.topo.rank

        self.units: dict[str, FlatUnit] = {}
        for name, params in partition_units(model).items():
            frozen = name.endswith(FROZEN_SUFFIX)
            self.units[name] = FlatUnit(name, params, world, rank, self.device, cfg.param_align(frozen),
                                        cfg.shard_align(frozen))
        # What the weight all-gather sends: the shard in the comm dtype, or qwZ's codes + scales.
        # Frozen units under zero_quantized_nontrainable_weights are stored as codes: their wire
        # shard is the only copy of the weights, gathered as it is, never requantized.
        codec = (QuantizedCodec(cfg.zero_quantized_weights_bits, cfg.zero_quantization_block_size)
                 if cfg.zero_quantized_weights else PlainCodec(self.comm_dtype))
        frozen_codec = (QuantizedCodec(cfg.zero_quantized_weights_bits, cfg.zero_quantization_block_size)
                        if cfg.zero_quantized_nontrainable_weights else codec)
        for u in self.units.values():
            u.stored_quantized = cfg.zero_quantized_nontrainable_weights and not u.trainable
            u.codec = frozen_codec if u.stored_quantized else codec
        wanted = cfg.zero_hpz_partition_size or self.topo.ranks_per_node
        if cfg.hpz and wanted != self.topo.secondary_size:
            raise ZeroConfigError(
                f"zero_optimization.zero_hpz_partition_size={cfg.zero_hpz_partition_size} asks for secondary groups "
                f"of {wanted} ranks, but the topology was built with {self.topo.secondary_size}; pass "
                f"secondary_size={wanted} to build_topology")
        self.hpz = cfg.hpz and self.topo.secondary_size > 1
        self.qgz_hops = cfg.zero_quantized_gradients_hops or (2 if self.topo.num_nodes > 1 else 1)
        # A block's units (trainable, then frozen) are gathered, computed and freed together.
        self.block_groups = [[self.units[n] for n in (f"blocks.{i}", f"blocks.{i}{FROZEN_SUFFIX}") if n in self.units]
                             for i in range(len(model.blocks))]
        self.blocks = [u for group in self.block_groups for u in group]
        self.resident = [self.units[n] for base in ("embedding", "norms") for n in (base, base + FROZEN_SUFFIX)
                         if n in self.units]

        # The block order of the first forward: prefetch follows it, and a block's position
        # picks which of the two alternating buffers it uses.
        self._order: list[list[FlatUnit]] = []
        self._order_known = False
        self._position: dict[int, int] = {}

        for slot in (s for u in self.units.values() for s in u.slots):
            for module, attr in slot.aliases:
                del module._parameters[attr]
        for u in self.units.values():
            u.pending_gather = None
            u.pending_reduce = None
            u.grad_target = None
            u.writing_grads = False
            u.gathered_version = -1
            u.wire = self._new_buffer(u.codec.wire_numel(u.shard_numel), u.codec.dtype)
            u.wire_numel = world * u.wire.numel()  # of the gathered buffer
            # hpZ: this rank's part of a block's gathered wire bytes within its secondary group
            # (resident units are not re-gathered for the backward).
            u.secondary = self._new_buffer(u.wire_numel // self.topo.secondary_size, u.codec.dtype) \
                if self.hpz and u in self.blocks else None
            u.secondary_version = -1
        # Buffers: two alternating byte buffers shared by the blocks, each holding one block's
        # units side by side; a resident unit has buffers of its own.
        self._shared_compute = all(u.codec.dtype == self.param_dtype for u in self.blocks)
        gather_bytes = compute_numel = grad_numel = 0
        offsets = {}  # unit -> (byte offset in a gather buffer, element offset in a compute buffer)
        for group in self.block_groups:
            gather_at = compute_at = 0
            for u in group:
                offsets[u] = gather_at, compute_at
                gather_at += _aligned(u.wire_numel * u.wire.element_size())
                compute_at += u.padded_numel
                if u.trainable:
                    grad_numel = max(grad_numel, u.padded_numel)
            gather_bytes, compute_numel = max(gather_bytes, gather_at), max(compute_numel, compute_at)
        self._gather_pair = [self._new_buffer(gather_bytes, torch.uint8) for _ in range(2)]
        self._compute_pair = [] if self._shared_compute else \
            [self._new_buffer(compute_numel, self.param_dtype) for _ in range(2)]
        self._grad_pair = [self._new_buffer(grad_numel, self.param_dtype) for _ in range(2)]
        self._grad_owner: list[FlatUnit | None] = [None, None]
        # Each unit's (gather, compute) views, per slot: a block's in the shared pair, a
        # resident unit's of its own (the same in both slots).
        for u, (gather_at, compute_at) in offsets.items():
            u.buffers = []
            for s in range(2):
                gather = self._gather_pair[s][gather_at:gather_at + u.wire_numel * u.wire.element_size()] \
                    .view(u.codec.dtype)
                compute = gather if self._shared_compute else \
                    self._compute_pair[s][compute_at:compute_at + u.padded_numel]
                u.buffers.append((gather, compute))
        for u in self.resident:
            u.gather_buf = self._new_buffer(u.wire_numel, u.codec.dtype)
            u.compute_buf = u.gather_buf if u.codec.dtype == self.param_dtype else \
                self._new_buffer(u.padded_numel, self.param_dtype)
            u.grad_buf = self._new_buffer(u.padded_numel, self.param_dtype) if u.trainable else None
            u.buffers = [(u.gather_buf, u.compute_buf)] * 2
        for u in self.units.values():
            self._bind(u, grad=False)  # parameters exist (as views) from the start

        pieces = [(p, decay) for u in self.units.values() for p, decay in u.optim_params]
        self.optimizer = optimizer_factory(pieces)
        self.weights_version = 0
        for u in self.units.values():
            u.codec.encode(u.master, u.wire)
            if u.stored_quantized:
                u.master = None  # from now on the codes are the weights
        self.micro_batches = 0
        self._phase = "forward"
        # Seconds the calling thread spent per kind since the last clear (the trainer clears it
        # every step): where the time goes besides compute.
        self.timings: dict[str, float] = defaultdict(float)

        self._hooks = [model.register_forward_pre_hook(self._model_pre_forward),
                       model.register_forward_hook(self._model_post_forward)]
        for block, group in zip(model.blocks, self.block_groups):
            if group:
                self._hooks.append(block.register_forward_pre_hook(lambda m, a, g=group: self._block_pre_forward(g)))
                self._hooks.append(block.register_forward_hook(lambda m, a, o, g=group: self._block_post_forward(g, o)))

    # ------------------------------------------------------------------ buffers

    def _new_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _slot(self, unit: FlatUnit) -> int:
        return self._position[id(unit)] % 2

    def _gather_buf(self, unit):
        """(gather, compute) buffers of the unit; a block not yet run gets slot 0 as a placeholder."""
        return unit.buffers[self._position.get(id(unit), 0) % 2]

    # ------------------------------------------------------------------ gathering

    def _issue_gather(self, unit: FlatUnit, tag: str) -> None:
        """All-gather the unit's wire bytes: from the hpZ secondary partition when it is valid
        (backward, inside the secondary group), else from every rank's primary shard."""
        gather, _ = self._gather_buf(unit)
        if tag == "backward gather" and unit.secondary is not None and unit.secondary_version == self.weights_version:
            source, group = unit.secondary, "secondary"
        else:
            source, group = unit.wire, "dp"
        unit.pending_gather = self.comm.all_gather(gather, source, group=group, tag=tag,
                                                   async_op=self.config.overlap_comm)

    def _ensure_gathered(self, units: list[FlatUnit], tag: str) -> None:
        """Wait for the units' prefetched gathers (issuing the missing ones), then decode each
        into its compute buffer."""
        for unit in units:
            if unit.pending_gather is None:
                self._issue_gather(unit, tag)
        for unit in units:
            start = time.perf_counter()
            unit.pending_gather.wait()
            unit.pending_gather = None
            decoding = time.perf_counter()
            gather, compute = self._gather_buf(unit)
            unit.codec.decode(gather, compute, self.topo.world_size)
            self.timings["waiting for gathers"] += decoding - start
            self.timings["weight decode"] += time.perf_counter() - decoding
            unit.gathered_version = self.weights_version
            if unit.secondary is not None and tag == "forward gather" and torch.is_grad_enabled():
                n = unit.secondary.numel()
                j = self.comm.group_rank("secondary")
                unit.secondary.copy_(gather[j * n:(j + 1) * n])
                unit.secondary_version = self.weights_version

    def _prefetch(self, units: list[FlatUnit] | None, tag: str) -> None:
        for unit in units or ():
            if (unit.pending_gather is None and self.config.overlap_comm
                    and unit.padded_numel <= self.config.stage3_prefetch_bucket_size):
                self._issue_gather(unit, tag)

    def _bind(self, unit: FlatUnit, grad: bool) -> None:
        """Point the unit's module attributes at views of its gathered weights."""
        _, compute = self._gather_buf(unit)
        # A fresh alias of the buffer (own version counter): re-gathering into the buffer later
        # does not trip autograd's checks on the tensors this forward saves.
        flat = torch.empty(0, dtype=compute.dtype, device=compute.device).set_(
            compute.untyped_storage(), compute.storage_offset(), (unit.numel,), (1,))
        gated = None
        if grad and unit.trainable:
            flat.requires_grad_(True)
            gated = _WeightGate.apply(flat, self, unit)
        for slot in unit.slots:
            if gated is not None:
                view = _Narrow.apply(gated, slot.offset, slot.shape, unit)
            else:
                view = flat.detach()[slot.offset:slot.offset + slot.numel].view(slot.shape)
            for module, attr in slot.aliases:
                module.__dict__[attr] = view

    # ------------------------------------------------------------------ hooks

    def _model_pre_forward(self, module, args):
        self._phase = "forward"
        grad = torch.is_grad_enabled()
        # Own buffers: gathered once per weight update.
        self._ensure_gathered([u for u in self.resident if u.gathered_version != self.weights_version],
                              "forward gather")
        for u in self.resident:
            self._bind(u, grad)
        if self._order_known:
            self._prefetch(self._order[0], "forward gather")

    def _block_pre_forward(self, group: list[FlatUnit]):
        if not self._order_known and id(group[0]) not in self._position:
            for unit in group:
                self._position[id(unit)] = len(self._order)
            self._order.append(group)
        self._ensure_gathered(group, "forward gather")
        for unit in group:
            self._bind(unit, torch.is_grad_enabled())
        if self._order_known:
            pos = self._position[id(group[0])]
            self._prefetch(self._order[pos + 1] if pos + 1 < len(self._order) else None, "forward gather")

    def _block_post_forward(self, group: list[FlatUnit], output):
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

    # ------------------------------------------------------------------ backward

    def _set_grad_target(self, unit: FlatUnit) -> None:
        """Pick and zero the buffer this unit's gradients are written to in this backward."""
        if unit in self.resident:
            buf, previous = unit.grad_buf, unit
        else:
            s = self._slot(unit)
            previous = self._grad_owner[s]
            if previous is not None and previous is not unit and previous.writing_grads:
                # The previous owner's gate has not fired yet (autograd ordering): use a fresh buffer.
                buf, previous = None, None
            else:
                self._grad_owner[s] = unit
                buf = self._grad_pair[s][:unit.padded_numel]
        if previous is not None and previous.pending_reduce is not None:
            self._wait_reduce(previous)
        if buf is None:
            buf = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=self.device)
        else:
            buf.zero_()
        unit.grad_target = buf
        unit.writing_grads = True

    def _pre_backward(self, units) -> None:
        if self._phase == "forward":  # the first gate of this backward: the model's output
            self._phase = "backward"
            self.micro_batches += 1
        for unit in units:
            if unit.trainable:
                self._set_grad_target(unit)
        if units is self.resident:  # their buffers still hold the forward's weights
            if self._order:
                self._prefetch(self._order[-1], "backward gather")
        else:
            self._ensure_gathered(units, "backward gather")
            pos = self._position[id(units[0])]
            self._prefetch(self._order[pos - 1] if pos > 0 else None, "backward gather")

    def _reduce(self, unit: FlatUnit) -> None:
        """All of the unit's gradients are in grad_target: reduce-scatter them into grad_shard."""
        grad = unit.grad_target[:unit.padded_numel]
        if unit.pending_reduce is not None:  # a temporary buffer's earlier reduce (rare path)
            self._wait_reduce(unit)
        cfg = self.config
        if cfg.zero_quantized_gradients:
            unit.pending_reduce = self.comm.quantized_reduce_scatter(
                unit.grad_shard, grad, cfg.zero_quantized_gradients_bits, cfg.zero_quantization_block_size,
                hops=self.qgz_hops, stages=cfg.zero_quantized_gradients_stages, tag="gradient reduce",
                async_op=cfg.overlap_comm)
        else:
            wire = grad if grad.dtype == self.comm_dtype else grad.to(self.comm_dtype)
            unit.pending_reduce = self.comm.reduce_scatter(unit.grad_shard, wire, tag="gradient reduce",
                                                           async_op=cfg.overlap_comm, accumulate=True)
        unit.writing_grads = False

    # ------------------------------------------------------------------ public API

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, unscaled.

        Gradients are summed over micro-batches and ranks, then divided once, in
        clip_grad_norm(), by world size x micro-batches (post-divide).
        """
        loss.backward()

    def _wait_reduce(self, unit: FlatUnit) -> None:
        start = time.perf_counter()
        unit.pending_reduce.wait()
        unit.pending_reduce = None
        self.timings["waiting for reductions"] += time.perf_counter() - start

    def _finish_reduces(self) -> None:
        for u in self.units.values():
            if u.pending_reduce is not None:
                self._wait_reduce(u)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Post-divide the summed gradients, then clip them by their global L2 norm (returned)."""
        self._finish_reduces()
        scale = 1.0 / (self.topo.world_size * max(1, self.micro_batches))
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for u in self.units.values():
            if u.grad_shard is not None:
                u.grad_shard.mul_(scale)
                local += u.trainable_grad().double().pow(2).sum()
        self.micro_batches = 0
        self.comm.all_reduce(local, tag="grad norm")
        norm = local.sqrt().float()
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for u in self.units.values():
                if u.grad_shard is not None:
                    u.grad_shard.mul_(coef)
        return norm

    def step(self) -> None:
        self.optimizer.step()
        self.weights_changed()

    def weights_changed(self) -> None:
        """Call after anything that edits the master shards (step, checkpoint load): re-encode
        the wire shards, and mark every copy made from them (gathered norms, hpZ secondaries) stale."""
        self._encode_weights()
        self.weights_version += 1

    def _encode_weights(self) -> None:
        start = time.perf_counter()
        for u in self.units.values():
            if u.master is not None:
                u.codec.encode(u.master, u.wire)
        self.timings["weight encode"] += time.perf_counter() - start

    def master_shard(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's fp32 shard of this rank (decoded from the codes for weights stored quantized)."""
        if unit.master is not None:
            return unit.master
        out = torch.empty(unit.shard_numel, dtype=torch.float32, device=self.device)
        unit.codec.decode(unit.wire, out, 1)
        return out

    def load_master_shard(self, unit: FlatUnit, values: torch.Tensor) -> None:
        """Overwrite the unit's shard (checkpoint load); call weights_changed() afterwards."""
        if unit.master is not None:
            unit.master.copy_(values)
        else:  # quantizing dequantized codes gives the same codes back: reloading is exact
            unit.codec.encode(values.to(self.device, torch.float32), unit.wire)

    def zero_grad(self) -> None:
        self._finish_reduces()
        for u in self.units.values():
            if u.grad_shard is not None:
                u.grad_shard.zero_()
        self.micro_batches = 0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded in fp32, under all its names (like model.state_dict())."""
        out = {}
        for u in self.units.values():
            full = torch.empty(u.padded_numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, self.master_shard(u), tag="consolidate")
            for slot in u.slots:
                tensor = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                for name in slot.alias_names:
                    out[name] = tensor
        return out

    def model_state_bytes(self) -> dict[str, int]:
        """Per-rank model-state memory by kind: master, optimizer states, comm copy, gradient shard."""
        totals: dict[str, int] = {}
        for u in self.units.values():
            wire = "quantized frozen weights" if u.stored_quantized else "comm copy"
            state = {**u.model_state_bytes(), wire: u.wire.numel() * u.wire.element_size()}
            if u.secondary is not None:
                state["hpZ secondary"] = u.secondary.numel() * u.secondary.element_size()
            for k, v in state.items():
                totals[k] = totals.get(k, 0) + v
        totals["optimizer states"] = sum(
            t.numel() * t.element_size() for state in self.optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        return totals

    def zero3_cross_node_bytes(self) -> dict[str, int]:
        """Cross-node bytes this rank sends in one training step under plain ZeRO-3 (bf16 wire,
        no qwZ, hpZ or qgZ) for this model and node layout, by the ledger's rules: the baseline
        ZeRO++'s ledger figures are compared with (the tests check it against a ZeRO-3 run)."""
        world = self.topo.world_size
        remote = world - self.topo.ranks_per_node  # peers on other nodes

        def cross(units):
            return sum(remote * -(-max(1, u.numel) // world) * DTYPES["bf16"].itemsize for u in units)

        return {"forward gather": cross(self.units.values()), "backward gather": cross(self.blocks),
                "gradient reduce": cross(u for u in self.units.values() if u.trainable)}

    def close(self) -> None:
        self._finish_reduces()
        for h in self._hooks:
            h.remove()
        self.comm.close()
