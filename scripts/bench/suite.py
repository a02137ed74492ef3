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

A benchmark is a module of this package with TITLE (its docs heading), add_args(parser) (a default that
differs under --quick is a Quick(full, quick)), run(args, progress) -> result (`rows` its table, `skipped`
why it could not run), markdown(result), and optionally plots(result, out_dir), DOCS (its page, when not
docs/benchmarks.md), OUT (its results directory) and worker(argv) (what `NAME.py --worker ...` runs on
each rank). Results go to <out>/<name>.json, .csv and plots/, the suite's to <out>/suite.json and (unless
--no-docs) docs/benchmarks.md. The summary is issue 17's T1-T6 (`targets()`), then the earlier targets.
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
        words = [(" ".join(map(str, v)) or "none") if isinstance(v, list) else str(v) for v in (self.full, self.quick)]
        return f"{words[0]}, quick {words[1]}"


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
    p.add_argument("--out", type=Path,
                   help=f"results directory (default runs/bench/{getattr(mod, 'OUT', name + '-<time>')})")
    p.add_argument("--update-docs", action="store_true", help="also refresh this benchmark's docs section")
    p.add_argument("--render", type=Path, metavar="RESULT_JSON",
                   help=f"run nothing: the plots and (with --update-docs) the docs section from a saved {name}.json")
    return p


def execute(name: str, args, out: Path, progress=print, **extra) -> tuple[dict, list[Path]]:
    """Run one benchmark; write its results and plots (a missing matplotlib is noted, not fatal)."""
    start, load = time.monotonic(), round(os.getloadavg()[0], 2)
    result = {"benchmark": name, **extra, **module(name).run(args, progress=progress)}
    result.update(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), load_average_start=load,
                  load_average_end=round(os.getloadavg()[0], 2), seconds=time.monotonic() - start)
    if result.get("skipped"):
        progress(f"  {name}: skipped ({result['skipped']})")
    pngs = plots(name, result, out, progress)
    report.write_results(result, out, name)
    return result, pngs


def plots(name: str, result: dict, out: Path, progress=print) -> list[Path]:
    if not hasattr(module(name), "plots") or not any(r.get("ok", True) for r in result.get("rows", [])):
        return []
    try:
        return module(name).plots(result, out)
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
    mod = module(name)
    if argv[:1] == ["--worker"]:
        return mod.worker(argv[1:])
    args = parser(name).parse_args(argv)
    if args.render:
        out, result = args.render.parent, json.loads(args.render.read_text())
        pngs = plots(name, result, out)
    else:
        stem = getattr(mod, "OUT", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        args.out = out = args.out or ROOT / "runs" / "bench" / stem
        result, pngs = execute(name, args, out, machine=report.machine_info(),
                               command=shlex.join(["python", f"scripts/bench/{name}.py", *argv]))
    print(f"\n{markdown(name, result, {p.stem: str(p) for p in pngs})}")
    print(f"results in {out}/{name}.json, .csv{''.join(f', {p}' for p in pngs)} ({result['seconds']:.0f} s)")
    if args.update_docs:
        docs = getattr(mod, "DOCS", report.DOCS)
        stamp = report.stamp(result["machine"], result["command"])
        report.update_docs_section(docs, name, markdown(name, result, report.copy_images(pngs), stamp), mod.TITLE)
        print(f"updated {docs}")
    rows = result.get("rows")
    return 1 if rows and not any(r.get("ok", True) for r in rows) else 0


# ---------------------------------------------------------------- the summary


ISSUE = "issue 17"
# what --targets runs: T5 on kernel_bandwidth's 1-thread CPU-time clock (steadier than wall time on a busy machine)
TARGET_ARGS = {"kernel_bandwidth": ["--sizes", str(16 << 20), "--threads", "1", "--clock", "cpu"],
               "peers": ["--plan", "targets"]}
T_COMMANDS = [  # the commands of the T table's measurements: (command, what it gives)
    ("python scripts/bench/peers.py --plan targets", "T1-T4, T6: the rows above, issue 17's model, 8 steps"),
    (f"python scripts/bench/kernel_bandwidth.py {' '.join(TARGET_ARGS['kernel_bandwidth'])}", "T5"),
    ("python scripts/bench/suite.py --targets --out DIR", "both, and this table (other results in DIR kept)")]
T_KEYS = ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16", "zeropp-c32", "zero3-bf16-c32", "ddp",
          "fsdp2-fp32", "deepspeed-fp32", "zero3-fp32", "zeropp-flat", "zero3-flat", "zero3-keep", "zeropp-keep",
          "zeropp-nostep", "zeropp-delta"]  # peers rows of the T table
