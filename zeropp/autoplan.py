"""A plan chosen from the machine (`plan.auto`): probe the links, the compute and the memory,
price every candidate runtime configuration, pick the fastest that fits (docs/autoplan.md).

Probes (`probe`): every rank runs the same timed all-gathers on the runtime's own groups
(intra_node, inter_node) at two message sizes (bandwidth from the slope, latency from the
intercept), times a one-block model's forward + backward (the block's share by hooks), an
optimizer step, the codec, the overlap of compute with an all-gather and how long a rank waits
for the slowest after the compute (the jitter), and reads its free memory; the numbers are
all-reduced with MAX (times; memory as its negative; the jitter averaged; the link's own times
before that with MIN in each group: a collective's time is its last rank's), so every rank holds
the same `Probes` and `choose`, a pure function of them, picks the same plan everywhere: no rank
decides alone.

Cost model (`price`): a candidate's bytes per step are `zeropp.plan.predicted_step_bytes` of
its units, built on the meta device on a mesh on paper (no process group, no memory), so they
are exactly what its runtime would predict. Step time = compute + codec work + the optimizer
step + the longer of the visible communication and the skew + what of the skew the wire does not
hide. Communication = 'sent' minus 'cross_node_sent' at the intra-node bandwidth + 'cross_node_sent'
at the inter-node bandwidth + one latency per collective and link level (the step's own
all-reduces counted too); visible is what overlap x the shorter of it and compute leaves (the
overlap is probed, 0 without overlap_comm, and hides nothing of the exposed communication: the
gathers the forward starts with, the reductions the optimizer waits for). The skew is the waiting
for the slowest rank at each of the k collectives, k x jitter x sqrt(work / k). A rank waits for the
slowest and for the wire at the same collectives: where the wire is slow the drift hides in its wait
(the others' bytes are in flight meanwhile), but the rest starts only when the last rank arrives:
the collectives' latency, loopback copies inside a node, a link as fast as the node's own. So the
step pays the longer of the visible communication and the skew plus the shorter of the skew and that
processor-bound part: their sum on one machine's loopback, nearly their maximum over a slow wire.
Memory is the trainer's predicted peak (passed in as `memory`) of the candidate's model states
and buffers.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from kernels import dequantize, quantize
from models.transformer import Transformer, lm_loss
from zeropp.buffers import BufferPool
from zeropp.comm import Comm
from zeropp.config import PlanConfig, ZeroConfig, ZeroConfigError
from zeropp.engine import Zero3Engine
from zeropp.plan import build_units, predicted_step_bytes, rotating_buffer_count, schedule_groups, unit_gathers
from zeropp.plan import model_state_bytes as unit_state_bytes
from zeropp.reducers import TAG as REDUCE_TAG
from zeropp.runtime import Timings
from zeropp.topology import Mesh, _blocks, build_mesh, data_parallel_ranks_per_node

LEVELS = ("intra_node", "inter_node")
PROBE_BYTES = (2**12, 2**18)  # the all-gather chunks per rank: latency from the first, the slope from there to
PROBE_BYTES_MAX = 2**24  # the second, grown up to this until it takes LINK_SIGNAL times the first's time
LINK_SIGNAL = 4
# ... and at least this long: longer than a scheduler's time slice (3 ms), so that a rank descheduled in it (ranks
# sharing cores) does not make the slope; on 4 loopback ranks, eight probes in one launch spread the bandwidth
# 15-33x stopping at LINK_SIGNAL alone, 1.3-1.6x with this (1.7-7.4x at 3 ms)
LINK_SECONDS = 0.005
LINK_IN_FLIGHT = 2  # the large chunk goes as this many all-gathers of a part each, in flight together
REPS = 3  # timed runs of each probe: the median outvotes one disturbed run
LATENCY_REPS = 9  # runs of the link probe's small chunk, of which the fastest is the latency
DDP_BUCKET_BYTES = 25 * 2**20  # zeropp.ddp's gradient buckets
STEP_ALL_REDUCES = 2  # a training step's own collectives: its token counts and its loss (trainer.loop.train_step)
DELTA_BITS = 8  # qwZ deltas' forward weights: closer to the masters than int8 qwZ's (docs/zeropp.md)
VOCAB_PROBED = 8192  # the compute probe's one-block model has at most this vocabulary (scaled up from there)


class PlanError(ValueError):
    """No candidate satisfies the constraints; the message names them and the closest miss."""


@dataclass
class Probes:
    """What the machine measured, identical on every rank. Bandwidths are bytes a rank sends per
    second in an all-gather over the level's group (the ledger's 'sent'); inf where the level is
    a group of one (nothing crosses it)."""

    world_size: int
    ranks_per_node: int
    device: str  # "cpu" or the GPU's name
    backend: str  # gloo / nccl: whether the dp collectives go node-aware (zeropp.comm)
    bandwidth: dict[str, float]  # level -> bytes/s
    latency: dict[str, float]  # level -> seconds per collective
    block_seconds: float  # one block's forward + backward at the run's micro-batch and precision
    head_seconds: float  # the rest of the model's: embeddings, final norm, head and loss
    optimizer_seconds: float  # an optimizer step (and gradient norm) per stepped element
    optimizer_tensor_seconds: float  # and per stepped tensor
    codec_seconds: float  # quantizing + dequantizing one element (int8, blocks of 256, the full grid)
    overlap: float  # the share of the shorter of compute and communication that hides behind the other
    memory_bytes: int  # available to this rank
    # how far ranks drift apart: after t seconds of work a rank waits jitter x sqrt(t) seconds, on average, for
    # the slowest at the next collective (ranks sharing cores drift like a random walk; about 0 with a core each)
    jitter: float = 0.0

    def fingerprint(self) -> dict:
        return fingerprint(self.world_size, self.ranks_per_node, self.device)


def fingerprint(world_size: int, ranks_per_node: int, device: str) -> dict:
    """What must match for a stored plan to be reused (a resume on the same machine): known before any probe."""
    return {"world_size": world_size, "ranks_per_node": ranks_per_node, "device": device}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@dataclass
class Cost:
    """One candidate, priced: seconds per step by term, bytes per step by ledger tag, memory."""

    name: str
    config: ZeroConfig
    step_bytes: dict[str, dict[str, int]]
    collectives: dict[str, int]  # level -> collectives per step that touch it
    weight_bits: int  # of the weights the forward computes with
    memory_bytes: int
    # seconds per step: compute, codec, optimizer, intra_node, inter_node, latency, exposed (of the three before),
    # hidden (of them, behind compute), skew, processor_bound (of the visible, what waits for the last rank)
    terms: dict[str, float]
    step_seconds: float
    states: dict[str, int] = field(default_factory=dict)  # model states by kind (what memory_bytes is made of)
    buffers: int = 0  # and the preallocated buffers
    excluded: str = ""  # why the constraints rule it out ("" where it is eligible)


@dataclass
class Plan:
    chosen: Cost
    runner_up: Cost | None
    reason: str  # the term that decided between them
    costs: list[Cost] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The plan for the log: each candidate's predicted step time and memory, the choice and why."""
        out = []
        for c in sorted(self.costs, key=_rank):
            terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c.terms.items())
            mark = "-> " if c is self.chosen else "   "
            why = f" [excluded: {c.excluded}]" if c.excluded else ""
            out.append(f"{mark}{c.name}: {c.step_seconds * 1e3:.1f} ms/step ({terms} ms), "
                       f"{c.memory_bytes / 2**20:.1f} MB{why}")
        beat = f"; runner-up {self.runner_up.name}: {self.reason}" if self.runner_up else ""
        return [f"plan: {self.chosen.name} = {self.chosen.config.describe()}{beat}"] + out


