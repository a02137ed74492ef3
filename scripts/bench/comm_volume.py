"""Communication volume per collective, ZeRO-3 vs ZeRO++ (the ZeRO++ paper's Table 4), from one training step on
4 local gloo ranks laid out as 2 nodes x 2: the ledger's logical bytes (zeropp.comm.CommLedger) and, with
`--physical`, the bytes each node's link sent during each collective on the emulated cluster.

    python scripts/bench/comm_volume.py                      # the 10.56M reference GPT-2, + physical bytes
    python scripts/bench/comm_volume.py --quick              # ledger only (what the suite's --quick runs)
    python scripts/bench/comm_volume.py --tiny               # a tiny model, seconds (what the test runs)
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from scripts.bench import report, runner
from scripts.bench.runner import NODES, RANKS_PER_NODE
from scripts.bench.suite import main_one
from trainer.config import OptimSection
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp import build_runtime
from zeropp.config import ZeroConfig

TITLE = "## 3. Communication volume per collective (paper Table 4)"
TAGS = ["forward gather", "backward gather", "gradient reduce", "grad norm"]
PAPER = {"forward gather": 0.5, "backward gather": 0.0, "gradient reduce": 0.25, "total": 0.25}
RANKS = NODES * RANKS_PER_NODE
REFERENCE = dict(preset="gpt2-small-cpu", n_layer=12, d_model=256, n_head=8, vocab=4096, seq=128, micro_batch=4)
TINY = dict(preset="gpt2-tiny", n_layer=2, d_model=64, n_head=4, vocab=512, seq=32, micro_batch=2)
ZPP = {"zero_quantized_weights": True, "zero_quantized_weights_bits": 8, "zero_hpz_partition_size": 0,
       "zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4}


def model_config(m: dict) -> ModelConfig:
    return ModelConfig.from_preset(m["preset"], n_layer=m["n_layer"], d_model=m["d_model"], n_head=m["n_head"],
                                   d_ff=4 * m["d_model"], vocab_size=m["vocab"], max_seq_len=m["seq"])


# ---------------------------------------------------------------- the step (runs on every rank)


def _fenced(comm, ifname: str) -> dict:
    """Make comm's collectives synchronous, fenced by barriers, and count the bytes this node's link sent
    during each: tag -> bytes. Every rank calls the same collectives in the same order, so the barriers
    match up; the bytes of an empty fenced window (the barriers themselves) are subtracted."""
    sent, tx_bytes = defaultdict(float), Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")

    def window(fn=lambda: None) -> int:
        dist.barrier()
        before = int(tx_bytes.read_text())
        dist.barrier()
        fn()
        dist.barrier()
        return int(tx_bytes.read_text()) - before

    fence = sum(window() for _ in range(20)) / 20

    def wrap(fn):
        default_tag = inspect.signature(fn).parameters["tag"].default

        def fenced(*args, **kwargs):
            work = []

            def call():  # an async collective is waited for inside the window (wait() is idempotent)
                work.append(fn(*args, **kwargs))
                if work[0] is not None:
                    work[0].wait()

            sent[kwargs.get("tag", default_tag)] += window(call) - fence
            return work[0]

        return fenced

    for name in ("all_gather", "reduce_scatter", "quantized_reduce_scatter", "all_reduce", "all_to_all"):
        if hasattr(comm, name):
            setattr(comm, name, wrap(getattr(comm, name)))
    return sent


def one_step(rank: int, world: int, zero_kwargs: dict, m: dict, physical_if: str | None = None) -> dict:
    """One training step on this rank: the ledger's totals (and, on the cluster, the bytes the node's link
    sent per tag)."""
    torch.manual_seed(0)
    zero = ZeroConfig(stage=3, ranks_per_node=RANKS_PER_NODE, **zero_kwargs)
    runtime = build_runtime(Transformer(model_config(m)), zero, torch.device("cpu"))
    optimizer = runtime.attach_optimizer(build_optimizer(runtime.module, OptimSection()))
    sent = _fenced(runtime.comm, physical_if) if physical_if else None
    g = torch.Generator().manual_seed(1 + rank)
    sample = torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1), generator=g)
    runtime.ledger.reset()
    runtime.backward(lm_loss(runtime(sample[:, :-1]), sample[:, 1:]))
    runtime.clip_grad_norm_(1.0)
    # the step's own collectives: the optimizer step then sends the next forward's first gathers
    out = {"rank": rank, "ledger": runtime.ledger.totals(), **({"physical": dict(sent)} if sent is not None else {})}
    optimizer.step()
    runtime.close()
    return out


def worker(argv: list[str]) -> int:
    """`--worker SPEC RESULT`: one rank under torchrun on the emulated cluster."""
    torch.set_num_threads(1)
    spec = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = [None] * world
    dist.all_gather_object(everyone, one_step(rank, world, spec["zero"], spec["model"],
                                              os.environ["GLOO_SOCKET_IFNAME"]))
    if rank == 0:
        Path(argv[1]).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- driver


def _steps(rank: int, world: int, configs: dict[str, dict], m: dict) -> dict[str, dict]:
    return {name: one_step(rank, world, kw, m) for name, kw in configs.items()}


def summarize(per_rank: list[dict]) -> dict:
    """Per tag: calls, bytes sent and cross-node bytes sent (mean per rank); physical per node."""
    tags = sorted({t for r in per_rank for t in r["ledger"]}, key=lambda t: TAGS.index(t) if t in TAGS else 99)
    out = {}
    for tag in tags:
        es = [r["ledger"].get(tag, {}) for r in per_rank]
        out[tag] = {"calls": es[0].get("calls", 0), "dtypes": es[0].get("dtypes", []),
                    **{k: sum(e.get(k, 0) for e in es) / len(es) for k in ("sent", "cross_node_sent")}}
        if "physical" in per_rank[0]:
            per_node = [r["physical"].get(tag, 0) for r in per_rank if r["rank"] % RANKS_PER_NODE == 0]
            out[tag]["physical_tx_node"] = max(0.0, sum(per_node) / len(per_node))
    return out


def add_args(p) -> None:
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (2 layers, d 64, vocab 512): seconds")
    p.add_argument("--block-size", type=int, default=256, help="zero_quantization_block_size (default 256)")
    p.add_argument("--physical", action="store_true", default=None,
                   help="also physical bytes on the emulated cluster (root; default without --quick and --tiny)")
    p.add_argument("--rate", default="1gbit", help="link rate for --physical (bytes do not depend on it)")


def run(args, progress=print) -> dict:
    m = TINY if args.tiny else REFERENCE
    mc = model_config(m)
    facts = runner.model_facts(mc, m["preset"], m["seq"])
    configs, t0 = {"ZeRO-3": {}, "ZeRO++": {**ZPP, "zero_quantization_block_size": args.block_size}}, time.monotonic()
    per_rank = run_ranks(_steps, RANKS, args=(configs, m), ranks_per_node=RANKS_PER_NODE, timeout=900)
    result = {"model": {**facts, "micro_batch": m["micro_batch"],
                        "embedding_share": mc.vocab_size * mc.d_model / facts["params"]},
              "block_size": args.block_size, "ranks": RANKS, "ranks_per_node": RANKS_PER_NODE,
              "configs": {name: {"zero": zero, "tags": summarize([r[name] for r in per_rank])}
                          for name, zero in configs.items()},
              "node_aware_collectives": ZeroConfig().node_aware_collectives}
    progress(f"  comm_volume: ledger of one step on {RANKS} ranks, {' and '.join(configs)} "
             f"({time.monotonic() - t0:.0f} s)")
    physical = args.physical if args.physical is not None else not (args.quick or args.tiny)
    if physical and (why := runner.cluster_unavailable()):
        result["physical_skipped"] = f"emulated cluster unavailable: {why}"
        progress(f"  comm_volume: physical bytes skipped ({why})")
    elif physical:
        with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp, runner.cluster_at(args.rate) as cluster:
            for name, zero in configs.items():
                t0, spec, res = time.monotonic(), Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.result.json"
                spec.write_text(json.dumps({"zero": zero, "model": m}))
                rc, output = runner.launch([sys.executable, __file__, "--worker", spec, res], cluster)
                if rc or not res.is_file():
                    raise RuntimeError(f"physical run failed ({rc}): {runner.error_tail(output)}")
                for tag, v in summarize(json.loads(res.read_text())).items():
                    result["configs"][name]["tags"].setdefault(tag, {})["physical_tx_node"] = v["physical_tx_node"]
                progress(f"  comm_volume: {name} physical bytes on the emulated cluster "
                         f"({time.monotonic() - t0:.0f} s)")
        result["physical_rate"] = args.rate
    result["rows"] = table_rows(result)
    result["total_ratio"] = result["rows"][-1].get("ratio")
    return result


def table_rows(result: dict) -> list[dict]:
    z3, zpp = result["configs"]["ZeRO-3"]["tags"], result["configs"]["ZeRO++"]["tags"]
    phys = any("physical_tx_node" in v for v in z3.values())
    total = [{k: sum(v.get(k) or 0 for v in side.values()) for k in ("sent", "cross_node_sent", "physical_tx_node")}
             for side in (z3, zpp)]
    rows = []
    for tag in [t for t in TAGS if t in z3 or t in zpp] + [t for t in z3 if t not in TAGS] + ["total"]:
        a, b = total if tag == "total" else (z3.get(tag, {}), zpp.get(tag, {}))
        row = {"collective": tag, "ok": True, "paper_ratio": PAPER.get(tag)}
        for side, v in (("zero3", a), ("zeropp", b)):
            row.update({f"{side}_dtypes": "/".join(v.get("dtypes", [])), f"{side}_sent_mb": v.get("sent", 0) / 1e6,
                        f"{side}_cross_mb": v.get("cross_node_sent", 0) / 1e6})
            if phys:
                row[f"{side}_phys_mb"] = (v.get("physical_tx_node") or 0) / 1e6
        if a.get("cross_node_sent"):
            row["ratio"] = b.get("cross_node_sent", 0) / a["cross_node_sent"]
        if phys and row["zero3_phys_mb"] > 0.01:
            row["physical_ratio"] = row["zeropp_phys_mb"] / row["zero3_phys_mb"]
        rows.append(row)
    return rows


COLUMNS = [("collective", "collective", "{}"), ("zero3_dtypes", "ZeRO-3 wire", "{}"),
           ("zero3_cross_mb", "ZeRO-3 cross-node MB/rank", "{:.3f}"), ("zeropp_dtypes", "ZeRO++ wire", "{}"),
           ("zeropp_cross_mb", "ZeRO++ cross-node MB/rank", "{:.3f}"), ("ratio", "ZeRO++ / ZeRO-3", "{:.3f}"),
           ("paper_ratio", "paper", "{:.2f}"), ("zero3_phys_mb", "ZeRO-3 physical MB/node", "{:.3f}"),
           ("zeropp_phys_mb", "ZeRO++ physical MB/node", "{:.3f}"), ("physical_ratio", "physical ratio", "{:.3f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows, zpp = [r for r in result["rows"] if r["collective"] in TAGS[:3]], "ZeRO++ (int8 qwZ, hpZ, int4 qgZ)"
    return [report.bar_chart(
        out_dir, "comm_volume", [r["collective"] for r in rows],
        {"ZeRO-3 (bf16)": [r["zero3_cross_mb"] for r in rows], zpp: [r["zeropp_cross_mb"] for r in rows]},
        f"{result['model']['params'] / 1e6:.2f}M-parameter GPT-2, 2 nodes x 2 ranks",
        "cross-node MB per rank, one step (ledger)", figsize=(7.5, 4),
        labels={zpp: [report.fmt(r.get("ratio"), "{:.2f}x") for r in rows]})]


def markdown(result: dict) -> str:
    m, rate = result["model"], result.get("physical_rate")
    lines = [f"Setup: {runner.model_words(m)} (embedding {100 * m['embedding_share']:.0f}%); {m['micro_batch']}x{m['seq_len']} tokens per rank, {result['ranks']} ranks as 2 nodes x "
             f"{result['ranks_per_node']}; ZeRO++ block size {result['block_size']}"
             + (f"; physical bytes on the emulated cluster at {rate}." if rate else "."), "",
             *report.md_table(result["rows"], COLUMNS if rate else COLUMNS[:7])]
    if result.get("physical_skipped"):
        lines += ["", f"Physical bytes per collective: {result['physical_skipped']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("comm_volume"))
