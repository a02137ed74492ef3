"""The benchmark suite that reproduces the ZeRO++ paper's tables on one machine, and the one CLI of
every benchmark.

    python scripts/bench/suite.py --quick                  # reduced set: 12 minutes at load 15, fewer when quiet
    python scripts/bench/suite.py                          # everything, ~45 minutes on 2 quiet cores (estimate)
    python scripts/bench/suite.py --targets --out runs/bench/t17    # only issue 17's T1-T6 rows, 17 min at load 15
    python scripts/bench/suite.py --out runs/bench/full --only ablation peers   # refreshes those sections and
                                                                  # the summary (the other results in DIR kept)
    python scripts/bench/suite.py --quick --no-docs        # leave docs/benchmarks.md alone
    python scripts/bench/suite.py --render runs/bench/full/suite.json           # docs again, nothing run
    python scripts/bench/NAME.py [--quick] [--out DIR] [--update-docs] [its options; --help]   # one benchmark

The registry: SUITE in its run order (cheapest first), then the benchmarks that run on their own
(memory, reduce_scatter, quantized_perplexity, separate and tensor_parallel: their sections are in
docs/export.md, docs/separate.md and docs/tensor_parallel.md). A benchmark is a
module of this package with `TITLE` (its docs heading), `add_args(parser)` (a default that differs
under --quick is a `Quick(full, quick)`), `run(args, progress) -> result` (a dict: `rows` are its
table, `skipped` says why it could not run), `markdown(result)` and optionally `plots(result,
out_dir) -> [png]`, `DOCS` (its page) and `worker(argv)` (what `NAME.py --worker ...` runs on each
rank). Results go to `<out>/<name>.json` and `.csv`, plots to
`<out>/plots/`, the suite's to `<out>/suite.json` and, unless `--no-docs`, docs/benchmarks.md (plots
copied to docs/benchmarks/). The cluster parts need root and iproute2; without them they say so and
the rest still runs.

The summary (printed, in suite.json as "targets" and "summary", and the docs' first section) is issue
17's T1-T6 (`targets()`: each ratio, the rows it divides with their compute dtype, the issue's "before",
the goal, met or missed), then the earlier targets (`summary()`). T1-T4 and T6 come from peers (issue
17's model; `peers.py --plan targets` runs just those rows), T5 from kernel_bandwidth's 16M-element,
1-thread rows. A run with --only keeps the other benchmarks' results found in --out (its suite.json,
else their <name>.json), so the summary covers them; the date and load of each are shown.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from scripts.bench import report
from scripts.bench.report import ROOT

SUITE = ["comm_volume", "kernel_bandwidth", "ablation", "peers", "rlhf", "convergence"]  # run order: cheapest first
DOC_ORDER = ["ablation", "peers", "comm_volume", "convergence", "kernel_bandwidth", "rlhf"]  # sections 1-6 of the docs
BENCHMARKS = SUITE + ["memory", "reduce_scatter", "quantized_perplexity", "separate", "tensor_parallel"]


def module(name: str):
    return importlib.import_module(f"scripts.bench.{name}")


@dataclass(frozen=True)
class Quick:
    """An option's default: `full` in a full run, `quick` under --quick (help: "default %(default)s")."""
    full: object
    quick: object

    def __str__(self) -> str:
        return f"{_words(self.full)}, quick {_words(self.quick)}"


