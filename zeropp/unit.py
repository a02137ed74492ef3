"""A unit: the parameters of one transformer block (or the embeddings, or the norms) as one
flat buffer, and every step of their life in one training step.

Layout: the parameters back to back in model order (each starting at a multiple of
`param_align`, so quantization blocks never straddle two), padded so every rank holds an
equal `shard_numel`-long shard. A unit is all trainable or all frozen.

Per rank a unit holds:
  master       fp32 shard (None for frozen weights stored as qwZ codes: the wire is the copy)
  params       the shard's piece of each parameter, registered on its module as the
               `nn.Parameter` (1-D; `unsharded_shape` tells its full shape), so optimizers,
               clipping, EMAs and state dicts see this rank's weights; their .grad are views
               of `grad_shard`
  grad_shard   fp32 reduced gradients, accumulated over micro-batches
  wire         the shard as the all-gather sends it (zeropp.quantized: a dtype or qwZ codes)
  secondary    hpZ: this rank's part of the gathered wire bytes within its secondary group;
               with qwZ deltas, the references: this node's copy of the weights (the shards
               of the ranks with this local rank, in the communication dtype) that the
               deltas update

The data flow of one step, as methods the engine calls in order:
  refresh()    re-encode the wire when the master changed (an optimizer step, a load)
  gather()     all-gather the wire bytes from a named source (primary: every DP rank;
               secondary: hpZ's group, valid until the next refresh) into a gather buffer
  decode()     wait, decode into the compute buffer; in the forward, keep the hpZ secondary
  bind()       point the modules' attributes at views of the compute buffer (with autograd
               gates that collect the gradients into one flat buffer)
  collect_grads()  take this backward's flat gradient buffer (BufferPool.grad_target)
  reduce()     hand the flat gradient to the reducer (reduce-scatter, qgZ, ...) into grad_shard;
               wait_reduce() waits for it
  release()    drop the modules' views once another unit took the buffer

A rollout (zeropp.rollout.Rollout, inside Zero3Engine.inference_weights) may give a unit an
inference copy: buffers of its own (`inference`) that gather(), decode() and bind() use instead
of the shared ones until drop_inference_copy().
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from zeropp.quantized import delta_gather


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    ROLLOUT = "rollout"  # no-grad forwards inside Zero3Engine.inference_weights (generation; zeropp.rollout)


class UnitState(enum.Enum):
    """Where a unit's full weights are (`Unit.state`), one at a time:

    SHARDED   -> gather()  -> GATHERING -> decode() -> GATHERED <-> COMPUTING (begin_use / end_use)
    GATHERED  -> release() -> SHARDED   (another unit takes the buffer; refused while GATHERING or COMPUTING)
    any       -> refresh() -> SHARDED   when the master changed (the buffer's weights are stale; a
                                         gather in flight is let land and dropped)
    """
    SHARDED = "sharded"  # only the shards: what the buffer holds (if anything) is not the current weights
    GATHERING = "gathering"  # an all-gather into the unit's buffer is in flight (pending_gather)
    GATHERED = "gathered"  # the buffer holds the current weights, decoded
    COMPUTING = "computing"  # a block the schedule is running (its forward, or its backward until the next)


class Secondary(enum.Enum):
    """What the unit's secondary holds (hpZ's slice, or qwZ deltas' references) against the wire."""
    EMPTY = "empty"  # nothing yet (deltas: the next gather sends the weights whole)
    BEHIND = "behind"  # made from older weights (deltas: the next gather sends the change)
    CURRENT = "current"  # made from the current wire: the backward may gather from it


class BufferInUseError(RuntimeError):
    """A unit asked for a buffer that another unit still needs (YaFSDP refuses the same way)."""


class Source(enum.Enum):
    """Where a gather reads from: mesh group name."""
    PRIMARY = "dp"
    SECONDARY = "secondary"


@dataclass
class ParamSlot:
    name: str  # qualified name in the model (the first one, for a shared parameter)
    shape: torch.Size
    offset: int  # into the unit's flat buffer
    trainable: bool
    aliases: list[tuple[nn.Module, str]] = field(default_factory=list)  # every (module, attribute) holding it
    alias_names: list[str] = field(default_factory=list)  # their qualified names

    @property
    def numel(self) -> int:
        return self.shape.numel()


