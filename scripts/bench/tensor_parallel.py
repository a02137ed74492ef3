"""Tensor parallelism with AccTFM: plain Megatron TP against AccTFM's pipelined and compressed all-reduces, TP 2
across a shaped link (timing) and on 2 loopback ranks (convergence); the setup and the run keys are in
docs/tensor_parallel.md, section "Measured".

    python scripts/bench/tensor_parallel.py                 # both parts, into runs/bench/tensor_parallel
    python scripts/bench/tensor_parallel.py --quick         # 100 Mbit/s only, fewer runs and steps (minutes)
    python scripts/bench/tensor_parallel.py --parts convergence --conv-runs single plain full --conv-steps 500

Run keys: plain, single (no tensor parallelism), full, or kN / topk[NN] / drop / local / pN / fwd / bwd / qB
joined by "-" (e.g. k2-topk-p1-q4).
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
TP_WAIT = "waiting for tp all-reduces"
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
        k = best_k if plan["full_partitions"] is None else plan["full_partitions"]
        return (f"full AccTFM: {'K planned per sublayer' if k == 0 else f'K={k}'} + top-k tokens "
                f"{plan['keep_ratio']:g} ({default_pruned()}) + piecewise int{plan['bits']}",
                parse_key(f"k{k}-topk-q{plan['bits']}", plan)[1])
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
    p.add_argument("--runs", nargs="+", default=Quick(RUNS, QUICK_RUNS), help="timing runs (default %(default)s)")
    p.add_argument("--conv-runs", nargs="+", default=Quick(CONV_RUNS, QUICK_CONV_RUNS),
                   help="convergence runs (default %(default)s)")
    p.add_argument("--full-partitions", type=int, choices=[0, 1, 2, 4],
                   help="partitions of the timed full run (default: the fastest pipelining run at that rate)")
    p.add_argument("--conv-partitions", type=int, default=2, choices=[1, 2, 4],
                   help="partitions of the full convergence run (default %(default)s)")
    for name, typ, default, what in [
            ("steps", int, Quick(12, 5), "steps of a timing run"), ("warmup", int, 2, "untimed timing steps"),
            ("keep-ratio", float, 0.5, "top-k keep ratio of topk and full"), ("bits", int, 4, "bits of full"),
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
    """train.py arguments of a timed job: the default corpus, a GPT-2 of the plan's size, every step logged and
    nothing else in the steps, fp32 compute, DDP over a DP group of one."""
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
                   step_ms=statistics.median(m[runner.STEP_KEY] for m in steps[1:] or steps))
    return row


def run(args, progress=print) -> dict:
    plan = resolve(args)
    for key in plan["runs"] + plan["conv_runs"]:
        parse_key(key, plan)  # an unknown key fails before anything runs
    result = {"plan": plan, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-tensor-parallel-") as tmp:
        if "timing" in plan["parts"]:
            result["timing_model"] = runner.model_summary(config_args=timing_args(plan))
            if why := runner.cluster_unavailable():
                result["timing_skipped"] = f"emulated cluster unavailable: {why}"
            else:
                result["quiet"] = q = runner.wait_quiet(plan["quiet_wait"], plan["quiet_load"], progress)
                progress(f"  timing part starts at load {q['load_1min']} (quiet: {q['quiet']})")
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
    """Speedups over plain TP at the same rate; final validation losses against plain TP and one process."""
    ok = [r for r in result["rows"] if r["ok"]]
    plain = {r.get("setting"): r for r in ok if r["key"] == "plain"}  # convergence rows: setting None
    single = next((r for r in ok if r["key"] == "single"), None)
    for r in ok:
        base = plain.get(r.get("setting"))
        if r["part"] == "timing" and base:
            r["speedup"] = base["step_ms"] / r["step_ms"]
        elif r["part"] == "convergence":
            if base and base is not r:
                r["vs_plain"] = r["final_val_loss"] / base["final_val_loss"] - 1
            if single and single is not r:
                r["abs_vs_single"] = r["final_val_loss"] - single["final_val_loss"]


# ---------------------------------------------------------------- the report


CONV_COLUMNS = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
                ("vs_plain", "vs plain TP", "{:+.2%}"), ("abs_vs_single", "minus one process", "{:+.2e}"),
                ("final_train_loss", "final training loss", "{:.4f}"), ("step_ms", "ms/step (loopback)", "{:.0f}")]
TIMING_COLUMNS = [("label", "run", "{}"), ("step_ms", "step ms (median)", "{:.0f}"),
                  ("speedup", "speedup vs plain TP", "{:.2f}"),
                  ("ledger_cross_mb_rank", "ledger MB/step/rank", "{:.2f}"),
                  ("phys_tx_mb_node", "link MB/step/node (tx)", "{:.2f}"),
                  ("phys_rx_mb_node", "link MB/step/node (rx)", "{:.2f}"), ("wire_ms", "wire ms", "{:.0f}")]


def timing_kinds(rows: list[dict]) -> list[str]:
    return sorted({k for r in rows for k in r.get("timing_kinds", [])}, key=lambda k: (k != TP_WAIT, k))


def slowest(plan: dict) -> str:
    from scripts.cluster import parse_rate

    return min(plan["rates"], key=parse_rate)


def timing_markdown(result: dict, timing: list[dict]) -> list[str]:
    plan, m, slow = result["plan"], result["timing_model"], slowest(result["plan"])
    by = {(r["setting"], r["key"]): r for r in timing if r["ok"]}
    tokens, base = plan["micro_batch"] * plan["seq"], by.get((slow, "plain"), {})
    lines = [f"### Step time, TP 2 across the shaped link ({', '.join(plan['rates'])})", "",
             f"Setup: {runner.model_words(m)}; {plan['micro_batch']}x{plan['seq']} tokens per step: {4 * m['n_layer'] + 2} "
             f"all-reduces of [{tokens}, {m['d_model']}] fp32 ({4 * tokens * m['d_model'] / 1e6:.2f} MB) per step; "
             f"{plan['steps']} steps, the first {plan['warmup']} untimed"
             + (f"; full: K = {plan['full_partitions']}" if plan["full_partitions"] is not None else "") + ". "
             + (f"Plain TP at {slow} waits {base[TP_WAIT + ' ms']:.0f} of its {base['step_ms']:.0f} ms on the "
                f"all-reduces (rest: {base['rest ms']:.0f} ms). " if TP_WAIT + " ms" in base else "")
             + runner.quiet_words(result["quiet"]) + ".", ""]
    columns = [*TIMING_COLUMNS, *report.time_columns(timing_kinds(timing)), ("load_at_start", "load", "{:.1f}")]
    for rate in plan["rates"]:
        if at := [r for r in timing if r["setting"] == rate]:
            lines += [f"**{rate}**", "", *report.md_table(at, columns), ""]
    for key in ("full", "k0-topk-q4"):
        if "speedup" in (full := by.get((slow, key), {})):
            lines.append(f"- Goal: full AccTFM >= 1.8x plain TP at {slow}: {full['label']} "
                         f"{full['speedup']:.2f}x, {'met' if full['speedup'] >= 1.8 else '**not met**'}.")
    if planned := [r for r in timing if r.get("plan_log")]:
        lines += ["", "Partition plans the planned runs logged:", "", "```"]
        for r in planned:
            lines += [f"# {r['key']} @ {r['setting']}", *filter(is_plan_line, r["plan_log"])]
        lines += ["```"]
    return lines + [""]


def conv_markdown(result: dict, conv: list[dict]) -> list[str]:
    plan, m = result["plan"], result["conv_model"]
    by = {r["key"]: r for r in conv if r["ok"]}
    lines = ["### Convergence on Tiny Shakespeare (2 loopback ranks, TP 2)", "",
             f"Setup: {runner.model_words(m)}; {plan['conv_micro_batch']}x{plan['seq']} tokens per step, {plan['conv_steps']} "
             f"steps, lr {plan['lr']:g}; validation every {plan['eval_interval']} steps on {plan['eval_batches']} "
             f"batches; full: K = {plan['conv_partitions']}.", "", *report.md_table(conv, CONV_COLUMNS), ""]
    if "abs_vs_single" in by.get("plain", {}):
        d = by["plain"]["abs_vs_single"]
        lines.append(f"- Plain TP vs one process, final validation loss: {d:+.2e} (expected ~1e-4 or less: "
                     f"{'met' if abs(d) <= 1e-4 else '**not met**'}).")
    if "vs_plain" in by.get("full", {}):
        v = by["full"]["vs_plain"]
        lines.append(f"- {by['full']['label']}: {v:+.2%} from plain TP (target: within 1%: "
                     f"{'met' if abs(v) <= 0.01 else '**not met**'}).")
    if plan["conv_steps"] < 200:
        lines.append(f"- Only {plan['conv_steps']} steps (`--quick`): judge the 1% target on the full run.")
    return lines + [""]


def joined(result: dict) -> list[str]:
    """One table of the runs measured in both parts: final validation loss and step time at the slowest rate."""
    slow = slowest(result["plan"])
    at = {r["key"]: r for r in result["rows"] if r["ok"] and r["part"] == "timing" and r["setting"] == slow}
    conv = {r["key"]: r for r in result["rows"] if r["ok"] and r["part"] == "convergence"}
    if len(keys := [k for k in at if k in conv]) < 2:
        return []
    rows = [{**at[k], "final_val_loss": conv[k]["final_val_loss"], "vs_plain": (vs := conv[k].get("vs_plain")),
             "both": "–" if k == "plain" or vs is None or "speedup" not in at[k] else
             ("both" if abs(vs) <= 0.01 and at[k]["speedup"] >= 1.8 else "no")} for k in keys]
    columns = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
               ("vs_plain", "vs plain TP", "{:+.2%}"), ("step_ms", f"step ms at {slow}", "{:.0f}"),
               ("speedup", "speedup vs plain TP", "{:.2f}"), ("both", "1% and 1.8x", "{}")]
    return [f"### Both parts: validation loss and step time at {slow}", "",
            f"\"full\": K = {result['plan']['conv_partitions']} in the convergence part, K = "
            f"{at['full']['partitions'] if 'full' in at else '?'} in the timing part.", "",
            *report.md_table(rows, columns, align="lrrrrl"), ""]


def markdown(result: dict) -> str:
    timing, conv = ([r for r in result["rows"] if r["part"] == part] for part in ("timing", "convergence"))
    lines = [f"Timing part skipped: {result['timing_skipped']}.", ""] if result.get("timing_skipped") else []
    lines += timing_markdown(result, timing) if timing else []
    if result.get("convergence_skipped"):
        lines += [f"Convergence part skipped: {result['convergence_skipped']}.", ""]
    lines += conv_markdown(result, conv) if conv else []
    return "\n".join(lines + joined(result)).rstrip()


def plots(result: dict, out_dir: Path) -> list[Path]:
    plt, paths = report.pyplot(), []
    timing, conv = ([r for r in result["rows"] if r["ok"] and r["part"] == p] for p in ("timing", "convergence"))
    if timing:
        rates = [rate for rate in result["plan"]["rates"] if any(r["setting"] == rate for r in timing)]
        fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            at = [r for r in timing if r["setting"] == rate]
            report.time_bars(ax, at, timing_kinds(timing), [r["key"] for r in at],
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
