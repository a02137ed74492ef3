"""The emulated cluster: real torchrun + gloo across rate-limited namespaces, loopback within a
node, throughput, and teardown in every exit path. Needs root and iproute2 (skips otherwise)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.cluster import EmulatedCluster, list_namespaces, parse_rate, tbf_params

ROOT = str(Path(__file__).resolve().parents[2])

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated cluster needs root and iproute2 (`ip`, `tc`)",
)

ALLREDUCE = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    numel, iters, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.arange(numel, dtype=torch.float32) % 1000
    dist.barrier()
    start = time.perf_counter()
    err = 0.0
    for it in range(iters):
        t = base * (rank + 1) + it
        dist.all_reduce(t)
        expected = base * (world * (world + 1) / 2) + world * it
        err = max(err, (t - expected).abs().max().item())
    dist.barrier()
    elapsed = time.perf_counter() - start
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "err": err, "elapsed": elapsed,
                   "sum_first": t[:3].tolist(), "pid": os.getpid()}, f)
    print("RESULT", rank, err, elapsed)
    dist.destroy_process_group()
""")

COLLECTIVES = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from zeropp.comm import Comm
    from zeropp.topology import build_mesh
    numel, iters, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = build_mesh()  # torchrun's LOCAL_WORLD_SIZE ranks per node
    comm = Comm(mesh, node_aware=mode == "1")
    ok = True
    if mode == "all-reduce":
        full = torch.empty(numel * mesh.world_size)
        for _ in range(iters):
            comm.all_reduce(full.fill_(1.0), tag="all-reduce")
            ok = ok and bool((full == mesh.world_size).all())
    else:  # "1": node-aware, "0": flat
        shard = torch.full((numel,), float(mesh.rank))
        gathered = torch.empty(numel * mesh.world_size)
        for _ in range(iters):
            comm.all_gather(gathered, shard, node_aware=True)
        ok = all(gathered[p * numel] == r for p, r in enumerate(comm.gather_order or range(mesh.world_size)))
        full, mine = torch.ones(numel * mesh.world_size), torch.zeros(numel)
        for _ in range(iters):
            comm.reduce_scatter(mine, full, accumulate=True)
        ok = ok and bool((mine == iters * mesh.world_size).all())
    comm.close()
    with open(f"{out}/rank{mesh.rank}.json", "w") as f:
        json.dump({"ok": ok, "node_aware": comm.node_aware, "ledger": comm.ledger.totals()}, f)
    dist.destroy_process_group()