class _WeightGate(torch.autograd.Function):
    """Identity on the unit's flat weights; its backward runs once all the unit's grads are written
    (YaFSDP's GateGradFlow): it calls `on_ready(unit)`."""

    @staticmethod
    def forward(ctx, flat, unit, on_ready):
        ctx.set_materialize_grads(False)
        ctx.unit, ctx.on_ready = unit, on_ready
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, _):
        ctx.on_ready(ctx.unit)
        return None, None, None


class _Narrow(torch.autograd.Function):
    """A parameter as a view of the flat weights; backward adds its grad into the unit's grad target."""

    @staticmethod
    def forward(ctx, flat, offset, shape, unit):
        ctx.offset, ctx.numel, ctx.unit = offset, shape.numel(), unit
        return flat.detach()[offset:offset + shape.numel()].view(shape)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.unit.grad_target[ctx.offset:ctx.offset + ctx.numel].add_(grad.reshape(-1))
        return None, None, None, None


class _CopiedOut:
    """A reduce into a device staging shard whose wait() also adds it into the host's gradient shard."""

    def __init__(self, work, staging: torch.Tensor, grad_shard: torch.Tensor):
        self.work, self.staging, self.grad_shard = work, staging, grad_shard

    def wait(self) -> None:
        self.work.wait()
        self.grad_shard.add_(self.staging.to(self.grad_shard.device))


