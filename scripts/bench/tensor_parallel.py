"""Tensor parallelism with AccTFM (docs/tensor_parallel.md): plain Megatron TP against AccTFM's pipelined
and compressed all-reduces with TP across a shaped link, and their convergence; every run computes in fp32.

    python scripts/bench/tensor_parallel.py                 # both parts, into runs/bench/tensor_parallel
    python scripts/bench/tensor_parallel.py --quick         # 100 Mbit/s only, fewer runs and steps (minutes)
    python scripts/bench/tensor_parallel.py --parts convergence --conv-runs single plain full --conv-steps 500

1. timing: `train.py` with `tensor_parallel.size 2` on 2 emulated nodes x 1 rank, so the tensor-parallel
   group spans the shaped link (AccTFM's setting: TP across Ethernet), at each rate of `--rates`.
2. convergence: convergence.py's job on 2 loopback ranks (TP 2, unshaped), plus one process without tensor
   parallelism (`single`) as the exactness anchor.

Run keys: `plain` (Megatron's synchronous all-reduce), or parts joined by "-": `kN` (AccTFM pipelining,
N = 1, 2, 4 partitions per sublayer, 0 = planned per sublayer by the runtime), `topk` (token top-k at
--keep-ratio; `topkNN`: keep NN/100), what the pruned rows get (default: TensorParallelConfig's; `drop`:
nothing; `local`: each rank's own partial sum x 2; `pN`: all-reduced at N bits, 1 = sign + mean magnitude),
`fwd` / `bwd` (top-k in that pass only), `qB` (piecewise quantization of the kept rows to B bits); `full` =
the fastest pipelining run measured at that rate (`--full-partitions` to fix it) + topk + q<--bits>.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.bench import convergence, report, runner
from scripts.bench.report import ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## Measured"
DOCS = ROOT / "docs" / "tensor_parallel.md"
OUT = "tensor_parallel"  # the results directory under runs/bench/ (default: no time stamp)
STEP = runner.STEP_KEY
TP_WAIT = "waiting for tp all-reduces"
# topk-q4 and full use the default handling of pruned rows (TensorParallelConfig.topk_pruned*); the
# -drop, -local and -pN runs are the alternatives it was chosen from (docs/tensor_parallel.md).
RUNS = ["plain", "k2", "k4", "k0", "topk", "q4", "topk-drop-q4", "topk-p1-q4", "topk-local-q4", "topk-q4", "full",
        "k0-topk-q4"]
QUICK_RUNS = ["plain", "k2", "q4", "full"]
CONV_RUNS = ["single", "plain", "topk", "q4", "q3", "topk-drop-q4", "topk-p1-q4", "topk-p2-q4", "topk-local-q4",
             "topk25-q4", "topk-q4", "full"]
QUICK_CONV_RUNS = ["single", "plain", "full"]


# ---------------------------------------------------------------- the runs


PRUNED = {"drop": "pruned rows dropped", "local": "pruned rows: local partial sum x 2 (ranks differ)"}


def default_pruned() -> str:
    """What TensorParallelConfig's defaults give the pruned rows, in words."""
    from zeropp.config import TensorParallelConfig

    cfg = TensorParallelConfig()
    return {"reduce": f"pruned rows {cfg.topk_pruned_bits}-bit", **PRUNED}[cfg.topk_pruned]


