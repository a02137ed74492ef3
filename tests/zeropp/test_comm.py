import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_ranks
from zeropp.comm import Comm
from zeropp.topology import TopologyError, build_topology


def _collectives(rank, world, ranks_per_node, dtype):
    topo = build_topology(ranks_per_node=ranks_per_node)
    comm = Comm(topo)
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

    # intra-node all-to-all: chunk j goes to local rank j
    L = topo.ranks_per_node
    inp = torch.arange(L * 2, dtype=torch.float32) + 100 * rank
    res = torch.empty_like(inp)
    comm.all_to_all(res, inp, group="intra_node", tag="a2a")
    senders = [topo.node * L + j for j in range(L)]
    assert torch.equal(res, torch.cat([torch.arange(2 * topo.local_rank, 2 * topo.local_rank + 2) + 100 * s
                                       for s in senders]).float())
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
        assert ledger["a2a"]["cross_node_sent"] == 0  # intra-node never crosses
        assert nodes * ranks_per_node == world


def test_bf16_wire_reduce_scatter_accumulates_in_fp32():
    results = run_ranks(_collectives, 4, args=(2, torch.bfloat16), ranks_per_node=2)
    for err, _, _ in results:
        # one bf16 rounding per hop of values ~ sum of 4 unit normals: well under 0.1
        assert err < 0.1


def _bad_layout(rank, world):
    with pytest.raises(TopologyError, match="does not divide"):
        build_topology(ranks_per_node=2)
    with pytest.raises(TopologyError, match="zero_hpz_partition_size"):
        build_topology(ranks_per_node=3, secondary_size=2)
    return True


def test_layout_that_does_not_divide_is_an_error():
    assert run_ranks(_bad_layout, 3, ranks_per_node=3) == [True] * 3