def candidates(base: ZeroConfig) -> dict[str, ZeroConfig]:
    """The configurations the planner prices: the user's keys kept (communication and compute
    dtypes, ranks per node, block size, offload, frozen weights), the planned ones set."""
    planned = dict(stage=3, stage3_max_reuse_distance=0, zero_quantized_weights=False, zero_quantized_weights_bits=8,
                   zero_quantized_weights_delta=False, zero_hpz_partition_size=1, zero_quantized_gradients=False,
                   zero_quantized_gradients_bits=4, zero_quantized_gradients_error_feedback=False)
    variants = {
        "ZeRO-3": {},
        "ZeRO-3 + keep-gathered": dict(stage3_max_reuse_distance=10**9),  # DeepSpeed's default distance
        "ZeRO-3 + qwZ int8": dict(zero_quantized_weights=True),
        "ZeRO-3 + hpZ": dict(zero_hpz_partition_size=0),
        "ZeRO-3 + qgZ int4": dict(zero_quantized_gradients=True),
        "ZeRO++ (qwZ int8, hpZ, qgZ int4)": dict(zero_quantized_weights=True, zero_hpz_partition_size=0,
                                                 zero_quantized_gradients=True),
        "ZeRO++ with int4 deltas": dict(zero_quantized_weights=True, zero_quantized_weights_bits=4,
                                        zero_quantized_weights_delta=True, zero_hpz_partition_size=0,
                                        zero_quantized_gradients=True),
        "ZeRO++ int4 weights": dict(zero_quantized_weights=True, zero_quantized_weights_bits=4,
                                    zero_hpz_partition_size=0, zero_quantized_gradients=True),
    }
    out = {name: dataclasses.replace(base, **{**planned, **v}) for name, v in variants.items()}
    out["DDP"] = ZeroConfig(stage=0, ranks_per_node=base.ranks_per_node)
    for cfg in out.values():
        cfg.validate()
    return out


def weight_bits(cfg: ZeroConfig, has_frozen: bool) -> int:
    """Bits of the weights the forward computes with: qwZ's, frozen weights stored as codes, qwZ
    deltas counted as int8 (measured: half int8 qwZ's error), else the communication dtype's."""
    bits = cfg.comm_dtype.itemsize * 8 if cfg.stage else 32
    if cfg.zero_quantized_weights:
        bits = min(bits, DELTA_BITS if cfg.zero_quantized_weights_delta else cfg.zero_quantized_weights_bits)
    if has_frozen and (cfg.zero_quantized_nontrainable_weights or
                       (cfg.zero_quantized_weights and cfg.zero_quantized_weights_delta)):
        bits = min(bits, cfg.zero_quantized_weights_bits)  # frozen units keep plain qwZ
    return bits


# ----------------------------------------------------------------------------- bytes on paper

def paper_mesh(world_size: int, ranks_per_node: int) -> Mesh:
    """Rank 0's mesh of this layout without process groups: what Comm.volume reads."""
    mesh = Mesh(0, world_size, ranks_per_node, ranks_per_node, 1, list(range(world_size)))
    for name in ("dp", "intra_node", "inter_node", "secondary"):
        mesh._members[name] = _blocks(name, world_size, ranks_per_node, ranks_per_node)[0]
    return mesh


class _PaperComm:
    """Comm's arithmetic over a paper mesh: its own volume(), no transport; the shard orders the
    units and buffers read, set by Comm.set_layout itself."""

    volume, all_reduce_volume = Comm.volume, Comm.all_reduce_volume
    __init__ = Comm.set_layout


class _CountingComm(_PaperComm):
    """volume() as (1 if the collective has peers inside the node, 1 if across): fed to the same
    predicted_step_bytes, it counts collectives per link level instead of bytes."""

    def volume(self, chunk_bytes: int, group: str = "dp", node_aware: bool = False) -> tuple[int, int]:
        sent, cross = _PaperComm.volume(self, 1, group, node_aware)
        return int(sent > cross), int(cross > 0)