class Unit:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
                 world_size: int, rank: int, device: torch.device, codec, stored_quantized: bool,
                 param_align: int = 1, shard_align: int = 1, delta_codec=None, weights=None,
                 host: torch.device | None = None):
        """params: (qualified name, parameter, [(module, attribute)], [alias names]) in model order;
        codec: what the gathered bytes hold (zeropp.quantized); stored_quantized: a frozen unit kept
        only as codes; delta_codec: qwZ deltas, the wire holds the codes of the change since the
        last gather (the references, in `codec`'s dtype, come with enable_secondary); weights: where
        the values of parameters on the meta device come from (models.weights.WeightSource); host:
        where the master and gradient shards (and so the optimizer's states) live, when not on
        `device` (ZeRO-Offload)."""
        if len({p.requires_grad for _, p, _, _ in params}) > 1:
            raise ValueError(f"unit {name} mixes trainable and frozen parameters; split them into two units")
        self.name, self.world_size, self.rank, self.device = name, world_size, rank, device
        self.host = host or device
        self.offloaded = host is not None
        self.trainable = params[0][1].requires_grad
        self.slots: list[ParamSlot] = []
        offset = 0
        for qualname, p, aliases, alias_names in params:
            offset = -(-offset // param_align) * param_align
            self.slots.append(ParamSlot(qualname, p.shape, offset, p.requires_grad, aliases, alias_names))
            offset += p.numel()
        self.numel = offset
        self.shard_numel = -(-max(1, -(-self.numel // world_size)) // shard_align) * shard_align
        self.padded_numel = self.shard_numel * world_size
        self.shard_start = rank * self.shard_numel

        self.master: torch.Tensor | None = self._initial_shard(params, weights)
        self.grad_shard = torch.zeros_like(self.master) if self.trainable else None

        self.codec, self.delta_codec = codec, delta_codec
        self.stored_quantized = stored_quantized
        wire = delta_codec or codec
        # An fp32 wire is the master itself (no second fp32 copy): the gather sends the master.
        self.wire_is_master = (wire.dtype == torch.float32 and wire.wire_numel(self.shard_numel) == self.shard_numel
                               and not stored_quantized and not self.offloaded)
        self.wire = self.master if self.wire_is_master else \
            torch.zeros(wire.wire_numel(self.shard_numel), dtype=wire.dtype, device=device)
        self.gathered_numel = world_size * codec.wire_numel(self.shard_numel)
        self.reference_at = 0  # qwZ deltas: where this rank's own shard sits in the references
        self.secondary: torch.Tensor | None = None  # set by enable_secondary()
        self.state = UnitState.SHARDED
        self.secondary_state = Secondary.EMPTY
        self._encoded_master_version = -1  # the master's version counter when the wire was encoded
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gather, compute) per buffer slot
        self.slot = 0  # which of the rotating weight buffers the unit uses (resident units: their own)
        self.grad_slot = 0  # which of the alternating gradient buffers (zeropp.buffers.BufferPool)
        self.grad_buffer: torch.Tensor | None = None  # a resident trainable unit's own gradient buffer
        # A rollout's inference copy: (gather buffer or None once decoded, compute buffer), used
        # instead of buffers[slot] while set.
        self.inference: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self.pending_gather = None
        self.pending_reduce = None
        self.grad_target: torch.Tensor | None = None  # the flat gradient buffer of this backward
        self.writing_grads = False
        self.params: list[tuple[ParamSlot, nn.Parameter, torch.Tensor | None]] = []  # (slot, piece, its grad view)
        self._gated: torch.Tensor | None = None  # the flat weights through the gate while bound with autograd
        self.slots_of: dict[nn.Module, list[ParamSlot]] = {}  # module -> the slots it holds (bind_module)
        for slot in self.slots:
            for module, _ in slot.aliases:
                self.slots_of.setdefault(module, []).append(slot)

        self.refresh()
        if stored_quantized:
            self.master = None  # from now on the codes are the weights
        self._register_parameters()

    # ------------------------------------------------------------------ parameters

    @torch.no_grad()
    def _initial_shard(self, params, weights) -> torch.Tensor:
        """This rank's fp32 shard, filled parameter by parameter with just the slice of each that
        falls in it: from the parameter itself, or from `weights` for one on the meta device (the
        model was never materialized; the rank reads only what it keeps)."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.host,
                            pin_memory=self.offloaded and self.device.type == "cuda")
        for slot, (_, p, _, _) in zip(self.slots, params):
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if b <= a:
                continue
            if not p.is_meta:
                values = p.detach().reshape(-1)[a - slot.offset:b - slot.offset]
            elif weights is None:
                raise ValueError(f"parameter {slot.name} is on the meta device and no weight source was given "
                                 f"(models.weights: InitWeights for a fresh model, models.hf.HFCheckpointWeights)")
            else:
                values = weights.read(slot.name, a - slot.offset, b - slot.offset)
            shard[a - lo:b - lo] = values.to(self.host, torch.float32)
        return shard

    def _register_parameters(self) -> None:
        """Replace each parameter on its modules by this rank's piece of it (possibly empty)."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            a, b = (a, b) if b > a else (lo, lo)  # no element here: an empty piece
            if self.master is None:  # weights stored as codes: nothing in fp32 to expose
                for module, attr in slot.aliases:
                    del module._parameters[attr]
                continue
            piece = nn.Parameter(self.master[a - lo:b - lo], requires_grad=self.trainable)
            piece.unsharded_shape = slot.shape  # the weight-decay rule and checkpoint tools read it
            piece.unsharded_offset = a - slot.offset if b > a else 0
            grad = self.grad_shard[a - lo:b - lo] if self.trainable else None
            self.params.append((slot, piece, grad))
            for module, attr in slot.aliases:
                module._parameters[attr] = piece

    def attach_grads(self) -> None:
        """Make each piece's .grad the view of grad_shard the reduce writes into, keeping what it
        held (the optimizer's zero_grad may have set it to None, or a user another tensor)."""
        for _, piece, view in self.params:
            if piece.grad is view:
                continue
            if piece.grad is None:
                view.zero_()
            else:
                view.copy_(piece.grad)
            piece.grad = view

    def master_shard(self) -> torch.Tensor:
        """The fp32 shard on the compute device (decoded from the codes for weights stored quantized)."""
        if self.master is not None:
            return self.master.to(self.device)
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        self.codec.decode(self.wire, out, 1)
        return out

    def load_master_shard(self, values: torch.Tensor) -> None:
        """Overwrite the shard (checkpoint load); the next refresh() re-encodes it."""
        with torch.no_grad():
            if self.master is not None:
                self.master.copy_(values)
            else:  # quantizing dequantized codes gives the same codes back: reloading is exact
                self.drop_gather()
                self.codec.encode(values.to(self.device, torch.float32), self.wire)
                self._wire_changed()

    # ------------------------------------------------------------------ the step's data flow

    def refresh(self) -> bool:
        """Re-encode the wire if the master changed since (any in-place edit bumps its version
        counter: an optimizer step, a load); what the buffer and the secondary hold is then stale.
        A gather in flight reads the wire (and, with deltas, writes the references): it lands first
        and is dropped. Returns whether it re-encoded."""
        if self.master is None or self.master._version == self._encoded_master_version:
            return False
        self.drop_gather()
        master = self.master.to(self.device, non_blocking=True)  # offloaded: the weights come back
        if self.delta_codec is None:
            self.codec.encode(master, self.wire)
        elif self.secondary_state is not Secondary.EMPTY:  # else the next gather sends the values whole
            own = self.secondary[self.reference_at:self.reference_at + self.shard_numel]
            self.delta_codec.encode(master - own, self.wire)  # computed in fp32
        self._encoded_master_version = self.master._version
        self._wire_changed()
        return True

    def _wire_changed(self) -> None:
        self.state = UnitState.SHARDED
        if self.secondary_state is Secondary.CURRENT:
            self.secondary_state = Secondary.BEHIND

    def holds_current(self) -> bool:
        """The buffer holds the current weights (call refresh() first): no gather needed."""
        return self.state in (UnitState.GATHERED, UnitState.COMPUTING)

    def wait_gather(self) -> None:
        """Let a gather in flight land, still to be decoded (its bytes, and with qwZ deltas the
        references it updates, are then final: a checkpoint may read them)."""
        if self.pending_gather is not None:
            self.pending_gather.wait()

    def drop_gather(self) -> None:
        """Let a gather in flight land without decoding it (the buffer is wanted elsewhere, the
        weights changed, or the engine closes)."""
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None
            self.state = UnitState.SHARDED

    def enable_secondary(self, size: int, node: int = 0) -> None:
        """hpZ: keep 1/size of the gathered bytes, so the backward gathers inside a group of `size`
        (with qwZ deltas: the node's references, this rank's own shard at position `node`)."""
        self.secondary = torch.zeros(self.gathered_numel // size, dtype=self.codec.dtype, device=self.device)
        self.reference_at = node * self.shard_numel

    def master_stepped(self) -> None:
        """An optimizer stepped the master (its kernel may not bump version counters: torch's fused
        AdamW does not): the next refresh() re-encodes."""
        self._encoded_master_version = -1

    def references_current(self) -> bool:
        """qwZ deltas: the references hold the master's weights (nothing to send for them)."""
        return self.secondary_state is Secondary.CURRENT and self.master._version == self._encoded_master_version

    def load_references(self, references: torch.Tensor | None, current: bool) -> None:
        """qwZ deltas, after load_master_shard: restore the references a checkpoint saved (`current`:
        they held the saved weights, so nothing is sent for them), or with None resend the
        weights whole at the next gather."""
        if references is None:
            self.secondary_state = Secondary.EMPTY
        else:
            self.secondary.copy_(references)
            self.secondary_state = Secondary.BEHIND  # so refresh() encodes the change against them
        self._encoded_master_version = -1
        self.refresh()
        if references is not None and current:
            self.secondary_state = Secondary.CURRENT

    def source(self, phase: Phase) -> Source:
        """hpZ: the secondary while it holds the current weights (kept by the first forward after a
        weight update, or a rollout): the backward, and the forwards of later micro-batches and
        frozen weights, gather inside the secondary group; otherwise every data-parallel rank."""
        if self.secondary is not None and self.secondary_state is Secondary.CURRENT:
            return Source.SECONDARY
        return Source.PRIMARY

    def _buffer_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inference if self.inference is not None else self.buffers[self.slot]

    def gather(self, comm, phase: Phase, async_op: bool) -> None:
        """All-gather the current wire (refresh() first) into the unit's gather buffer."""
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"unit {self.name} asked to gather while {self.state.value}")
        gather, _ = self._buffer_pair()
        self.state = UnitState.GATHERING
        if self.delta_codec is not None:  # the change (if any) across nodes, then the references inside
            sent, codec = None, self.delta_codec
            if self.secondary_state is Secondary.EMPTY:
                sent, codec = self.master.to(self.device, self.codec.dtype), None
            elif self.secondary_state is Secondary.BEHIND:
                sent = self.wire
            self.secondary_state = Secondary.CURRENT
            self.pending_gather = delta_gather(comm, gather, self.secondary, sent, codec, tag=f"{phase.value} gather",
                                               async_op=async_op)
            return
        source = self.source(phase)
        shard = self.secondary if source is Source.SECONDARY else self.wire
        self.pending_gather = comm.all_gather(gather, shard, group=source.value, tag=f"{phase.value} gather",
                                              async_op=async_op, node_aware=True)

    def decode(self, comm, phase: Phase, timings) -> None:
        """Wait for the gather, decode into the compute buffer (putting the shards of a node-aware
        gather in place); in a forward with autograd or a rollout (a training forward follows it),
        keep this rank's part of the bytes as the hpZ secondary. The secondary slices of a group
        concatenate to the primary's gathered bytes, so both sources decode in the primary's order."""
        if self.state is not UnitState.GATHERING:
            raise RuntimeError(f"unit {self.name} asked to decode while {self.state.value}")
        timer = timings.timer
        if self.pending_gather is not None:  # a synchronous gather (overlap_comm off) is already in
            with timer("waiting for gathers"):
                self.pending_gather.wait()
                self.pending_gather = None
        gather, compute = self._buffer_pair()
        with timer("weight decode"):
            self.codec.decode(gather, compute, self.world_size, self.gather_order(comm))
        self.state = UnitState.GATHERED
        if self.delta_codec is None and self.secondary is not None and self.secondary_state is not Secondary.CURRENT \
                and (phase is Phase.ROLLOUT or phase is Phase.FORWARD and torch.is_grad_enabled()):
            n = self.secondary.numel()
            j = comm.mesh.group_rank("secondary")
            self.secondary.copy_(gather[j * n:(j + 1) * n])
            self.secondary_state = Secondary.CURRENT

    def gather_order(self, comm) -> list[int] | None:
        """The rank whose shard is at each position of the gathered bytes (None: rank order)."""
        return comm.local_major_order if self.delta_codec is not None else comm.gather_order

    def decodes_in_place(self, comm, compute_dtype: torch.dtype) -> bool:
        """The gathered bytes are the weights themselves (wire dtype = compute dtype), unless a
        node-aware gather's shards must be put in place while decoding: no compute buffer of its own."""
        return self.codec.dtype == compute_dtype and self.gather_order(comm) is None

    def bind(self, grad: bool, on_grads_ready) -> None:
        """Point the modules' attributes at views of the compute buffer; with `grad`, through the
        gates that collect the unit's gradients and call on_grads_ready(unit) when all are in."""
        _, compute = self._buffer_pair()
        # A fresh alias of the buffer (own version counter): re-gathering into the buffer later
        # does not trip autograd's checks on the tensors this forward saves.
        flat = torch.empty(0, dtype=compute.dtype, device=compute.device).set_(
            compute.untyped_storage(), compute.storage_offset(), (self.numel,), (1,))
        gated = None
        if grad and self.trainable:
            flat.requires_grad_(True)
            gated = _WeightGate.apply(flat, self, on_grads_ready)
        self._gated = gated
        for slot in self.slots:
            if gated is not None:
                view = _Narrow.apply(gated, slot.offset, slot.shape, self)
            else:
                view = flat.detach()[slot.offset:slot.offset + slot.numel].view(slot.shape)
            for module, attr in slot.aliases:
                module.__dict__[attr] = view  # shadows the registered piece while bound

    def bind_module(self, module: nn.Module) -> None:
        """Just before `module` runs (its forward pre-hook) in a forward with autograd: its
        parameters anew as views through the gate. Autograd runs a node after every node created
        later whose inputs are ready, so the views made when the unit was bound would hold each
        parameter's gradient until the unit's whole backward is done (a block's worth of
        gradients at once); made here, each is added into grad_target right after the module's own
        backward and freed."""
        if self._gated is None or not torch.is_grad_enabled():
            return
        for slot in self.slots_of[module]:
            view = _Narrow.apply(self._gated, slot.offset, slot.shape, self)
            for owner, attr in slot.aliases:
                if owner is module:
                    owner.__dict__[attr] = view

    def begin_use(self) -> None:
        """The schedule runs the unit's block (its forward, or its backward): its buffer is not to be taken."""
        if self.state is not UnitState.GATHERED and self.state is not UnitState.COMPUTING:
            raise RuntimeError(f"unit {self.name} used while {self.state.value}, not gathered")
        self.state = UnitState.COMPUTING

    def end_use(self) -> None:
        if self.state is UnitState.COMPUTING:
            self.state = UnitState.GATHERED

    def release(self) -> None:
        """Another unit takes the buffer (BufferPool.take checked that this one is done with it): the
        modules' attributes fall back to the registered pieces."""
        self._gated = None
        for slot in self.slots:
            for module, attr in slot.aliases:
                module.__dict__.pop(attr, None)
        if self.inference is None:  # a rollout's copy of its own is not the buffer let go
            self.state = UnitState.SHARDED

    def hold_inference_copy(self, gather: torch.Tensor, compute: torch.Tensor) -> None:
        """From now on gather into `gather` and decode into `compute`, buffers of the unit's own
        (`gather` may be `compute` itself when the wire is the compute dtype)."""
        self.inference = (gather, compute)

    def keep_inference_copy(self, compute: torch.Tensor) -> None:
        """A rollout keeps the weights the training buffer holds (gathered and decoded): copied into
        `compute`, the unit's own copy from now on, with no gather of its own."""
        compute.copy_(self._buffer_pair()[1][:compute.numel()])
        self.inference = (None, compute)

    def drop_gathered_bytes(self) -> None:
        """The inference copy is decoded: let its gathered bytes go, keep the weights."""
        self.inference = (None, self.inference[1])

    def drop_inference_copy(self) -> None:
        """Back to the shared buffers: unbind, and let the copy go (freed with its last view)."""
        self.drop_gather()
        self.end_use()
        self.inference = None
        self.release()

    def collect_grads(self, grad_target: torch.Tensor) -> None:
        """This backward writes the unit's gradients into `grad_target` (zeroed, BufferPool.grad_target);
        each piece's .grad is the view of grad_shard the reduce adds into."""
        self.grad_target = grad_target
        self.writing_grads = True
        self.attach_grads()

    def wait_reduce(self, timings) -> None:
        """Wait for the reduce in flight (if any): its gradients are then in grad_shard, and its
        gradient buffer free."""
        if self.pending_reduce is not None:
            with timings.timer("waiting for reductions"):
                self.pending_reduce.wait()
                self.pending_reduce = None

    def reduce(self, reducer, divide: float, async_op: bool) -> None:
        """All the unit's gradients are in grad_target: reduce them (divided by `divide`) into grad_shard."""
        grad = self.grad_target[:self.padded_numel]
        if divide != 1:
            grad.div_(divide)
        if not self.offloaded:
            self.pending_reduce = reducer.reduce(self.name, self.grad_shard, grad, async_op=async_op)
        else:  # reduced on the device into a staging shard, added to the host's when it lands
            staging = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
            self.pending_reduce = _CopiedOut(reducer.reduce(self.name, staging, grad, async_op=async_op),
                                             staging, self.grad_shard)
        self.writing_grads = False

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds for the unit (optimizer states: zeropp.plan.model_state_bytes)."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = {} if self.wire_is_master else \
            {"quantized frozen weights" if self.stored_quantized else "comm copy": nbytes(self.wire)}
        where = " (host)" if self.offloaded else ""
        if self.master is not None:
            out["master" + where] = nbytes(self.master)
        if self.grad_shard is not None:
            out["gradient shard" + where] = nbytes(self.grad_shard)
        if self.secondary is not None:
            out["qwZ delta references" if self.delta_codec is not None else "hpZ secondary"] = nbytes(self.secondary)
        return out