FAMILIES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}  # a peers key's first part -> its name


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
    """Issue 17's T1-T6, each from the rows it divides (value None when one is missing). T1-T4 and T6 come from
    peers (issue 17's model, ZeRO++ and its peers side by side in one run), T5 from kernel_bandwidth; the lines
    without a goal are the comparisons behind them: node-aware collectives off (the before of T4 / T6), fp32
    compute, what each overlap option bought, and the ablation's 10.56M model."""
    out, peers, ablation = [], results.get("peers", {}), results.get("ablation", {})
    slow = peers.get("plan", {}).get("rate", "100mbit")
    peer_rows = [r for r in peers.get("rows", []) if r.get("ok")]
    ablation_rows = [dict(r, key={"zero3": "zero3-bf16"}.get(r["key"], r["key"])) for r in ablation.get("rows", [])
                     if r.get("ok") and r.get("micro_batch") == 4]

    def pick(key: str, setting: str = slow, ablated: bool = False) -> tuple[dict | None, str]:
        """(the row of `key` at `setting`, or None; its name for "not measured")."""
        rows = ablation_rows if ablated else peer_rows
        return (next((r for r in rows if r["key"] == key and r["setting"] == setting), None),
                f"{'ablation ' * ablated}{key} @ {setting}")

    def steps(a, b):
        return a["step_ms"] / b["step_ms"]

    def per_bf16_model(mb: float):  # physical bytes per node and step / the model's bytes in bf16
        return lambda r: r["phys_tx_mb_node"] / mb if r.get("phys_tx_mb_node") and mb else None

    def add(tid, what, goal, test, inputs, value=steps, before=None, shown="step"):
        rows = [r for r, _ in inputs]
        v = None if None in rows else value(*rows)
        out.append({"id": tid, "what": what, "goal": goal, "before": before, "value": v,
                    "met": None if v is None or test is None else bool(test(v)),
                    "from": "; ".join(_row_text(r, shown) if r else f"{name}: not measured" for r, name in inputs)})

    def where(setting: str) -> str:
        return "unshaped" if setting == "loopback" else setting

    def at_least(goal: float):
        return lambda v: v >= goal

    add("T1", f"ZeRO++ step at {slow} / the same job unshaped (bf16 compute)", "<= 1.3", lambda v: v <= 1.3,
        [pick("zeropp"), pick("zeropp", "loopback")], before=2.29)
    if pick("zeropp-delta")[0]:  # ours beyond the paper: the T1/T2/T4 ratios of ZeRO++ with qwZ int4 deltas
        add("T1 (deltas)", "the same, ZeRO++ with qwZ int4 deltas", "<= 1.3", lambda v: v <= 1.3,
            [pick("zeropp-delta"), pick("zeropp-delta", "loopback")])
    for tid, dtype, zkey, keys, before in (("T2", "bf16", "zeropp", ("ddp-bf16", "fsdp2-bf16", "deepspeed-bf16"), 3.03),
                                           ("T2 (deltas)", "bf16", "zeropp-delta",
                                            ("ddp-bf16", "fsdp2-bf16", "deepspeed-bf16"), None),
                                           ("T2 (fp32)", "fp32", "zeropp-c32", ("ddp", "fsdp2-fp32", "deepspeed-fp32"),
                                            None)):
        if tid != "T2" and not pick(zkey)[0]:
            continue
        measured = [r for r in (pick(k)[0] for k in keys) if r]
        missing = [FAMILIES[k.split("-")[0]] for k in keys if not pick(k)[0]]
        partly = bool(missing and measured)  # the fastest of some of them: shown, no verdict
        add(tid, f"fastest of DDP, FSDP2, DeepSpeed ZeRO-3 / ZeRO++{' with qwZ int4 deltas' * (zkey == 'zeropp-delta')}"
            f", step at {slow}, {dtype} compute"
            + (f" (not measured: {', '.join(missing)})" if partly else ""), ">= 4", None if partly else at_least(4),
            [(min(measured, key=lambda r: r["step_ms"], default=None), f"fastest of {', '.join(keys)} @ {slow}"),
             pick(zkey)], before=before)
    for setting, before in ((slow, 1.13), ("loopback", 1.14)):
        add("T3", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, bf16 wire + bf16 compute, {where(setting)}", ">= 1.25",
            at_least(1.25), [pick("deepspeed-bf16", setting), pick("zero3-bf16", setting)], before=before)
        if pick("zero3-keep", setting)[0]:  # both keep a model this small gathered from forward to backward
            add("T3 (kept)", "the same, ours also kept gathered (DeepSpeed's stage3_max_reuse_distance), "
                f"{where(setting)}", ">= 1.25", at_least(1.25),
                [pick("deepspeed-bf16", setting), pick("zero3-keep", setting)])
    for setting in (slow, "loopback"):
        if pick("deepspeed-fp32", setting)[0] and pick("zero3-fp32", setting)[0]:
            add("T3 (fp32)", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, fp32 wire + fp32 compute, {where(setting)}",
                ">= 1.25", at_least(1.25), [pick("deepspeed-fp32", setting), pick("zero3-fp32", setting)])
    bf16_mb = (peers.get("model") or {}).get("params", 0) * 2 / 1e6
    for key, tid, goal, before, how in (("zeropp", "T4", "<= 0.40", 0.53, ""),
                                        ("zeropp-delta", "T4 (deltas)", "<= 0.40", None, ", with qwZ int4 deltas"),
                                        ("zeropp-flat", "T4 before", "–", None, ", node-aware collectives off")):
        if key != "zeropp" and not pick(key)[0]:
            continue
        add(tid, "ZeRO++ physical cross-node bytes per node per step / model size in bf16"
            + (f" ({bf16_mb:.2f} MB)" if bf16_mb else "") + how, goal, (lambda v: v <= 0.40) if goal != "–" else None,
            [pick(key)], per_bf16_model(bf16_mb), before, "bytes")
    for op, goal, before in (("quantize", 0.6, 0.41), ("dequantize", 0.85, 0.65)):
        ratio, text = _kernel_ratio(results, op)
        out.append({"id": "T5", "what": f"int8 {op} throughput / copy bandwidth, 1 thread, 16M elements",
                    "goal": f">= {goal}", "before": before, "value": ratio, "from": text,
                    "met": None if ratio is None else ratio >= goal})
    add("T6", f"our ZeRO-3 / ZeRO++, step at {slow} (bf16 compute; paper 2.16x)", "report", None,
        [pick("zero3-bf16"), pick("zeropp")], before=2.69)
    for tid, what, z3, zpp in (("T6 before", "node-aware collectives off", "zero3-flat", "zeropp-flat"),
                               ("T6 (fp32)", "fp32 compute", "zero3-bf16-c32", "zeropp-c32")):
        if pick(z3)[0] or pick(zpp)[0]:
            add(tid, f"the same, {what}", "–", None, [pick(z3), pick(zpp)])
    # what each overlap option bought: the step without it / with it
    for key, base, what in (("zeropp-keep", "zeropp", "ZeRO++ default / kept gathered for the backward"),
                            ("zero3-keep", "zero3-bf16", "our ZeRO-3 default / kept gathered for the backward"),
                            ("zeropp", "zeropp-nostep", "ZeRO++ first gathers at the forward / at the optimizer step")):
        for setting in (slow, "loopback"):
            if pick(key, setting)[0] and pick(base, setting)[0]:
                add("overlap", f"{what}, step, {where(setting)}", "–", None,
                    [pick(base, setting), pick(key, setting)])
    if ablation_rows:
        params = (ablation.get("model") or {}).get("params", 0)
        add("T4 (ablation)", f"T4 on the ablation's {params / 1e6:.2f}M model ({params * 2 / 1e6:.2f} MB in bf16)",
            "<= 0.40", lambda v: v <= 0.40, [pick("zeropp", ablated=True)], per_bf16_model(params * 2 / 1e6),
            shown="bytes")
        add("T6 (ablation)", f"T6 on the ablation's {params / 1e6:.2f}M model", "report", None,
            [pick("zero3-bf16", ablated=True), pick("zeropp", ablated=True)])
    return out