class _MetaWeights:
    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return torch.empty(end - start, device="meta")


class _MetaCopy:
    """A copy of a model whose parameters are meta tensors (shared ones still shared: Module.to would untie
    them), made once for all candidates: building units re-registers a model's parameters, `restore` puts the
    copy's own back."""

    def __init__(self, model: nn.Module):
        meta = torch.device("meta")
        self.model = copy.deepcopy(model, {id(p): nn.Parameter(torch.empty_like(p, device=meta), p.requires_grad)
                                           for p in model.parameters()})
        self._params = [(m, name, p) for m in self.model.modules() for name, p in m._parameters.items()]

    def restore(self) -> nn.Module:
        for module, name, p in self._params:
            module._parameters[name] = p
        return self.model


def _zero3_on_paper(meta_copy: _MetaCopy, cfg: ZeroConfig, probes: Probes):
    """The units, reducer, schedule and buffers a Zero3Engine of `cfg` would build on rank 0,
    on the meta device over a paper mesh, from the model's meta copy."""
    meta = torch.device("meta")
    model = meta_copy.restore()
    mesh = paper_mesh(probes.world_size, probes.ranks_per_node)
    comm = _PaperComm(mesh, cfg.node_aware_collectives, probes.backend)
    units = build_units(model, cfg, mesh, meta, _MetaWeights())
    reducer = _reducer(cfg, comm)
    groups, resident = schedule_groups(units, len(model.blocks))
    held = rotating_buffer_count([[u.padded_numel for u in g] for g in groups], cfg)
    pool = BufferPool(groups, resident, held, 2 if cfg.overlap_comm else 1, cfg.compute_dtype, meta, comm)
    return units, reducer, groups, held, pool, mesh


def _reducer(cfg: ZeroConfig, comm):
    """The reducer the engine would build over `comm` (Zero3Engine._build_reducer itself)."""
    engine = SimpleNamespace(config=cfg, comm=comm, mesh=comm.mesh, device=torch.device("meta"),
                             comm_dtype=cfg.comm_dtype, timings=Timings())
    return Zero3Engine._build_reducer(engine)


def _collectives(units, groups, held, mesh, cfg, backend, micro_batches, tags=None) -> dict[str, int]:
    """Collectives per link level of a step (of its `tags` only, where given)."""
    counting = _CountingComm(mesh, cfg.node_aware_collectives, backend)
    counted = predicted_step_bytes(units, groups, held, counting, _reducer(cfg, counting), micro_batches)
    counted = {tag: v for tag, v in counted.items() if tags is None or tag in tags}
    return {"intra_node": sum(v["sent"] for v in counted.values()),
            "inter_node": sum(v["cross_node_sent"] for v in counted.values())}


EXPOSED_TAGS = ("forward gather", REDUCE_TAG)


def _exposed(units, groups, held, reducer, mesh, cfg, backend) -> tuple[dict, dict[str, int]]:
    """(bytes by tag, collectives per level) that no compute can hide: the forward waits for the gathers of
    the resident units (embeddings, norms) and of the first block group, the optimizer step for their
    gradients' reduction (block 0 is the backward's last): one pass' worth."""
    first = {id(u) for u in groups[0]} if groups else set()
    blocks = {id(u) for g in groups for u in g}
    edge = {name: u for name, u in units.items() if id(u) in first or id(u) not in blocks}
    step = predicted_step_bytes(edge, groups, held, reducer.comm, reducer, 1)
    return ({tag: v for tag, v in step.items() if tag in EXPOSED_TAGS},
            _collectives(edge, groups, held, mesh, cfg, backend, 1, EXPOSED_TAGS))


def _codec_elements(units, groups, held, cfg: ZeroConfig, micro_batches: int, nodes: int) -> int:
    """Elements quantized or dequantized per step (approximate): qwZ encodes each trainable shard
    once and decodes every gather; deltas decode the change of the node's shards once; qgZ
    quantizes and requantizes each micro-batch's gradient (about twice its elements)."""
    position = {id(u): i for i, g in enumerate(groups) for u in g}
    total = 0
    for u in units.values():
        quantized = u.codec.dtype == torch.uint8 or u.delta_codec is not None
        if quantized and u.trainable:
            total += u.shard_numel
        if u.delta_codec is not None:
            total += nodes * u.shard_numel
        elif quantized:
            forward, backward = unit_gathers(position.get(id(u)), len(groups), held, micro_batches, not u.trainable)
            total += (forward + (backward if id(u) in position else 0)) * u.padded_numel
        if cfg.zero_quantized_gradients and u.trainable:
            total += 2 * u.padded_numel * micro_batches
    return total


