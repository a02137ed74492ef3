"""Throughput ablation on the emulated cluster (ZeRO++ paper, Fig. 10 / Table 1): ZeRO-3, + qwZ (int8
weights), + hpZ (secondary partition = one node), + qgZ (int4 gradients, 2 hops) and full ZeRO++, each
`train.py` on 2 emulated nodes x 2 ranks at every link rate and micro-batch size (runner.py measures).

    python scripts/bench/ablation.py                      # 2 rates x 2 tokens-per-rank x 5 configurations
    python scripts/bench/ablation.py --quick              # ZeRO-3 and ZeRO++ at 100mbit, 4 x 128 tokens
    python scripts/bench/ablation.py --quick --precision fp32 --shape issue   # fp32 compute, issue 17's model
"""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.bench import report, runner
from scripts.cluster import parse_rate
from scripts.bench.runner import SEQ, Job
from scripts.bench.suite import Quick, main_one, options

TITLE = "## 1. Throughput ablation (paper Fig. 10 / Table 1)"
ZERO3 = {"stage": 3}
QWZ, HPZ, QGZ = {"zero_quantized_weights": True}, {"zero_hpz_partition_size": 0}, {"zero_quantized_gradients": True}
CONFIGS = {  # key -> (label, zero_optimization keys)
    "zero3": ("ZeRO-3", ZERO3), "qwz": ("ZeRO-3 + qwZ", {**ZERO3, **QWZ}), "hpz": ("ZeRO-3 + hpZ", {**ZERO3, **HPZ}),
    "qgz": ("ZeRO-3 + qgZ", {**ZERO3, **QGZ}), "zeropp": ("ZeRO++", {**ZERO3, **QWZ, **HPZ, **QGZ}),
}


def add_args(p) -> None:
    p.add_argument("--rates", nargs="+", default=Quick(["100mbit", "1gbit"], ["100mbit"]),
                   help="link rates (default %(default)s)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=Quick([4, 8], [4]),
                   help=f"micro-batch sizes x {SEQ} tokens per rank (default %(default)s)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=Quick(list(CONFIGS), ["zero3", "zeropp"]))
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="every run's --train.precision (default %(default)s)")
    p.add_argument("--shape", choices=list(runner.SHAPES), default="suite",
                   help="the model, runner.SHAPES (default %(default)s)")
    p.add_argument("--steps", type=int, default=Quick(5, 4), help="steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed")
    p.add_argument("--timeout", type=float, default=900)


def run(args, progress=print) -> dict:
    plan = options(args)
    result = {"plan": plan, "model": runner.model_summary(shape=plan["shape"]), "nodes": runner.NODES,
              "ranks_per_node": runner.RANKS_PER_NODE, "rows": []}
    why = runner.cluster_unavailable()
    if why:
        result["skipped"] = f"emulated cluster unavailable: {why}"
        return result
    compute = plan["precision"]
    jobs = [Job(key, CONFIGS[key][0], runner.zero_args(**CONFIGS[key][1]) + ["--train.precision", compute], mb, rate,
                shape=plan["shape"], compute=compute)
            for rate in plan["rates"] for mb in plan["micro_batches"] for key in plan["configs"]]
    result["rows"] = runner.run_jobs("ablation", jobs, plan["steps"], plan["warmup"], plan["timeout"], progress)
    base = {(r["setting"], r["micro_batch"]): r for r in result["rows"] if r["key"] == "zero3" and r["ok"]}
    for r in result["rows"]:
        if r["ok"] and (b := base.get((r["setting"], r["micro_batch"]))):
            r["speedup_vs_zero3"] = b["step_ms"] / r["step_ms"]
            if r.get("phys_tx_mb_node") and b.get("phys_tx_mb_node"):
                r["phys_ratio_vs_zero3"] = r["phys_tx_mb_node"] / b["phys_tx_mb_node"]
    return result


COLUMNS = [("label", "configuration", "{}"), ("compute", "compute", "{}"), ("setting", "link", "{}"),
           ("tokens_per_rank", "tokens/rank", "{}"),
           ("step_ms", "step ms", "{:.0f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
           ("tflops_per_rank", "TFLOP/s per rank", "{:.4f}"), ("speedup_vs_zero3", "speedup vs ZeRO-3", "{:.2f}x"),
           ("ledger_cross_mb_rank", "ledger cross-node MB/rank/step", "{:.2f}"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"),
           ("phys_ratio_vs_zero3", "physical / ZeRO-3", "{:.3f}"),
           ("wire_ms", "wire time ms", "{:.0f}"), ("link_busy_pct", "link busy %", "{:.0f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result["rows"] if r["ok"]]
    groups = sorted({(r["setting"], r["micro_batch"]) for r in rows}, key=lambda g: (parse_rate(g[0]), g[1]))
    return [report.bar_chart(
        out_dir, name, [f"{rate}\n{mb}x{SEQ} tokens/rank" for rate, mb in groups],
        {CONFIGS[k][0]: [next((r.get(metric) for r in rows if (r["setting"], r["micro_batch"]) == g and r["key"] == k),
                              None) for g in groups] for k in result["plan"]["configs"]},
        f"{result['model']['params'] / 1e6:.1f}M-parameter GPT-2, 2 nodes x 2 ranks (emulated)", ylabel,
        figsize=(9, 4.2))
        for metric, ylabel, name in (("tokens_per_s", "tokens/s (4 ranks)", "ablation_throughput"),
                                     ("phys_tx_mb_node", "physical MB per step per node link", "ablation_bytes"))]


def markdown(result: dict) -> str:
    plan, rows = result["plan"], [r for r in result["rows"] if r["ok"]]
    lines = [f"Setup: {runner.model_words(result['model'])}, {result['model']['seq_len']} tokens per sample; every "
             f"run computing in {plan['precision']} (`--train.precision {plan['precision']}`); {plan['steps']} steps "
             f"per run, the first {plan['warmup']} not timed.", "", *report.md_table(result["rows"], COLUMNS), ""]
    rates = sorted({r["setting"] for r in rows}, key=parse_rate)
    find = {(r["key"], r["setting"], r["micro_batch"]): r for r in rows}.get
    for mb in sorted({r["micro_batch"] for r in rows}):
        slow, fast = rates[0], rates[-1]
        z3, zs, zf = find(("zero3", slow, mb)), find(("zeropp", slow, mb)), find(("zeropp", fast, mb))
        if not (z3 and zs):
            continue
        text = (f"At {slow} and {mb}x{SEQ} tokens per rank, ZeRO-3's step is {z3['step_ms']:.0f} ms, "
                f"{z3.get('wire_ms', 0):.0f} ms of it wire time; ZeRO++'s is {zs['step_ms']:.0f} ms with "
                f"{zs.get('wire_ms', 0):.0f} ms of wire time")
        if zf and fast != slow:
            text += (f"; at {fast} ZeRO++ takes {zf['step_ms']:.0f} ms, about its compute floor on this machine, so "
                     f"ZeRO++ could be at most {z3['step_ms'] / zf['step_ms']:.2f}x faster than ZeRO-3 at {slow} "
                     "here, however few bytes it sent")
        lines += [text + ".", ""]
    if kinds := sorted({k for r in rows for k in r.get("timing_kinds", [])}):
        cols = COLUMNS[:5] + [("wire_ms", "wire time ms", "{:.0f}"), *report.time_columns(kinds)]
        lines += ["Where the time goes, per step on rank 0:", "", *report.md_table(rows, cols)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("ablation"))