def _verdict(met: bool | None) -> str:
    return "–" if met is None else ("yes" if met else "**no**")


def targets_markdown(items: list[dict]) -> list[str]:
    return report.md_table(
        [dict(it, value="not measured" if it["value"] is None else f"{it['value']:.3f}", met=_verdict(it["met"]))
         for it in items],
        [("id", "id", "{}"), ("what", "ratio", "{}"), ("from", "from (rows, compute dtype)", "{}"),
         ("before", "before", "{:.2f}"), ("goal", "goal", "{}"), ("value", "measured", "{}"), ("met", "met", "{}")],
        "lllrrrc")


def _find(rows, **match) -> dict:
    return next((r for r in rows if r.get("ok") and all(r.get(k) == v for k, v in match.items())), {})


def summary(results: dict) -> list[dict]:
    """The earlier issue's target ratios, as the sections below compute them (None when not measured)."""
    out = []

    def target(what, target, value, ok, percent=False):
        out.append({"what": what, "target": target, "value": value, "percent": percent,
                    "met": None if value is None or ok is None else bool(ok(value))})

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
    for what, key, theirs in (("generation tokens/s", "generation", 2.25), ("PPO step time", "step", 1.26)):
        # DeepSpeed's ZeRO++ blog figure is a reference (GPUs, far larger models), not a target: no verdict
        target(f"RLHF: ZeRO++ / ZeRO-3 speedup of the {what}, {rlhf.get('plan', {}).get('rate', '100mbit')}",
               f"DeepSpeed (GPUs): {theirs}x", (rlhf.get("ratios") or {}).get(key), None)
    return out


