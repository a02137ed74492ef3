import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import trainer.distributed as td
from trainer.spawn import run_ranks
from zeropp.comm import Comm, world_comm
from zeropp.topology import TopologyError, build_mesh, world_mesh


def _collectives(rank, world, ranks_per_node, dtype):
    topo = build_mesh(ranks_per_node=ranks_per_node)
    comm = Comm(topo, node_aware=False)
    n = 5  # shard numel: deliberately not a power of two
    g = torch.Generator().manual_seed(100 + rank)
    shard = torch.randn(n, generator=g).to(dtype)

    out = torch.empty(n * world, dtype=dtype)
    comm.all_gather(out, shard, tag="gather", async_op=True).wait()
    expect = [torch.randn(n, generator=torch.Generator().manual_seed(100 + r)).to(dtype) for r in range(world)]
    assert torch.equal(out, torch.cat(expect))

    full = torch.randn(n * world, generator=g, dtype=torch.float32).to(dtype)
    reference = full.double()
    dist.all_reduce(reference)
    mine = torch.empty(n, dtype=dtype)
    comm.reduce_scatter(mine, full, tag="reduce", async_op=True).wait()
    err = (mine.double() - reference.view(world, n)[rank]).abs().max().item()
    scratch, summed_in_place = full.clone(), torch.empty(n, dtype=dtype)  # the same sums, in the input's chunks
    comm.reduce_scatter(summed_in_place, scratch, tag="reduce in place", scratch_input=True)
    assert torch.equal(summed_in_place, mine)

    # the mesh's groups: intra-node and inter-node talk to exactly their members
    members = {name: topo.members(name) for name in ("intra_node", "inter_node")}
    for name, ranks in members.items():
        seen = torch.zeros(len(ranks), dtype=torch.float32)
        comm.all_gather(seen, torch.tensor([float(rank)]), group=name, tag=name)
        assert seen.tolist() == [float(r) for r in ranks], (name, seen, ranks)
    L = topo.ranks_per_node
    assert members["intra_node"] == [topo.node * L + j for j in range(L)]
    assert members["inter_node"] == [n * L + topo.local_rank for n in range(world // L)]
    comm.close()
    return err, comm.ledger.totals(), (topo.node, topo.local_rank)


@pytest.mark.parametrize("world,ranks_per_node", [(4, 2), (3, 3), (3, 1)])
def test_collectives_and_ledger(world, ranks_per_node):
    results = run_ranks(_collectives, world, args=(ranks_per_node, torch.float32), ranks_per_node=ranks_per_node)
    nodes = world // ranks_per_node
    for rank, (err, ledger, (node, local)) in enumerate(results):
        assert err < 1e-5, f"ring reduce-scatter error {err}"
        assert (node, local) == (rank // ranks_per_node, rank % ranks_per_node)
        shard_bytes = 5 * 4
        other_node_ranks = world - ranks_per_node
        assert ledger["gather"]["received"] == (world - 1) * shard_bytes
        assert ledger["gather"]["cross_node_received"] == other_node_ranks * shard_bytes
        assert ledger["reduce"]["sent"] == (world - 1) * shard_bytes
        assert ledger["reduce"]["cross_node_sent"] == other_node_ranks * shard_bytes
        assert ledger["intra_node"]["cross_node_sent"] == 0  # intra-node never crosses
        assert ledger["inter_node"]["cross_node_sent"] == ledger["inter_node"]["sent"]  # inter-node always does
        assert nodes * ranks_per_node == world


def test_bf16_wire_reduce_scatter_accumulates_in_fp32():
    results = run_ranks(_collectives, 4, args=(2, torch.bfloat16), ranks_per_node=2)
    for err, _, _ in results:
        # one bf16 rounding per hop of values ~ sum of 4 unit normals: well under 0.1
        assert err < 0.1


def _node_aware_vs_flat(rank, world, ranks_per_node):
    mesh = build_mesh(ranks_per_node=ranks_per_node)
    flat, aware = Comm(mesh, node_aware=False), Comm(mesh)
    n = 7  # shard numel: not a power of two
    g = torch.Generator().manual_seed(7 + rank)
    shard = torch.randn(n, generator=g).to(torch.bfloat16)
    expect = torch.empty(n * world, dtype=torch.bfloat16)
    flat.all_gather(expect, shard, tag="gather")
    got = torch.empty_like(expect)
    aware.all_gather(got, shard, tag="gather", async_op=True, node_aware=True).wait()
    in_place = torch.empty_like(got)
    for p, r in enumerate(aware.gather_order or range(world)):  # what the decode does
        in_place[r * n:(r + 1) * n] = got[p * n:(p + 1) * n]
    gathers_equal = torch.equal(in_place, expect)

    # integers: every summation order is exact, so the two reduce-scatters must agree bit for bit
    full = torch.randint(-1000, 1000, (n * world,), generator=g).float()
    results = []
    for comm in (flat, aware):
        out = torch.full((n,), 0.5)
        comm.reduce_scatter(out, full, tag="reduce", async_op=True, accumulate=True).wait()
        results.append(out)
    reference = full.double()
    dist.all_reduce(reference)
    # random values on a bf16 wire: within the flat ring's rounding of the exact sum
    normal = torch.randn(n * world, generator=g).to(torch.bfloat16)
    exact = normal.double()
    dist.all_reduce(exact)
    errors = []
    for comm in (flat, aware):
        out = torch.zeros(n)
        comm.reduce_scatter(out, normal, tag="bf16 reduce")
        errors.append((out.double() - exact.view(world, n)[rank]).abs().max().item())
    for comm in (flat, aware):
        comm.close()
    return (gathers_equal, torch.equal(results[0], results[1]),
            torch.equal(results[1].double() - 0.5, reference.view(world, n)[rank]), errors,
            aware.node_aware, aware.ledger.totals(), flat.ledger.totals())


@pytest.mark.parametrize("nodes,local", [(2, 2), (2, 3), (3, 2), (1, 4), (4, 1)])
def test_node_aware_collectives_match_flat_and_cross_each_boundary_once(nodes, local):
    """The node-aware all-gather (reordered as the decode does) and reduce-scatter equal the flat
    ones bit for bit; a node sends (N - 1)/N of the model's bytes across, the flat ring more."""
    world = nodes * local
    results = run_ranks(_node_aware_vs_flat, world, args=(local,), ranks_per_node=local)
    shard = {"gather": 7 * 2, "reduce": 7 * 4}  # bytes of one rank's shard: bf16 gather, fp32 reduce
    for gathers_equal, reduces_equal, reduce_exact, (flat_err, aware_err), aware, ledger, flat_ledger in results:
        assert gathers_equal and reduces_equal and reduce_exact
        assert aware_err < 0.1 and flat_err < 0.1  # one bf16 rounding per hop of sums of ~world normals
        assert aware == (nodes > 1 and local > 1)  # one node or one rank per node: the flat collectives
        for tag, nbytes in shard.items():
            assert ledger[tag]["sent"] == flat_ledger[tag]["sent"] == (world - 1) * nbytes
            # per node: local ranks x (nodes - 1) shards = (N - 1)/N of the model's nodes x local shards
            assert ledger[tag]["cross_node_sent"] * local == (nodes - 1) / nodes * world * nbytes
            assert flat_ledger[tag]["cross_node_sent"] == (world - local) * nbytes


def _bad_layout(rank, world):
    with pytest.raises(TopologyError, match="does not divide"):
        build_mesh(ranks_per_node=2)
    with pytest.raises(TopologyError, match="zero_hpz_partition_size"):
        build_mesh(ranks_per_node=3, secondary_size=2)
    return True


def test_layout_that_does_not_divide_is_an_error():
    assert run_ranks(_bad_layout, 3, ranks_per_node=3) == [True] * 3


def _tp_by_dp(rank, world):
    mesh = build_mesh(ranks_per_node=1, tp=2)
    comm = Comm(mesh)
    seen = torch.zeros(mesh.world_size)
    comm.all_gather(seen, torch.tensor([float(rank)]), tag="dp")
    comm.close()
    return mesh.rank, mesh.world_size, mesh.members("tp"), seen.tolist()


def test_mesh_splits_tensor_parallel_from_data_parallel():
    """tp=2 on 4 ranks: tp groups of consecutive ranks, dp groups of the ranks with the same tp
    index, and the runtime's collectives stay inside this rank's dp group."""
    results = run_ranks(_tp_by_dp, 4, ranks_per_node=4)
    assert [r[:2] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r[2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[3] for r in results] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]


def _dropped_exchanges(rank, world, fixed):
    """Exchange all-gathers over the tp group whose handles are dropped unwaited (what a checkpointed
    block's early-stopped recompute does to its pending forward all-reduces), between waited ones."""
    import zeropp.comm as comm_module

    if not fixed:  # the old handle: dropping it destroys torch's Works, abandoning the ops in gloo
        class Plain:
            def __init__(self, works, pg):
                self.works = works

            def wait(self):
                for w in self.works:
                    w.wait()
        comm_module._ExchangeWork = Plain
    mesh = build_mesh(ranks_per_node=2, tp=2)
    comm = Comm(mesh)
    me, dropped_outs = mesh.group_rank("tp"), []
    for i in range(20):
        dropped = torch.empty(2 * 64)
        comm.all_gather(dropped, torch.full((64,), 1000.0 * i + rank), "tp", tag="dropped", async_op=True)
        dropped_outs.append((i, dropped))  # the handle is dropped at once, the buffer kept to check
        outs, handles = [], []
        for j in range(2):
            out = torch.empty(2 * 16)
            handles.append(comm.all_gather(out, torch.full((16,), 100.0 * i + 10 * j + rank), "tp", tag="kept",
                                           async_op=True))
            outs.append(out)
        for j in (1, 0):  # waited out of order
            handles[j].wait()
            expect = [100.0 * i + 10 * j + m for m in mesh.members("tp")]
            assert outs[j].view(2, -1)[:, 0].tolist() == expect, (i, j, outs[j])
    comm.all_gather(torch.empty(2), torch.zeros(1), "tp")  # waits for the last dropped one
    for i, out in dropped_outs:
        assert out.view(2, -1)[:, 0].tolist() == [1000.0 * i + m for m in mesh.members("tp")], (i, me)
    comm.close()
    return True


def test_exchange_whose_handle_is_dropped_still_completes():
    """The gloo exchange all-gather on every group (tp included): a handle dropped without wait()
    neither hangs the next exchanges nor lets their messages pair with its ones. With the old handle
    (`_dropped_exchanges` with fixed=False) these calls hang, as TP 2 x DP 2 with activation
    checkpointing did (tests/trainer/test_activation_checkpointing.py, "tp topk int4")."""
    assert run_ranks(_dropped_exchanges, 4, args=(True,), ranks_per_node=2, timeout=120) == [True] * 4


def _world_collectives(rank, world):
    groups = distributed_c10d._world.group_count
    mesh = world_mesh()
    assert distributed_c10d._world.group_count == groups  # it makes no process group
    assert mesh.group("dp") is mesh.group("world") is dist.group.WORLD
    assert (mesh.members("world"), mesh.ranks_per_node, mesh.num_nodes) == (list(range(world)), 2, 2)
    comm = world_comm()
    assert world_comm() is comm and comm.device == torch.device("cpu")
    ledger = comm.ledger
    ledger.reset()
    td.barrier()
    objects = [{"rank": r, "words": ["x" * r] * (3 * r)} for r in range(world)]  # pickles of different sizes
    got = td.all_gather_objects(objects[rank], tag="objects")
    summed = td.all_reduce_sum(torch.tensor([float(rank), 1.0], dtype=torch.float64), tag="sums")
    top = td.all_reduce_max(torch.tensor([float(rank)]), tag="sums")
    return got, summed.tolist(), top.tolist(), ledger.totals(), max(len(pickle.dumps(o)) for o in objects)


def test_world_comm_runs_the_trainer_collectives_and_ledgers_their_bytes():
    """trainer.distributed's barrier, sums and object gathers go through zeropp.comm.world_comm (a
    Comm over the default group, no group of its own); the ledger's bytes against a count made
    here: an object gather all-gathers one int64 size, then every pickle padded to the largest."""
    world, rpn = 4, 2
    results = run_ranks(_world_collectives, world, ranks_per_node=rpn)
    for rank, (got, summed, top, ledger, largest) in enumerate(results):
        assert got == [{"rank": r, "words": ["x" * r] * (3 * r)} for r in range(world)]
        assert summed == [0.0 + 1 + 2 + 3, 4.0] and top == [3.0]
        assert ledger["barrier"] == {"calls": 1, "sent": 0, "received": 0, "cross_node_sent": 0,
                                     "cross_node_received": 0, "dtypes": []}
        gathered = (world - 1) * (8 + largest)  # from each other rank: its size, its padded pickle
        assert ledger["objects"]["calls"] == 2 and ledger["objects"]["dtypes"] == ["int64", "uint8"]
        assert ledger["objects"]["sent"] == ledger["objects"]["received"] == gathered
        assert ledger["objects"]["cross_node_sent"] == (world - rpn) * (8 + largest)
        # two ring all-reduces: 2 (n - 1) / n of 16 bytes (two float64), then of 4 bytes (one float32)
        assert ledger["sums"]["calls"] == 2 and ledger["sums"]["sent"] == 2 * 3 * 16 // 4 + 2 * 3 * 4 // 4