def parse_key(key: str, plan: dict, best_k: int = 1) -> tuple[str, dict]:
    """(label, tensor_parallel keys) of a run key; `full` pipelines with best_k unless plan's full_partitions."""
    if key == "single":
        return "one process, no tensor parallelism (exactness anchor)", {"size": 1}
    if key == "full":
        k = plan["full_partitions"] if plan["full_partitions"] is not None else best_k
        label, keys = parse_key("-".join([f"k{k}", "topk", f"q{plan['bits']}"]), plan)
        what = "K planned per sublayer" if k == 0 else f"K={k}"
        return (f"full AccTFM: {what} + top-k tokens {plan['keep_ratio']:g} ({default_pruned()}) + piecewise "
                f"int{plan['bits']}"), keys
    keys, words, topk_at = {"size": 2}, [], None
    for part in ([] if key == "plain" else key.split("-")):
        if m := re.fullmatch(r"k([0124])", part):
            keys["partitions"] = int(m.group(1))
            words.append({"0": "pipelined, planned per sublayer", "1": "K=1 (not pipelined)"}.get(
                m.group(1), f"pipelined K={m.group(1)}"))
        elif m := re.fullmatch(r"topk(\d\d)?", part):
            keys["topk_keep_ratio"] = int(m.group(1)) / 100 if m.group(1) else plan["keep_ratio"]
            words.append(f"top-k tokens {keys['topk_keep_ratio']:g}")
            topk_at = len(words)
        elif m := re.fullmatch(r"p([1-8])|drop|local", part):
            keys["topk_pruned"] = "reduce" if m.group(1) else part
            if m.group(1):
                keys["topk_pruned_bits"] = int(m.group(1))
            words.append(PRUNED.get(part, f"pruned rows {part[1:]}-bit"))
        elif part in ("fwd", "bwd"):
            keys["topk_passes"] = {"fwd": "forward", "bwd": "backward"}[part]
            words.append(f"top-k in the {keys['topk_passes']} only")
        elif m := re.fullmatch(r"q(\d)", part):
            keys["quantize_bits"] = int(m.group(1))
            words.append(f"piecewise int{m.group(1)}")
        else:
            raise ValueError(f"unknown run {key!r}: plain, full, single, or kN / topk[NN] / drop / local / pN / fwd / "
                             f"bwd / qB joined by '-'")
    if topk_at is not None and "topk_pruned" not in keys:
        words.insert(topk_at, default_pruned())
    return ("plain TP (Megatron: synchronous fp32 all-reduce)" if not words else "TP 2 + " + " + ".join(words)), keys


def tp_args(keys: dict) -> list[str]:
    return [a for k, v in keys.items() for a in (f"--tensor_parallel.{k}", str(v))]