def summary_markdown(items: list[dict]) -> list[str]:
    return report.md_table(
        [dict(it, value="not measured" if it["value"] is None else
              (f"{100 * it['value']:+.2f}%" if it.get("percent") else f"{it['value']:.3f}"), met=_verdict(it["met"]))
         for it in items],
        [("what", "ratio", "{}"), ("target", "target", "{}"), ("value", "measured", "{}"), ("met", "met", "{}")],
        "lrrc")


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
    lines += ["Measured: " + "; ".join(when) + ".", ""] if when else []
    lines += [
        *targets_markdown(t_items), "",
        f"Ratios are of step times measured side by side in one run (peers, section 2: {_model_words(peers)}, "
        f"{peers.get('plan', {}).get('micro_batch', 4)}x128 tokens per rank, step time = median of the steps after "
        "the warm-up); \"before\" = the issue's figures (yesterday's runtime: flat gloo collectives; the "
        "bf16 figures with bf16 autocast). T4 divides the bytes each node's link sent per step (veth counters) by "
        "the model's parameters x 2 bytes. T5 is copy_'s time / the kernel's at 1 thread (section 5; the issue's "
        "before was taken on the wall clock, [performance.md](performance.md) has a before/after pair on one "
        "clock). Lines without a goal are the comparisons behind the targets: node-aware collectives off "
        "(`--zero_optimization.node_aware_collectives false`, the before of T4 and T6), fp32 compute, and the "
        "ablation's model. On a busy machine the step times are noisy (compare the load column) and the ratios "
        "that divide a wire-bound step by a compute-bound one (T1, T2, T6) are pulled towards 1: the compute grows "
        "with the load, the wire time does not. What each optimisation bought and what limits the rest: "
        "[performance.md](performance.md). Targets are measured, not tuned for: a **no** is the honest result on "
        "this machine.", ""]
    if rows:
        table = [{"label": r["label"], "compute": r.get("compute"), "setting": r["setting"],
                  "step": report.fmt(r.get("step_ms"), "{:.0f}") if r.get("ok") else "failed",
                  "mb": r.get("phys_tx_mb_node"), "load": r.get("load_start"), "script": r.get("script", "?"),
                  "args": " ".join(r.get("args") or []) or "–"} for r in rows]
        lines += [f"The rows (each node runs `torchrun ... SCRIPT <common> <its arguments>`, common = "
                  f"`{peers.get('common_args', '?')}`):", "",
                  *report.md_table(table, [
                      ("label", "runtime", "{}"), ("compute", "compute", "{}"), ("setting", "link", "{}"),
                      ("step", "step ms", "{}"), ("mb", "physical MB/node/step", "{:.2f}"),
                      ("load", "load at its start", "{:.1f}"), ("script", "script", "`{}`"),
                      ("args", "its arguments", "`{}`")], "lllrrrll"), ""]
    width = max(len(c) for c, _ in T_COMMANDS) + 2
    lines += ["Commands:", "", "```bash", *[f"{c:<{width}}# {why}" for c, why in T_COMMANDS], "```", "",
              "### Earlier targets", "",
              "From the same results (\"not measured\": that benchmark's result is not in this run's directory; a "
              "section below may hold an older run's figure).", "", *summary_markdown(items), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the suite


def write_docs(results: dict, images: dict[str, dict], info: dict, command: str, quick: bool, seconds: float,
               items: list[dict], t_items: list[dict]) -> None:
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
        report.section("summary", summary_section(results, items, t_items))])
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