""")

SLEEPER = textwrap.dedent("""
    import os, sys, time
    with open(f"{sys.argv[1]}/pid{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours would still "exist"; check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone(cluster):
    assert not [ns for ns in list_namespaces() if ns.startswith(cluster.prefix + "-")]
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    links = {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}
    assert not links & {name for n in cluster.nodes for name in (n.ifname, n.hub_ifname)}
    assert not [name for name in links if name.startswith(cluster.prefix)]


def test_parse_rate_and_burst():
    assert parse_rate("20mbit") == 20_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("1.5Gbit") == 1_500_000_000
    assert parse_rate("10mbps") == 80_000_000
    with pytest.raises(ValueError):
        parse_rate("fast")
    assert tbf_params(20_000_000)[0] == 64 * 1024
    assert tbf_params(1_000_000_000)[0] == 625_000


def test_allreduce_across_two_nodes_at_20mbit(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    numel, iters = 512 * 1024, 4                     # 2 MiB fp32, 4 all-reduces
    payload = numel * 4 * iters                      # each node must receive (and send) >= this
    rate = 20_000_000
    with EmulatedCluster(nodes=2, rate="20mbit", run_dir=tmp_path / "run") as cluster:
        result = cluster.run([sys.executable, str(script), numel, iters, tmp_path],
                             nproc_per_node=1, timeout=120, cwd=tmp_path)
    _assert_gone(cluster)
    assert result.returncode == 0, result.node_outputs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["err"] == 0.0 for r in ranks)
    # The sum x0 + x1 plus its own x_k gives away the other's x: each node must receive at least
    # the payload, and (symmetrically) send it.
    for k in range(2):
        assert result.link_bytes[k]["rx"] >= payload, result.link_bytes
        assert result.link_bytes[k]["tx"] >= payload, result.link_bytes
        assert result.link_bytes[k]["tx"] < 3 * payload, result.link_bytes
    # Timing consistent with the rate: no faster than the bytes allow (less the 64 KiB bucket),
    # and not wildly slower.
    lower = (payload - 2 * 64 * 1024) * 8 / rate
    elapsed = max(r["elapsed"] for r in ranks)
    assert lower <= elapsed <= 4 * lower + 2, (elapsed, lower)
    assert result.wall_s >= elapsed
    assert (tmp_path / "run" / "node0.out").exists()


def test_node_aware_collectives_cross_each_node_boundary_once(tmp_path):
    """2 nodes x 2 ranks: the node-aware all-gather and reduce-scatter send (N - 1)/N = 0.5 of
    the model's bytes out of each node, measured on the link; gloo's flat ring sends 0.75. An
    all-reduce, a ring over the 4 ranks, sends 2 (N - 1)/N = 1.5 of the tensor out of each node
    (one hop of the ring leaves it), what the ledger's cross-node bytes of the node's ranks add up to."""
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    numel, iters = 256 * 1024, 4
    model = 4 * numel * 4 * iters  # 4 ranks' fp32 shards, per collective, over the iterations
    sent = {}
    with EmulatedCluster(nodes=2, rate="1gbit", run_dir=tmp_path / "run") as cluster:
        for mode in (1, 0, "all-reduce"):  # node-aware gathers, flat ones, an all-reduce
            out = tmp_path / str(mode)
            out.mkdir()
            result = cluster.run([sys.executable, str(script), numel, iters, mode, out], nproc_per_node=2,
                                 timeout=120, cwd=tmp_path, env={"PYTHONPATH": ROOT})
            assert result.returncode == 0, result.node_outputs
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
            assert all(r["ok"] and r["node_aware"] == (mode == 1) for r in ranks)
            if mode == "all-reduce":
                ring = [lb["tx"] / model for lb in result.link_bytes]
                ledger = [sum(r["ledger"]["all-reduce"]["cross_node_sent"] for r in ranks[2 * k:2 * k + 2])
                          for k in range(2)]
                assert ledger == [1.5 * model] * 2
                continue
            # both collectives together: 2 x model bytes, of which each node sends a share
            sent[mode] = [lb["tx"] / (2 * model) for lb in result.link_bytes]
            ledger = sum(r["ledger"][tag]["cross_node_sent"] for r in ranks[:2] for tag in ("all-gather", "reduce-scatter"))
            if mode:  # the ledger counts what node 0 sends across: exactly half the model, twice
                assert ledger == model
    _assert_gone(cluster)
    print("share of the model each node sends, node-aware / flat:", sent, "all-reduce:", ring)
    for share in ring:
        assert 1.5 <= share < 1.6, ring
    for share in sent[1]:
        assert 0.5 <= share < 0.56, sent  # the bytes themselves plus TCP/IP headers
    for share in sent[0]:
        assert share > 0.72, sent  # 3 of the 4 shards leave each node on the ring


def test_ranks_of_one_node_use_loopback(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    with EmulatedCluster(nodes=1, rate="20mbit") as cluster:
        result = cluster.run([sys.executable, str(script), 512 * 1024, 4, tmp_path],
                             nproc_per_node=2, timeout=120)
    _assert_gone(cluster)
    assert result.returncode == 0, result.node_outputs
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["err"] == 0.0 for r in range(2))
    # 8 MiB moved between the two ranks, none of it over the shaped link
    assert result.link_bytes[0]["tx"] < 10_000 and result.link_bytes[0]["rx"] < 10_000, result.link_bytes


def test_teardown_after_success_failure_and_timeout(tmp_path):
    with EmulatedCluster(nodes=2, rate="100mbit") as ok:
        assert len([ns for ns in list_namespaces() if ns.startswith(ok.prefix + "-")]) == 3
        assert ok.run(["true"], torchrun=False).returncode == 0
    _assert_gone(ok)

    with EmulatedCluster(nodes=2, rate="100mbit") as failing:
        result = failing.run(["sh", "-c", "exit 3"], torchrun=False)
        assert result.returncode == 3 and result.returncodes == [3, 3]
    _assert_gone(failing)

    # timeout with a real torchrun tree: its workers must die too
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with EmulatedCluster(nodes=2, rate="100mbit") as slow:
        result = slow.run([sys.executable, str(script), tmp_path], nproc_per_node=1, timeout=15)
        assert result.timed_out and result.returncode == 124
    _assert_gone(slow)
    started = [tmp_path / f"pid{r}" for r in range(2)]
    assert all(p.exists() for p in started), f"workers did not start within 15 s: {result.node_outputs}"
    pids = [int(p.read_text()) for p in started]
    assert not [p for p in pids if _alive(p)]

    # an exception inside the with-block tears down too
    with pytest.raises(RuntimeError):
        with EmulatedCluster(nodes=2, rate="100mbit") as raising:
            raise RuntimeError("boom")
    _assert_gone(raising)


def test_throughput_at_20mbit():
    with EmulatedCluster(nodes=2, rate="20mbit") as cluster:
        measured = cluster.measure_throughput(0, 1, seconds=1.5)
    _assert_gone(cluster)
    assert 0.6 * 20 <= measured["mbit_s"] <= 1.1 * 20, measured
