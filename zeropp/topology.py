"""The mesh: where each rank lives, and every process group the runtime talks over, made once.

The world is split into tensor-parallel groups of `tp` consecutive ranks (tp 1: no tensor
parallelism) and data-parallel groups of the ranks with the same tp index. Data-parallel
rank r sits on node r // ranks_per_node as local rank r % ranks_per_node (node-major, what
torchrun and Slurm produce; counted in DP ranks, i.e. per tp index).

Groups, looked up by name (`mesh.group(name)`, `mesh.members(name)`):
  dp          the data-parallel ranks of this rank's tp index
  intra_node  the DP ranks of this rank's node
  inter_node  the DP ranks with this rank's local rank, one per node
  secondary   a block of `secondary_size` consecutive DP ranks (hpZ's secondary partition;
              by default a node)
  tp          the tensor-parallel ranks of this rank (one rank when tp is 1)
  world       every rank (tp x dp)
  cross_site  DiLoCo (site_size): the ranks at this rank's place in every site, one per site
With DiLoCo the world is cut into sites of site_size consecutive ranks and every group but world
and cross_site lives inside this rank's site: the runtime sees its site as its world.
`tp`, `world` and `cross_site` list global ranks, the others DP ranks (`mesh.global_rank(name, member)`).
A runtime's mesh comes from `mesh_from_config`; `world_mesh` is the world alone (dp = world, the
default group), for the collectives outside a runtime (zeropp.comm.world_comm).
On gloo, every group also has a twin (`mesh.group(name, thread=True)`) for the communication
thread's point-to-point traffic, so it never interleaves with the main thread's collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zeropp.config import ZeroConfig

GROUPS = ("dp", "intra_node", "inter_node", "secondary", "tp", "world", "cross_site")
GLOBAL_GROUPS = ("tp", "world", "cross_site")  # their members are global ranks


class TopologyError(ValueError):
    """A layout that cannot be built; the message names the numbers involved."""


def ranks_per_node_from_env(world_size: int) -> int:
    """The launcher's ranks per node: LOCAL_WORLD_SIZE (torchrun) or SLURM_NTASKS_PER_NODE."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return world_size


