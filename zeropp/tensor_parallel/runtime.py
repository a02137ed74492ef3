"""TensorParallelRuntime: tensor parallelism inside each group of `tensor_parallel.size` ranks,
and a data-parallel runtime (DDP, ZeRO-3 / ZeRO++) across the groups; docs/tensor_parallel.md.

It slices the model (zeropp.tensor_parallel.parallelize), wraps it in the data-parallel runtime,
plans AccTFM's partitions on the first batch (`tensor_parallel.partitions 0`), takes the loss from
the vocabulary slices (zeropp.tensor_parallel.loss) and clips over the whole model. Its checkpoints:
each TP rank's data-parallel runtime writes `tp<rank>/`, rank 0 writes PLAN_FILE (the group size,
each sliced tensor's dim and AccTFM's partition plan, which a resume reuses instead of profiling
again); `consolidated_tensors` puts the slices back together offline, and `load` re-slices a
checkpoint of another TP size.
"""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.transformer import Transformer
from zeropp import acctfm
from zeropp.checkpoint import FULL, SHARDED, read_safetensors, unsharded_tensors
from zeropp.config import TensorParallelConfig, ZeroConfig
from zeropp.runtime import Runtime, clip_by_norm_, squared_norm
from zeropp.tensor_parallel.collectives import TPComm
from zeropp.tensor_parallel.layers import TensorParallelSublayer
from zeropp.tensor_parallel.loss import vocab_parallel_cross_entropy
from zeropp.tensor_parallel.parallelize import parallelize
from zeropp.topology import mesh_from_config

PLAN_FILE = "tensor_parallel.json"  # in a checkpoint: the group size, each sliced tensor's dim, AccTFM's plan
# The partition planner's profile: timed no-grad forwards per K, of which each sublayer's median counts (one
# forward alone lets a passing stall pick the plan); and the predicted gain a plan needs over all K = 1,
# since differences below the profile's noise would make identical runs pick different plans.
PROFILE_REPEATS = 3
MIN_PREDICTED_GAIN = 0.10