def _ddp_on_paper(model: nn.Module, probes: Probes) -> tuple[dict, dict, dict[str, int], tuple]:
    """DDP's step bytes (one fp32 ring all-reduce of the gradients, as Comm ledgers it; its buckets'
    rounding left out), collectives (25 MB buckets), model states and what of
    the step's communication is exposed (`_exposed`'s)."""
    params = list(model.parameters())
    n_all, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    mesh = paper_mesh(probes.world_size, probes.ranks_per_node)
    n, grads = mesh.world_size, 4 * trainable
    sent, cross = _PaperComm(mesh, False, probes.backend).all_reduce_volume(grads)
    step = {"gradient reduce": {"sent": sent, "cross_node_sent": cross}} if n > 1 else {}
    buckets = -(-grads // DDP_BUCKET_BYTES) if n > 1 else 0
    collectives = {"intra_node": buckets * (mesh.ranks_per_node > 1), "inter_node": buckets * (mesh.num_nodes > 1)}
    states = {"weights": 4 * n_all, "gradients": grads, "optimizer states": 2 * grads}
    if n > 1:
        states["gradient buckets"] = grads
    # the last bucket's all-reduce (the first layers' gradients, made last) has no backward left to hide behind
    last = min(grads, DDP_BUCKET_BYTES) / grads if grads else 0
    exposed = {tag: {k: int(v * last) for k, v in volume.items()} for tag, volume in step.items()}
    return step, collectives, states, (exposed, {level: int(c > 0) for level, c in collectives.items()})


def price(model: nn.Module, probes: Probes, micro_batches: int = 1, memory=None,
          base: ZeroConfig | None = None) -> list[Cost]:
    """Every candidate of `base`, priced on `probes` for steps of `micro_batches` passes.
    memory(config, states: dict, buffers: int) -> bytes: the predicted peak of a rank holding
    these model states and buffers under `config` (the trainer passes trainer.memory.predicted_peak's
    sum); by default their sum."""
    memory = memory or (lambda config, states, buffers: sum(states.values()) + buffers)
    has_frozen = any(not p.requires_grad for p in model.parameters())
    compute = (probes.block_seconds * len(model.blocks) + probes.head_seconds) * micro_batches
    out, meta_copy = [], None
    for name, cfg in candidates(base or ZeroConfig(stage=3)).items():
        if cfg.stage == 0:
            step, collectives, states, exposed = _ddp_on_paper(model, probes)
            buffers, codec = 0, 0
            stepped = [p.numel() for p in model.parameters() if p.requires_grad]
        else:
            meta_copy = meta_copy or _MetaCopy(model)
            units, reducer, groups, held, pool, mesh = _zero3_on_paper(meta_copy, cfg, probes)
            step = predicted_step_bytes(units, groups, held, reducer.comm, reducer, micro_batches)
            states = unit_state_bytes(units.values(), reducer, offloaded=cfg.offload_optimizer != "none")
            stepped = [piece.numel() for u in units.values() if u.trainable for _, piece, _ in u.params]
            states["optimizer states" + (" (host)" if cfg.offload_optimizer != "none" else "")] = 8 * sum(stepped)
            # BufferPool.nbytes, by storage identity: meta storages have no address
            buffers = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in pool.preallocated()}
                          .values())
            codec = _codec_elements(units, groups, held, cfg, micro_batches, mesh.num_nodes) * probes.codec_seconds
            collectives = _collectives(units, groups, held, mesh, cfg, probes.backend, micro_batches)
            exposed = _exposed(units, groups, held, reducer, mesh, cfg, probes.backend)
        # the step's own all-reduces, and a sharded runtime's of the gradient norm, on every level with peers:
        # between passes or after the last reduction, nothing hides them
        own = {level: (STEP_ALL_REDUCES + (cfg.stage > 0)) * (probes.bandwidth[level] < math.inf) for level in LEVELS}
        collectives = {level: collectives[level] + own[level] for level in LEVELS}
        exposed = exposed[0], {level: exposed[1][level] + own[level] for level in LEVELS}
        optimizer = probes.optimizer_seconds * sum(stepped) + probes.optimizer_tensor_seconds * len(stepped)
        work = compute + codec + optimizer
        terms = {"compute": compute, "codec": codec, "optimizer": optimizer,
                 **_wire_seconds(step, collectives, probes),
                 "exposed": sum(_wire_seconds(*exposed, probes).values())}  # of the three before
        comm = terms["intra_node"] + terms["inter_node"] + terms["latency"]
        terms["hidden"] = probes.overlap * min(compute + codec, comm - terms["exposed"]) if cfg.overlap_comm else 0.0
        visible = comm - terms["hidden"]
        # k collectives cut the work into k pieces; after each a rank waits jitter x sqrt(work / k)
        terms["skew"] = probes.jitter * math.sqrt(max(collectives.values()) * work)
        terms["processor_bound"] = visible * _processor_share(terms, probes)
        # the optimizer steps after the last reduction: nothing to hide behind. A rank waits for the slowest rank
        # and for the wire at the same collectives (the longer of the two), then for the collective's processor
        # work, which starts when the last rank arrives
        seconds = work + max(visible, terms["skew"]) + min(terms["processor_bound"], terms["skew"])
        out.append(Cost(name, cfg, step, collectives, weight_bits(cfg, has_frozen), memory(cfg, states, buffers), terms,
                        seconds, states, buffers))
    return out


def _processor_share(terms: dict[str, float], probes: Probes) -> float:
    """The share of a step's communication that cannot start before the last rank arrives: the latency (a
    collective's rounds need every member), the transfers inside a node (loopback copies on the cores the ranks
    compute on), and of the cross-node transfers as much as that link is as fast as the node's own (all where
    the nodes are ranks of one machine, about none over a slow wire, which carries the early ranks' bytes)."""
    comm = terms["intra_node"] + terms["inter_node"] + terms["latency"]
    inside, across = probes.bandwidth["intra_node"], probes.bandwidth["inter_node"]
    like_inside = min(1.0, across / inside) if math.isfinite(inside) and math.isfinite(across) else 0.0
    return (terms["intra_node"] + terms["latency"] + like_inside * terms["inter_node"]) / comm if comm > 0 else 0.0


def _wire_seconds(step: dict[str, dict[str, int]], collectives: dict[str, int], probes: Probes) -> dict[str, float]:
    """Seconds on the wire by level ('sent' less 'cross_node_sent' inside the node, 'cross_node_sent' across) and
    the collectives' latency."""
    cross = sum(v["cross_node_sent"] for v in step.values())
    intra = sum(v["sent"] for v in step.values()) - cross
    return {"intra_node": intra / probes.bandwidth["intra_node"], "inter_node": cross / probes.bandwidth["inter_node"],
            "latency": sum(collectives[level] * probes.latency[level] for level in LEVELS)}


