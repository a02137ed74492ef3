"""Plain data parallelism behind the runtime interface: PyTorch DDP, the baseline.

Every rank holds the whole model and optimizer; gradients are all-reduced in DDP's buckets
by a communication hook that divides by the gradient divide factor and records each bucket
in the ledger, so a DDP run's traffic is reported like ZeRO's. One process: no wrapper.

`gradient_compression` swaps the hook: SEPARATE (the same `ProjectedReduce` ZeRO uses)
all-reduces each bucket's projections and reconstructs (its state is saved per rank beside the
full checkpoint, in the file ZeRO uses), or torch's own PowerSGD hook runs (the low-rank baseline).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from zeropp.checkpoint import (FULL, load_full, load_full_tensors, load_reducer_state, model_tensors,
                               save_full, save_reducer_state)
from zeropp.comm import Comm, CommLedger
from zeropp.config import ZeroConfig
from zeropp.plan import partition_units, unit_numels, zero3_cross_node_bytes
from zeropp.runtime import Runtime, Timings, clip_by_norm_, squared_norm
from zeropp.separate import ProjectedReduce, Separate
from zeropp.topology import Mesh, mesh_from_config, new_group


class DDPRuntime(Runtime):
    checkpoint_format = FULL

    def __init__(self, model: nn.Module, config: ZeroConfig | None = None, device: torch.device | None = None,
                 mesh: Mesh | None = None, site_size: int | None = None):
        """mesh: the groups to run over (a tensor-parallel runtime passes its TP x DP mesh; DDP then
        spans its `dp` group; it stays the caller's); by default built from the config over the whole
        world (DiLoCo: over sites of `site_size` ranks) and closed with the runtime."""
        self.module = model
        self.config = config or ZeroConfig()
        self.timings = Timings()
        self._own_mesh = mesh is None
        if mesh is None and (site_size or (dist.is_initialized() and dist.get_world_size() > 1)):
            mesh = mesh_from_config(self.config, site_size=site_size)
        self.world_size = mesh.world_size if mesh else 1
        self.gradient_divide_factor = float(self.world_size)
        self.mesh = self.comm = self._ddp = self.reducer = self._powersgd = self._powersgd_group = None
        self.ledger = CommLedger()
        if mesh is not None:
            self.mesh, self.comm = mesh, Comm(mesh, self.ledger)
        if self.world_size > 1 and any(p.requires_grad for p in model.parameters()):  # a frozen model: no DDP
            device = device or torch.device("cpu")
            # find_unused_parameters also keeps DDP from rebuilding its buckets after the first
            # step; a rebuild changes the summation order, so a resumed run would not be bit-exact.
            # torch's PowerSGD hook issues its later all-reduces from the first one's callback; on
            # gloo those threads race another bucket's (ranks disagree on the order and gloo
            # aborts), so under gloo it gets one bucket.
            one_bucket = (self.config.gradient_compression.method == "powersgd" and device.type != "cuda")
            bucket_mb = sum(p.numel() * p.element_size() for p in model.parameters()) // 2**20 + 1
            self._ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                process_group=self.mesh.group("dp"), find_unused_parameters=True,
                                                bucket_cap_mb=bucket_mb if one_bucket else None)
            # find_unused_parameters routes the outputs through DDP's sink, which by default clones them (a
            # whole logits tensor more of memory, and its copy: +14-30% step time on gpt2-tiny); nothing here
            # changes a model's output in place (which the clone is for: autograd would name such an edit)
            self._ddp._set_ddp_sink_clone(False)
            self._register_hook(device)
        self.device = device

    def _register_hook(self, device: torch.device) -> None:
        compression = self.config.gradient_compression
        if compression.method == "powersgd":
            # Its own group: the hook chains all-reduces in gloo's callbacks, which must not
            # interleave with DDP's own all-reduces (the unused-parameter map) on the default group.
            tp, dp = self.mesh.tp_size, self.mesh.world_size  # one group per tensor-parallel index (collective)
            groups = [new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
            self._powersgd_group = groups[dist.get_rank() % tp]
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=self._powersgd_group, matrix_approximation_rank=compression.powersgd_rank,
                start_powerSGD_iter=2, random_seed=compression.seed)
            self._ddp.register_comm_hook(self._powersgd, self._powersgd_hook)
        elif compression.separate:
            self.reducer = ProjectedReduce(self.comm, Separate(compression, device), None, self.timings)
            self._ddp.register_comm_hook(None, self._separate_hook)
        else:
            self._ddp.register_comm_hook(None, self._all_reduce_hook)

    def _all_reduce_hook(self, _, bucket):
        buffer = bucket.buffer()
        if self.gradient_divide_factor != 1:
            buffer.div_(self.gradient_divide_factor)
        work = self.comm.all_reduce(buffer, tag="gradient reduce", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _powersgd_hook(self, state, bucket):
        """torch's PowerSGD hook averages over the ranks: pre-scale so the result is sum / factor.
        It issues its all-reduces itself; the ledger gets their elements from the hook's own
        statistics (the uncompressed tensors, P and Q), or the whole bucket while it still runs
        plain all-reduces (before start_powerSGD_iter)."""
        buffer = bucket.buffer()
        if self.gradient_divide_factor != self.world_size:
            buffer.mul_(self.world_size / self.gradient_divide_factor)
        before = state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        numel = state.total_numel_after_compression - before or buffer.numel()
        self.comm.record_all_reduce("gradient reduce", buffer.dtype, numel * buffer.element_size())
        return future

    def _separate_hook(self, state, bucket):
        """Each bucket is one row of blocks: all-reduce its projections, reconstruct it whole (in the
        compressor's warm-up rounds the plain all-reduce)."""
        key = f"bucket{bucket.index()}"
        if self.reducer.compressor.exact_round(key):
            return self._all_reduce_hook(state, bucket)
        buffer = bucket.buffer()
        if self.gradient_divide_factor != 1:
            buffer.div_(self.gradient_divide_factor)
        return self.reducer.all_reduce(key, buffer)

    def __call__(self, *args, **kwargs):
        return (self._ddp or self.module)(*args, **kwargs)

    def no_sync(self):
        return self._ddp.no_sync() if self._ddp else super().no_sync()

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = float(factor)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]  # already the mean
        return clip_by_norm_(grads, squared_norm(grads, next(self.module.parameters()).device), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """The whole model, its gradients and (several processes) DDP's gradient buckets, and the
        optimizer's states when given."""
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
        params = list(self.module.parameters())
        trainable = [p for p in params if p.requires_grad]
        totals = {"weights": nbytes(params), "gradients": nbytes(trainable)}
        if self._ddp is not None:
            totals["gradient buckets"] = nbytes(trainable)
        if self.reducer is not None and self.reducer.compressor.feedback.errors:
            totals["gradient error feedback"] = self.reducer.compressor.error_bytes()
        if optimizer is not None:
            totals["optimizer states"] = nbytes(t for state in optimizer.state.values() for t in state.values()
                                                if isinstance(t, torch.Tensor) and t.dim() > 0)
        return totals

    def save(self, directory, optimizer) -> None:
        save_full(directory, self.module, optimizer, self.mesh.rank if self.mesh else 0)
        if self.reducer is not None:  # each rank's error buffers and round counters
            save_reducer_state(self.reducer, directory, self.mesh.rank, self.world_size)

    def load_unsharded(self, tensors, optimizer) -> None:
        weights = model_tensors(self.module)
        load_full_tensors(self.module, optimizer, {k: v for k, v in tensors.items() if k in weights},
                          {k: v for k, v in tensors.items() if k not in weights})

    def load(self, directory, optimizer) -> None:
        load_full(directory, self.module, optimizer)
        if self.reducer is not None:
            load_reducer_state(self.reducer, directory, self.mesh.rank, self.world_size, self.device)

    def describe(self) -> str:
        if self.mesh is None:
            return "one process"
        compression = self.config.gradient_compression
        reduce = compression.describe() if compression.enabled else "fp32 all-reduce"
        return f"DDP ({reduce}) | topology: {self.mesh.describe()}"

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        if self.mesh is None:
            return {}
        return zero3_cross_node_bytes(unit_numels(partition_units(self.module)), self.mesh, self.comm.node_aware,
                                      micro_batches)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
        if self._own_mesh and self.mesh is not None:
            self.mesh.close()
        if self._powersgd_group is not None:
            dist.destroy_process_group(self._powersgd_group)
        # torch's DDP (its C++ reducer holds the hook's state and groups) goes now, not at some later collection
        self._ddp = self._powersgd = self._powersgd_group = None