def _words(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        for key, value in vars(ns).items():
            if isinstance(value, Quick):
                setattr(ns, key, value.quick if ns.quick else value.full)
        return ns, rest


def options(args) -> dict:
    """A benchmark's own options as parsed, for its result's "plan"."""
    return {k: v for k, v in vars(args).items() if k not in ("quick", "out", "update_docs", "render", "reuse")}


def parser(name: str) -> argparse.ArgumentParser:
    mod = module(name)
    p = _Parser(prog=f"scripts/bench/{name}.py", description=mod.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(p)
    p.add_argument("--quick", action="store_true", help="the reduced set the suite's --quick runs")
    out = getattr(mod, "OUT", f"{name}-<time>")
    p.add_argument("--out", type=Path, help=f"results directory (default runs/bench/{out})")
    p.add_argument("--update-docs", action="store_true", help="also refresh this benchmark's docs section")
    p.add_argument("--render", type=Path, metavar="RESULT_JSON",
                   help=f"run nothing: the plots and (with --update-docs) the docs section from a saved {name}.json")
    return p


def execute(name: str, args, out: Path, progress=print, **extra) -> tuple[dict, list[Path]]:
    """Run one benchmark; write its results and plots (a missing matplotlib is noted, not fatal)."""
    start, load = time.monotonic(), round(os.getloadavg()[0], 2)
    result = {"benchmark": name, **extra, **module(name).run(args, progress=progress)}
    result.update(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), load_average_start=load,
                  load_average_end=round(os.getloadavg()[0], 2))
    result["seconds"] = time.monotonic() - start
    if result.get("skipped"):
        progress(f"  {name}: skipped ({result['skipped']})")
    pngs = plots(name, result, out, progress)
    report.write_results(result, out, name)
    return result, pngs


def plots(name: str, result: dict, out: Path, progress=print) -> list[Path]:
    if not any(r.get("ok", True) for r in result.get("rows", [])):
        return []
    try:
        return module(name).plots(result, out) if hasattr(module(name), "plots") else []
    except ImportError as e:
        result.setdefault("notes", []).append(f"no plots: {e} (pip install -r requirements-bench.txt)")
        progress(f"  no plots: {e}")
        return []


def markdown(name: str, result: dict, images: dict[str, str], stamp: str | None = None) -> str:
    """The benchmark's docs section: its title, [stamp,] its body (or why it was skipped), notes, plots."""
    lines = [module(name).TITLE, ""] + ([stamp, ""] if stamp else [])
    lines += [f"Skipped: {result['skipped']}."] if result.get("skipped") else [module(name).markdown(result)]
    lines += [""] + [f"- {note}" for note in result.get("notes", [])] + [""] * bool(result.get("notes"))
    return "\n".join(lines + [f"![{stem}]({path})\n" for stem, path in images.items()])


def main_one(name: str, argv: list[str] | None = None) -> int:
    """The CLI of one benchmark (`python scripts/bench/NAME.py ...`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return module(name).worker(argv[1:])
    args = parser(name).parse_args(argv)
    if args.render:
        out = args.render.parent
        result = json.loads(args.render.read_text())
        pngs = plots(name, result, out)
    else:
        stem = getattr(module(name), "OUT", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        args.out = out = args.out or ROOT / "runs" / "bench" / stem
        result, pngs = execute(name, args, out, machine=report.machine_info(),
                               command=shlex.join(["python", f"scripts/bench/{name}.py", *argv]))
    print(f"\n{markdown(name, result, {p.stem: str(p) for p in pngs})}")
    print(f"results in {out}/{name}.json, .csv{''.join(f', {p}' for p in pngs)} ({result['seconds']:.0f} s)")
    if args.update_docs:
        mod = module(name)
        docs = getattr(mod, "DOCS", report.DOCS)
        stamp = report.stamp(result["machine"], result["command"])
        report.update_docs_section(docs, name, markdown(name, result, report.copy_images(pngs), stamp), mod.TITLE)
        print(f"updated {docs}")
    rows = result.get("rows")
    return 1 if rows and not any(r.get("ok", True) for r in rows) else 0


# ---------------------------------------------------------------- the summary


def _find(rows, **match) -> dict:
    return next((r for r in rows if r.get("ok") and all(r.get(k) == v for k, v in match.items())), {})


ISSUE = "issue 17"
# what --targets runs: T5 on kernel_bandwidth's 1-thread CPU-time clock (steadier than wall time on a busy machine)
TARGET_ARGS = {"kernel_bandwidth": ["--sizes", str(16 << 20), "--threads", "1", "--clock", "cpu"],
               "peers": ["--plan", "targets"]}


def t_commands() -> list[tuple[str, str]]:
    """The commands of the T table's measurements: (command, what it gives)."""
    kernels = " ".join(TARGET_ARGS["kernel_bandwidth"])
    return [("python scripts/bench/peers.py --plan targets", "T1-T4, T6: the rows above, issue 17's model, 8 steps"),
            (f"python scripts/bench/kernel_bandwidth.py {kernels}", "T5"),
            ("python scripts/bench/suite.py --targets --out DIR", "both, and this table (other results in DIR kept)")]


def _row_text(r: dict, value: str = "step") -> str:
    what = (f"{r['phys_tx_mb_node']:.2f} MB/node/step" if value == "bytes" and r.get("phys_tx_mb_node") is not None
            else f"{r['step_ms']:.0f} ms")
    return f"{r['label']} [{r.get('compute') or '?'} compute] @ {r['setting']}: {what}"


def _kernel_ratio(results: dict, op: str, bits: int = 8) -> tuple[float | None, str]:
    """Throughput of `op` / copy_ bandwidth at 1 thread (16M elements, else the largest size measured):
    copy_'s time / op's time, from kernel_bandwidth's rows."""
    rows = [r for r in results.get("kernel_bandwidth", {}).get("rows", []) if r.get("ok", True)
            and r.get("threads") == 1 and r.get("version", "current") == "current"]
    sizes = sorted({r["numel"] for r in rows if r["op"] == op and r.get("bits") == bits})
    if not sizes:
        return None, f"kernel_bandwidth: int{bits} {op}, 1 thread: not measured"
    numel = 16 << 20 if 16 << 20 in sizes else sizes[-1]
    r = next(r for r in rows if r["op"] == op and r.get("bits") == bits and r["numel"] == numel)
    copy = next((c for c in rows if c["op"] == "copy_" and c["numel"] == numel), None)
    ratio = copy["seconds"] / r["seconds"] if copy and copy.get("seconds") and r.get("seconds") else 1 / r["vs_copy"]
    size = f"{numel >> 20}M" if numel % (1 << 20) == 0 else str(numel)
    clock = results["kernel_bandwidth"].get("clock")
    text = (f"kernel_bandwidth: int{bits} {op} {r['seconds'] * 1e3:.2f} ms, copy_ {copy['seconds'] * 1e3:.2f} ms"
            if copy else f"kernel_bandwidth: int{bits} {op}, x copy {r['vs_copy']:.2f}")
    return ratio, (f"{text} ({size} elements, 1 thread" + (f", {clock} clock" if clock else "")
                   + ("" if numel == 16 << 20 else "; not the 16M of the target") + ")")


def targets(results: dict) -> list[dict]:
    """Issue 17's T1-T6, each from the rows it divides (None when one is missing). T1-T4 and T6 come from peers
    (issue 17's model, ZeRO++ and its peers side by side in one run), T5 from kernel_bandwidth; the extra
    lines without a goal show the node-aware collectives off (the before of T4 / T6), fp32 compute, and the
    ablation's 10.56M model."""
    out = []
    peers = results.get("peers", {})
    prow, slow = [r for r in peers.get("rows", []) if r.get("ok")], peers.get("plan", {}).get("rate", "100mbit")
    bf16_mb = (peers.get("model") or {}).get("params", 0) * 2 / 1e6

    def row(key, setting=slow, rows=prow):
        return next((r for r in rows if r["key"] == key and r["setting"] == setting), None)

    def add(tid, what, goal, test, inputs, compute, before=None, step="step"):
        """inputs: (row or None, what the row is, for "not measured")."""
        value = None if any(r is None for r, _ in inputs) else compute(*(r for r, _ in inputs))
        out.append({"id": tid, "what": what, "goal": goal, "before": before, "value": value,
                    "met": None if value is None or test is None else bool(test(value)),
                    "from": "; ".join(_row_text(r, step) if r else f"{name}: not measured" for r, name in inputs)})

    def steps(a, b):
        return a["step_ms"] / b["step_ms"]

    zpp, zpp_loop = row("zeropp"), row("zeropp", "loopback")
    add("T1", f"ZeRO++ step at {slow} / the same job unshaped (bf16 compute)", "<= 1.3", lambda v: v <= 1.3,
        [(zpp, f"ZeRO++ [bf16] @ {slow}"), (zpp_loop, "ZeRO++ [bf16] @ loopback")], steps, before=2.29)
    for dtype, zkey, keys, before in (("bf16", "zeropp", ("ddp-bf16", "fsdp2-bf16", "deepspeed-bf16"), 3.03),
                                      ("fp32", "zeropp-c32", ("ddp", "fsdp2-fp32", "deepspeed-fp32"), None)):
        measured = [r for r in (row(k) for k in keys) if r]
        fastest = min(measured, key=lambda r: r["step_ms"], default=None)
        missing = [FAMILIES[k.split("-")[0]] for k in keys if not row(k)]
        note = f" (not measured: {', '.join(missing)})" if missing and measured else ""
        add("T2" if dtype == "bf16" else "T2 (fp32)", f"fastest of DDP, FSDP2, DeepSpeed ZeRO-3 / ZeRO++, step at "
            f"{slow}, {dtype} compute{note}", ">= 4", lambda v: v >= 4,
            [(fastest, f"DDP, FSDP2, DeepSpeed [{dtype}] @ {slow}"), (row(zkey), f"ZeRO++ [{dtype}] @ {slow}")], steps,
            before=before)
        if missing and measured:  # the fastest of some of them: shown, no verdict
            out[-1]["met"] = None
    for setting, before in ((slow, 1.13), ("loopback", 1.14)):
        where = "unshaped" if setting == "loopback" else setting
        add("T3", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, bf16 wire + bf16 compute, {where}", ">= 1.25",
            lambda v: v >= 1.25, [(row("deepspeed-bf16", setting), f"DeepSpeed ZeRO-3 [bf16] @ {setting}"),
                                  (row("zero3-bf16", setting), f"our ZeRO-3 [bf16] @ {setting}")], steps, before=before)
        if row("zero3-keep", setting):  # both keep a model this small gathered from forward to backward
            add("T3 (kept)", f"the same, ours also kept gathered (DeepSpeed's stage3_max_reuse_distance), {where}",
                ">= 1.25", lambda v: v >= 1.25, [(row("deepspeed-bf16", setting), ""), (row("zero3-keep", setting), "")],
                steps)
    for setting in (slow, "loopback"):
        if row("deepspeed-fp32", setting) and row("zero3-fp32", setting):
            where = "unshaped" if setting == "loopback" else setting
            add("T3 (fp32)", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, fp32 wire + fp32 compute, {where}", ">= 1.25",
                lambda v: v >= 1.25, [(row("deepspeed-fp32", setting), ""), (row("zero3-fp32", setting), "")], steps)
    phys = lambda r: r["phys_tx_mb_node"] / bf16_mb if r.get("phys_tx_mb_node") and bf16_mb else None  # noqa: E731
    for key, tid, goal, before in (("zeropp", "T4", "<= 0.40", 0.53), ("zeropp-flat", "T4 before", "–", None)):
        r = row(key)
        add(tid, "ZeRO++ physical cross-node bytes per node per step / model size in bf16"
            + (f" ({bf16_mb:.2f} MB)" if bf16_mb else "")
            + (", node-aware collectives off" if key == "zeropp-flat" else ""), goal,
            (lambda v: v <= 0.40) if tid == "T4" else None, [(r, f"{key} @ {slow}")], phys, before=before,
            step="bytes")
    for op, goal, before in (("quantize", 0.6, 0.41), ("dequantize", 0.85, 0.65)):
        ratio, text = _kernel_ratio(results, op)
        out.append({"id": "T5", "what": f"int8 {op} throughput / copy bandwidth, 1 thread, 16M elements",
                    "goal": f">= {goal}", "before": before, "value": ratio, "from": text,
                    "met": None if ratio is None else ratio >= goal})
    add("T6", f"our ZeRO-3 / ZeRO++, step at {slow} (bf16 compute; paper 2.16x)", "report", None,
        [(row("zero3-bf16"), f"our ZeRO-3 [bf16] @ {slow}"), (zpp, f"ZeRO++ [bf16] @ {slow}")], steps, before=2.69)
    if row("zero3-flat") or row("zeropp-flat"):
        add("T6 before", "the same, node-aware collectives off", "–", None,
            [(row("zero3-flat"), "zero3-flat"), (row("zeropp-flat"), "zeropp-flat")], steps)
    if row("zero3-bf16-c32") or row("zeropp-c32"):
        add("T6 (fp32)", "the same, fp32 compute", "–", None,
            [(row("zero3-bf16-c32"), "zero3-bf16-c32"), (row("zeropp-c32"), "zeropp-c32")], steps)
    # what each overlap option bought: the step without it / with it
    for key, base, what in (("zeropp-keep", "zeropp", "ZeRO++ default / kept gathered for the backward"),
                            ("zero3-keep", "zero3-bf16", "our ZeRO-3 default / kept gathered for the backward"),
                            ("zeropp", "zeropp-nostep", "ZeRO++ first gathers at the forward / at the optimizer step")):
        for setting in (slow, "loopback"):
            if row(key, setting) and row(base, setting):
                where = "unshaped" if setting == "loopback" else setting
                add("overlap", f"{what}, step, {where}", "–", None, [(row(base, setting), ""), (row(key, setting), "")],
                    steps)
    ablation = results.get("ablation", {})
    arow = [dict(r, key={"zero3": "zero3-bf16"}.get(r["key"], r["key"])) for r in ablation.get("rows", [])
            if r.get("ok") and r.get("micro_batch") == 4]
    ab_mb = (ablation.get("model") or {}).get("params", 0) * 2 / 1e6
    if arow:
        size = f"{(ablation.get('model') or {}).get('params', 0) / 1e6:.2f}M"
        a_zpp, a_z3 = row("zeropp", slow, arow), row("zero3-bf16", slow, arow)
        add("T4 (ablation)", f"T4 on the ablation's {size} model ({ab_mb:.2f} MB in bf16)", "<= 0.40",
            lambda v: v <= 0.40, [(a_zpp, "ablation ZeRO++")],
            lambda r: r["phys_tx_mb_node"] / ab_mb if r.get("phys_tx_mb_node") and ab_mb else None, step="bytes")
        add("T6 (ablation)", f"T6 on the ablation's {size} model", "report", None,
            [(a_z3, "ablation ZeRO-3"), (a_zpp, "ablation ZeRO++")], steps)
    return out


FAMILIES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}  # a peers key's first part -> its name


