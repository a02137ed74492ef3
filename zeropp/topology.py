"""Where each data-parallel rank lives, and the process groups the runtime talks over.

Ranks are laid out node-major: data-parallel rank r sits on node r // ranks_per_node as
local rank r % ranks_per_node (what torchrun and Slurm produce). The groups are built from
a data-parallel group rather than the global world, so that a tensor-parallel split of the
world (TP x DP) can hand this module only its DP ranks.

Groups:
  dp          all data-parallel ranks
  intra_node  the ranks of this rank's node
  inter_node  the ranks with this rank's local rank, one per node
  secondary   a block of `secondary_size` consecutive ranks (hpZ's secondary partition;
              by default a node)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


class TopologyError(ValueError):
    """A node layout that cannot be built; the message names the numbers involved."""


@dataclass
class Topology:
    rank: int  # this rank's index in the data-parallel group
    world_size: int  # data-parallel world size
    ranks_per_node: int
    secondary_size: int
    dp_ranks: list[int]  # global ranks of the data-parallel group, in DP order
    dp: object = None
    intra_node: object = None
    inter_node: object = None
    secondary: object = None

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

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.ranks_per_node} rank(s) per node, "
                f"secondary partition of {self.secondary_size}")


def ranks_per_node_from_env(world_size: int) -> int:
    """The launcher's ranks per node: LOCAL_WORLD_SIZE (torchrun) or SLURM_NTASKS_PER_NODE."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return world_size


def build_topology(ranks_per_node: int | None = None, secondary_size: int | None = None,
                   dp_group=None) -> Topology:
    """Create the process groups; every rank of the world must call this in the same order.

    ranks_per_node: None takes the launcher's value; set it to emulate nodes on one machine.
    secondary_size: None means one node.
    """
    if dp_group is None:
        dp_group = dist.group.WORLD
    world_size = dist.get_world_size(dp_group)
    rank = dist.get_rank(dp_group)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    rpn = ranks_per_node or ranks_per_node_from_env(world_size)
    rpn = min(rpn, world_size)
    if world_size % rpn:
        raise TopologyError(
            f"ranks_per_node={rpn} does not divide the data-parallel world size {world_size}"
        )
    sec = secondary_size or rpn
    if sec < 1 or world_size % sec:
        raise TopologyError(
            f"secondary partition size {sec} (zero_hpz_partition_size) must divide the "
            f"data-parallel world size {world_size}"
        )
    topo = Topology(rank, world_size, rpn, sec, dp_ranks, dp=dp_group)
    # new_group is collective over the whole world: every rank creates every group.
    for node in range(world_size // rpn):
        members = [dp_ranks[node * rpn + i] for i in range(rpn)]
        group = dist.new_group(members)
        if topo.node == node:
            topo.intra_node = group
    for local in range(rpn):
        members = [dp_ranks[node * rpn + local] for node in range(world_size // rpn)]
        group = dist.new_group(members)
        if topo.local_rank == local:
            topo.inter_node = group
    if sec == rpn:
        topo.secondary = topo.intra_node
    else:
        for block in range(world_size // sec):
            members = [dp_ranks[block * sec + i] for i in range(sec)]
            group = dist.new_group(members)
            if rank // sec == block:
                topo.secondary = group
    return topo
