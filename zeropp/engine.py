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

from zeropp.buffers import BufferPool
from zeropp.checkpoint import SHARDED, full_state_dict, load_shards, load_unsharded, save_shards, unshard
from zeropp.comm import Comm
from zeropp.config import ZeroConfig, ZeroConfigError
from zeropp.plan import (FROZEN_SUFFIX, UnsupportedModelError, partition_units,  # noqa: F401 (re-exported)
                         predicted_step_bytes, rotating_buffer_count, zero3_cross_node_bytes)
from zeropp.quantized import PlainCodec, QuantizedCodec
from zeropp.qgz import QuantizedReduce
from zeropp.reducers import ExactReduceScatter
from zeropp.runtime import InferenceWeights, Runtime, Timings, clip_by_norm_, squared_norm
from zeropp.separate import ProjectedReduce, Separate
from zeropp.topology import Mesh, mesh_from_config
from zeropp.unit import Phase, Unit, UnitState


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
        self.mesh = mesh or mesh_from_config(cfg)
        self.comm = Comm(self.mesh, node_aware=cfg.node_aware_collectives)
        self.ledger = self.comm.ledger
        self.timings = Timings()
        self.gradient_divide_factor = float(self.mesh.world_size)
        self.units = self._build_units(model, weights)
        self._unit_numels = {name: sum(slot.numel for slot in u.slots) for name, u in self.units.items()}
        self.reducer = self._build_reducer()
        # A block's units (trainable, then frozen) are gathered, computed and freed together.
        self.block_groups = [[self.units[n] for n in (f"blocks.{i}", f"blocks.{i}{FROZEN_SUFFIX}") if n in self.units]
                             for i in range(len(model.blocks))]
        self.blocks = [u for group in self.block_groups for u in group]
        self.resident = [self.units[n] for base in ("embedding", "norms") for n in (base, base + FROZEN_SUFFIX)
                         if n in self.units]
        for u in self.units.values():
            if u.delta_codec is not None:  # every unit (resident ones too) keeps its references
                u.enable_secondary(self.mesh.ranks_per_node, self.mesh.node)
            elif cfg.hpz and self.mesh.secondary_size > 1 and u in self.blocks:
                u.enable_secondary(self.mesh.secondary_size)  # resident units are not re-gathered for the backward
        self._slots = rotating_buffer_count([[u.padded_numel for u in group] for group in self.block_groups], cfg)
        self.pool = BufferPool(self.block_groups, self.resident, self._slots, 2 if cfg.overlap_comm else 1,
                               self.param_dtype, self.device, self._decodes_in_place)

        # The block order of the first forward: prefetch follows it, and a block's position
        # picks which of the rotating buffers it uses.
        self._order: list[list[Unit]] = []
        self._order_known = False
        self._position: dict[int, int] = {}
        self._computing: list[Unit] = []  # the block group whose forward or backward runs
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

    def _build_units(self, model: nn.Module, weights) -> dict[str, Unit]:
        """One Unit per group of `partition_units`, with what its all-gather sends: the shard in the
        comm dtype, or qwZ's codes + scales. Frozen units under zero_quantized_nontrainable_weights
        are stored as codes: their wire shard is the only copy of the weights, gathered as it is,
        never requantized. With qwZ deltas trainable units gather their weights in the comm dtype
        from the node's references; only the quantized change crosses nodes."""
        cfg, mesh = self.config, self.mesh
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
        plain = PlainCodec(self.comm_dtype)
        units = {}
        for name, params in partition_units(model).items():
            frozen = name.endswith(FROZEN_SUFFIX)
            stored_quantized = frozen and cfg.zero_quantized_nontrainable_weights
            deltas = cfg.zero_quantized_weights_delta and not frozen
            wire = qwz if cfg.zero_quantized_weights else plain
            codec = (qwz if stored_quantized else wire) if frozen else plain if deltas else wire
            units[name] = Unit(name, params, mesh.world_size, mesh.rank, self.device, codec, stored_quantized,
                               cfg.param_align(frozen), cfg.shard_align(frozen),
                               delta_codec=wire if deltas else None, weights=weights,
                               host=torch.device("cpu") if cfg.offload_optimizer == "cpu" else None)
        return units

    def _decodes_in_place(self, unit: Unit) -> bool:
        """The gathered bytes are the weights themselves (wire dtype = compute dtype), unless a
        node-aware gather's shards must be put in place while decoding."""
        return unit.codec.dtype == self.param_dtype and unit.gather_order(self.comm) is None

    # ------------------------------------------------------------------ gathering

    def _refresh(self, unit: Unit) -> None:
        """Re-encode the unit's wire if its master changed (a named step of its own, timed)."""
        with self.timings.timer("weight encode"):
            unit.refresh()

    def _issue_gather(self, unit: Unit, async_op: bool | None = None) -> None:
        unit.gather(self.comm, self._phase, async_op=self.config.overlap_comm if async_op is None else async_op)

    def _due(self, units: list[Unit]) -> list[Unit]:
        """The units whose buffers do not hold their current weights (re-encoded first where the
        master changed): a block whose buffer no later block took since it was gathered (the last
        blocks of the forward when the backward starts, the first ones of the backward when the
        next micro-batch's forward starts) needs no gather."""
        for unit in units:
            self._refresh(unit)
        return [u for u in units if not u.holds_current()]

    def _ensure_gathered(self, units: list[Unit]) -> None:
        """Wait for the units' prefetched gathers (issuing the missing ones) and decode them."""
        due = self._due(units)
        for unit in due:
            if unit.state is UnitState.SHARDED:  # else its (prefetched) gather is in flight
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
        cfg = self.config
        if group[0].inference is not None or not cfg.overlap_comm:  # a rollout holds it; or nothing overlaps
            return
        due = [u for u in self._due(group) if u.state is UnitState.SHARDED
               and u.padded_numel <= cfg.stage3_prefetch_bucket_size]
        if due:
            self.pool.take(group)
        for unit in due:
            self._issue_gather(unit, async_op=True)

    def _begin(self, group: list[Unit], grad: bool) -> None:
        """The group's block runs now (its forward, or its backward): bind it, and mark it in use
        until it ends, so no prefetch takes its buffer."""
        self._end_computing()
        for unit in group:
            unit.bind(grad, self._reduce)
            unit.begin_use()
        self._computing = group

    def _end_computing(self) -> None:
        for unit in self._computing:
            unit.end_use()
        self._computing = []

    # ------------------------------------------------------------------ hooks

    def _model_pre_forward(self, module, args):
        grad = torch.is_grad_enabled()
        if self._rollout is None:
            self._phase = Phase.FORWARD
        elif grad:
            raise RuntimeError("a forward inside Zero3Engine.inference_weights must run under torch.no_grad(): "
                               "the inference copy has no gradient path; train outside the context")
        self._end_computing()  # a forward or backward that failed midway may have left one
        # Own buffers: gathered once per weight update. Their gathers go out first, the first
        # blocks' right behind them, before anything waits (synchronous ones: in _ensure_gathered).
        stale = self._due(self.resident)
        for u in stale:
            if u.state is UnitState.SHARDED and self.config.overlap_comm:  # else issued when the optimizer stepped
                self._issue_gather(u)
        if self._order_known:
            self._prefetch_from(0, +1)
        self._ensure_gathered(stale)
        if self._rollout is not None:  # weights edited inside the context: renew their copies
            self._gather_copies(self._due([u for u in self.blocks if u.inference is not None]))
        for u in self.resident:
            u.bind(grad, self._reduce)

    def _block_pre_forward(self, group: list[Unit]):
        if not self._order_known and id(group[0]) not in self._position:
            for unit in group:
                self._position[id(unit)] = len(self._order)
            self.pool.assign(group, len(self._order))
            self._order.append(group)
        if group[0].inference is None:  # a held inference copy is only bound (again): no gather
            self.pool.take(group)
            self._ensure_gathered(group)
        self._begin(group, torch.is_grad_enabled())
        if self._order_known:
            self._prefetch_from(self._position[id(group[0])] + 1, +1)

    def _block_post_forward(self, group: list[Unit], output):
        self._end_computing()
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
        for u in self._due(self.resident):
            if u.state is UnitState.SHARDED:
                self._issue_gather(u)
        self._prefetch_from(0, +1)

    def _wait_gathers(self) -> None:
        """Let every gather in flight land undecoded (before the buffers are handed elsewhere, or closing)."""
        for u in self.units.values():
            u.drop_gather()

    # ------------------------------------------------------------------ backward

    def _set_grad_target(self, unit: Unit) -> None:
        unit.grad_target = self.pool.grad_target(unit, self._wait_reduce)
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
            return
        self._end_computing()  # the block above is done: its buffer may be taken
        self.pool.take(units)
        self._ensure_gathered(units)
        # Bound again, as in the forward: an activation-checkpointed block's recompute
        # (trainer/activation_checkpointing.py) runs its forward without the hooks and must
        # see the gathered weights, not the pieces a release left. Its gates belong to the
        # recompute's graph, which autograd never runs backward: the forward's gates reduce.
        with torch.enable_grad():
            self._begin(units, True)
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
        self._end_computing()
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
            gather = compute if self._decodes_in_place(u) else self.pool.new(u.gathered_numel, u.codec.dtype)
            u.hold_inference_copy(gather, compute)
            u.gather(self.comm, self._phase, async_op=True)

        for i, u in enumerate(units):
            if u.state is UnitState.SHARDED:
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
        self._end_computing()
        self.pool.release_all()
        self._rollout, self._phase = info, Phase.ROLLOUT
        try:
            with self.timings.timer("weight encode"):
                for u in self.units.values():
                    u.refresh()
            self._ensure_gathered(self.resident)
            for u in held:
                u.hold_inference_copy(None, self.pool.new(u.padded_numel, self.param_dtype))
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
        return unshard(self, tensors)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self)

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
        buffers = sum(b.numel() * b.element_size() for b in self.pool.block_buffers)
        return (f"{self.config.describe()}, gradients by {self.reducer.describe()}, {self._slots} of "
                f"{len(self.block_groups)} blocks gathered at once ({buffers / 2**20:.1f} MB of buffers) | "
                f"topology: {self.mesh.describe()}")

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        return zero3_cross_node_bytes(self._unit_numels, self.mesh, self.comm.node_aware, micro_batches)

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        """What this rank should send in one training step, by ledger tag (zeropp.plan.predicted_step_bytes)."""
        return predicted_step_bytes(self.units, self.block_groups, self._slots, self.comm, self.reducer, micro_batches)

    def preallocated_buffers(self) -> list[torch.Tensor]:
        return self.pool.preallocated()

    def buffer_bytes(self) -> int:
        return self.pool.nbytes()

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