def targets_markdown(items: list[dict]) -> list[str]:
    lines = ["| id | ratio | from (rows, compute dtype) | before | goal | measured | met |",
             "| --- | --- | --- | ---: | ---: | ---: | :---: |"]
    for it in items:
        v = it["value"]
        met = "–" if it["met"] is None else ("yes" if it["met"] else "**no**")
        lines.append(f"| {it['id']} | {it['what']} | {it['from']} | {report.fmt(it.get('before'), '{:.2f}')} | "
                     f"{it['goal']} | {'not measured' if v is None else f'{v:.3f}'} | {met} |")
    return lines


def summary(results: dict) -> list[dict]:
    """The earlier issue's target ratios, as the sections below compute them (None when not measured)."""
    out = []

    def target(what, target, value, ok, percent=False):
        out.append({"what": what, "target": target, "value": value, "percent": percent,
                    "met": None if value is None else bool(ok(value))})

    zpp = _find(results.get("ablation", {}).get("rows", []), key="zeropp", setting="100mbit", micro_batch=4)
    target("ZeRO++ / our ZeRO-3 throughput, 100 Mbit/s, 4x128 tokens/rank", ">= 3", zpp.get("speedup_vs_zero3"),
           lambda v: v >= 3)
    target("physical cross-node bytes per step, ZeRO++ / ZeRO-3 (node link, tx)", "<= 0.28",
           zpp.get("phys_ratio_vs_zero3"), lambda v: v <= 0.28)
    target("ledger cross-node bytes of one step, ZeRO++ / ZeRO-3 (comm_volume, scales included)", "<= 0.28",
           results.get("comm_volume", {}).get("total_ratio"), lambda v: v <= 0.28)
    peers = results.get("peers", {})
    prow, slow = peers.get("rows", []), peers.get("plan", {}).get("rate", "100mbit")
    best = max((r for r in prow if r.get("ok") and r.get("setting") == slow
                and r.get("family") in ("ddp", "fsdp2", "deepspeed")), key=lambda r: r["tokens_per_s"], default={})
    target(f"ZeRO++ / fastest of DDP, FSDP2, DeepSpeed ZeRO-3 at {slow}"
           + (f" (fastest: {best['label']})" if best else ""), ">= 3", best.get("zeropp_speedup"), lambda v: v >= 3)
    for setting in (slow, "loopback"):
        for dtype in ("fp32", "bf16"):
            target(f"our ZeRO-3 / DeepSpeed ZeRO-3 throughput, {dtype} wire, "
                   f"{'unshaped loopback' if setting == 'loopback' else setting}"
                   + (" (DeepSpeed bf16 also computes in bf16)" if dtype == "bf16" else ""), ">= 1.2",
                   _find(prow, key=f"zero3-{dtype}", setting=setting).get("vs_deepspeed_same_dtype"),
                   lambda v: v >= 1.2)
    conv = results.get("convergence", {})
    for r in conv.get("rows", []):
        if r.get("key") == "zeropp-w8" and r.get("ok"):
            target(f"convergence: final validation loss after {conv.get('plan', {}).get('steps')} steps, ZeRO++ "
                   "(8-bit qwZ) vs ZeRO-3, relative", "within 1%", r.get("rel_diff"), lambda v: abs(v) <= 0.01,
                   percent=True)
    rlhf = results.get("rlhf", {})
    rate = rlhf.get("plan", {}).get("rate", "100mbit")
    for what, key, theirs in (("generation tokens/s", "generation", 2.25), ("PPO step time", "step", 1.26)):
        # DeepSpeed's ZeRO++ blog figure is a reference (GPUs, far larger models), not a target: no verdict
        out.append({"what": f"RLHF: ZeRO++ / ZeRO-3 speedup of the {what}, {rate}", "target": f"DeepSpeed (GPUs): "
                    f"{theirs}x", "value": (rlhf.get("ratios") or {}).get(key), "percent": False, "met": None})
    return out


