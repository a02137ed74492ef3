"""Communication volume per collective, ZeRO-3 vs ZeRO++ (the ZeRO++ paper's Table 4), from one step.

    python scripts/bench/comm_volume.py                      # the 10.56M reference GPT-2, ledger only
    python scripts/bench/comm_volume.py --physical           # + physical bytes per collective (emulated cluster)
    python scripts/bench/comm_volume.py --tiny               # a tiny model, seconds (what the test runs)
    python scripts/bench/comm_volume.py --block-size 64 --n-layer 2 --d-model 64 --vocab 512

Runs ONE training step (forward, backward, clip, AdamW) of the same model on 4 local gloo ranks
laid out as 2 nodes x 2, once with ZeRO-3 (bf16 communication) and once with ZeRO++ (8-bit qwZ,
hpZ over the node, 4-bit qgZ with 2 hops, block size 256 by default; fp16 weight scales and fp32
gradient scales travel with the codes and are counted). No namespaces are needed: the ledger
(`zeropp.comm.CommLedger`) knows which bytes cross a node boundary from the topology. It counts
LOGICAL volume, as the paper does: an all-gather of an S-byte shard over n ranks sends (n-1)·S per
rank, whatever algorithm the backend uses.

`--physical` runs the same step on the emulated cluster (`scripts/bench/cluster.py`: 2 network
namespaces, 2 ranks each) with every collective made synchronous and fenced by barriers, and
reads the node's link counters around each one: the bytes that really crossed, per collective
(frame bytes, minus the measured cost of the fencing barriers). gloo's ring all-gather crosses
the node boundary with 3 shards per node where the logical count is 4, so physical all-gather
bytes are ~3/4 of the ledger's (+ TCP/IP headers); all-to-all bytes match.

The paper's Table 4 (per rank, model size M): ZeRO-3 sends M (forward gather) + M (backward
gather) + M (gradient reduce-scatter); ZeRO++ 0.5M + 0 + 0.25M, i.e. 0.25x in total. Its M is
fp16 weights; qgZ's 0.25M is int4 gradients over the fp16 reduce-scatter.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench import suite  # noqa: E402

TAGS = ["forward gather", "backward gather", "gradient reduce", "grad norm"]
PAPER = {"forward gather": 0.5, "backward gather": 0.0, "gradient reduce": 0.25, "total": 0.25}
RANKS, RANKS_PER_NODE = 4, 2
REFERENCE = dict(preset="gpt2-small-cpu", n_layer=12, d_model=256, n_head=8, vocab=4096, seq=128, micro_batch=4)
TINY = dict(preset="gpt2-tiny", n_layer=2, d_model=64, n_head=4, vocab=512, seq=32, micro_batch=2)


def zero_configs(block_size: int) -> dict[str, dict]:
    return {"ZeRO-3": {},
            "ZeRO++": {"zero_quantized_weights": True, "zero_quantized_weights_bits": 8, "zero_hpz_partition_size": 0,
                       "zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4,
                       "zero_quantization_block_size": block_size}}


def model_config(m: dict):
    from models.config import ModelConfig

    return ModelConfig.from_preset(m["preset"], n_layer=m["n_layer"], d_model=m["d_model"], n_head=m["n_head"],
                                   d_ff=4 * m["d_model"], vocab_size=m["vocab"], max_seq_len=m["seq"])


# ---------------------------------------------------------------- the step (runs on every rank)


class _Done:
    def wait(self):
        pass


def _instrument(comm, ifname: str, fence_bytes: tuple[float, float]):
    """Make comm's collectives synchronous, fenced by barriers, and count this node's link bytes
    during each: tag -> [tx, rx, calls]. Every rank calls the same collectives in the same order,
    so the barriers match up; the bytes of the fencing barriers themselves are subtracted."""
    import torch.distributed as dist

    stats = defaultdict(lambda: [0.0, 0.0, 0])

    def read():
        base = f"/sys/class/net/{ifname}/statistics"
        return int(Path(f"{base}/tx_bytes").read_text()), int(Path(f"{base}/rx_bytes").read_text())

    def wrap(name):
        fn = getattr(comm, name)
        default_tag = inspect.signature(fn).parameters["tag"].default

        def fenced(*args, **kwargs):
            tag = kwargs.get("tag", default_tag)
            dist.barrier()
            t0, r0 = read()
            dist.barrier()
            work = fn(*args, **kwargs)
            if work is not None:
                work.wait()
            dist.barrier()
            t1, r1 = read()
            s = stats[tag]
            s[0] += t1 - t0 - fence_bytes[0]
            s[1] += r1 - r0 - fence_bytes[1]
            s[2] += 1
            return _Done() if kwargs.get("async_op") else None

        setattr(comm, name, fenced)

    for name in ("all_gather", "reduce_scatter", "quantized_reduce_scatter", "all_reduce", "all_to_all"):
        wrap(name)
    return stats


def _fence_cost(ifname: str, repeats: int = 20) -> tuple[float, float]:
    """Link bytes of an empty fenced window (barrier, read, barrier, barrier, read)."""
    import torch.distributed as dist

    base = f"/sys/class/net/{ifname}/statistics"
    read = lambda: (int(Path(f"{base}/tx_bytes").read_text()), int(Path(f"{base}/rx_bytes").read_text()))  # noqa
    tx = rx = 0
    for _ in range(repeats):
        dist.barrier()
        t0, r0 = read()
        dist.barrier()
        dist.barrier()
        t1, r1 = read()
        tx, rx = tx + t1 - t0, rx + r1 - r0
    return tx / repeats, rx / repeats


def one_step(rank: int, world: int, zero_kwargs: dict, m: dict, physical_if: str | None = None) -> dict:
    """One training step on this rank; returns the ledger's totals (and physical bytes per tag)."""
    import torch

    from models.transformer import Transformer, lm_loss
    from trainer.config import OptimSection
    from trainer.optim import build_shard_optimizer
    from zeropp.config import ZeroConfig
    from zeropp.engine import Zero3Engine

    torch.manual_seed(0)
    cfg = ZeroConfig(stage=3, ranks_per_node=RANKS_PER_NODE, **zero_kwargs)
    model = Transformer(model_config(m))
    n_params = sum(p.numel() for p in model.parameters())
    engine = Zero3Engine(model, lambda pieces: build_shard_optimizer(pieces, OptimSection()), cfg)
    stats = None
    if physical_if:
        stats = _instrument(engine.comm, physical_if, _fence_cost(physical_if))
    g = torch.Generator().manual_seed(1 + rank)
    sample = torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1), generator=g)
    engine.ledger.reset()
    engine.backward(lm_loss(engine(sample[:, :-1]), sample[:, 1:]))
    engine.clip_grad_norm(1.0)
    engine.step()
    totals = engine.ledger.totals()
    engine.close()
    out = {"rank": rank, "params": n_params, "ledger": totals}
    if stats is not None:
        out["physical"] = {tag: {"tx": s[0], "rx": s[1], "calls": s[2]} for tag, s in stats.items()}
    return out


