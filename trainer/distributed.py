"""Process-group setup from the launcher's environment.

Two launchers are understood:
  torchrun  sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
  srun      (one task per rank, `srun python train.py`) sets SLURM_PROCID, SLURM_NTASKS,
            SLURM_LOCALID, SLURM_NNODES and the tasks per node; MASTER_ADDR and MASTER_PORT
            come from the batch script (scripts/slurm/launch.sbatch exports them).
The srun variables are translated into torchrun's, so the rest of the code (and
zeropp.topology's ranks_per_node_from_env) sees one set of names and the real node layout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zeropp.comm import world_comm


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LauncherError(RuntimeError):
    """The launcher's environment does not describe a usable set of ranks; says what to set."""


def parse_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LauncherError(f"cannot parse Slurm tasks per node {value!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_rank_env(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """torchrun-style variables for a process that srun started as one rank of a step.

    Returns {} unless this process is a task of an srun step (SLURM_PROCID and
    SLURM_STEP_NUM_TASKS set: a batch script or salloc shell has the job's SLURM_NTASKS but
    no step, and must not be taken for rank 0 of several) and no launcher has set RANK or
    WORLD_SIZE already (torchrun inside srun keeps torchrun's numbering).
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return {}
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}
    rank = int(environ["SLURM_PROCID"])
    world_size = int(environ["SLURM_STEP_NUM_TASKS"])  # the step's SLURM_NTASKS
    local_rank = int(environ.get("SLURM_LOCALID", "0"))
    nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    per_node_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    per_node = parse_tasks_per_node(per_node_spec) if per_node_spec else [world_size // max(nodes, 1)] * nodes
    if len(set(per_node)) == 1:
        local_world_size = per_node[0]
        # Ranks are assumed node-major (zeropp.topology): rank r on node r // L as local rank
        # r % L, which is srun's default block distribution.
        if rank % local_world_size != local_rank:
            raise LauncherError(
                f"srun placed rank {rank} as local rank {local_rank} of {local_world_size} on its node; "
                f"ranks must be laid out node-major (use srun's default --distribution=block)"
            )
    else:  # uneven nodes: this node's count (the sharded runtime will refuse such a layout)
        node = int(environ.get("SLURM_NODEID", "0"))
        local_world_size = per_node[node] if node < len(per_node) else 1
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
    }
    if world_size > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise LauncherError(
                f"srun started this process as rank {rank} of {world_size}, but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: export the head node's address and a free "
                f"port in the batch script (scripts/slurm/launch.sbatch does), or launch with torchrun"
            )
    return env


DEFAULT_TIMEOUT = 600.0  # seconds; TrainSection.dist_timeout's default, for callers without a config


def init_distributed(timeout: float | None = None) -> DistEnv:
    """Join the process group when launched with several ranks; a no-op for one process.

    CUDA ranks use NCCL on their local GPU; CPU ranks use gloo with one thread each, since
    several ranks share the machine's cores. Under srun (one task per rank) the Slurm
    variables are exported as RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE first. `timeout`
    (seconds; the config's train.dist_timeout, the one way to set it) bounds how long a
    collective may wait for the other ranks; without one, DEFAULT_TIMEOUT. zeropp.topology
    gives every sub-group the same. The DIST_TIMEOUT variable that once set it is refused, so
    that a value there is not silently ignored.
    """
    if os.environ.get("DIST_TIMEOUT"):
        raise LauncherError(f"DIST_TIMEOUT={os.environ['DIST_TIMEOUT']} is not read any more: set the timeout with "
                            f"--train.dist_timeout SECONDS (default {DEFAULT_TIMEOUT:g}) and unset DIST_TIMEOUT")
    os.environ.update(slurm_rank_env())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        # A launcher that binds one GPU per task leaves each rank a single visible device.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        dist.init_process_group(_backend(device), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), store=elastic_store(rank, world_size, timeout))
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def elastic_store(rank: int, world_size: int, timeout: float) -> dist.Store | None:
    """Under torchrun, the process group's store with a prefix of this attempt's own
    (TORCHELASTIC_RESTART_COUNT); None elsewhere (init_process_group reads the environment).

    After `torchrun --max-restarts` restarts the ranks, torch 2.13's env:// rendezvous gives the
    new attempt the store the old one wrote its gloo addresses to, and the new ranks fail in
    connectFullMesh ("Connection refused") or wait there for train.dist_timeout; keys under a
    per-attempt prefix cannot collide. Hosting follows torch: the agent's store where
    TORCHELASTIC_USE_AGENT_STORE is True, else rank 0's.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise LauncherError(f"TORCHELASTIC_RESTART_COUNT is set but {' and '.join(missing)} is not: "
                            f"launch with torchrun, which sets both")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timedelta(seconds=timeout),
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"attempt_{attempt}/", store)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# The collectives outside a runtime (setup, checkpoint agreements, the loop's sums) go through
# zeropp.comm.world_comm(): a Comm over the whole world, on the device the backend reduces on (a
# CPU tensor is reduced there and handed back where it was), recorded in that Comm's ledger.

def barrier() -> None:
    if dist.is_initialized():
        world_comm().barrier()


def _all_reduce(value: torch.Tensor, op, tag: str, comm=None, group: str = "world") -> torch.Tensor:
    if comm is None and not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    comm = comm or world_comm()
    reduced = value.to(comm.device, copy=True)
    comm.all_reduce(reduced, group, tag, op=op)
    return reduced.to(value.device)


def all_reduce_sum(value: torch.Tensor, tag: str = "trainer all-reduce", comm=None,
                   group: str = "world") -> torch.Tensor:
    """Sum a tensor over all ranks (identity for one process), or over `comm`'s `group` (a
    runtime's Comm: DiLoCo's site); a new tensor where `value` is."""
    return _all_reduce(value, dist.ReduceOp.SUM, tag, comm, group)


def all_reduce_max(value: torch.Tensor, tag: str = "trainer all-reduce") -> torch.Tensor:
    """The elementwise maximum over all ranks (identity for one process); a new tensor where `value` is."""
    return _all_reduce(value, dist.ReduceOp.MAX, tag)


def all_gather_objects(obj, tag: str = "trainer objects") -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] for one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return world_comm().all_gather_object(obj, "world", tag)
    return [obj]


class PeerError(RuntimeError):
    """A collective failed because another rank died, stopped answering or raised: this rank's
    error is a consequence, and says so, so that the failing rank's own message stands out."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out or lost its peers (gloo / NCCL)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in PEER_FAILURES)


def is_timeout(error: BaseException) -> bool:
    """Whether a peer failure is a collective that waited out its timeout (a peer stopped answering),
    rather than one that lost its connection (a peer died)."""
    return any(s in str(error) for s in TIMEOUTS)


# What gloo and NCCL say when a collective waited out its timeout (gloo's "pair closure" comes
# from a collective issued before an earlier one timed out), and when a peer died.
TIMEOUTS = ("Timed out", "timed out", "Application timeout caused pair closure", "Socket Timeout",
            "Watchdog caught collective operation timeout")
PEER_FAILURES = (*TIMEOUTS, "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "NCCL communicator was aborted")