def summary_markdown(items: list[dict]) -> list[str]:
    lines = ["| ratio | target | measured | met |", "| --- | ---: | ---: | :---: |"]
    for it in items:
        v = it["value"]
        shown = "not measured" if v is None else (f"{100 * v:+.2f}%" if it.get("percent") else f"{v:.3f}")
        met = "–" if it["met"] is None else ("yes" if it["met"] else "**no**")
        lines.append(f"| {it['what']} | {it['target']} | {shown} | {met} |")
    return lines


# ---------------------------------------------------------------- the suite


T_KEYS = ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16", "zeropp-c32", "zero3-bf16-c32", "ddp",
          "fsdp2-fp32", "deepspeed-fp32", "zero3-fp32", "zeropp-flat", "zero3-flat", "zero3-keep", "zeropp-keep",
          "zeropp-nostep"]  # peers rows of the T table


def _model_words(result: dict) -> str:
    m, shape = result.get("model") or {}, (result.get("plan") or {}).get("shape")
    if not m:
        return "not run"
    what = "issue 17's model" if shape == "issue" else ("the ablation's model, not issue 17's" if shape == "suite"
                                                         else "the model")
    return (f"{what}: GPT-2 of {m.get('n_layer')} layers, d_model {m.get('d_model')}, vocabulary "
            f"{m.get('vocab_size')}, {m.get('params', 0) / 1e6:.2f}M parameters")