def price_step(trained: list[tuple[nn.Module, int, int]], probes: Probes, memory=None,
               base: ZeroConfig | None = None) -> list[Cost]:
    """Every candidate priced for a step that trains each (model, micro-batches per optimizer step,
    optimizer steps per step) of `trained` under it: pretraining trains one model once, an RLHF step
    several (PPO's actor and critic, each `epochs x mini_batches` times). Times and bytes add up; the
    memory is `memory` of the models' states and buffers together (they live side by side)."""
    memory = memory or (lambda config, states, buffers: sum(states.values()) + buffers)
    per_model = [(price(model, probes, micro_batches, memory, base), times) for model, micro_batches, times in trained]
    out = []
    for i, first in enumerate(per_model[0][0]):
        costs = [(costs[i], times) for costs, times in per_model]
        step_bytes: dict[str, dict[str, int]] = {}
        states: dict[str, int] = {}
        for c, times in costs:
            for tag, volume in c.step_bytes.items():
                into = step_bytes.setdefault(tag, dict.fromkeys(volume, 0))
                for k, v in volume.items():
                    into[k] += times * v
            for kind, n in c.states.items():
                states[kind] = states.get(kind, 0) + n
        buffers = sum(c.buffers for c, _ in costs)
        out.append(Cost(first.name, first.config, step_bytes,
                        {level: sum(times * c.collectives[level] for c, times in costs) for level in LEVELS},
                        min(c.weight_bits for c, _ in costs), memory(first.config, states, buffers),
                        {k: sum(times * c.terms[k] for c, times in costs) for k in first.terms},
                        sum(times * c.step_seconds for c, times in costs), states, buffers))
    return out


# ----------------------------------------------------------------------------- the choice

def _comm_seconds(c: Cost) -> float:
    return c.terms["intra_node"] + c.terms["inter_node"] + c.terms["latency"]


def _rank(c: Cost) -> tuple:
    """Eligible first, then the predicted step time; ties (communication hidden behind compute):
    the leaner plan, then the one with the least communication."""
    return bool(c.excluded), round(c.step_seconds, 9), c.memory_bytes, _comm_seconds(c)


def choose(costs: list[Cost], min_weight_bits: int = 0, memory_cap_bytes: int | None = None,
           stage: int | None = None) -> Plan:
    """The fastest candidate whose forward weights have at least `min_weight_bits` bits and whose
    predicted memory fits `memory_cap_bytes` (and of `stage`, where a checkpoint to resume fixes
    its format); the runner-up is the next eligible one, and the reason names the term that
    separates them most."""
    for c in costs:
        why = [] if stage is None or c.config.stage == stage else [f"the checkpoint to resume is stage {stage}"]
        if c.weight_bits < min_weight_bits:
            why.append(f"weights at {c.weight_bits} bits, below the floor of {min_weight_bits}")
        if memory_cap_bytes is not None and c.memory_bytes > memory_cap_bytes:
            why.append(f"{c.memory_bytes / 2**20:.1f} MB over the cap of {memory_cap_bytes / 2**20:.1f} MB")
        c.excluded = "; ".join(why)
    ranked = sorted(costs, key=_rank)
    if ranked[0].excluded:
        lean = min((c for c in costs if c.weight_bits >= min_weight_bits), key=lambda c: c.memory_bytes, default=None)
        closest = f"; the leanest allowed, {lean.name}, needs {lean.memory_bytes / 2**20:.1f} MB" if lean else ""
        cap = "no cap" if memory_cap_bytes is None else f"{memory_cap_bytes / 2**20:.1f} MB"
        raise PlanError(f"plan.auto: no candidate fits plan.memory_cap_gb (or the probed memory: {cap}) with "
                        f"plan.min_weight_bits {min_weight_bits}{closest}")
    chosen = ranked[0]
    runner_up = ranked[1] if len(ranked) > 1 and not ranked[1].excluded else None
    return Plan(chosen, runner_up, _reason(chosen, runner_up) if runner_up else "the only eligible candidate", costs)


def _reason(a: Cost, b: Cost) -> str:
    if round(a.step_seconds, 9) == round(b.step_seconds, 9):
        tie = f"the same predicted step time ({a.step_seconds * 1e3:.1f} ms, communication hidden), "
        if a.memory_bytes < b.memory_bytes:
            return tie + f"less memory ({a.memory_bytes / 2**20:.1f} vs {b.memory_bytes / 2**20:.1f} MB)"
        if _comm_seconds(a) < _comm_seconds(b):
            return tie + f"less communication ({_comm_seconds(a) * 1e3:.1f} vs {_comm_seconds(b) * 1e3:.1f} ms)"
        return tie + "the same memory and communication: the simpler one (listed first)"
    term = max(a.terms, key=lambda k: abs(b.terms[k] - a.terms[k]))
    return (f"{b.step_seconds * 1e3:.1f} ms/step against {a.step_seconds * 1e3:.1f}, decided by {term} "
            f"({b.terms[term] * 1e3:.1f} ms against {a.terms[term] * 1e3:.1f})")


# ----------------------------------------------------------------------------- probes

def _timed(fn, reps: int, together=None, warm_up: bool = True, waits: list | None = None,
           stat=statistics.median) -> float:
    """Seconds of one fn(): `stat` (the median) of `reps` runs, after a warm-up run (first-call setup: gloo's
    connections, kernels' code) unless warm_up is False. together: a barrier every rank passes before each run,
    so all ranks work at once, as in a training step (ranks that share cores slow each other down there too).
    waits: gets the seconds of a barrier passed after each run (this rank's wait for the slowest, and the
    barrier's own)."""
    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        if together:
            together()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if waits is not None:
            together()
            waits.append(time.perf_counter() - start - times[-1])
    return stat(times)