def add_args(p) -> None:
    p.add_argument("--parts", nargs="+", choices=["timing", "convergence"], default=["timing", "convergence"])
    p.add_argument("--rates", nargs="+", default=Quick(["1gbit", "100mbit"], ["100mbit"]),
                   help="link rates of the timing part (default %(default)s)")
    p.add_argument("--runs", nargs="+", default=Quick(RUNS, QUICK_RUNS),
                   help="timing runs, in order (default %(default)s)")
    p.add_argument("--conv-runs", nargs="+", default=Quick(CONV_RUNS, QUICK_CONV_RUNS),
                   help="convergence runs (default %(default)s)")
    p.add_argument("--steps", type=int, default=Quick(12, 5), help="steps of a timing run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="timing steps left out of the medians (default %(default)s)")
    p.add_argument("--keep-ratio", type=float, default=0.5, help="top-k keep ratio of topk and full (default %(default)s)")
    p.add_argument("--bits", type=int, default=4, help="quantization bits of full (default %(default)s)")
    p.add_argument("--full-partitions", type=int, choices=[0, 1, 2, 4],
                   help="partitions of the full run (default: the fastest pipelining run at that rate)")
    p.add_argument("--conv-partitions", type=int, default=2, choices=[1, 2, 4],
                   help="partitions of the full convergence run (pipelining is exact; default %(default)s)")
    for name, typ, default, what in [
            ("layers", int, 4, "timing model: GPT-2 layers"), ("d-model", int, 256, "timing model width"),
            ("heads", int, 8, "timing model heads"), ("micro-batch", int, 4, "timing sequences per step"),
            ("seq", int, 128, "tokens per sequence (both parts)"),
            ("conv-steps", int, Quick(300, 60), "convergence steps"), ("conv-micro-batch", int, 8, "convergence"),
            ("eval-batches", int, 8, "convergence"), ("lr", float, 2e-3, "convergence peak"),
            ("quiet-load", float, 1.2, "1-minute load the timing part waits to fall below"),
            ("quiet-wait", float, Quick(600, 0), "longest wait for a quiet machine, s"),
            ("data", Path, convergence.DATA, "Tiny Shakespeare"), ("timeout", float, 900, "per run, s")]:
        p.add_argument(f"--{name}", type=typ, default=default, help=f"{what} (default %(default)s)")


def resolve(args) -> dict:
    return {**options(args), "data": str(args.data),
            "eval_interval": max(1, args.conv_steps // (4 if args.quick else 10))}


def timing_args(plan: dict) -> list[str]:
    """train.py arguments of a timed job: the default corpus (4096-token vocabulary), a GPT-2 of the plan's
    size, every step logged and nothing else in the steps, fp32 compute, DDP over a DP group of one."""
    d, seq = plan["d_model"], plan["seq"]
    model = ["--model.preset", "gpt2-small-cpu", "--model.n_layer", str(plan["layers"]), "--model.d_model", str(d),
             "--model.n_head", str(plan["heads"]), "--model.d_ff", str(4 * d), "--model.max_seq_len", str(seq)]
    return [*runner.train_args(plan["micro_batch"], plan["steps"], model=model, seq=seq), "--train.precision", "fp32",
            *runner.zero_args(stage=0)]


def conv_args(plan: dict) -> list[str]:
    """convergence.py's job (its model, data and schedule), evaluating at step 0, fp32, DDP over a DP group of one."""
    return convergence.fp32_curve_args({**plan, "steps": plan["conv_steps"], "micro_batch": plan["conv_micro_batch"]},
                                       stage=0)


def is_plan_line(line: str) -> bool:
    """The runtime's AccTFM partition plan line (it carries the predicted times too)."""
    return "partition plan" in line.lower() and not line.startswith("runtime:") and "Warning" not in line


def run_timing(key: str, plan: dict, rate: str, cluster, work: Path, best_k: int) -> dict:
    """One timed run on the cluster, one rank per node; a planned (k0) run keeps the partition plan it logged."""
    label, keys = parse_key(key, plan, best_k)
    out = work / f"{rate}-{key}"
    cmd = [sys.executable, ROOT / "train.py", *timing_args(plan), "--train.out_dir", out, *tp_args(keys)]
    row = {"key": key, "label": label, "part": "timing", "setting": rate, "partitions": keys.get("partitions", 1),
           "load_at_start": round(os.getloadavg()[0], 2), **runner.measured_launch(
               cmd, out / "metrics.jsonl", cluster, plan["steps"], plan["warmup"], plan["timeout"], per_node=1,
               keep_lines=is_plan_line if keys.get("partitions") == 0 else None)}
    row["load_at_end"] = round(os.getloadavg()[0], 2)
    if "log" in row:
        row["plan_log"] = row.pop("log")
    if row["ok"]:
        metrics = row.pop("metrics")
        row.update(runner.step_stats(metrics, plan["warmup"], rest_of="mean"), losses=[m["lm loss"] for m in metrics])
    return row


def run_convergence(key: str, plan: dict, work: Path) -> dict:
    label, keys = parse_key(key, {**plan, "full_partitions": plan["conv_partitions"]})
    out = work / f"conv-{key}"
    row = {"key": key, "label": label, "part": "convergence", **convergence.curve_run(
        [sys.executable, ROOT / "train.py", *conv_args(plan), "--train.out_dir", out, *tp_args(keys)], out,
        plan["timeout"], nproc=None if key == "single" else 2)}
    steps = row.pop("metrics", [])
    if row["ok"] and len(steps) < plan["conv_steps"]:
        row.update(ok=False, error=f"{len(steps)} of {plan['conv_steps']} steps logged")
    elif row["ok"]:
        row.update(final_train_loss=steps[-1]["lm loss"], train_losses=[m["lm loss"] for m in steps],
                   step_ms=statistics.median(m[STEP] for m in steps[1:] or steps))
    return row


def run(args, progress=print) -> dict:
    plan = resolve(args)
    for key in plan["runs"] + plan["conv_runs"]:
        parse_key(key, plan)  # an unknown key fails before anything runs
    result = {"plan": plan, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-tensor-parallel-") as tmp:
        if "timing" in plan["parts"]:
            result["timing_model"] = runner.model_summary(config_args=timing_args(plan))
            why = runner.cluster_unavailable()
            if why:
                result["timing_skipped"] = f"emulated cluster unavailable: {why}"
            else:
                result["quiet"] = runner.wait_quiet(plan["quiet_wait"], plan["quiet_load"], progress)
                progress(f"  timing part starts at load {result['quiet']['load_1min']} (quiet: {result['quiet']['quiet']})")
                for rate in plan["rates"]:
                    with runner.cluster_at(rate) as cluster:
                        for i, key in enumerate(plan["runs"], 1):
                            done = [r for r in result["rows"] if r["ok"] and r.get("setting") == rate
                                    and r["key"] in ("plain", "k1", "k2", "k4", "k0")]
                            best_k = min(done, key=lambda r: r["step_ms"])["partitions"] if done else 1
                            result["rows"].append(row := run_timing(key, plan, rate, cluster, Path(tmp), best_k))
                            progress(f"  tensor_parallel timing @ {rate} [{i}/{len(plan['runs'])}] {row['label']}: "
                                     + (f"{row['step_ms']:.0f} ms/step, {row.get('phys_tx_mb_node', 0):.2f} MB/step on "
                                        f"the link" if row["ok"] else row["error"]) + f" ({row['wall_s']:.0f} s)")
        if "convergence" in plan["parts"]:
            if why := convergence.data_missing(plan["data"]):
                result["convergence_skipped"] = why
            else:
                result["conv_model"] = runner.model_summary(config_args=conv_args(plan))
                for i, key in enumerate(plan["conv_runs"], 1):
                    result["rows"].append(row := run_convergence(key, plan, Path(tmp)))
                    progress(f"  tensor_parallel convergence [{i}/{len(plan['conv_runs'])}] {row['label']}: "
                             + (f"final validation loss {row['final_val_loss']:.4f}" if row["ok"] else row["error"])
                             + f" ({row['wall_s']:.0f} s)")
    analyse(result)
    return result


def analyse(result: dict) -> None:
    ok = [r for r in result["rows"] if r["ok"]]
    for r in ok:
        if r["part"] == "timing":
            base = next((b for b in ok if b["part"] == "timing" and b["setting"] == r["setting"] and b["key"] == "plain"),
                        None)
            if base:
                r["speedup"] = base["step_ms"] / r["step_ms"]
                if r.get("phys_tx_mb_node") and base.get("phys_tx_mb_node"):
                    r["link_ratio"] = r["phys_tx_mb_node"] / base["phys_tx_mb_node"]
            if "wire_ms" in r:
                r["link_busy_pct"] = 100 * r["wire_ms"] / r["step_ms"]
        else:
            for base in ("plain", "single"):
                b = next((b for b in ok if b["part"] == "convergence" and b["key"] == base), None)
                if b and b is not r:
                    r[f"vs_{base}"] = r["final_val_loss"] / b["final_val_loss"] - 1
                    r[f"abs_vs_{base}"] = r["final_val_loss"] - b["final_val_loss"]


# ---------------------------------------------------------------- the report


CONV_COLUMNS = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
                ("vs_plain", "vs plain TP", "{:+.2%}"), ("abs_vs_single", "minus one process", "{:+.2e}"),
                ("final_train_loss", "final training loss", "{:.4f}"), ("step_ms", "ms/step (loopback)", "{:.0f}")]


def timing_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    kinds = sorted({k for r in rows for k in r.get("timing_kinds", [])}, key=lambda k: (k != TP_WAIT, k))
    return ([("label", "run", "{}"), ("step_ms", "step ms (median)", "{:.0f}"), ("speedup", "speedup vs plain TP", "{:.2f}"),
             ("ledger_cross_mb_rank", "ledger MB/step/rank", "{:.2f}"), ("phys_tx_mb_node", "link MB/step/node (tx)", "{:.2f}"),
             ("phys_rx_mb_node", "link MB/step/node (rx)", "{:.2f}"), ("wire_ms", "wire ms", "{:.0f}")]
            + report.time_columns(kinds) + [("load_at_start", "load", "{:.1f}")])


def markdown(result: dict) -> str:
    plan, rows, lines = result["plan"], result["rows"], []
    timing = [r for r in rows if r["part"] == "timing"]
    conv = [r for r in rows if r["part"] == "convergence"]
    if result.get("timing_skipped"):
        lines += [f"Timing part skipped: {result['timing_skipped']}.", ""]
    if timing:
        m, q = result["timing_model"], result["quiet"]
        from scripts.cluster import parse_rate

        slow = min(plan["rates"], key=parse_rate)
        by = {(r["setting"], r["key"]): r for r in timing if r["ok"]}
        tokens = plan["micro_batch"] * plan["seq"]
        allreduce_mb = 4 * tokens * m["d_model"] / 1e6
        lines += [f"### Step time, TP 2 across the shaped link ({', '.join(plan['rates'])})", "",
                  f"`train.py` on 2 emulated nodes x 1 rank ([cluster.md](cluster.md)), `--tensor_parallel.size 2`: the "
                  "tensor-parallel group spans the node link, data parallelism of size 1 (`zero_optimization.stage 0`). "
                  f"Model: GPT-2, {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, d_ff "
                  f"{4 * m['d_model']}, vocabulary {m['vocab_size']} (the default corpus): {m['params'] / 1e6:.2f}M "
                  f"parameters; {plan['micro_batch']}x{plan['seq']} tokens per step (both TP ranks see the same "
                  f"batch). Compute in fp32 everywhere (`train.precision fp32`), so plain TP all-reduces fp32: each "
                  f"sublayer's all-reduce is a [{tokens}, {m['d_model']}] tensor = {allreduce_mb:.2f} MB, "
                  f"{4 * m['n_layer'] + 2} of them per step (forward and backward of every attention and MLP, the "
                  "embedding's forward and the LM head input's backward), and a ring all-reduce over 2 ranks sends "
                  "the whole tensor once. The size is chosen so that plain TP at 100 Mbit/s spends most of its step "
                  "on the link while a step stays under a second: the all-reduces matter, as in AccTFM's setting, "
                  "and every run takes seconds" + (
                      f" (measured: plain TP at {slow} waits {base[TP_WAIT + ' ms']:.0f} of its {base['step_ms']:.0f} "
                      f"ms on the all-reduces; compute and the rest take {base['rest ms']:.0f} ms)"
                      if (base := by.get((slow, "plain"))) and TP_WAIT + " ms" in base else "") + ".", "",
                  f"{plan['steps']} steps per run; the step time is the median of the logged "
                  f"\"{STEP}\" after the first {plan['warmup']}; the timings (rank 0) are means over the same steps; "
                  "\"rest\" = mean step time minus them: compute (quantization and top-k scoring included) and "
                  "everything else. Ledger MB: what the runtime's ledger records as sent across nodes by one rank per "
                  "step (the TP all-reduces; the vocabulary-parallel loss' and grad-norm's few bytes are not in it). "
                  "Link MB: the node veth counters between those steps, mean over the 2 nodes; wire ms = the busier "
                  "direction's bytes at the tbf rate. \"full\" uses the partitions of the fastest pipelining run at "
                  "that rate" + (f" (fixed: {plan['full_partitions']})" if plan["full_partitions"] is not None else "")
                  + ". " + runner.quiet_words(q) + "; the load column "
                  "is the 1-minute load when each run started (2 cores: above ~1 the runs share them with others).", ""]
        cols = timing_columns(timing)
        for rate in plan["rates"]:
            at = [r for r in timing if r["setting"] == rate]
            if at:
                lines += [f"**{rate}**", "", *report.md_table(at, cols), ""]
        for rate in plan["rates"]:
            full, pipe = by.get((rate, "full")), [r for r in timing if r["ok"] and r["setting"] == rate
                                                  and r["key"] in ("k2", "k4", "k0")]
            comp = [r for r in timing if r["ok"] and r["setting"] == rate and r["key"] in ("topk", "q4", "topk-q4")]
            bits = []
            if pipe:
                bits.append("pipelining " + ", ".join(f"{r['speedup']:.2f}x ({r['key']})" for r in pipe if "speedup" in r))
            if comp:
                bits.append("compression " + ", ".join(f"{r['speedup']:.2f}x ({r['key']})" for r in comp if "speedup" in r))
            if full and "speedup" in full:
                bits.append(f"full AccTFM {full['speedup']:.2f}x (K={full['partitions']})")
            if (planned := by.get((rate, "k0-topk-q4"))) and "speedup" in planned:
                bits.append(f"full AccTFM with planned K {planned['speedup']:.2f}x")
            if bits:
                lines.append(f"- {rate}: " + "; ".join(bits) + " over plain TP (paper, 10 Gbit/s Ethernet: 1.11-1.32x "
                             "from pipelining, 1.21-1.89x from compression, up to 2.08x together).")
        for key in ("full", "k0-topk-q4"):
            full = by.get((slow, key))
            if full and "speedup" in full:
                lines.append(f"- Goal: full AccTFM >= 1.8x plain TP at {slow}: {full['label']} "
                             f"{full['speedup']:.2f}x, {'met' if full['speedup'] >= 1.8 else '**not met**'}.")
        planned = [r for r in timing if r.get("plan_log")]
        if planned:
            lines += ["", "The partition plans the planned runs logged (K per sublayer, as the runtime prints them):", "", "```"]
            for r in planned:
                lines += [f"# {r['key']} @ {r['setting']}", *r["plan_log"]]
            lines += ["```"]
        lines.append("")
    if result.get("convergence_skipped"):
        lines += [f"Convergence part skipped: {result['convergence_skipped']}.", ""]
    if conv:
        m = result["conv_model"]
        lines += ["### Convergence on Tiny Shakespeare (2 loopback ranks, TP 2)", "",
                  f"convergence.py's tiny GPT-2 ({m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, "
                  f"vocabulary {m['vocab_size']}: {m['params'] / 1e6:.2f}M parameters), {plan['conv_micro_batch']}x"
                  f"{plan['seq']} tokens per step, {plan['conv_steps']} steps, AdamW, lr {plan['lr']:g} with warm-up "
                  f"and cosine decay, the same seed (initial weights, batches) for every run; validation loss at step "
                  f"0 and every {plan['eval_interval']} steps on {plan['eval_batches']} batches. TP 2 on 2 loopback "
                  "ranks (no shaping), fp32 compute; \"one process\" is the same job without tensor parallelism, "
                  f"the exactness anchor. The full run uses K = {plan['conv_partitions']} (pipelining only reorders "
                  "work).", "", *report.md_table(conv, CONV_COLUMNS), ""]
        by = {r["key"]: r for r in conv if r["ok"]}
        if "plain" in by and "abs_vs_single" in by["plain"]:
            d = by["plain"]["abs_vs_single"]
            lines.append(f"- Plain TP vs one process, final validation loss: {d:+.2e} (expected ~1e-4 or less: "
                         f"{'met' if abs(d) <= 1e-4 else '**not met**'}).")
        for key, r in by.items():
            if key not in ("plain", "single") and "vs_plain" in r:
                v = r["vs_plain"]
                lines.append(f"- {r['label']}: {v:+.2%} from plain TP" + (
                    f" (target: within 1%: {'met' if abs(v) <= 0.01 else '**not met**'})." if key == "full" else "."))
        if plan["conv_steps"] < 200:
            lines.append(f"- Only {plan['conv_steps']} steps (`--quick`): judge the 1% target on the full run.")
        lines.append("")
    lines += joined(result)
    return "\n".join(lines).rstrip()


def joined(result: dict) -> list[str]:
    """One table of the runs measured in both parts: final validation loss and step time at the slowest rate."""
    rows = [r for r in result["rows"] if r["ok"]]
    timing = [r for r in rows if r["part"] == "timing"]
    conv = {r["key"]: r for r in rows if r["part"] == "convergence"}
    if not timing or not conv:
        return []
    from scripts.cluster import parse_rate

    slow = min(result["plan"]["rates"], key=parse_rate)
    at = {r["key"]: r for r in timing if r["setting"] == slow}
    keys = [k for k in at if k in conv]
    if len(keys) < 2:
        return []
    out = [f"### Both parts: validation loss and step time at {slow}", "",
           f"The runs measured in both parts (same keys; \"full\" is K = {result['plan']['conv_partitions']} in the "
           f"convergence part and K = {at['full']['partitions'] if 'full' in at else '?'} in the timing part; "
           "pipelining only reorders work).", "",
           f"| run | final validation loss | vs plain TP | step ms at {slow} | speedup vs plain TP | 1% and 1.8x |",
           "| --- | ---: | ---: | ---: | ---: | --- |"]
    for k in keys:
        c, t = conv[k], at[k]
        vs = c.get("vs_plain")
        both = "–" if k == "plain" or vs is None or "speedup" not in t else \
            ("both" if abs(vs) <= 0.01 and t["speedup"] >= 1.8 else "no")
        speedup = f"{t['speedup']:.2f}" if "speedup" in t else "–"
        out.append(f"| {t['label']} | {c['final_val_loss']:.4f} | " + ("–" if vs is None else f"{vs:+.2%}")
                   + f" | {t['step_ms']:.0f} | {speedup} | {both} |")
    return out + [""]


def plots(result: dict, out_dir: Path) -> list[Path]:
    plt, paths = report.pyplot(), []
    timing = [r for r in result["rows"] if r["ok"] and r["part"] == "timing"]
    conv = [r for r in result["rows"] if r["ok"] and r["part"] == "convergence"]
    if timing:
        rates = [rate for rate in result["plan"]["rates"] if any(r["setting"] == rate for r in timing)]
        fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
        kinds = sorted({k for r in timing for k in r.get("timing_kinds", [])}, key=lambda k: (k != TP_WAIT, k))
        for ax, rate in zip(axes[0], rates):
            at = [r for r in timing if r["setting"] == rate]
            report.time_bars(ax, at, kinds, [r["key"] for r in at],
                             "ms per step (rank 0, mean after warm-up); rest = compute and other")
            ax.set_title(f"TP 2 across {rate}")
        paths.append(report.save(fig, out_dir, "tensor_parallel_step_time"))
    if conv:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        report.curves(ax, {r["label"]: r["val_curve"][1:] for r in conv}, "step", "validation loss", marker="o", ms=2)
        ax.set_title("Tiny Shakespeare, TP 2 on 2 loopback ranks (step 0 left out)")
        ax.legend(fontsize=7)
        paths.append(report.save(fig, out_dir, "tensor_parallel_convergence"))
    return paths


if __name__ == "__main__":
    sys.exit(main_one("tensor_parallel"))