class TensorParallelRuntime(Runtime):
    """Tensor parallelism inside each group of `tensor_parallel.size` consecutive ranks, and a
    data-parallel runtime (DDP, ZeRO-3 / ZeRO++) across the groups (each DP group holds the same
    slice). The trainer drives it like any runtime; the loss must come from `lm_loss`, which
    takes the vocabulary-sliced logits the model now returns."""

    def __init__(self, model: Transformer, zero: ZeroConfig, tp_config: TensorParallelConfig, device: torch.device):
        from zeropp.ddp import DDPRuntime
        from zeropp.engine import Zero3Engine
        mesh = mesh_from_config(zero, tp_config.size)
        self.tp = TPComm(mesh, tp_config)
        self.plan = parallelize(model, self.tp)
        self.vocab_start = model.vocab_start
        self.inner = Zero3Engine(model, zero, mesh=mesh, device=device) if zero.stage == 3 else \
            DDPRuntime(model, zero, device, mesh=mesh)
        self.module, self.mesh = model, mesh
        self.ledger = self.tp.comm.ledger = self.inner.ledger
        self.timings = self.inner.timings
        self.checkpoint_format = f"{self.inner.checkpoint_format}+tp"  # loads any TP size (see load)
        self.partition_plan: list[int] | None = None  # tensor_parallel.partitions 0: planned on the first batch
        self.plan_source = ""  # where partition_plan came from: "profiled" or "from checkpoint"
        self._notes: list[str] = []

    def __call__(self, *args, **kwargs):
        if self.tp.config.partitions == 0 and self.partition_plan is None:
            self._plan_partitions(*args, **kwargs)
        return self.inner(*args, **kwargs)

    def _sublayers(self) -> list[TensorParallelSublayer]:
        return [m for m in self.module.modules() if isinstance(m, TensorParallelSublayer)]

    def _use_plan(self, plan: list[int], source: str) -> None:
        for sub, k in zip(self._sublayers(), plan):
            sub.partitions, sub.profile = k, None
        self.partition_plan, self.plan_source = list(plan), source

    def _plan_partitions(self, *args, **kwargs) -> None:
        """AccTFM's partition plan (paper Algorithm 1), from the first batch: each sublayer's compute
        per partition profiled at K = 1, 2, 4 (no-grad forwards, the median of PROFILE_REPEATS; the
        backward taken as twice the forward), the link's alpha and beta measured on the group, the
        all-reduce times predicted from them. The dynamic program runs on the forward and on the
        reversed backward; one K per sublayer serves both (autograd replays the forward's
        partitions), so the plan with the smaller predicted forward + backward time is kept, if it
        beats all K = 1 by MIN_PREDICTED_GAIN. Every rank of the world plans from the slowest rank's
        times, so all ranks choose alike (K changes the rounding: data-parallel groups on different
        plans would train on different numbers). The profile leaves no trace in training: the RNG
        state is restored, no gradient is made, and its all-reduce waits are not counted."""
        subs = self._sublayers()
        cfg = self.tp.config
        op = "all_gather" if cfg.quantize_bits else "all_reduce"
        tokens = args[0] if args else next(iter(kwargs.values()))
        with torch.random.fork_rng(devices=[tokens.device] if tokens.device.type == "cuda" else []):
            compute, rows, row_bytes = self._profile(subs, args, kwargs)
            alpha, beta = acctfm.measure_alpha_beta(self.tp.comm, "tp", op=op, tag="tp plan")
        self.tp.seconds_waiting = 0.0
        link = torch.tensor([alpha, beta], dtype=torch.float64)
        self.tp.comm.all_reduce(compute, "world", "tp plan", op=dist.ReduceOp.MAX)
        self.tp.comm.all_reduce(link, "world", "tp plan", op=dist.ReduceOp.MAX)
        alpha, beta = link.tolist()
        sizes = acctfm.PARTITION_SIZES
        sparse = {"forward": cfg.topk_passes != "backward", "backward": cfg.topk_passes != "forward"}

        def comm(j, k, direction):  # one partition's all-reduce, predicted from the measured link
            keep = cfg.topk_keep_ratio if sparse[direction] else 1.0
            n = max(1, round(rows[j] * keep / k))
            cols = row_bytes[j] // 4
            nbytes = acctfm.wire_bytes((n, cols), self.tp.size, cfg.quantize_bits) if cfg.quantize_bits \
                else n * row_bytes[j]
            if keep < 1.0 and cfg.topk_pruned == "reduce":  # the pruned rows, in the same message
                nbytes += acctfm.wire_bytes((max(0, round(rows[j] / k) - n), cols), self.tp.size, cfg.topk_pruned_bits)
            return acctfm.comm_time(nbytes, alpha, beta)
        t_cm = [[comm(j, k, "forward") for k in sizes] for j in range(len(subs))]
        t_cm_bw = [[comm(j, k, "backward") for k in sizes] for j in reversed(range(len(subs)))]
        t_fw = compute.tolist()
        t_bw = [[2 * t for t in row] for row in reversed(t_fw)]
        forward = acctfm.plan_partitions(t_fw, t_cm)
        backward = acctfm.plan_partitions(t_bw, t_cm_bw)

        def total(plan):
            return acctfm.simulate(plan, t_fw, t_cm) + acctfm.simulate(plan[::-1], t_bw, t_cm_bw)
        chosen = min((forward.partitions, backward.partitions[::-1]), key=total)
        synchronous = [1] * len(subs)
        below = total(chosen) > (1 - MIN_PREDICTED_GAIN) * total(synchronous)
        kept = f"; best plan {chosen} predicted {total(chosen) * 1e3:.1f} ms, under {MIN_PREDICTED_GAIN:.0%} gain: " \
               f"all K = 1 kept" if below and chosen != synchronous else ""
        if below:
            chosen = synchronous
        self._use_plan(chosen, "profiled")
        self._notes.append(
            f"AccTFM partition plan (K per sublayer, attention/MLP alternating): {chosen}, profiled on the first "
            f"batch (median of {PROFILE_REPEATS} forwards per K, slowest rank); link alpha {alpha * 1e6:.0f} us, "
            f"{8e-6 / beta if beta > 0 else float('inf'):.0f} Mbit/s; predicted forward + backward "
            f"{total(chosen) * 1e3:.1f} ms (all K = 1: {total(synchronous) * 1e3:.1f} ms){kept}")

    def _profile(self, subs, args, kwargs) -> tuple[torch.Tensor, list[int], list[int]]:
        """[sublayer, K] compute seconds per partition, each the median of PROFILE_REPEATS forwards (the K
        taken in turn within each round, so a passing load slows them alike), after one warm-up
        forward; and each sublayer's output rows and bytes per row."""
        sizes = acctfm.PARTITION_SIZES
        samples = [[[] for _ in sizes] for _ in subs]
        with torch.no_grad():
            self._timed_forward(subs, 1, args, kwargs)
            for _ in range(PROFILE_REPEATS):
                for i, k in enumerate(sizes):
                    measured = self._timed_forward(subs, k, args, kwargs)
                    for j, (seconds, _, _) in enumerate(measured):
                        samples[j][i].append(seconds)
        compute = torch.tensor([[statistics.median(s) for s in row] for row in samples], dtype=torch.float64)
        return compute, [rows for _, rows, _ in measured], [nbytes for _, _, nbytes in measured]

    def _timed_forward(self, subs, k: int, args, kwargs) -> list[tuple[float, int, int]]:
        """One forward with every sublayer cut into k partitions: per sublayer, its mean compute
        seconds per partition, its output rows and bytes per row."""
        for sub in subs:
            sub.partitions, sub.profile = k, []
        self.inner(*args, **kwargs)
        measured = [(sum(t for t, _, _ in sub.profile) / len(sub.profile), sum(r for _, r, _ in sub.profile),
                     sub.profile[0][2]) for sub in subs]
        for sub in subs:
            sub.profile = None
        return measured

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.tp)

    def no_sync(self):
        return self.inner.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)
        self.timings["waiting for tp all-reduces"] += self.tp.seconds_waiting
        self.tp.seconds_waiting = 0.0

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.inner.set_gradient_divide_factor(factor)

    def attach_optimizer(self, optimizer):
        return self.inner.attach_optimizer(optimizer)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm over the whole model: sliced parameters summed over the tensor-parallel group,
        replicated ones counted once (tp rank 0's), and over the DP shards under ZeRO."""
        device = next(self.module.parameters()).device
        sliced = [p.grad for name, p in self.module.named_parameters() if p.grad is not None and name in self.plan]
        replicated = [p.grad for name, p in self.module.named_parameters()
                      if p.grad is not None and name not in self.plan]
        parts = torch.stack([squared_norm(sliced, device), squared_norm(replicated, device) * (self.tp.rank == 0)])
        # DDP holds the same full gradient on every DP rank; ZeRO-3 holds shards of it.
        self.tp.comm.all_reduce(parts, "tp" if self.inner.checkpoint_format == FULL else "world", "grad norm")
        return clip_by_norm_(sliced + replicated, parts.sum(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unsliced model (the group's slices concatenated), on every rank."""
        return {name: _gather_slices(t, self.plan[name][0], self.tp) if name in self.plan else t
                for name, t in self.inner.full_state_dict().items()}

    def _subdir(self, directory) -> Path:
        path = Path(directory) / f"tp{self.tp.rank:02d}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def save(self, directory, optimizer) -> None:
        self.inner.save(self._subdir(directory), optimizer)
        if dist.get_rank() == 0:  # how to put the slices back together, for consolidation; the plan, for a resume
            dims = {name: dim for name, (dim, _, _) in self.plan.items()}
            meta = {"size": self.tp.size, "dims": dims}
            if self.partition_plan is not None:
                meta["partitions"] = self.partition_plan
            (Path(directory) / PLAN_FILE).write_text(json.dumps(meta, indent=1))

    def load(self, directory, optimizer) -> None:
        """Restore a checkpoint of any tensor-parallel size (a plain one is size 1): the same size
        loads each slice as saved (the DP runtime reshards a different DP size); another size is
        consolidated in memory and re-sliced for this rank, weights and optimizer states alike."""
        directory = Path(directory)
        plan_path = directory / PLAN_FILE
        meta = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
        saved_size = meta.get("size", 1)
        self._reuse_plan(meta.get("partitions"), saved_size, directory)
        if saved_size == self.tp.size:
            self.inner.load(directory / f"tp{self.tp.rank:02d}", optimizer)
            return
        read = unsharded_tensors if self.inner.checkpoint_format == SHARDED else _full_tensors
        full = consolidated_tensors(directory, read) if saved_size > 1 else read(directory)
        mine = {}
        for key, tensor in full.items():
            base = key if key in self.plan else key.rsplit(".", 1)[0]  # "<param>.<optimizer state>"
            if base in self.plan and tensor.dim() > 0:
                dim, start, end = self.plan[base]
                tensor = tensor.narrow(dim, start, end - start).clone()
            mine[key] = tensor
        self.inner.load_unsharded(mine, optimizer)

    def _reuse_plan(self, saved: list[int] | None, saved_size: int, directory: Path) -> None:
        """`partitions 0`: the checkpoint's AccTFM plan, not a new profile, so the resumed run computes
        exactly as the saved one did (K changes the rounding, and a profile's pick varies with load).
        A plan for another TP size does not fit its sublayers' work: planned anew on the first batch."""
        if self.tp.config.partitions != 0 or saved is None:
            return
        if saved_size != self.tp.size or len(saved) != len(self._sublayers()):
            self._notes.append(f"AccTFM partition plan {saved} of checkpoint {directory} was made for tensor parallel "
                               f"{saved_size}, this run is {self.tp.size}: profiling again on the first batch")
            return
        self._use_plan(saved, "from checkpoint")
        self._notes.append(f"AccTFM partition plan (K per sublayer, attention/MLP alternating): {saved}, from "
                           f"checkpoint {directory} (not profiled again)")

    @contextmanager
    def inference_weights(self, max_bytes=None):
        raise NotImplementedError("generation under tensor parallelism is not supported (the logits are "
                                  "vocabulary slices); run it with tensor_parallel.size 1")
        yield

    def describe(self) -> str:
        """E.g. "tensor parallel 2 + pipelined (planned per sublayer): plan [1, 2, 1, 1] from checkpoint ... x
        ZeRO-3 ...": the TP group, its AccTFM options and plan (once known), then the data-parallel runtime."""
        plan = "" if self.partition_plan is None else f": plan {self.partition_plan} {self.plan_source}"
        return f"{self.tp.config.describe()}{plan} x {self.inner.describe()}"

    def zero3_cross_node_bytes(self, micro_batches: int = 1) -> dict[str, int]:
        return self.inner.zero3_cross_node_bytes(micro_batches)

    def predicted_step_bytes(self, micro_batches: int = 1) -> dict[str, dict[str, int]]:
        return self.inner.predicted_step_bytes(micro_batches)  # the DP dimension's (TP's all-reduces: not yet)

    def model_state_bytes(self, optimizer=None) -> dict[str, int]:
        return self.inner.model_state_bytes(optimizer)

    def buffer_bytes(self) -> int:
        return self.inner.buffer_bytes()

    def close(self) -> None:
        self.inner.close()
        self.mesh.close()  # built here, lent to the inner runtime


def consolidated_tensors(directory: str | Path, read_slice) -> dict[str, torch.Tensor]:
    """The unsliced tensors of a tensor-parallel checkpoint: `read_slice(subdirectory)` reads one
    slice's tensors (whatever the data-parallel format), and sliced ones are concatenated along
    the dims the run recorded; needs no process group."""
    directory = Path(directory)
    plan_path = directory / PLAN_FILE
    if not plan_path.is_file():
        raise FileNotFoundError(f"{directory}: no {PLAN_FILE}; not a tensor-parallel checkpoint")
    meta = json.loads(plan_path.read_text())
    slices = [read_slice(directory / f"tp{t:02d}") for t in range(meta["size"])]
    out = {}
    for name, tensor in slices[0].items():
        dim = meta["dims"].get(name, meta["dims"].get(name.rsplit(".", 1)[0]))  # optimizer states too
        out[name] = torch.cat([s[name] for s in slices], dim=dim) if dim is not None and tensor.dim() else tensor
    return out


def _full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The full (DDP) format's weights and "<param>.<state>" optimizer states."""
    return {**read_safetensors(directory / "model.safetensors"), **read_safetensors(directory / "optimizer.safetensors")}


def _gather_slices(tensor: torch.Tensor, dim: int, tp: TPComm) -> torch.Tensor:
    """Concatenate every rank's slice along `dim` (slices may differ by one unit in length)."""
    size = torch.tensor([tensor.shape[dim]], dtype=torch.int64)
    sizes = torch.empty(tp.size, dtype=torch.int64)
    tp.comm.all_gather(sizes, size, "tp", tag="consolidate")
    longest = int(sizes.max())
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, longest - tensor.shape[dim]]
    padded = F.pad(tensor.float(), pad).contiguous()
    pieces = torch.empty(tp.size * padded.numel(), dtype=padded.dtype)
    tp.comm.all_gather(pieces, padded.view(-1), "tp", tag="consolidate")
    return torch.cat([piece.narrow(dim, 0, int(s)) for piece, s in zip(pieces.view(tp.size, *padded.shape), sizes)],
                     dim=dim)
