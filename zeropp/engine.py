"""ZeRO-3 / ZeRO++, applied to an unmodified model from outside: the scheduler over its units.

Units (zeropp.unit, made by zeropp.plan.build_units): each transformer block is one; the
embeddings with the LM head (and OPT's project_in/out) form one; all norms form one (as in
YaFSDP); frozen parameters of each form a unit of their own. The buffers they are gathered into
are zeropp.buffers.BufferPool's. The engine decides when each unit moves through its data flow:

Forward: a unit's wire is re-encoded just before its gather when its master changed (the
optimizer stepped, a checkpoint loaded). The model's pre-hook gathers the two resident units
(embeddings, norms) into buffers of their own, once per weight update, and issues the first
blocks' gathers behind theirs before it waits for anything. A block's pre-hook gathers it into
one of `prefetch_depth` + 1 preallocated, rotating buffers (more when
`stage3_max_reuse_distance` keeps the forward's last blocks gathered for the backward) and binds
its parameters as views of it; the next blocks' gathers (`prefetch_depth` of them) are issued
first (prefetch in the order recorded on the first forward), so communication overlaps compute.

Backward: an identity autograd function on each block's output (`_PreBackward`) fires
before the block's backward: it re-gathers the block (from the hpZ secondary when valid)
into the same buffer and prefetches the next ones. The parameters' gradients land in one
flat buffer per unit; the unit's gate fires when all are in, and the engine hands the flat
gradient to the reducer (zeropp.reducers), asynchronously. When the backward ends, a final
callback waits for every reduce, so each parameter's .grad (a view of the unit's fp32
gradient shard) holds the sum over ranks divided by the gradient divide factor.

Step: the caller's optimizer steps the registered shard pieces (`model.parameters()`); its
post-hook issues the next forward's first gathers, and the next forward re-encodes what changed.

Rollouts (`inference_weights`, phase ROLLOUT): zeropp.rollout.Rollout gathers the model once
into copies of its own for generation's no-grad forwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from zeropp.buffers import BufferPool
from zeropp.checkpoint import SHARDED, full_state_dict, load_shards, load_unsharded, save_shards, unshard
from zeropp.comm import Comm
from zeropp.config import ZeroConfig
from zeropp.plan import FROZEN_SUFFIX, UnsupportedModelError, partition_units  # noqa: F401 (re-exported)
from zeropp.plan import (build_units, model_state_bytes, predicted_step_bytes, rotating_buffer_count, schedule_groups,
                         zero3_cross_node_bytes)
from zeropp.qgz import QuantizedReduce
from zeropp.reducers import ErrorFeedback, ExactReduceScatter
from zeropp.rollout import Rollout
from zeropp.runtime import Runtime, Timings, clip_by_norm_, squared_norm
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
    """Pass every grad-requiring tensor of a module's output through _PreBackward (under autograd)."""
    if not torch.is_grad_enabled():
        return output
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
                 device: torch.device | None = None, weights=None, site_size: int | None = None):
        """`model` may be on the meta device (partly or wholly): then each rank reads just its shards
        of those parameters from `weights` (models.weights.WeightSource), unit by unit, and never
        holds the full model. mesh None: built from the config (over DiLoCo's sites of `site_size`
        ranks where given) and closed with the engine; a mesh passed in stays its owner's."""
        self.module = model
        self.config = cfg = config or ZeroConfig(stage=3)
        self.comm_dtype, self.param_dtype = cfg.comm_dtype, cfg.compute_dtype
        self.device = device or torch.device("cpu")
        self._own_group = not dist.is_initialized()
        if self._own_group:  # one process without a launcher: a group of one, so collectives work
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        # The layout: by default the one the config asks for (its ranks per node, hpZ's secondary group size).
        self._own_mesh = mesh is None
        self.mesh = mesh or mesh_from_config(cfg, site_size=site_size)
        self.comm = Comm(self.mesh, node_aware=cfg.node_aware_collectives)
        self.ledger, self.timings = self.comm.ledger, Timings()
        self.gradient_divide_factor = float(self.mesh.world_size)
        # The units, the reducer of their gradients, the buffers they are gathered into.
        self.units = build_units(model, cfg, self.mesh, self.device, weights)
        self.reducer = self._build_reducer()
        self.block_groups, self.resident = schedule_groups(self.units, len(model.blocks))
        self.blocks = [u for group in self.block_groups for u in group]
        slots = rotating_buffer_count([[u.padded_numel for u in group] for group in self.block_groups], cfg)
        self.pool = BufferPool(self.block_groups, self.resident, slots, 2 if cfg.overlap_comm else 1,
                               self.param_dtype, self.device, self.comm)
        # The schedule: the block order of the first forward (prefetch follows it, and a block's
        # position picks which of the rotating buffers it uses), the block computing, the phase.
        self._order: list[list[Unit]] = []
        self._position: dict[int, int] = {}  # id of a group's first unit -> its place in _order
        self._order_known = False
        self._computing: list[Unit] = []  # the block group whose forward or backward runs
        self._phase = Phase.FORWARD
        self._rollout: Rollout | None = None  # set inside inference_weights
        self._hooks = self._register_hooks(model)

    def _register_hooks(self, model: nn.Module) -> list:
        hooks = [model.register_forward_pre_hook(self._model_pre_forward),
                 model.register_forward_hook(self._model_post_forward)]
        for block, group in zip(model.blocks, self.block_groups):
            if group:
                hooks.append(block.register_forward_pre_hook(lambda m, a, g=group: self._block_pre_forward(g)))
                hooks.append(block.register_forward_hook(lambda m, a, o, g=group: self._block_post_forward(g, o)))
        for u in self.units.values():  # each module's trainable parameters bound again right before it runs
            # (after the engine's own hooks bound the unit)
            if u.trainable:
                hooks += [m.register_forward_pre_hook(lambda m, a, u=u: u.bind_module(m)) for m in u.slots_of]
        return hooks

    # ------------------------------------------------------------------ gathering

    def _due(self, units: list[Unit]) -> list[Unit]:
        """The units whose buffers do not hold their current weights (re-encoded first where the
        master changed, timed as "weight encode"): a block whose buffer no later block took since
        it was gathered (the last blocks of the forward when the backward starts, the first ones
        of the backward when the next micro-batch's forward starts) needs no gather."""
        for unit in units:
            with self.timings.timer("weight encode"):
                unit.refresh()
        return [u for u in units if not u.holds_current()]

    def _gather(self, units: list[Unit]) -> None:
        """Issue the gathers of those units that have none in flight (asynchronous under overlap_comm)."""
        for unit in units:
            if unit.state is UnitState.SHARDED:
                unit.gather(self.comm, self._phase, async_op=self.config.overlap_comm)

    def _ensure_gathered(self, units: list[Unit]) -> None:
        """Wait for the units' prefetched gathers (issuing the missing ones) and decode them."""
        due = self._due(units)
        self._gather(due)
        for unit in due:
            unit.decode(self.comm, self._phase, self.timings)

    def _prefetch(self, pos: int, step: int) -> None:
        """Issue the gathers of the prefetch_depth block groups from position `pos` on, in
        direction `step` (+1 forward, -1 backward), into their buffers (those of blocks already
        done); units past stage3_prefetch_bucket_size are gathered when their block runs."""
        cfg = self.config
        if not cfg.overlap_comm:  # nothing overlaps: each block is gathered when it runs
            return
        for at in range(pos, pos + cfg.prefetch_depth * step, step):
            if not 0 <= at < len(self._order) or self._order[at][0].inference is not None:  # a rollout holds it
                continue
            group = self._order[at]
            due = [u for u in self._due(group) if u.state is UnitState.SHARDED
                   and u.padded_numel <= cfg.stage3_prefetch_bucket_size]
            if due:
                self.pool.take(group)
            self._gather(due)

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

    def _wait_gathers(self) -> None:
        """Let every gather in flight land undecoded (before the buffers are handed elsewhere, or closing)."""
        for u in self.units.values():
            u.drop_gather()

    # ------------------------------------------------------------------ forward hooks

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
        if self.config.overlap_comm:  # (those the optimizer step sent are in flight already)
            self._gather(stale)
        if self._order_known:
            self._prefetch(0, +1)
        self._ensure_gathered(stale)
        if self._rollout is not None:  # weights edited inside the context: renew their copies
            self._rollout.renew()
        for u in self.resident:
            u.bind(grad, self._reduce)

    def _block_pre_forward(self, group: list[Unit]):
        if not self._order_known and id(group[0]) not in self._position:
            self._position[id(group[0])] = len(self._order)
            self.pool.assign(group, len(self._order))
            self._order.append(group)
        if group[0].inference is None:  # a held inference copy is only bound (again): no gather
            self.pool.take(group)
            self._ensure_gathered(group)
        self._begin(group, torch.is_grad_enabled())
        if self._order_known:
            self._prefetch(self._position[id(group[0])] + 1, +1)

    def _block_post_forward(self, group: list[Unit], output):
        self._end_computing()
        # Wrapped even when the block is frozen: the backward still needs its weights to carry
        # the gradient to the blocks below.
        return _wrap_outputs(output, self, group)

    def _model_post_forward(self, module, args, output):
        self._order_known = True
        return _wrap_outputs(output, self, self.resident)

    # ------------------------------------------------------------------ backward

    def _pre_backward(self, units) -> None:
        if self._phase is Phase.FORWARD:  # the first gate of this backward: the model's output
            self._phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        for unit in units:
            if unit.trainable:
                unit.collect_grads(self.pool.grad_target(unit, self.timings))
        if units is self.resident:  # their buffers still hold the forward's weights
            self._prefetch(len(self._order) - 1, -1)
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
        self._prefetch(self._position[id(units[0])] - 1, -1)

    def _build_reducer(self):
        cfg = self.config
        qgz = None
        if cfg.zero_quantized_gradients:
            feedback = ErrorFeedback(cfg.zero_quantized_gradients_error_beta, cfg.zero_quantized_gradients_error_reset) \
                if cfg.zero_quantized_gradients_error_feedback else None
            qgz = QuantizedReduce(self.comm, cfg.zero_quantized_gradients_bits, cfg.zero_quantization_block_size,
                                  cfg.zero_quantized_gradients_hops or (2 if self.mesh.num_nodes > 1 else 1),
                                  cfg.zero_quantized_gradients_stages, feedback)
        own = qgz or ExactReduceScatter(self.comm, self.comm_dtype)
        if cfg.gradient_compression.separate:  # SEPARATE's projections, through qgZ when it is on
            return ProjectedReduce(self.comm, Separate(cfg.gradient_compression, self.device), self.comm_dtype,
                                   self.timings, qgz, warmup_reduce=own)
        return own

    def _reduce(self, unit: Unit) -> None:
        unit.wait_reduce(self.timings)  # a temporary buffer's earlier reduce (rare path)
        unit.reduce(self.reducer, self.gradient_divide_factor, async_op=self.config.overlap_comm)

    def _post_backward(self) -> None:
        """End of the backward: every reduce has landed in the gradient shards."""
        self._end_computing()
        for u in self.units.values():
            u.wait_reduce(self.timings)
        self._phase = Phase.FORWARD

    # ------------------------------------------------------------------ the step hook, rollouts

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, with a step post-hook that marks the masters changed and sends the next
        forward's first gathers. An
        offloaded step runs torch's fused AdamW on the host: the for-loop one made a 361.6M-parameter
        step on an H100 node 9.9x slower than on the GPU (DeepSpeed ships its own CPU Adam for this)."""
        if self.config.offload_optimizer == "cpu":
            for group in optimizer.param_groups:
                if "fused" in group:
                    group.update(fused=True, foreach=False)
        if self.config.gradient_compression.separate and self.config.gradient_compression.variance_correction:
            units = list(self.units.values())
            optimizer.register_step_pre_hook(lambda *_: self.reducer.correct_second_moment(optimizer, units))
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        return optimizer

    def _after_step(self) -> None:
        """The masters changed, whatever the kernel (fused ones leave version counters alone): mark
        them for re-encoding, then prefetch."""
        for u in self.units.values():
            u.master_stepped()
        self._prefetch_next_forward()

    def _prefetch_next_forward(self) -> None:
        """Right after an optimizer step: re-encode and issue the next forward's first gathers
        (the embeddings and norms, then the first prefetch_depth blocks), so that they travel
        while the caller logs, evaluates or loads the next batch."""
        cfg = self.config
        if self._rollout is not None or not self._order_known or not (cfg.overlap_comm and cfg.prefetch_across_steps):
            return
        self._phase = Phase.FORWARD
        self._gather(self._due(self.resident))
        self._prefetch(0, +1)

    @contextmanager
    def inference_weights(self, max_bytes: int | None = None):
        """Gather the model once for any number of no-grad forwards (Runtime.inference_weights):
        the blocks that fit `max_bytes` into copies of their own, the rest through the training
        buffers (zeropp.rollout.Rollout). Inside, forwards must run under no_grad; on exit the
        copies go and training goes on as if there had been no rollout (only the embeddings' and
        norms' gather may already be done)."""
        if self._rollout is not None:
            raise RuntimeError("Zero3Engine.inference_weights is already active; it does not nest")
        if self._phase is not Phase.FORWARD:
            raise RuntimeError("Zero3Engine.inference_weights entered during a backward")
        rollout = Rollout(self, max_bytes)
        rollout.keep_prefetched()  # the next forward's gathers, issued when the optimizer stepped
        # The training buffers' occupants let go: a held block never takes a training buffer,
        # so nothing releases its copy's binding while the rollout runs.
        self._wait_gathers()  # the prefetches the rollout does not use
        self._end_computing()
        self.pool.release_all()
        self._rollout, self._phase = rollout, Phase.ROLLOUT
        try:
            yield rollout.gather()
        finally:
            self._wait_gathers()  # a forward that failed midway may leave a prefetch
            rollout.drop()
            self._rollout, self._phase = None, Phase.FORWARD

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The units gathered the rollout's way (qwZ codes and scales, deltas; `inference_weights`) into
        the compute dtype, copied out by name: the weights the runtime's own rollout would sample with."""
        out = {}
        with self.inference_weights():
            for u in self.units.values():
                for slot in u.slots:
                    module, attr = slot.aliases[0]
                    tensor = getattr(module, attr).detach().clone()  # the bound full weight, shadowing the piece
                    for name in slot.alias_names:
                        out[name] = tensor
        return out

    # ------------------------------------------------------------------ the rest of the Runtime interface

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = float(factor)

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
            u.wait_gather()
        save_shards(self, Path(directory), optimizer)

    def load(self, directory, optimizer: torch.optim.Optimizer) -> None:
        load_shards(self, Path(directory), optimizer)

    def load_unsharded(self, tensors, optimizer) -> None:
        load_unsharded(self, tensors, optimizer)

    def describe(self) -> str:
        return (f"{self.config.describe()}, gradients by {self.reducer.describe()}, {self.pool.slots} of "
                f"{len(self.block_groups)} blocks gathered at once ({self.pool.block_bytes() / 2**20:.1f} MB of "
                f"buffers) | topology: {self.mesh.describe()}")

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        numels = {name: sum(slot.numel for slot in u.slots) for name, u in self.units.items()}
        return zero3_cross_node_bytes(numels, self.mesh, self.comm.node_aware, micro_batches)

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        """What this rank should send in one training step, by ledger tag (zeropp.plan.predicted_step_bytes)."""
        return predicted_step_bytes(self.units, self.block_groups, self.pool.slots, self.comm, self.reducer,
                                    micro_batches)

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Per-rank model-state memory by kind (zeropp.plan.model_state_bytes)."""
        return model_state_bytes(self.units.values(), self.reducer, optimizer, self.config.offload_optimizer != "none")

    def preallocated_buffers(self) -> list[torch.Tensor]:
        return self.pool.preallocated()

    def buffer_bytes(self) -> int:
        return self.pool.nbytes()

    def close(self) -> None:
        for u in self.units.values():
            u.wait_reduce(self.timings)
        self._wait_gathers()
        for h in self._hooks:
            h.remove()
        self.comm.close()
        if self._own_mesh:
            self.mesh.close()
        if self._own_group:
            dist.destroy_process_group()
