"""Plain data parallelism behind the runtime interface: PyTorch DDP, the baseline.

Every rank holds the whole model and optimizer; gradients are all-reduced in DDP's buckets
by a communication hook that divides by the gradient divide factor and records each bucket
in the ledger, so a DDP run's traffic is reported like ZeRO's. One process: no wrapper.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from zeropp.checkpoint import FULL, load_full, save_full
from zeropp.comm import Comm, CommLedger
from zeropp.config import ZeroConfig
from zeropp.engine import partition_units, unit_numels, zero3_cross_node_bytes
from zeropp.runtime import Runtime, Timings
from zeropp.topology import build_mesh


class DDPRuntime(Runtime):
    checkpoint_format = FULL

    def __init__(self, model: nn.Module, config: ZeroConfig | None = None, device: torch.device | None = None):
        self.module = model
        self.config = config or ZeroConfig()
        self.timings = Timings()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.gradient_divide_factor = float(self.world_size)
        self.mesh = self.comm = self._ddp = None
        self.ledger = CommLedger()
        if self.world_size > 1:
            self.mesh = build_mesh(ranks_per_node=self.config.ranks_per_node, thread_groups=False)
            self.comm = Comm(self.mesh, self.ledger)
        if self.world_size > 1 and any(p.requires_grad for p in model.parameters()):  # a frozen model: no DDP
            device = device or torch.device("cpu")
            # find_unused_parameters also keeps DDP from rebuilding its buckets after the first
            # step; a rebuild changes the summation order, so a resumed run would not be bit-exact.
            self._ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                find_unused_parameters=True)
            self._ddp.register_comm_hook(None, self._all_reduce_hook)

    def _all_reduce_hook(self, _, bucket):
        buffer = bucket.buffer()
        if self.gradient_divide_factor != 1:
            buffer.div_(self.gradient_divide_factor)
        work = self.comm.all_reduce(buffer, tag="gradient reduce", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def __call__(self, *args, **kwargs):
        return (self._ddp or self.module)(*args, **kwargs)

    def no_sync(self):
        return self._ddp.no_sync() if self._ddp else super().no_sync()

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = float(factor)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def save(self, directory, optimizer) -> None:
        save_full(directory, self.module, optimizer, dist.get_rank() if dist.is_initialized() else 0)

    def load(self, directory, optimizer) -> None:
        load_full(directory, self.module, optimizer)

    def describe(self) -> str:
        if self.mesh is None:
            return "one process"
        return f"DDP (fp32 all-reduce) | topology: {self.mesh.describe()}"

    def zero3_cross_node_bytes(self) -> dict[str, int]:
        if self.mesh is None:
            return {}
        return zero3_cross_node_bytes(unit_numels(partition_units(self.module)), self.mesh)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