def _worker_main(spec_path: str, result_path: str) -> None:
    """`--worker`: one rank under torchrun on the emulated cluster."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = one_step(rank, world, spec["zero"], spec["model"], os.environ["GLOO_SOCKET_IFNAME"])
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        Path(result_path).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def _steps(rank: int, world: int, configs: dict[str, dict], m: dict) -> dict[str, dict]:
    return {name: one_step(rank, world, kw, m) for name, kw in configs.items()}


def measure_local(configs: dict[str, dict], m: dict) -> dict[str, list[dict]]:
    """name -> per-rank results of one step with each ZeroConfig, all in one set of spawned ranks."""
    from tests.spawn import run_ranks

    per_rank = run_ranks(_steps, RANKS, args=(configs, m), ranks_per_node=RANKS_PER_NODE, timeout=900)
    return {name: [r[name] for r in per_rank] for name in configs}


def measure_physical(cluster, zero_kwargs: dict, m: dict, tmp: Path) -> list[dict]:
    spec, res = tmp / f"spec-{time.time_ns()}.json", tmp / f"result-{time.time_ns()}.json"
    spec.write_text(json.dumps({"zero": zero_kwargs, "model": m}))
    result = cluster.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec), str(res)],
                         nproc_per_node=RANKS_PER_NODE, cwd=ROOT, timeout=900)
    if result.returncode or not res.is_file():
        raise RuntimeError(f"physical run failed ({result.returncode}): {result.node_outputs[0][-1500:]}")
    return json.loads(res.read_text())


def summarize(per_rank: list[dict]) -> dict:
    """Per tag: calls, bytes sent and cross-node bytes sent (mean per rank); physical per node."""
    tags = sorted({t for r in per_rank for t in r["ledger"]}, key=lambda t: TAGS.index(t) if t in TAGS else 99)
    out = {}
    for tag in tags:
        es = [r["ledger"].get(tag, {}) for r in per_rank]
        out[tag] = {"calls": es[0].get("calls", 0), "dtypes": es[0].get("dtypes", []),
                    "sent": sum(e.get("sent", 0) for e in es) / len(es),
                    "cross_node_sent": sum(e.get("cross_node_sent", 0) for e in es) / len(es)}
        if "physical" in per_rank[0]:
            readers = [r for r in per_rank if r["rank"] % RANKS_PER_NODE == 0]   # one per node
            ph = [r["physical"].get(tag, {"tx": 0, "rx": 0}) for r in readers]
            out[tag]["physical_tx_node"] = max(0.0, sum(p["tx"] for p in ph) / len(ph))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (2 layers, d 64, vocab 512): seconds")
    for k in ("preset",):
        p.add_argument(f"--{k}", default=None)
    for k in ("n-layer", "d-model", "n-head", "vocab", "seq", "micro-batch"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--block-size", type=int, default=256, help="zero_quantization_block_size (default 256)")
    p.add_argument("--physical", action="store_true", default=None,
                   help="also measure physical bytes per collective on the emulated cluster (root)")
    p.add_argument("--rate", default="1gbit", help="link rate for --physical (bytes do not depend on it)")


def resolve_model(args) -> dict:
    m = dict(TINY if args.tiny else REFERENCE)
    for k in m:
        v = getattr(args, k, None)
        if v is not None:
            m[k] = v
    return m


def run(args, progress=print) -> dict:
    m = resolve_model(args)
    physical = args.physical if args.physical is not None else not getattr(args, "quick", False) and not args.tiny
    from models.config import num_params

    mc = model_config(m)
    result = {"benchmark": "comm_volume", "model": {**m, "params": num_params(mc),
                                                    "params_non_embedding": num_params(mc, False),
                                                    "embedding_share": mc.vocab_size * mc.d_model / num_params(mc)},
              "block_size": args.block_size, "ranks": RANKS, "ranks_per_node": RANKS_PER_NODE, "configs": {}}
    configs = zero_configs(args.block_size)
    t0 = time.monotonic()
    for name, per_rank in measure_local(configs, m).items():
        result["configs"][name] = {"zero": configs[name], "tags": summarize(per_rank)}
    progress(f"  comm_volume: ledger of one step on {RANKS} ranks, {' and '.join(configs)} "
             f"({time.monotonic() - t0:.0f} s)")
    if physical:
        from scripts.bench.ablation import cluster_unavailable

        why = cluster_unavailable()
        if why:
            result["physical_skipped"] = f"emulated cluster unavailable: {why}"
            progress(f"  comm_volume: physical bytes skipped ({why})")
        else:
            from scripts.bench.cluster import EmulatedCluster

            with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp, \
                    EmulatedCluster(nodes=RANKS // RANKS_PER_NODE, rate=args.rate) as cluster:
                for name, kw in configs.items():
                    t0 = time.monotonic()
                    tags = summarize(measure_physical(cluster, kw, m, Path(tmp)))
                    for tag, v in tags.items():
                        result["configs"][name]["tags"].setdefault(tag, {})["physical_tx_node"] = \
                            v.get("physical_tx_node")
                    progress(f"  comm_volume: {name} physical bytes on the emulated cluster "
                             f"({time.monotonic() - t0:.0f} s)")
            result["physical_rate"] = args.rate
    result["rows"] = table_rows(result)
    total = next(r for r in result["rows"] if r["collective"] == "total")
    result["total_ratio"] = total.get("ratio")
    result["physical_total_ratio"] = total.get("physical_ratio")
    return result


def table_rows(result: dict) -> list[dict]:
    z3, zpp = result["configs"]["ZeRO-3"]["tags"], result["configs"]["ZeRO++"]["tags"]
    rows = []
    tags = [t for t in TAGS if t in z3 or t in zpp] + [t for t in z3 if t not in TAGS]
    for tag in tags + ["total"]:
        if tag == "total":
            a = {k: sum(z3[t].get(k, 0) or 0 for t in z3) for k in ("sent", "cross_node_sent", "physical_tx_node")}
            b = {k: sum(zpp[t].get(k, 0) or 0 for t in zpp) for k in ("sent", "cross_node_sent", "physical_tx_node")}
            phys = "physical_tx_node" in next(iter(z3.values()))
        else:
            a, b = z3.get(tag, {}), zpp.get(tag, {})
            phys = "physical_tx_node" in a or "physical_tx_node" in b
        row = {"collective": tag, "ok": True,
               "zero3_dtypes": "/".join(a.get("dtypes", [])) if tag != "total" else "",
               "zeropp_dtypes": "/".join(b.get("dtypes", [])) if tag != "total" else "",
               "zero3_sent_mb": a.get("sent", 0) / 1e6, "zero3_cross_mb": a.get("cross_node_sent", 0) / 1e6,
               "zeropp_sent_mb": b.get("sent", 0) / 1e6, "zeropp_cross_mb": b.get("cross_node_sent", 0) / 1e6,
               "paper_ratio": PAPER.get(tag)}
        if a.get("cross_node_sent"):
            row["ratio"] = b.get("cross_node_sent", 0) / a["cross_node_sent"]
        if phys:
            row["zero3_phys_mb"] = (a.get("physical_tx_node") or 0) / 1e6
            row["zeropp_phys_mb"] = (b.get("physical_tx_node") or 0) / 1e6
            if row["zero3_phys_mb"] > 0.01:
                row["physical_ratio"] = row["zeropp_phys_mb"] / row["zero3_phys_mb"]
        rows.append(row)
    return rows


COLUMNS = [("collective", "collective", "{}"), ("zero3_dtypes", "ZeRO-3 wire", "{}"),
           ("zero3_cross_mb", "ZeRO-3 cross-node MB/rank", "{:.3f}"), ("zeropp_dtypes", "ZeRO++ wire", "{}"),
           ("zeropp_cross_mb", "ZeRO++ cross-node MB/rank", "{:.3f}"), ("ratio", "ZeRO++ / ZeRO-3", "{:.3f}"),
           ("paper_ratio", "paper", "{:.2f}"), ("zero3_phys_mb", "ZeRO-3 physical MB/node", "{:.3f}"),
           ("zeropp_phys_mb", "ZeRO++ physical MB/node", "{:.3f}"), ("physical_ratio", "physical ratio", "{:.3f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result.get("rows", []) if r["collective"] in TAGS[:3]]
    if not rows:
        return []
    plt = suite.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["zero3_cross_mb"] for r in rows], 0.4, label="ZeRO-3 (bf16)")
    ax.bar([x + 0.2 for x in xs], [r["zeropp_cross_mb"] for r in rows], 0.4, label="ZeRO++ (int8 qwZ, hpZ, int4 qgZ)")
    for x, r in zip(xs, rows):
        if r.get("ratio") is not None:
            ax.text(x + 0.2, r["zeropp_cross_mb"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["collective"] for r in rows])
    ax.set_ylabel("cross-node MB per rank, one step (ledger)")
    ax.set_title(f"{result['model']['params'] / 1e6:.2f}M-parameter GPT-2, 2 nodes x 2 ranks")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return [suite.save_fig(fig, out_dir, "comm_volume")]


def markdown(result: dict, images: dict[str, str]) -> str:
    m = result["model"]
    lines = ["## 3. Communication volume per collective (paper Table 4)", "",
             f"One training step of a {m['preset']}-shaped GPT-2 with {m['n_layer']} layers, d_model {m['d_model']}, "
             f"vocabulary {m['vocab']}: **{m['params'] / 1e6:.2f}M parameters** (embedding "
             f"{100 * m['embedding_share']:.0f}% of them), {m['micro_batch']}x{m['seq']} tokens per rank, on "
             f"{result['ranks']} ranks as 2 nodes x {result['ranks_per_node']}. ZeRO-3 communicates bf16; ZeRO++ = "
             f"8-bit qwZ + hpZ (one node) + 4-bit qgZ (2 hops), block size {result['block_size']}, scales "
             "included. Ledger = logical bytes this rank sends across the node boundary (mean over ranks), as in the "
             "paper's analysis. The embeddings and norms are gathered once per step (forward), so the backward "
             "gather covers the blocks only.", ""]
    lines += suite.md_table(result["rows"], COLUMNS if result.get("physical_rate") else COLUMNS[:7])
    lines.append("")
    lines += ["\"paper\" = Table 4 of the ZeRO++ paper in units of ZeRO-3's volume. Its 0.25 for the gradients is "
              "int4 over fp16; with 2 hops each rank sends across nodes only the share it reduced inside its node "
              "(1/L of its gradients, L = ranks per node), so on 2 nodes x 2 the ledger sees about 1/8 of ZeRO-3's "
              "bf16 reduce-scatter, plus the fp32 scales.", ""]
    if result.get("physical_rate"):
        lines += [f"Physical: bytes each node's link sent during each collective on the emulated cluster "
                  f"({result['physical_rate']}), every collective made synchronous and fenced by barriers whose own "
                  "bytes are subtracted. gloo's ring all-gather crosses the node boundary with 3 of the 4 "
                  "logical shards per node; TCP/IP headers add ~4%.", ""]
    elif result.get("physical_skipped"):
        lines += [f"Physical bytes per collective: {result['physical_skipped']}.", ""]
    if "comm_volume" in images:
        lines += [f"![comm_volume]({images['comm_volume']})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker_main(argv[1], argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    suite.add_common_args(p)
    args = p.parse_args(argv)
    return suite.run_standalone("comm_volume", run, plots, markdown, args)


if __name__ == "__main__":
    sys.exit(main())