def summary_section(results: dict, items: list[dict], t_items: list[dict]) -> str:
    """The docs' summary: issue 17's T1-T6 (with the rows, their compute dtype and commands), then the earlier
    targets; the date and load of each benchmark it draws on."""
    when = []
    for name, res in results.items():
        if res.get("date"):
            loads = [r["load_start"] for r in res.get("rows", []) if r.get("load_start") is not None]
            when.append(f"{name} {res['date']} (load average {res.get('load_average_start', '?')} at its start"
                        + (f", {min(loads):.1f}-{max(loads):.1f} at its runs' starts" if loads else "") + ")")
    peers = results.get("peers", {})
    rows = sorted((r for r in peers.get("rows", []) if r.get("key") in T_KEYS),
                  key=lambda r: (r["setting"] == "loopback", T_KEYS.index(r["key"])))
    lines = [f"## Summary: {ISSUE}'s targets (T1-T6)", ""]
    if when:
        lines += ["Measured: " + "; ".join(when) + ".", ""]
    lines += [
        *targets_markdown(t_items), "",
        f"Ratios are of step times measured side by side in one run (peers, section 2: {_model_words(peers)}, "
        f"{peers.get('plan', {}).get('micro_batch', 4)}x128 tokens per rank, step time = median of the steps after "
        "the warm-up); \"before\" = the issue's figures (yesterday's runtime: flat gloo collectives; the "
        "bf16 figures with bf16 autocast). T4 divides the bytes each node's link sent per step (veth counters) by "
        "the model's parameters x 2 bytes. T5 is copy_'s time / the kernel's at 1 thread (section 5; the issue's "
        "before was taken on the wall clock, [performance.md](performance.md) has a before/after pair on one "
        "clock). Lines "
        "without a goal are the comparisons behind the targets: node-aware collectives off (`--zero_optimization."
        "node_aware_collectives false`, the before of T4 and T6), fp32 compute, and the ablation's model. On a "
        "busy machine the step times are noisy (compare the load column) and the ratios that divide a wire-bound "
        "step by a compute-bound one (T1, T2, T6) are pulled towards 1: the compute grows with the load, the "
        "wire time does not. What "
        "each optimisation bought and what limits the rest: [performance.md](performance.md). Targets are "
        "measured, not tuned for: a **no** is the honest result on this machine.", ""]
    if rows:
        lines += [f"The rows (each node runs `torchrun ... SCRIPT <common> <its arguments>`, common = "
                  f"`{peers.get('common_args', '?')}`):", "",
                  "| runtime | compute | link | step ms | physical MB/node/step | load at its start | script | "
                  "its arguments |", "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
        for r in rows:
            ok = r.get("ok")
            lines.append(f"| {r['label']} | {r.get('compute') or '–'} | {r['setting']} | "
                         f"{report.fmt(r.get('step_ms'), '{:.0f}') if ok else 'failed'} | "
                         f"{report.fmt(r.get('phys_tx_mb_node'), '{:.2f}')} | "
                         f"{report.fmt(r.get('load_start'), '{:.1f}')}"
                         f" | `{r.get('script', '?')}` | "
                         f"`{' '.join(r.get('args') or []) or '–'}` |")
        lines.append("")
    width = max(len(c) for c, _ in t_commands()) + 2
    lines += ["Commands:", "", "```bash", *[f"{c:<{width}}# {why}" for c, why in t_commands()], "```", "",
              "### Earlier targets", "",
              "From the same results (\"not measured\": that benchmark's result is not in this run's directory; a "
              "section below may hold an older run's figure).", "", *summary_markdown(items), ""]
    return "\n".join(lines)


def write_docs(results: dict, images: dict[str, dict], info: dict, command: str, quick: bool, seconds: float,
               items: list[dict], t_items: list[dict] | None = None) -> None:
    mode = ("`--quick`: a reduced set (fewer configurations, rates and steps) to check that everything "
            "works; run the suite without `--quick` for the full tables") if quick else "full"
    text = "\n".join([
        report.TITLE, "",
        f"Generated by `{command}` on {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} in {seconds / 60:.1f} "
        f"minutes ({mode}).", "",
        f"Machine: {report.machine_line(info)}.", "",
        "Every figure comes from one machine: the 'nodes' are network namespaces whose links are shaped with "
        "tbf ([cluster.md](cluster.md)), and all ranks of all nodes share its CPU cores, so compute does not "
        "scale with nodes and a busy machine slows every run. Compare configurations measured in the same "
        "suite run; absolute numbers are not a GPU cluster's. Every training row says what it computes in "
        "(its `--train.precision`, never the machine's `auto`).", "",
        "Commands (every benchmark also runs alone, with the same options; `--update-docs` refreshes only its "
        "section; `suite.py --only NAME --out DIR` keeps the other results in DIR and refreshes the summary):", "",
        "```bash",
        "pip install -r requirements-bench.txt               # DeepSpeed (CPU build) and matplotlib",
        "python scripts/bench/suite.py [--quick] [--out DIR] [--only NAME ...] [--no-docs] [--render SUITE_JSON]",
        "python scripts/bench/suite.py --targets --out DIR   # only what issue 17's T1-T6 need, + the summary",
        "python scripts/bench/comm_volume.py [--physical]    # Table 4, one step, 4 local ranks as 2x2",
        "python scripts/bench/kernel_bandwidth.py [--quick]",
        "python scripts/bench/ablation.py [--quick] [--precision bf16|fp32]   # needs root + iproute2",
        "python scripts/bench/peers.py [--quick] [--plan full|targets|quick]  # needs root + iproute2",
        "python scripts/bench/rlhf.py [--quick]              # PPO, ZeRO++ vs ZeRO-3; needs root + iproute2",
        "python scripts/bench/convergence.py [--quick]       # needs ../shared/data/tinyshakespeare.txt",
        "```", "",
        report.section("summary", summary_section(results, items, t_items if t_items is not None
                                                  else targets(results)))])
    for name in DOC_ORDER:
        if name in results:
            text += "\n" + report.section(name, markdown(name, results[name], images.get(name, {})))
    report.DOCS.write_text(text)


def publish(results: dict, images: dict[str, dict], info: dict, command: str, quick: bool, seconds: float,
            items: list[dict], t_items: list[dict], names: list[str]) -> None:
    """docs/benchmarks.md: the whole page when every benchmark of the suite ran, else the sections of `names`
    (stamped with their own command and date) and the summary, the rest of the page left be."""
    if set(SUITE) <= set(names):
        write_docs(results, images, info, command, quick, seconds, items, t_items)
        return
    for name in names:
        result = results[name]
        stamp = report.stamp(info, result.get("command", command), result.get("date", "")[:10] or None)
        report.update_docs_section(report.DOCS, name, markdown(name, result, images[name], stamp))
    report.update_docs_section(report.DOCS, "summary", summary_section(results, items, t_items))


def render(path: Path) -> int:
    """Plots and docs/benchmarks.md again from a suite.json (e.g. after editing the report code)."""
    saved = json.loads(path.read_text())
    results, out = saved["results"], path.parent
    images = {name: report.copy_images(plots(name, result, out)) for name, result in results.items()}
    items, t_items = summary(results), targets(results)
    publish(results, images, saved["machine"], saved["command"], saved["quick"], saved["seconds"], items, t_items,
            list(results))
    report.write_json(path, {**saved, "summary": items, "targets": t_items})
    print("\n".join(targets_markdown(t_items) + [""] + summary_markdown(items)))
    print(f"wrote {report.DOCS} and {report.DOCS_IMAGES}/ from {path}")
    return 0


def earlier_results(out: Path, skip: list[str]) -> dict:
    """What an earlier run left in `out` (its suite.json, else the benchmarks' own <name>.json), except `skip`."""
    saved = out / "suite.json"
    results = json.loads(saved.read_text()).get("results", {}) if saved.is_file() else {}
    for name in SUITE:
        if name not in results and (out / f"{name}.json").is_file():
            results[name] = json.loads((out / f"{name}.json").read_text())
    return {k: v for k, v in results.items() if k not in skip}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced set, minutes on 2 cores")
    p.add_argument("--out", type=Path, help="results directory (default runs/bench/suite-<time>)")
    p.add_argument("--only", nargs="+", choices=SUITE,
                   help="run only these benchmarks (the others' results in --out are kept for the summary)")
    p.add_argument("--skip", nargs="+", choices=SUITE, default=[], help="leave these out")
    p.add_argument("--targets", action="store_true",
                   help=f"run only what {ISSUE}'s T1-T6 need (" + "; ".join(
                       f"{n} {' '.join(a)}" for n, a in TARGET_ARGS.items()) + "), keeping the other results in --out")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--render", type=Path, metavar="SUITE_JSON",
                   help="run nothing: redraw the plots and rewrite docs/benchmarks.md from a saved suite.json")
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    out = args.out or ROOT / "runs" / "bench" / f"suite-{'quick-' * args.quick}{time.strftime('%Y%m%d-%H%M%S')}"
    names = [n for n in (list(TARGET_ARGS) if args.targets else args.only or SUITE) if n not in args.skip]
    extra = TARGET_ARGS if args.targets else {}
    info = report.machine_info()
    command = shlex.join(["python", "scripts/bench/suite.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"suite ({'quick' if args.quick else 'full'}): {', '.join(names)} -> {out}")
    print(f"machine: {report.machine_line(info)}", flush=True)
    start = time.monotonic()
    results, images = {}, {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ... (elapsed {time.monotonic() - start:.0f} s)", flush=True)
        bargs = parser(name).parse_args((["--quick"] if args.quick else []) + ["--out", str(out)] + extra.get(name, []))
        bargs.reuse = results.get("ablation")  # peers: our ZeRO-3 / ZeRO++ runs of the same job, not run twice
        try:
            results[name], pngs = execute(name, bargs, out, progress=lambda s: print(s, flush=True), command=command)
        except Exception as e:  # one broken benchmark must not lose the others' results
            traceback.print_exc()
            results[name], pngs = {"benchmark": name, "skipped": f"crashed: {type(e).__name__}: {e}", "rows": []}, []
        images[name] = {p.stem: str(p) for p in pngs} if args.no_docs else report.copy_images(pngs)
        print(f"[{i}/{len(names)}] {name} done in {results[name].get('seconds', 0):.0f} s", flush=True)
    seconds = time.monotonic() - start
    kept = earlier_results(out, names) if names != SUITE else {}  # a partial run keeps the others' results
    merged = {**kept, **results}
    items, t_items = summary(merged), targets(merged)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    report.write_json(out / "suite.json", {
        "machine": info, "command": command, "quick": args.quick, "seconds": seconds, "summary": items,
        "targets": t_items, "timings": {n: r.get("seconds") for n, r in results.items()}, "results": merged,
        **({"kept_from_earlier_runs": sorted(kept)} if kept else {})})
    if kept:
        print(f"\nkept from earlier runs in {out}: {', '.join(sorted(kept))}")
    print(f"\n{ISSUE}'s targets:\n" + "\n".join(targets_markdown(t_items)))
    print("\nearlier targets:\n" + "\n".join(summary_markdown(items)))
    if not args.no_docs:  # a partial run refreshes its own sections and the summary (from the merged results)
        publish(merged, images, info, command, args.quick, seconds, items, t_items, names)
        print(f"wrote {report.DOCS} ({', '.join(names)} and the summary) and {report.DOCS_IMAGES}/")
    print(f"suite done in {seconds:.0f} s ({seconds / 60:.1f} min); results in {out}")
    return 0


if __name__ == "__main__":
    from scripts.bench import suite  # this file as the package's module: the one whose Quick the benchmarks use

    sys.exit(suite.main())