def data_parallel_ranks_per_node(ranks_per_node: int | None, dp_world: int, tp: int = 1) -> int:
    """DP ranks per node as build_mesh lays them out: `ranks_per_node`, else the launcher's (its ranks per node /
    tp), at most the data-parallel world. Needs no process group: plan.auto's machine fingerprint is this."""
    return min(ranks_per_node or max(1, ranks_per_node_from_env(dp_world * tp) // tp), dp_world)


def world_timeout() -> timedelta | None:
    """The default group's collective timeout (init_process_group's), or None where it cannot be
    read: torch gives a new group its backend's default (30 minutes on gloo) unless told."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def new_group(ranks: list[int]):
    """dist.new_group with the world's timeout, so a frozen peer fails every group's collectives
    as soon as the world's (train.dist_timeout)."""
    return dist.new_group(ranks, timeout=world_timeout())


@dataclass
class Mesh:
    rank: int  # this rank's index among the data-parallel ranks
    world_size: int  # data-parallel world size
    ranks_per_node: int  # data-parallel ranks per node
    secondary_size: int
    tp_size: int
    global_ranks: list[int]  # the global rank of each DP rank of this rank's dp group
    secondary_requested: bool = False  # build_mesh was given a secondary size (hpZ)
    site: int = 0  # DiLoCo: this rank's site (its dp group is the site's)
    sites: int = 1
    _members: dict[str, list[int]] = field(default_factory=dict)  # name -> DP ranks (tp: global ranks)
    _groups: dict[tuple[str, bool], object] = field(default_factory=dict)  # (name, thread) -> process group
    _created: list = field(default_factory=list)  # the groups build_mesh made for it: close() destroys them
    _nodes: dict[str, list[int]] = field(default_factory=dict)  # name -> each member's node (nodes_of's cache)

    def close(self) -> None:
        """Destroy the process groups built for this mesh (never the default group). A process that builds
        runtimes one after another (tests, benchmarks, RLHF stages, the planner's probes) otherwise keeps
        every one's groups, and gloo's threads and sockets with them. Idempotent."""
        for group in self._created:
            dist.destroy_process_group(group)
        self._groups = {key: g for key, g in self._groups.items() if all(g is not c for c in self._created)}
        self._created.clear()

    def record(self, group):
        """`group`, remembered for close() where this rank is a member of it."""
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            self._created.append(group)
        return group

    @property
    def tp_crosses_nodes(self) -> bool:
        """Whether this rank's tensor-parallel group spans nodes."""
        return self.remote_members("tp") > 0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, dp_rank: int) -> int:
        return dp_rank // self.ranks_per_node

    def global_rank(self, name: str, member: int) -> int:
        """The global rank of a member of group `name` (as `members(name)` lists it)."""
        return member if name in GLOBAL_GROUPS else self.global_ranks[member]

    def group(self, name: str, thread: bool = False):
        """The process group `name`; thread=True: its twin for the communication thread (the group
        itself where the mesh was built without twins)."""
        return self._groups[name, thread and (name, True) in self._groups]

    def members(self, name: str) -> list[int]:
        """DP ranks (global ranks for tp and world) of this rank's group `name`, in group-rank order."""
        return self._members[name]

    def size(self, name: str) -> int:
        return len(self._members[name])

    def group_rank(self, name: str) -> int:
        me = dist.get_rank() if name in GLOBAL_GROUPS else self.rank
        return self._members[name].index(me)

    def nodes_of(self, name: str) -> list[int]:
        """The node (in the world, not the site) of each member of group `name`, in group-rank order; computed
        once per group (the ledger reads it at every collective). Global ranks are node-major too: a node
        holds ranks_per_node x tp_size of them."""
        if name not in self._nodes:
            per_node = self.ranks_per_node * self.tp_size
            self._nodes[name] = [self.global_rank(name, m) // per_node for m in self._members[name]]
        return self._nodes[name]

    def remote_members(self, name: str) -> int:
        """How many members of group `name` sit on another node than this rank (the ledger's cross-node
        share)."""
        node = self.global_ranks[self.rank] // (self.ranks_per_node * self.tp_size)
        return sum(n != node for n in self.nodes_of(name))

    def ring_crossings(self, name: str) -> int:
        """How many hops of a ring over group `name` (member to the next in group-rank order, the last back
        to the first: gloo's and NCCL's ring all-reduce) go from one node to another."""
        nodes = self.nodes_of(name)
        return sum(a != b for a, b in zip(nodes, nodes[1:] + nodes[:1]))

    def describe(self) -> str:
        """The layout; the secondary partition only where one was asked for (hpZ), not the
        node-sized default plain ZeRO-3 never uses."""
        tp = f", tensor parallel {self.tp_size}" if self.tp_size > 1 else ""
        sec = f", secondary partition of {self.secondary_size}" if self.secondary_requested else ""
        sites = f"{self.sites} sites of " if self.sites > 1 else ""
        return f"{sites}{self.num_nodes} node(s) x {self.ranks_per_node} rank(s) per node{sec}{tp}"


def _blocks(name: str, world: int, rpn: int, sec: int) -> list[list[int]]:
    """Every group `name` of a DP world, as lists of DP ranks."""
    nodes = world // rpn
    if name == "dp":
        return [list(range(world))]
    if name == "intra_node":
        return [[n * rpn + i for i in range(rpn)] for n in range(nodes)]
    if name == "inter_node":
        return [[n * rpn + local for n in range(nodes)] for local in range(rpn)]
    return [[b * sec + i for i in range(sec)] for b in range(world // sec)]


def build_mesh(ranks_per_node: int | None = None, secondary_size: int | None = None, tp: int = 1,
               thread_groups: bool | None = None, site_size: int | None = None) -> Mesh:
    """Create every process group; all ranks of the world must call this in the same order.

    ranks_per_node: DP ranks per node; None takes the launcher's (its ranks per node / tp).
    secondary_size: hpZ's group size in DP ranks; None means one node.
    thread_groups: twins for the communication thread; by default on gloo (see zeropp.comm).
    site_size: DiLoCo's sites of that many consecutive ranks, each a world of its own to every
    group but world and cross_site; None: one site, the world.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    site_size = site_size or world
    if world % site_size:
        raise TopologyError(f"diloco.site_size={site_size} does not divide the world size {world}: every site "
                            f"needs as many ranks; use a divisor of {world}")
    sites, site = world // site_size, me // site_size
    base = site * site_size  # the global rank of the site's first rank
    if tp < 1 or site_size % tp:
        raise TopologyError(f"tensor parallel size {tp} does not divide the world size {site_size}")
    dp_world, tp_index = site_size // tp, me % tp
    rpn = data_parallel_ranks_per_node(ranks_per_node, dp_world, tp)
    if dp_world % rpn:
        raise TopologyError(f"ranks_per_node={rpn} does not divide the data-parallel world size {dp_world}")
    sec = secondary_size or rpn
    if sec < 1 or dp_world % sec:
        raise TopologyError(f"secondary partition size {sec} (zero_hpz_partition_size) must divide the "
                            f"data-parallel world size {dp_world}")
    if thread_groups is None:
        thread_groups = dist.get_backend() == "gloo"
    mesh = Mesh((me - base) // tp, dp_world, rpn, sec, tp, [base + r * tp + tp_index for r in range(dp_world)],
                secondary_requested=secondary_size is not None, site=site, sites=sites)
    mesh._members["tp"] = [base + mesh.rank * tp + t for t in range(tp)]
    # new_group is collective over the whole world: every rank creates every group of every site and tp index.
    for thread in (False, True) if thread_groups else (False,):
        for s in range(sites):
            first = s * site_size
            if tp > 1:
                for d in range(dp_world):
                    group = mesh.record(new_group([first + d * tp + t for t in range(tp)]))
                    if s == site and d == mesh.rank:
                        mesh._groups["tp", thread] = group
            for name in GROUPS[:4]:
                if name == "secondary" and sec == rpn:  # one node: the intra-node group itself
                    if s == site:
                        mesh._groups[name, thread], mesh._members[name] = mesh._groups["intra_node", thread], \
                            mesh._members["intra_node"]
                    continue
                for t in range(tp):
                    for block in _blocks(name, dp_world, rpn, sec):
                        group = dist.group.WORLD if (sites == 1 and tp == 1 and name == "dp" and not thread) else \
                            mesh.record(new_group([first + d * tp + t for d in block]))
                        if s == site and t == tp_index and mesh.rank in block:
                            mesh._groups[name, thread], mesh._members[name] = group, block
    if sites > 1:  # the outer exchange's groups: one per place in a site, across the sites
        for place in range(site_size):
            members = [s * site_size + place for s in range(sites)]
            group = mesh.record(new_group(members))
            if me in members:
                mesh._groups["cross_site", False], mesh._members["cross_site"] = group, members
    else:  # one site: nothing to exchange with (Comm moves nothing over a group of one)
        mesh._members["cross_site"] = [me]
    mesh._groups["world", False], mesh._members["world"] = dist.group.WORLD, list(range(world))
    return mesh


def world_mesh() -> Mesh:
    """The whole world as one data-parallel group, over the default process group: it creates no
    group, so unlike build_mesh any rank may build it at any time (no collective call that every
    rank must make in the same order). Groups "dp" and "world" (the same group) only; nodes as
    the launcher lays them out (the ledger's cross-node share), one node where that does not
    divide the world."""
    world, me = dist.get_world_size(), dist.get_rank()
    rpn = ranks_per_node_from_env(world)
    if rpn < 1 or world % rpn:
        rpn = world
    mesh = Mesh(me, world, rpn, rpn, 1, list(range(world)))
    mesh._members["tp"] = [me]
    for name in ("dp", "world"):
        mesh._groups[name, False], mesh._members[name] = dist.group.WORLD, list(range(world))
    return mesh


def mesh_from_config(zero: ZeroConfig, tp: int = 1, site_size: int | None = None) -> Mesh:
    """The run's one layout, from `zero_optimization` (and `tensor_parallel.size`): its ranks per
    node (else the launcher's), hpZ's secondary group (`zero_hpz_partition_size`: 0 one node, n > 1
    n ranks, 1 off), tensor-parallel groups of `tp` consecutive ranks inside a node, and the
    communication thread's twins where ZeRO-3 runs on gloo; with DiLoCo, inside sites of `site_size`
    ranks (build_mesh). Every runtime is built on it."""
    rpn = zero.ranks_per_node
    if rpn is not None and rpn % tp:
        raise TopologyError(f"tensor_parallel.size={tp} must divide zero_optimization.ranks_per_node={rpn}: "
                            f"a tensor-parallel group lives inside a node")
    return build_mesh(ranks_per_node=rpn // tp if rpn else None, tp=tp,
                      secondary_size=zero.zero_hpz_partition_size if zero.zero_hpz_partition_size > 1 else None,
                      thread_groups=None if zero.stage == 3 else False, site_size=site_size)
