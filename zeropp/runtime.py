"""One interface for every data-parallel runtime: what the trainer calls, whatever it drives.

The trainer builds a runtime from the config (`build_runtime`: plain DDP for
`zero_optimization.stage: 0`, our ZeRO-3 / ZeRO++ engine for `stage: 3`; the benchmarks add
FSDP2 and DeepSpeed) and from then on uses only this:

    runtime = build_runtime(model, cfg.zero_optimization, device, cfg.tensor_parallel)
    optimizer = runtime.attach_optimizer(build_optimizer(runtime.module, cfg.optim))
    runtime.set_gradient_divide_factor(1.0)     # the loss is already the global mean
    for micro-batch:
        with (nullcontext() if last else runtime.no_sync()):
            runtime.backward(loss_fn(runtime(tokens)))
    norm = runtime.clip_grad_norm_(max_norm)    # the global norm, over every rank's gradients
    optimizer.step(); optimizer.zero_grad()
    runtime.save(directory, optimizer) / runtime.load(directory, optimizer)
    with runtime.inference_weights(max_bytes) as info:   # RLHF rollouts (rlhf.generation)
        runtime.module(...) under no_grad, any number of times (prefill + each decoded token)

After wrapping, `runtime.module.parameters()` are what this rank's optimizer steps: the
full tensors under DDP, this rank's shards under ZeRO-3 (see docs/architecture.md). Their
gradients are the mean over ranks (the sum divided by the gradient divide factor) once
`backward` returns, whether or not anyone clips.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from models.transformer import lm_loss
from zeropp.comm import CommLedger
from zeropp.topology import Mesh


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squares, accumulated in fp64 (a 0-d tensor on `device`)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.double().pow(2).sum()
    return total


def clip_by_norm_(grads: list[torch.Tensor], squared: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale `grads` so that their global L2 norm is at most `max_norm`; `squared` is the sum of
    squares over every rank (`squared_norm`, all-reduced where gradients are sharded). Every
    runtime clips through here, so one process, DDP, ZeRO-3 and TP agree to fp64 accuracy (torch's
    `clip_grad_norm_` accumulates in fp32: on a 1M-element tensor that drifted by 5e-5 in 20 steps)."""
    norm = squared.sqrt().float()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))  # offloaded gradients live on the host
    return norm


class Timings(defaultdict):
    """Seconds the calling thread spent per kind (waiting for gathers, weight encode, ...) since
    the last clear(): where a step's time goes besides compute."""

    def __init__(self):
        super().__init__(float)

    @contextmanager
    def timer(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self[kind] += time.perf_counter() - start


@dataclass
class InferenceWeights:
    """What `Runtime.inference_weights` holds for the forwards inside it.

    bytes: memory the inference copy adds (freed on exit); weights a runtime holds whole anyway
    (DDP's, ZeRO's embeddings and norms) cost nothing. resident_units: units whose full weights
    stay in memory through the context; streamed_units: units gathered per forward instead
    (they did not fit `max_bytes`). collectives_per_forward: a forward inside the context runs
    collectives, so every rank must run the same number of forwards (rlhf.generation keeps the
    ranks stepping together then).
    """

    bytes: int = 0
    resident_units: int = 0
    streamed_units: int = 0
    collectives_per_forward: bool = False


class Runtime:
    """The part of a runtime the trainer sees. Subclasses set `module`, `mesh`, `ledger`."""

    module: nn.Module  # the model; parameters() are what this rank's optimizer steps
    mesh: Mesh
    ledger: CommLedger  # bytes of every collective since the last reset()
    checkpoint_format: str  # state.json "format" of the tensors `save` writes
    timings: Timings
    param_dtype: torch.dtype = torch.float32  # the weights the forward computes with (before autocast)

    def __call__(self, *args, **kwargs):
        """The training forward (through the wrapper that hooks gradient synchronization)."""
        return self.module(*args, **kwargs)

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) among the data-parallel replicas, the ranks that read different batches (the
        ranks of one tensor-parallel group read the same ones; DiLoCo's sites read different ones too)."""
        mesh = getattr(self, "mesh", None)
        if mesh is not None:
            return mesh.site * mesh.world_size + mesh.rank, mesh.sites * mesh.world_size
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of what the module returned (models.transformer.lm_loss; under
        tensor parallelism the logits are vocabulary slices and the runtime computes it its way)."""
        return lm_loss(logits, labels)

    def no_sync(self):
        """Context for the micro-batches before the last one of a step: gradients may stay local."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients are the sum over ranks divided by `factor` (default: the data-parallel
        world size, the mean; 1 when the loss is already normalized over the global batch)."""
        raise NotImplementedError

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the trainer steps (the given one, unless the runtime steps its own way)."""
        return optimizer

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients by their global L2 norm over all ranks; returns the norm before clipping."""
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, under all its names (every rank calls it, every rank gets it)."""
        raise NotImplementedError

    def save(self, directory, optimizer: torch.optim.Optimizer) -> None:
        """Write this rank's part of the model and optimizer state into `directory` (every rank calls it)."""
        raise NotImplementedError

    def load(self, directory, optimizer: torch.optim.Optimizer) -> None:
        """Restore what `save` wrote (every rank calls it)."""
        raise NotImplementedError

    def load_unsharded(self, tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Set the weights and optimizer states from unsharded tensors: parameters by name, states as
        "<param>.<state>" (a checkpoint consolidated and re-sliced for another tensor-parallel size)."""
        raise NotImplementedError

    @contextmanager
    def inference_weights(self, max_bytes: int | None = None):
        """Context for no-grad forwards of `self.module` (generation): the full weights are made
        available once on entry, so the forwards inside (prefill, each decoded token) run without
        collectives where they fit in `max_bytes` of extra memory; yields an InferenceWeights.
        On exit the copy is freed and training goes on exactly as if nothing happened.

        Every rank enters it together. This default is for runtimes holding the full weights
        (DDP): nothing to gather, the module runs as it is.
        """
        yield InferenceWeights()

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The full weights as a rollout's forwards compute with them, under all their names, copied: what a
        sampler that keeps generating while training steps on holds (rlhf.online's rollouts ahead). Every
        rank calls it together. This default copies `full_state_dict` (DDP: the module's own weights)."""
        return {name: t.detach().clone() for name, t in self.full_state_dict().items()}

    def take_notes(self) -> list[str]:
        """What the runtime decided while running that belongs in the log (e.g. a plan it chose on the
        first batch), since the last call."""
        notes, self._notes = getattr(self, "_notes", []), []
        reducer = getattr(self, "reducer", None)  # the gradient reducer of ZeRO and DDP
        return notes + (reducer.take_notes() if reducer is not None else [])

    def describe(self) -> str:
        raise NotImplementedError

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        """Cross-node bytes a rank sends in one step of `micro_batches` passes under plain ZeRO-3
        (bf16) for this model and node layout, by collective: the baseline the step's ledger is
        reported against."""
        raise NotImplementedError

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        """What this rank should send in one training step, by ledger tag ({"sent",
        "cross_node_sent"} bytes), from sizes and configuration alone; {} where not predicted."""
        return {}

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Model-state memory this rank holds, by kind (with the optimizer's states when given);
        {} where not counted."""
        return {}

    def buffer_bytes(self) -> int:
        """Bytes of the communication buffers the runtime allocates once and reuses every step."""
        return 0

    def close(self) -> None:
        pass
