"""Every collective of the runtime goes through here, so each byte is accounted for.

`Comm` wraps the collectives the runtime needs (all-gather, reduce-scatter, quantized
all-to-all reduce, all-reduce, and for the trainer's agreements a barrier and an all-gather of
picklable objects) over the groups of the `Mesh`, looked up by name, returns async handles, and
records each call in a `CommLedger`: operation, group, dtype, the bytes this rank sends and
receives, and how many of those cross a node boundary. Collectives outside any runtime (setup,
the trainer's sums and agreements, before a runtime's mesh exists) go through `world_comm()`, a
Comm over the whole world that builds no process group (`zeropp.topology.world_mesh`).

The ledger counts logical volume, independent of the algorithm the backend picks: for an
all-gather of an S-byte shard over n ranks a rank receives (n-1)·S and sends (n-1)·S; for a
reduce-scatter of N bytes it sends and receives (n-1)·N/n; an all-to-all moves each chunk
once to its destination. Bytes that come from (or go to) a rank on another node are the
cross-node share. This is the accounting of the ZeRO++ paper's communication analysis.

On gloo, `reduce_scatter_single` moves about as much as an all-reduce; a ring built from
send/recv moves each byte once and measured 1.65-1.85x faster for fp32 on 4 ranks
(`scripts/bench/reduce_scatter.py`), so gloo uses the ring, run on a dedicated thread and
process group so it overlaps compute like an async collective. NCCL uses its native
reduce-scatter.

Node-aware collectives (gloo, several nodes of several ranks): gloo's ring all-gather over
N nodes x L ranks carries a shard over every ring edge, so the edge entering a node brings in
N·L - 1 of the N·L shards where the (N - 1)·L of the other nodes suffice (2 x 2: 0.75 of the
model instead of 0.5). The
node-aware all-gather gathers first across nodes among the ranks with the same local rank
(each shard crosses once per remote node), then inside the node; its output holds the shards
local-rank-major (`Comm.gather_order`), and the decode puts them in place, so no extra copy
is made. The node-aware reduce-scatter is the mirror: a ring inside the node over the chunks
each local rank will own, then a ring across nodes of the node sums. Both move exactly
(N - 1)/N of a node's bytes across and reduce to the flat collectives on one node.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import weakref
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeropp.topology import Mesh, world_mesh

# torch < 2.13 (the GPU images' 2.11) knows the single-tensor collectives by their older names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class LedgerEntry:
    calls: int = 0
    sent: int = 0
    received: int = 0
    cross_node_sent: int = 0
    cross_node_received: int = 0
    dtypes: set = field(default_factory=set)


class FlightRecord:
    """The last collective this process issued, whichever Comm issued it: its tag and how many
    collectives came before it (what torchtitan's Flight Recorder keeps, per op). trainer.heartbeat
    publishes it, so that when a collective times out the ranks can say who stopped where."""

    def __init__(self):
        self._numbers = itertools.count(1)
        self.calls = 0
        self.tag: str | None = None

    def issued(self, tag: str) -> None:
        self.calls, self.tag = next(self._numbers), tag


FLIGHT = FlightRecord()  # the process's


class CommLedger:
    """Bytes moved by this rank, by tag (e.g. "forward gather"), since the last reset()."""

    def __init__(self):
        self.entries: dict[str, LedgerEntry] = defaultdict(LedgerEntry)
        self._lock = threading.Lock()

    def record(self, tag: str, dtype: torch.dtype | None, sent: int, received: int, cross_sent: int,
               cross_received: int):
        """One call under `tag`; dtype None: a call that carries no payload (a barrier)."""
        FLIGHT.issued(tag)
        with self._lock:
            e = self.entries[tag]
            e.calls += 1
            e.sent += sent
            e.received += received
            e.cross_node_sent += cross_sent
            e.cross_node_received += cross_received
            if dtype is not None:
                e.dtypes.add(str(dtype).replace("torch.", ""))

    def reset(self) -> None:
        with self._lock:
            self.entries.clear()

    def totals(self) -> dict[str, dict]:
        with self._lock:
            return {
                tag: {"calls": e.calls, "sent": e.sent, "received": e.received,
                      "cross_node_sent": e.cross_node_sent, "cross_node_received": e.cross_node_received,
                      "dtypes": sorted(e.dtypes)}
                for tag, e in sorted(self.entries.items())
            }


class _FutureWork:
    """An async handle for work run on the communication thread."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()


class CallbackWork:
    """An async handle whose wait() finishes the work (waits, then post-processes)."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None


class _DoneWork:
    def wait(self) -> None:
        pass


# Exchanges whose handle was dropped before its wait(), by process group: their Works, kept alive
# until the group's next exchange waits for them (see _ExchangeWork). Reentrant: a handle may be
# collected (and hand its Works back) while this thread holds the lock.
_ABANDONED: dict[object, list[list]] = {}
_ABANDONED_LOCK = threading.RLock()


class _ExchangeWork:
    """The handle of an exchange all-gather (gloo send/recv).

    gloo's transport keeps only weak pointers to a pending send's or receive's buffer; the buffer
    belongs to torch's Work. A Work dropped before its op completed (a caller that lets go of the
    handle without waiting: a checkpointed block's recompute that torch.utils.checkpoint stops
    early drops the forward all-reduces still in flight) abandons the op silently, and the peer's
    matching op then pairs with this rank's next exchange on the group: a send that never finds its
    receive, a hang (TP 2 x DP 2 with activation checkpointing hung so). So a handle dropped unwaited
    hands its Works back, and the group's next exchange waits for them first: they were issued
    before it on every member, in the group's one order, so the wait needs nothing this rank has
    not issued yet."""

    def __init__(self, works: list, pg):
        self._works = works
        self._dropped = weakref.finalize(self, _abandon, pg, works)
        self._dropped.atexit = False

    def wait(self) -> None:
        if self._works is not None:
            works, self._works = self._works, None
            self._dropped.detach()
            for work in works:
                work.wait()


def _abandon(pg, works: list) -> None:
    with _ABANDONED_LOCK:
        _ABANDONED.setdefault(pg, []).append(works)


def _wait_abandoned(pg) -> None:
    """Wait for the exchanges on `pg` whose handles were dropped unwaited (_ExchangeWork)."""
    with _ABANDONED_LOCK:
        pending = _ABANDONED.pop(pg, [])
    for works in pending:
        for work in works:
            work.wait()


def uses_node_aware(mesh: Mesh, backend: str) -> bool:
    """Whether the dp all-gather and reduce-scatter go node-aware: on gloo with several nodes of
    several ranks (NCCL keeps its own algorithms; one node or one rank per node is flat anyway)."""
    return backend == "gloo" and mesh.num_nodes > 1 and mesh.ranks_per_node > 1


class Comm:
    """Collectives over the groups of a Mesh, each recorded in the ledger.

    `group` is a mesh group name ("dp", "intra_node", "inter_node", "secondary"); `tag` names
    what the bytes are for in the ledger.
    """

    def __init__(self, mesh: Mesh, ledger: CommLedger | None = None, node_aware: bool = True):
        self.mesh = mesh
        self.ledger = ledger if ledger is not None else CommLedger()
        self.backend = dist.get_backend(mesh.group("dp"))
        # Where the backend reduces: NCCL only takes tensors on this rank's GPU (the one
        # trainer.distributed.init_distributed made current), gloo CPU tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        # gloo: the ring and qgZ run on their own thread, over the mesh's twin groups
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeropp-comm") \
            if self.backend == "gloo" else None
        self.set_layout(mesh, node_aware, self.backend)

    def set_layout(self, mesh: Mesh, node_aware: bool, backend: str) -> None:
        """Whether `dp` gathers go node-aware, and the shard orders that follow (read by the units,
        buffers and codecs; also set on zeropp.autoplan's comm on paper, which has no transport)."""
        self.mesh = mesh
        self.node_aware = node_aware and uses_node_aware(mesh, backend)
        # The DP rank whose shard sits at each position of a gather across nodes, then inside the
        # node: local-rank-major (None where that is rank order: one node, or one rank per node).
        self.local_major_order = [n * mesh.ranks_per_node + local for local in range(mesh.ranks_per_node)
                                  for n in range(mesh.num_nodes)] \
            if mesh.num_nodes > 1 and mesh.ranks_per_node > 1 else None
        # ... and of a `dp` all-gather's output with `node_aware=True` (None: rank order).
        self.gather_order = self.local_major_order if self.node_aware else None

    def volume(self, chunk_bytes: int, group: str = "dp", node_aware: bool = False) -> tuple[int, int]:
        """(bytes sent, of which cross-node) by this rank in a collective over `group` that moves one
        `chunk_bytes` chunk between each pair of members (all-gather of a shard, reduce-scatter
        or all-to-all of chunks); received is the same. Node-aware (dp, gloo, several nodes of
        several ranks): a chunk crosses once per remote node, the node's other chunks inside it."""
        if node_aware and group == "dp" and self.node_aware:
            nodes, local = self.mesh.num_nodes, self.mesh.ranks_per_node
            return (nodes - 1) * chunk_bytes + (local - 1) * nodes * chunk_bytes, (nodes - 1) * chunk_bytes
        return (self.mesh.size(group) - 1) * chunk_bytes, self.mesh.remote_members(group) * chunk_bytes

    def record(self, tag: str, dtype: torch.dtype, chunk_bytes: int, group: str, node_aware: bool = False) -> None:
        """Ledger a collective that moves one `chunk_bytes` chunk between each pair of members of `group`."""
        sent, cross = self.volume(chunk_bytes, group, node_aware)
        self.ledger.record(tag, dtype, sent, sent, cross, cross)

    # ------------------------------------------------------------------ collectives

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: str = "dp", tag: str = "all-gather",
                   async_op: bool = False, node_aware: bool = False, thread: bool = False, record: bool = True):
        """`out` (1-D, n x shard) receives every member's shard, in group-rank order; with
        `node_aware` (a caller that reorders as it decodes) in `gather_order` for the dp group.
        `thread`: called from work on the communication thread (its twin groups); `record` False:
        the caller recorded it already (when it was issued: `record`)."""
        n = self.mesh.size(group)
        node_aware = node_aware and group == "dp" and self.node_aware
        if record:
            self.record(tag, shard.dtype, shard.numel() * shard.element_size(), group, node_aware)
        if node_aware:
            return self._on_thread(lambda: self._node_aware_all_gather(out, shard), async_op)
        if n == 1:
            out.copy_(shard)
            return _DoneWork() if async_op else None
        if self.backend == "gloo":
            return self._exchange_all_gather(out, shard, group, async_op, thread)
        return _all_gather_single(out, shard, group=self.mesh.group(group, thread=thread), async_op=async_op)

    def _exchange_all_gather(self, out, shard, group, async_op, thread=False):
        """gloo: each member sends its shard straight to every other one, received in place in `out`
        (the same bytes as gloo's ring; its all-gather receives into a flat copy of `out` first, a
        whole gathered unit more of memory). Point-to-point ops progress without a waiting thread;
        a handle dropped unwaited is finished before the group's next exchange (_ExchangeWork)."""
        members, pg = self.mesh.members(group), self.mesh.group(group, thread=thread)
        _wait_abandoned(pg)
        me = self.mesh.group_rank(group)
        pieces = out.view(len(members), -1)
        pieces[me].copy_(shard)
        ops = []
        for i, member in enumerate(members):
            if i != me:
                peer = self.mesh.global_rank(group, member)
                ops += [dist.P2POp(dist.isend, shard, peer, pg), dist.P2POp(dist.irecv, pieces[i], peer, pg)]
        done = _ExchangeWork(dist.batch_isend_irecv(ops), pg)
        if async_op:
            return done
        done.wait()
        return None

    def _node_aware_all_gather(self, out, shard):
        """Across nodes among the ranks with this local rank, then inside the node (on the comm thread)."""
        m = self.mesh
        across = torch.empty(m.num_nodes * shard.numel(), dtype=shard.dtype, device=shard.device)
        _all_gather_single(across, shard, group=m.group("inter_node", thread=True))
        _all_gather_single(out, across, group=m.group("intra_node", thread=True))

    @property
    def threaded(self) -> bool:
        """Whether work handed to run() goes to the communication thread (gloo) and so must use the
        mesh's twin groups (`thread=True` below)."""
        return self._executor is not None

    def run(self, work, async_op: bool):
        """Run `work` (a function issuing collectives) on the communication thread, or inline
        where there is none (NCCL); with async_op a handle whose wait() waits for it."""
        if self._executor is None:
            work()
            return _DoneWork() if async_op else None
        return self._on_thread(work, async_op)

    def _on_thread(self, work, async_op):
        future = self._executor.submit(work)
        if async_op:
            return _FutureWork(future)
        future.result()
        return None

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: str = "dp", tag: str = "reduce-scatter",
                       async_op: bool = False, accumulate: bool = False,
                       accumulate_dtype: torch.dtype = torch.float32, scratch_input: bool = False):
        """`out` receives (or with `accumulate`, adds) the sum over members of chunk `group_rank` of `full`.

        `full` is 1-D in the wire dtype; `out` may be of another dtype (an fp32 accumulator).
        `scratch_input`: the caller no longer needs `full`, so the gloo ring may sum into its chunks
        in place (when the wire dtype is the accumulation dtype) instead of into new ones: one
        chunk of transient memory instead of three.
        """
        n = self.mesh.size(group)
        node_aware = group == "dp" and self.node_aware
        self.record(tag, full.dtype, full.numel() // n * full.element_size(), group, node_aware)
        if node_aware:
            return self._on_thread(lambda: self._node_aware_reduce_scatter(out, full, accumulate, accumulate_dtype),
                                   async_op)
        if n == 1:
            out.add_(full) if accumulate else out.copy_(full)
            return _DoneWork() if async_op else None
        if self._executor is None:
            return self._native_reduce_scatter(out, full, group, async_op, accumulate)
        return self._on_thread(lambda: self._ring_reduce_scatter(out, full, group, accumulate, accumulate_dtype,
                                                                 scratch_input), async_op)

    def _native_reduce_scatter(self, out, full, group, async_op, accumulate):
        if not accumulate and out.dtype == full.dtype:
            return _reduce_scatter_single(out, full, group=self.mesh.group(group), async_op=async_op)
        result = torch.empty(full.numel() // self.mesh.size(group), dtype=full.dtype, device=full.device)
        work = _reduce_scatter_single(result, full, group=self.mesh.group(group), async_op=True)

        def finish():
            work.wait()
            out.add_(result) if accumulate else out.copy_(result)

        if async_op:
            return CallbackWork(finish)
        finish()
        return None

    def _ring_reduce_scatter(self, out, full, group, accumulate, accumulate_dtype, scratch_input=False):
        partial = self._ring(full.view(self.mesh.size(group), -1), group, full.dtype, accumulate_dtype,
                             in_place=scratch_input and full.dtype == accumulate_dtype)
        out.add_(partial) if accumulate else out.copy_(partial)

    def _node_aware_reduce_scatter(self, out, full, accumulate, accumulate_dtype):
        """A ring inside the node over each local rank's chunks of every node (node sums), then a
        ring across nodes among the ranks with the same local rank."""
        m = self.mesh
        by_local = full.view(m.num_nodes, m.ranks_per_node, -1).transpose(0, 1)  # [local rank, node, chunk]
        node_sums = self._ring(by_local, "intra_node", full.dtype, accumulate_dtype)  # [node, chunk]
        partial = self._ring(node_sums, "inter_node", full.dtype, accumulate_dtype)
        out.add_(partial) if accumulate else out.copy_(partial)

    def _ring(self, chunks, group, wire_dtype, accumulate_dtype, in_place=False):
        """Ring reduce-scatter from send/recv over `group`: n - 1 steps, each moving one chunk
        (chunks[i]: what member i receives the sum of) to the next member; returns this member's sum.

        Partial sums are kept in `accumulate_dtype` and only rounded to the wire dtype for
        sending, so a bf16 wire loses no more than one rounding per hop. `in_place` (chunks in
        the accumulation dtype, free to overwrite): each received partial is added into the
        chunk it sums with, which is then sent as it is; the receive buffer is the only new memory.
        """
        members, mesh = self.mesh.members(group), self.mesh
        n, r = len(members), mesh.group_rank(group)
        partial = chunks[(r - 1) % n].to(accumulate_dtype)
        pg = mesh.group(group, thread=True)
        to_rank = mesh.global_rank(group, members[(r + 1) % n])
        from_rank = mesh.global_rank(group, members[(r - 1) % n])
        send = partial.to(wire_dtype).contiguous()
        recv = torch.empty_like(send)
        for k in range(n - 1):
            ops = [dist.P2POp(dist.isend, send, to_rank, pg), dist.P2POp(dist.irecv, recv, from_rank, pg)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if in_place:
                partial = send = chunks[(r - k - 2) % n].add_(recv)
                continue
            partial = recv.to(accumulate_dtype) + chunks[(r - k - 2) % n]
            if k < n - 2:
                send = partial.to(wire_dtype)
        return partial

    def _record_a2a(self, out, inp, group, tag, pg, async_op):
        n = self.mesh.size(group)
        self.record(tag, inp.dtype, inp.numel() // n * inp.element_size(), group)
        if n == 1:
            out.copy_(inp)
            return _DoneWork()
        work = dist.all_to_all_single(out, inp, group=pg, async_op=async_op)
        return work if async_op else _DoneWork()

    def all_reduce(self, tensor: torch.Tensor, group: str = "dp", tag: str = "all-reduce", async_op: bool = False,
                   op=dist.ReduceOp.SUM):
        n = self.mesh.size(group)
        self.record_all_reduce(tag, tensor.dtype, tensor.numel() * tensor.element_size(), group)
        if n == 1:
            return _DoneWork() if async_op else None
        return dist.all_reduce(tensor, op=op, group=self.mesh.group(group), async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: str = "dp", tag: str = "all-to-all",
                   async_op: bool = False, thread: bool = False):
        """`inp` cut into n equal chunks, chunk i to member i; `out` receives member i's in chunk i.
        `thread`: called from work on the communication thread (its twin groups)."""
        return self._record_a2a(out, inp, group, tag, self.mesh.group(group, thread=thread), async_op)

    def barrier(self, group: str = "world", tag: str = "barrier") -> None:
        """Wait until every member of `group` reached this call; ledgered as a call that moves no payload."""
        self.ledger.record(tag, None, 0, 0, 0, 0)
        if self.mesh.size(group) > 1:
            dist.barrier(group=self.mesh.group(group))

    def all_gather_object(self, obj, group: str = "world", tag: str = "objects") -> list:
        """Every member's picklable `obj`, in group-rank order, through two all-gathers on `self.device`
        (what torch's all_gather_object does, but ledgered): each member's pickle size (one int64),
        then the pickles, each padded to the largest. Bytes sent: (n - 1) x (8 + the largest pickle)."""
        n = self.mesh.size(group)
        if n == 1:
            return [obj]
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = torch.empty(n, dtype=torch.int64, device=self.device)
        self.all_gather(sizes, size, group, tag)
        sizes = sizes.tolist()
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(n * max(sizes), dtype=torch.uint8, device=self.device)
        self.all_gather(everyone, mine.to(self.device), group, tag)
        rows = everyone.view(n, -1).cpu()
        return [pickle.loads(rows[i, :sizes[i]].numpy().tobytes()) for i in range(n)]

    def record_all_reduce(self, tag: str, dtype: torch.dtype, nbytes: int, group: str = "dp") -> None:
        """Ledger an all-reduce of `nbytes` over `group` (also one that a library hook issues itself)."""
        volume, cross_volume = self.all_reduce_volume(nbytes, group)
        self.ledger.record(tag, dtype, volume, volume, cross_volume, cross_volume)

    def all_reduce_volume(self, nbytes: int, group: str = "dp") -> tuple[int, int]:
        """(bytes sent, of which cross-node) by this rank in a ring all-reduce of `nbytes` over `group`: each
        member sends 2 (n - 1) / n of the tensor to the next (reduce-scatter, then all-gather); the ring's hops
        that leave a node carry it across, one per node where the group's nodes are contiguous. The cross-node
        bytes are this rank's share of those, the group's average: the sender on the crossing hop varies by
        rank, and a node's link carries what its ranks' shares add up to (measured on the emulated cluster)."""
        n = self.mesh.size(group)
        volume = 2 * (n - 1) * nbytes // n
        return volume, volume * self.mesh.ring_crossings(group) // n

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


_WORLD: tuple[object, Comm] | None = None  # (the default process group it was built on, the Comm)


def world_comm() -> Comm:
    """The process's Comm over the whole world (`zeropp.topology.world_mesh`: the default group,
    no group of its own, so any rank may make it at any time, before or without a runtime): the
    collectives outside a runtime (trainer.distributed's barrier, sums and object gathers, RLHF's
    statistics) go through it, on its `device`, recorded in its own ledger. Made anew after the
    default group is (a process group destroyed and initialized again)."""
    global _WORLD
    default = dist.group.WORLD
    if _WORLD is None or _WORLD[0] is not default:
        if _WORLD is not None:
            _WORLD[1].close()
        _WORLD = (default, Comm(world_mesh(), node_aware=False))
    return _WORLD[1]