def _jitter(comm: Comm, waits: list[float], run: float, together) -> float:
    """Probes.jitter from this rank's `waits` at a barrier after work of `run` seconds: the median wait less a
    barrier's own time (one right after another), averaged over the ranks (the step waits at each collective
    for its slowest rank: the ranks' mean wait is what the slowest adds to a step)."""
    alone = _timed(together, len(waits), together, warm_up=False)
    mine = max(0.0, statistics.median(waits) - alone) / math.sqrt(max(run, 1e-9))
    jitter = torch.tensor([mine], dtype=torch.float64, device=comm.device)
    comm.all_reduce(jitter, group="world", tag="plan probe")
    return jitter.item() / comm.mesh.world_size


def _link(comm: Comm, level: str, device: torch.device, reps: int) -> tuple[float, float]:
    """(bytes/s sent, seconds per collective) of an all-gather over `level`'s group, from the times at a small
    chunk (the latency) and a large one (the slope between them). The large chunk grows (at least 4x at a time,
    to where the slope so far says) until its time is at least LINK_SIGNAL times the small one's and LINK_SECONDS,
    so the slope is the wire's and not noise, whatever the link. Every rank is in one group of each level, and a
    group's time is the MIN of its members': a collective's own time is what its last member to arrive measures
    (an earlier one also counts its wait for that member: the skew's, which the jitter probe measures; on 4
    loopback ranks a MAX spread the latency 34-48x over eight probes, 0.04 to 1.9 ms, the MIN 2x). The groups of
    a level run at once, as in a step, and may share a link (a node's ranks, each in its own cross-node group):
    the level's time is the slowest group's, a MAX over the world, so all ranks grow the chunk alike. Only the
    small chunk is warmed up (the group's connections). Of the large chunk's runs, inside a node the fastest after
    the first counts (a slower one is a descheduled rank's); across nodes the median, which outvotes the run that
    rides a shaped link's token bucket (the fastest read 10 Mbit/s high: priced at 0.69-0.84 of its steps).
    The large chunk goes as LINK_IN_FLIGHT all-gathers of a part each, in flight together, as a step keeps its
    gathers and reductions (prefetched, asynchronous): one at a time, the link idles at each end of each (measured
    at 10 Mbit/s, 2 x 2 ranks: 2.9-4.4 Mbit/s a rank one at a time, 4.1-5.0 with two in flight; the two ranks'
    share of the link is 5). The small chunk's time is the fastest of LATENCY_REPS runs: the link's own round
    trip; a rank descheduled while it waits (ranks sharing cores) is the skew's, which the jitter probe measures
    (the median of three put 0.2-4.0 ms on one machine's links, and 110 ms of latency into a 260 ms step)."""
    n = comm.mesh.size(level)
    if n == 1:
        return math.inf, 0.0

    def seconds(chunk: int, in_flight: int, runs: int, stat, warm_up: bool = False) -> float:
        shard = torch.zeros(chunk // in_flight, dtype=torch.uint8, device=device)
        outs = [torch.empty(n * shard.numel(), dtype=torch.uint8, device=device) for _ in range(in_flight)]

        def run():
            for handle in [comm.all_gather(out, shard, group=level, tag="plan probe", async_op=True) for out in outs]:
                handle.wait()
        t = torch.tensor([_timed(run, runs, warm_up=warm_up, stat=stat)], dtype=torch.float64, device=device)
        comm.all_reduce(t, group=level, tag="plan probe", op=dist.ReduceOp.MIN)
        comm.all_reduce(t, group="world", tag="plan probe", op=dist.ReduceOp.MAX)
        return t.item()

    def fastest_after_first(times: list[float]) -> float:
        return min(times[1:])
    large_chunk_stat = fastest_after_first if level == "intra_node" else statistics.median

    def bandwidth_run(chunk: int) -> float:
        return seconds(chunk, LINK_IN_FLIGHT, reps, large_chunk_stat)
    small, large = PROBE_BYTES
    t_small = seconds(small, 1, LATENCY_REPS, min, warm_up=True)
    t_large = bandwidth_run(large)
    target = max(LINK_SIGNAL * t_small, LINK_SECONDS)
    while t_large < target and large < PROBE_BYTES_MAX:
        # straight to the chunk that the slope so far says takes the target's time (1.5x that, 4x at least)
        slope = (t_large - t_small) / (large - small)
        wanted = small + (target - t_small) / slope if slope > 0 else math.inf
        large = min(PROBE_BYTES_MAX, max(4 * large, 2 ** math.ceil(math.log2(min(1.5 * wanted, PROBE_BYTES_MAX)))))
        t_large = bandwidth_run(large)
    slope = max(t_large - t_small, 1e-9) / ((n - 1) * (large - small))
    return 1 / slope, max(0.0, t_small - (n - 1) * small * slope)


def _overlap(comm: Comm, level: str, bandwidth: float, latency: float, work, compute: float, together) -> float:
    """The share of the shorter of `work` (a compute probe's run, `compute` seconds as probed) and an all-gather
    over `level` of about as long that hides behind the other when both run at once, as in a training step: near
    1 where the transfer leaves the processor free (a slow link), lower where the collective itself needs the
    cores the compute runs on (ranks on one machine's loopback). The all-gather alone takes what the link's
    probe predicts; both are warm already."""
    n = comm.mesh.size(level)
    chunk = torch.tensor([min(max(PROBE_BYTES[0], (compute - latency) * bandwidth / (n - 1)), PROBE_BYTES_MAX)],
                         dtype=torch.float64, device=comm.device)
    comm.all_reduce(chunk, group="world", tag="plan probe", op=dist.ReduceOp.MAX)  # one size on every rank
    chunk = int(chunk.item())
    shard = torch.zeros(chunk, dtype=torch.uint8, device=comm.device)
    out = torch.empty(n * chunk, dtype=torch.uint8, device=comm.device)

    def both():
        handle = comm.all_gather(out, shard, group=level, tag="plan probe", async_op=True)
        work()
        handle.wait()
    alone = latency + (n - 1) * chunk / bandwidth
    together_ = _timed(both, 1, together, warm_up=False)  # one run: it is a compute run and more
    return min(1.0, max(0.0, (compute + alone - together_) / min(compute, alone)))


def _codec_seconds(device: torch.device, reps: int, together, numel: int = 2**18) -> float:
    x = torch.randn(numel, device=device)

    def roundtrip():
        q = quantize(x, 8, 256, levels="full")  # the grid qwZ and qgZ both quantize on
        dequantize(q.codes, q.scales, numel, 8, 256)
    return _timed(roundtrip, reps, together) / numel


def available_memory(device: torch.device, ranks_per_node: int) -> int:
    """Free device memory (CUDA), or the host's available memory shared by the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    info = Path("/proc/meminfo").read_text()
    kib = next(int(line.split()[1]) for line in info.splitlines() if line.startswith("MemAvailable:"))
    return kib * 1024 // ranks_per_node


def _rng_kept(device: torch.device):
    """The run's random streams as they were: the probes draw inputs and run dropout."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def probe(mesh: Mesh | None, device: torch.device, compute: ComputeProbe) -> Probes:
    """Measure this machine (every rank calls it, in the same order): the links per level on `mesh`'s groups,
    the compute (`compute`'s runs), the jitter, the optimizer, the codec and the memory; reduced over the world
    (MAX of times, MIN of bandwidth, overlap and memory, the mean jitter) so all ranks agree. mesh None: one process
    without a process group, no link to measure."""
    comm = Comm(mesh) if mesh is not None else None
    together = comm.barrier if comm else None
    try:
        with _rng_kept(device):
            links = [_link(comm, level, comm.device, REPS) if comm else (math.inf, 0.0) for level in LEVELS]
            # one sequence's run warms up (first-call setup) and is the overlap probe's work: the full micro-batch
            # is run only to be timed
            one_row = lambda: compute(rows=1)  # noqa: E731
            one_row()
            one_row_seconds = _timed(one_row, REPS, together, warm_up=False)
            shares, waits = [], []
            run = _timed(lambda: shares.append(compute()), REPS, together, warm_up=False,
                         waits=waits if comm else None)
            block = run * statistics.median(shares)
            jitter = _jitter(comm, waits, run, together) if comm else 0.0
            # overlap measured across nodes, else inside the node: a level every rank has alike
            level = next((i for i in (1, 0) if comm and comm.mesh.size(LEVELS[i]) > 1), None)
            overlap = 1.0 if level is None else _overlap(comm, LEVELS[level], *links[level], one_row, one_row_seconds,
                                                         together)
            local = torch.tensor([v for bw, lat in links for v in (1 / bw, lat)]
                                 + [block, max(0.0, run - block) * compute.vocab_factor,
                                    *_optimizer_seconds(device, REPS, together),
                                    _codec_seconds(device, REPS, together),
                                    -overlap,
                                    -available_memory(device, mesh.ranks_per_node if mesh else 1)],
                                 dtype=torch.float64, device=comm.device if comm else "cpu")
        if comm:
            comm.all_reduce(local, group="world", tag="plan probe", op=dist.ReduceOp.MAX)
    finally:
        if comm:
            comm.close()
    v = local.tolist()
    name = device_name(device)
    backend = comm.backend if comm else "nccl" if device.type == "cuda" else "gloo"
    return Probes(mesh.world_size if mesh else 1, mesh.ranks_per_node if mesh else 1, name, backend,
                  {level: 1 / v[2 * i] if v[2 * i] else math.inf for i, level in enumerate(LEVELS)},
                  {level: v[2 * i + 1] for i, level in enumerate(LEVELS)}, *v[4:9], -v[9], int(-v[10]), jitter)


class ComputeProbe:
    """The compute probe's work: forward + backward of a one-block model of `model`'s config at (micro_batch,
    seq_len) on `device`, under autocast to `dtype` (fp32: none), its vocabulary cut to at most VOCAB_PROBED
    tokens. Hooks on the block mark where its forward and backward start and end, so each run gives both the
    block's share and the rest's (embeddings, final norm, head and loss: `vocab_factor` scales those to the
    full vocabulary, they are linear in it): one run instead of a block run and a model run, half the work.
    The shares are of the processor's time (CPU: this process's; CUDA: the stream's, by events), not the wall
    clock's: ranks sharing cores are descheduled at arbitrary points, so the wall time of a few milliseconds
    inside a run is noise, while the run's whole wall time, split by the work each part did, is not."""

    def __init__(self, model: nn.Module, micro_batch: int, seq_len: int, device: torch.device, dtype: torch.dtype):
        config = model.config
        vocab = min(config.vocab_size, VOCAB_PROBED)
        with _rng_kept(device):
            self.model = Transformer(dataclasses.replace(config, n_layer=1, vocab_size=vocab)).to(device)
            self.tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), device=device)
        self.device, self.dtype, self.vocab_factor = device, dtype, config.vocab_size / vocab
        self.marks: dict[str, float | torch.cuda.Event] = {}
        block = self.model.blocks[0]
        block.register_forward_pre_hook(self._entered)
        block.register_forward_hook(self._left)

    def _mark(self, name: str) -> None:
        if self.device.type == "cuda":  # the kernels run later than Python reaches the hook: time them on the stream
            self.marks[name] = torch.cuda.Event(enable_timing=True)
            self.marks[name].record()
        else:
            self.marks[name] = time.process_time()

    def _entered(self, block, args) -> None:
        self._mark("forward")
        args[0].register_hook(lambda grad: self._mark("backward done"))  # the block's input: its gradient is last

    def _left(self, block, args, out) -> None:
        self._mark("forward done")
        out.register_hook(lambda grad: self._mark("backward"))

    def _seconds(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def __call__(self, rows: int | None = None) -> float:
        """One forward + backward (of the first `rows` sequences: all by default); returns the block's share
        of its work."""
        tokens = self.tokens[:rows]
        self._mark("run")
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
            loss = lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        self._mark("run done")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        block = self._seconds("forward", "forward done") + self._seconds("backward", "backward done")
        return block / max(self._seconds("run", "run done"), 1e-9)


def _optimizer_seconds(device: torch.device, reps: int, together, numel: int = 2**16,
                       tensors: int = 32) -> tuple[float, float]:
    """(per element, per tensor) seconds of an optimizer step as trainer.optim builds it (AdamW, foreach=False)
    after a gradient norm: from one tensor of `numel` elements and from `tensors` tensors holding as many."""
    def step_of(sizes):
        params = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer = torch.optim.AdamW(params, foreach=False)

        def run():
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run
    one = _timed(step_of([numel]), reps, together)
    many = _timed(step_of([numel // tensors] * tensors), reps, together)
    return one / numel, max(0.0, many - one) / (tensors - 1)


# ----------------------------------------------------------------------------- a run's plan

def auto_plan(trained: list[tuple[nn.Module, int, int]], rows: int, seq_len: int, device: torch.device,
              dtype: torch.dtype, base: ZeroConfig, settings: PlanConfig, memory, saved: dict | None,
              stage: int | None) -> tuple[ZeroConfig, dict, list[str]]:
    """plan.auto for a run whose step trains `trained` (price_step's), every rank alike: probe this machine
    (the compute probe runs the first model's block at `rows` x `seq_len`), reuse `saved` (a resumed
    checkpoint's plan) when it was made on this machine, else price the step and choose under `settings`'
    constraints, among the candidates of `stage` where a checkpoint fixes it. -> (the zero_optimization to
    build, the plan a checkpoint keeps, the lines to log before the first step, the last saying how long it
    took). PlanError: nothing fits. A plan reused is not probed for: the machine's fingerprint needs no probe,
    and every rank reads the same checkpoint, so all skip alike."""
    started = time.perf_counter()
    world = dist.get_world_size() if dist.is_initialized() else 1
    here = fingerprint(world, data_parallel_ranks_per_node(base.ranks_per_node, world), device_name(device))
    config, note = reuse(saved, here)
    if config is not None:
        return config, saved, [note, f"plan: read in {time.perf_counter() - started:.2f} s, nothing probed"]
    mesh = build_mesh(ranks_per_node=base.ranks_per_node, thread_groups=False) if dist.is_initialized() else None
    try:
        probes = probe(mesh, device, ComputeProbe(trained[0][0], rows, seq_len, device, dtype))
    finally:
        if mesh is not None:
            mesh.close()
    plan = choose(price_step(trained, probes, memory, base), settings.min_weight_bits,
                  int(settings.memory_cap_gb * 2**30) or probes.memory_bytes, stage)
    return plan.chosen.config, plan_state(plan, probes), ([note] if note else []) + plan.lines() + [
        f"plan: probed and planned in {time.perf_counter() - started:.2f} s"]


# ----------------------------------------------------------------------------- the checkpoint

def plan_state(plan: Plan, probes: Probes) -> dict:
    """What state.json keeps of a plan: the choice, its prediction, every candidate's (and by term), and the
    machine it was made on."""
    return {"chosen": plan.chosen.name, "config": dataclasses.asdict(plan.chosen.config),
            "step_seconds": plan.chosen.step_seconds, "memory_bytes": plan.chosen.memory_bytes,
            "machine": probes.fingerprint(), "predicted": {c.name: c.step_seconds for c in plan.costs},
            "terms": {c.name: c.terms for c in plan.costs}}


def reuse(saved: dict | None, machine: dict) -> tuple[ZeroConfig | None, str]:
    """(the stored plan's config, what to log) where a checkpoint's plan was made on this `machine`
    (the same fingerprint); (None, why) where it must be planned anew."""
    if saved is None:
        return None, ""
    if saved["machine"] == machine:
        return stored_config(saved), (f"plan: {saved['chosen']} reused from the checkpoint (same machine: "
                                      f"{saved['machine']})")
    return None, f"plan: the machine changed ({saved['machine']} -> {machine}): re-planned"


class StepTimeCheck:
    """The measured mean time of the priced work of a run's steps (the first, a warm-up, not counted) against
    the plan's prediction after `after` steps: a line to log, a warning when off by more than `tolerance`.
    `scope` says what was timed where it is not the whole step."""

    def __init__(self, predicted_seconds: float, after: int, tolerance: float = 0.25, scope: str = ""):
        self.predicted, self.after, self.tolerance, self.scope = predicted_seconds, after, tolerance, scope
        self.seconds: list[float] = []

    def add(self, seconds: float) -> str | None:
        """Call once per step with the seconds its priced work took; returns the line to log once, after
        `after` + 1 steps."""
        if not self.after or len(self.seconds) > self.after:
            return None
        self.seconds.append(seconds)
        if len(self.seconds) <= self.after:
            return None
        measured = sum(self.seconds[1:]) / self.after
        ratio = measured / self.predicted
        verdict = f"WARNING: off by more than {self.tolerance:.0%}" if abs(ratio - 1) > self.tolerance \
            else f"within {self.tolerance:.0%}"
        scope = f" ({self.scope})" if self.scope else ""
        return (f"plan check: measured {measured * 1e3:.1f} ms/step{scope} over {self.after} steps, predicted "
                f"{self.predicted * 1e3:.1f} ms (x{ratio:.2f}): {verdict}")


def stored_config(state: dict) -> ZeroConfig:
    """The ZeroConfig a stored plan chose."""
    values = dict(state["config"])
    compression = values.pop("gradient_compression")
    cfg = ZeroConfig(**values)
    cfg.gradient_compression = dataclasses.replace(cfg.gradient_compression, **compression)
    try:
        cfg.validate()
    except ZeroConfigError as e:
        raise PlanError(f"the checkpoint's stored plan is not a valid zero_optimization: {e}") from None
    return cfg

