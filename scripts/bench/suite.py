"""The benchmark suite that reproduces the ZeRO++ paper's tables on one machine, and the one CLI of
every benchmark.

    python scripts/bench/suite.py --quick                  # reduced set: 12 minutes at load 15, fewer when quiet
    python scripts/bench/suite.py                          # everything, ~45 minutes on 2 quiet cores (estimate)
    python scripts/bench/suite.py --targets --out runs/bench/t17    # only issue 17's T1-T6 rows, 17 min at load 15
    python scripts/bench/suite.py --out runs/bench/full --only ablation peers   # refreshes those sections and
                                                                  # the summary (the other results in DIR kept)
    python scripts/bench/suite.py --quick --no-docs        # leave docs/benchmarks.md alone
    python scripts/bench/suite.py --render DIR/suite.json                       # docs again, nothing run
    python scripts/bench/NAME.py [--quick] [--out DIR] [--update-docs] [its options; --help]   # one benchmark

A benchmark is a module of this package with TITLE (its docs heading), add_args(parser) (a default that
differs under --quick is a Quick(full, quick)), run(args, progress) -> result (`rows` its table, `skipped`
why it could not run), markdown(result), and optionally plots(result, out_dir), DOCS (its page, when not
docs/benchmarks.md), OUT (its results directory) and worker(argv) (what `NAME.py --worker ...` runs on
each rank). Results go to <out>/<name>.json, .csv and plots/, the suite's to <out>/suite.json. A docs page
holds hand-written text and, between `<!-- section:NAME -->` markers, what a benchmark generates (its tables,
measured setup, verdicts, plots); the suite (unless --no-docs) rewrites only those sections of
docs/benchmarks.md, and the summary: issue 17's T1-T6 (`targets()`).
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

from scripts.bench import report, runner
from scripts.bench.report import ROOT

SUITE = ["comm_volume", "kernel_bandwidth", "ablation", "peers", "rlhf", "convergence"]  # run order: cheapest first
BENCHMARKS = SUITE + ["memory", "reduce_scatter", "quantized_perplexity", "separate", "tensor_parallel", "diloco",
                      "autoplan", "fewer_bits", "grpo_math"]


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
    """The benchmark's docs section: [stamp,] its body (or why it was skipped), notes, plots."""
    lines = [stamp, ""] if stamp else []
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
    print(f"\n{mod.TITLE}\n\n{markdown(name, result, {p.stem: str(p) for p in pngs})}")
    print(f"results in {out}/{name}.json, .csv{''.join(f', {p}' for p in pngs)} ({result['seconds']:.0f} s)")
    if args.update_docs:
        docs = getattr(mod, "DOCS", report.DOCS)
        stamp = report.stamp(result, report.machine_info())
        report.update_docs_section(docs, name, markdown(name, result, report.copy_images(pngs), stamp), mod.TITLE)
        print(f"updated {docs}")
    rows = result.get("rows")
    return 1 if rows and not any(r.get("ok", True) for r in rows) else 0


# ---------------------------------------------------------------- the summary: issue 17's T1-T6


# what --targets runs: T5 on kernel_bandwidth's 1-thread CPU-time clock (steadier than wall time on a busy machine)
TARGET_ARGS = {"kernel_bandwidth": ["--sizes", str(16 << 20), "--threads", "1", "--clock", "cpu"],
               "peers": ["--plan", "targets"]}
T_KEYS = ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16", "zeropp-c32", "zero3-bf16-c32", "ddp",
          "fsdp2-fp32", "deepspeed-fp32", "zero3-fp32", "zeropp-flat", "zero3-flat", "zero3-keep", "zeropp-keep",
          "zeropp-nostep", "zeropp-delta"]  # peers rows of the T table
SUMMARY_TITLE = "## Summary: issue 17's targets (T1-T6)"
FAMILIES = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}  # a peers key's first part -> its name


def _row_text(r: dict, shown: str = "step") -> str:
    what = (f"{r['phys_tx_mb_node']:.2f} MB/node/step" if shown == "bytes" and r.get("phys_tx_mb_node") is not None
            else f"{r['step_ms']:.0f} ms")
    return f"{r['label']} [{r['compute']} compute] @ {r['setting']}: {what}"


def _met(goal: str, value: float | None) -> bool | None:
    """The verdict of a goal "<= x" / ">= x" (None: no goal, or not measured)."""
    if value is None or goal[:2] not in ("<=", ">="):
        return None
    bound = float(goal[2:])
    return value <= bound if goal.startswith("<=") else value >= bound


def _kernel_ratio(results: dict, op: str, bits: int = 8) -> tuple[float | None, str]:
    """copy_'s time / `op`'s at 1 thread (16M elements, else the largest size measured), from kernel_bandwidth."""
    bench = results.get("kernel_bandwidth", {})
    rows = [r for r in bench.get("rows", []) if r.get("ok", True) and r["threads"] == 1 and r["version"] == "current"]
    sizes = sorted({r["numel"] for r in rows if r["op"] == op and r["bits"] == bits})
    if not sizes:
        return None, f"kernel_bandwidth: int{bits} {op}, 1 thread: not measured"
    numel = 16 << 20 if 16 << 20 in sizes else sizes[-1]
    r = next(r for r in rows if r["op"] == op and r["bits"] == bits and r["numel"] == numel)
    copy = next(c for c in rows if c["op"] == "copy_" and c["numel"] == numel)
    return copy["seconds"] / r["seconds"], (
        f"kernel_bandwidth: int{bits} {op} {r['seconds'] * 1e3:.2f} ms, copy_ {copy['seconds'] * 1e3:.2f} ms "
        f"({numel / (1 << 20):g}M elements, 1 thread, {bench['clock']} clock"
        + ("" if numel == 16 << 20 else "; not the 16M of the target") + ")")


def targets(results: dict) -> list[dict]:
    """Issue 17's T1-T6, each from the rows it divides (value None when one is missing): T1-T4 and T6 from peers
    (issue 17's model, ZeRO++ and its peers side by side in one run), T5 from kernel_bandwidth. The lines marked
    optional appear when their rows were measured: ZeRO++ with qwZ deltas, fp32 compute, node-aware collectives
    off (the before of T4 / T6), and what each overlap option bought."""
    peers, out = results.get("peers", {}), []
    slow = peers.get("plan", {}).get("rate", "100mbit")
    rows = {(r["key"], r["setting"]): r for r in peers.get("rows", []) if r.get("ok")}
    bf16_mb = (peers.get("model") or {}).get("params", 0) * 2 / 1e6

    def add(tid, what, goal, keys, value=lambda a, b: a["step_ms"] / b["step_ms"], before=None, optional=False,
            shown="step"):
        """keys: the peers keys (or (key, setting)) whose rows `value` divides; `optional`: only if all measured."""
        keys = [(k, slow) if isinstance(k, str) else k for k in keys]
        picked = [rows.get(k) for k in keys]
        if optional and None in picked:
            return
        v = None if None in picked else value(*picked)
        out.append({"id": tid, "what": what, "goal": goal, "before": before, "value": v, "met": _met(goal, v),
                    "from": "; ".join(_row_text(r, shown) if r else f"{k} @ {s}: not measured"
                                      for r, (k, s) in zip(picked, keys))})

    def where(setting: str) -> str:
        return "unshaped" if setting == "loopback" else setting

    def per_bf16_model(r: dict) -> float | None:  # physical bytes per node and step / the model's bytes in bf16
        return r["phys_tx_mb_node"] / bf16_mb if r.get("phys_tx_mb_node") and bf16_mb else None

    add("T1", f"ZeRO++ step at {slow} / the same job unshaped (bf16 compute)", "<= 1.3",
        ["zeropp", ("zeropp", "loopback")], before=2.29)
    add("T1 (deltas)", "the same, ZeRO++ with qwZ int4 deltas", "<= 1.3", ["zeropp-delta", ("zeropp-delta", "loopback")],
        optional=True)
    for tid, dtype, zkey, keys in (("T2", "bf16", "zeropp", ("ddp-bf16", "fsdp2-bf16", "deepspeed-bf16")),
                                   ("T2 (deltas)", "bf16", "zeropp-delta", ("ddp-bf16", "fsdp2-bf16", "deepspeed-bf16")),
                                   ("T2 (fp32)", "fp32", "zeropp-c32", ("ddp", "fsdp2-fp32", "deepspeed-fp32"))):
        measured = [k for k in keys if (k, slow) in rows]
        missing = [FAMILIES[k.split("-")[0]] for k in keys if k not in measured]
        fastest = min(measured, key=lambda k: rows[k, slow]["step_ms"], default=f"fastest of {', '.join(keys)}")
        add(tid, f"fastest of DDP, FSDP2, DeepSpeed ZeRO-3 / ZeRO++{' with qwZ int4 deltas' * (zkey == 'zeropp-delta')}"
            f", step at {slow}, {dtype} compute" + (f" (not measured: {', '.join(missing)})" if missing else ""),
            ">= 4", [fastest, zkey], before=3.03 if tid == "T2" else None, optional=tid != "T2")
        if missing and measured and out[-1]["id"] == tid:  # the fastest of some of them: shown, no verdict
            out[-1]["met"] = None
    for setting, before in ((slow, 1.13), ("loopback", 1.14)):
        add("T3", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, bf16 wire + bf16 compute, {where(setting)}", ">= 1.25",
            [("deepspeed-bf16", setting), ("zero3-bf16", setting)], before=before)
        add("T3 (kept)", "the same, ours also kept gathered (DeepSpeed's stage3_max_reuse_distance), "
            f"{where(setting)}", ">= 1.25", [("deepspeed-bf16", setting), ("zero3-keep", setting)], optional=True)
    for setting in (slow, "loopback"):
        add("T3 (fp32)", f"DeepSpeed ZeRO-3 / our ZeRO-3, step, fp32 wire + fp32 compute, {where(setting)}", ">= 1.25",
            [("deepspeed-fp32", setting), ("zero3-fp32", setting)], optional=True)
    for key, tid, goal, before, how in (("zeropp", "T4", "<= 0.40", 0.53, ""),
                                        ("zeropp-delta", "T4 (deltas)", "<= 0.40", None, ", with qwZ int4 deltas"),
                                        ("zeropp-flat", "T4 before", "–", None, ", node-aware collectives off")):
        add(tid, "ZeRO++ physical cross-node bytes per node per step / model size in bf16"
            + (f" ({bf16_mb:.2f} MB)" if bf16_mb else "") + how, goal, [key], per_bf16_model, before,
            optional=key != "zeropp", shown="bytes")
    for op, goal, before in (("quantize", ">= 0.6", 0.41), ("dequantize", ">= 0.85", 0.65)):
        ratio, text = _kernel_ratio(results, op)
        out.append({"id": "T5", "what": f"int8 {op} throughput / copy bandwidth, 1 thread, 16M elements",
                    "goal": goal, "before": before, "value": ratio, "from": text, "met": _met(goal, ratio)})
    add("T6", f"our ZeRO-3 / ZeRO++, step at {slow} (bf16 compute; paper 2.16x)", "report", ["zero3-bf16", "zeropp"],
        before=2.69)
    add("T6 before", "the same, node-aware collectives off", "–", ["zero3-flat", "zeropp-flat"], optional=True)
    add("T6 (fp32)", "the same, fp32 compute", "–", ["zero3-bf16-c32", "zeropp-c32"], optional=True)
    for key, base, what in (("zeropp-keep", "zeropp", "ZeRO++ default / kept gathered for the backward"),
                            ("zero3-keep", "zero3-bf16", "our ZeRO-3 default / kept gathered for the backward"),
                            ("zeropp", "zeropp-nostep", "ZeRO++ first gathers at the forward / at the optimizer step")):
        for setting in (slow, "loopback"):
            add("overlap", f"{what}, step, {where(setting)}", "–", [(base, setting), (key, setting)], optional=True)
    return out


def targets_markdown(items: list[dict]) -> list[str]:
    verdict = {None: "–", True: "yes", False: "**no**"}
    return report.md_table(
        [dict(it, value="not measured" if it["value"] is None else f"{it['value']:.3f}", met=verdict[it["met"]])
         for it in items],
        [("id", "id", "{}"), ("what", "ratio", "{}"), ("from", "from (rows, compute dtype)", "{}"),
         ("before", "before", "{:.2f}"), ("goal", "goal", "{}"), ("value", "measured", "{}"), ("met", "met", "{}")],
        "lllrrrc")


def summary_markdown(results: dict, t_items: list[dict]) -> str:
    """The generated part of the docs' summary: when each benchmark ran, the T table, the peers rows behind it."""
    when = []
    for name, res in results.items():
        loads = [r["load_start"] for r in res.get("rows", []) if r.get("load_start") is not None]
        when.append(f"{name} {res['date']} (load average {res['load_average_start']} at its start"
                    + (f", {min(loads):.1f}-{max(loads):.1f} at its runs' starts" if loads else "") + ")")
    peers = results.get("peers", {})
    model = peers.get("model") or {}
    rows = sorted((r for r in peers.get("rows", []) if r["key"] in T_KEYS),
                  key=lambda r: (r["setting"] == "loopback", T_KEYS.index(r["key"])))
    lines = ["Measured: " + "; ".join(when) + ".", "", *targets_markdown(t_items), ""]
    if rows:
        lines += [f"Model: {runner.model_words(model)}; {peers['plan']['micro_batch']}x{model['seq_len']} tokens per "
                  "rank and step.", ""]
    if rows:
        table = [{**r, "step": report.fmt(r.get("step_ms"), "{:.0f}") if r["ok"] else "failed",
                  "args": " ".join(r["args"]) or "–"} for r in rows]
        lines += [f"The rows (each node runs `torchrun ... SCRIPT <common> <its arguments>`, common = "
                  f"`{peers['common_args']}`):", "",
                  *report.md_table(table, [
                      ("label", "runtime", "{}"), ("compute", "compute", "{}"), ("setting", "link", "{}"),
                      ("step", "step ms", "{}"), ("phys_tx_mb_node", "physical MB/node/step", "{:.2f}"),
                      ("load_start", "load at its start", "{:.1f}"), ("script", "script", "`{}`"),
                      ("args", "its arguments", "`{}`")], "lllrrrll")]
    return "\n".join(lines)


# ---------------------------------------------------------------- the suite


def publish(results: dict, images: dict[str, dict], info: dict, command: str, t_items: list[dict],
            names: list[str]) -> None:
    """docs/benchmarks.md: the sections of `names` (each stamped with its command and date) and the summary;
    the hand-written text around them is left be."""
    for name in names:
        stamp = report.stamp({"command": command, **results[name]}, info)
        report.update_docs_section(report.DOCS, name, markdown(name, results[name], images[name], stamp),
                                   module(name).TITLE)
    report.update_docs_section(report.DOCS, "summary", summary_markdown(results, t_items), SUMMARY_TITLE)


def render(path: Path) -> int:
    """Plots and docs/benchmarks.md again from a suite.json (e.g. after editing the report code)."""
    saved = json.loads(path.read_text())
    results = saved["results"]
    images = {name: report.copy_images(plots(name, result, path.parent)) for name, result in results.items()}
    t_items = targets(results)
    publish(results, images, saved["machine"], saved["command"], t_items, list(results))
    report.write_json(path, {**saved, "targets": t_items})
    print("\n".join(targets_markdown(t_items)))
    print(f"wrote {report.DOCS} and {report.DOCS_IMAGES}/ from {path}")
    return 0


def earlier_results(out: Path, skip: list[str]) -> dict:
    """What an earlier run left in `out` (its suite.json, else the benchmarks' own <name>.json), except `skip`."""
    saved = out / "suite.json"
    results = json.loads(saved.read_text())["results"] if saved.is_file() else {}
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
                   help="run only what issue 17's T1-T6 need (" + "; ".join(
                       f"{n} {' '.join(a)}" for n, a in TARGET_ARGS.items()) + "), keeping the other results in --out")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--render", type=Path, metavar="SUITE_JSON",
                   help="run nothing: redraw the plots and rewrite docs/benchmarks.md from a saved suite.json")
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    out = args.out or ROOT / "runs" / "bench" / f"suite-{'quick-' * args.quick}{time.strftime('%Y%m%d-%H%M%S')}"
    names = [n for n in (list(TARGET_ARGS) if args.targets else args.only or SUITE) if n not in args.skip]
    info = report.machine_info()
    command = shlex.join(["python", "scripts/bench/suite.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"suite ({'quick' if args.quick else 'full'}): {', '.join(names)} -> {out}")
    print(f"machine: {report.machine_line(info)}", flush=True)
    start = time.monotonic()
    results, images = {}, {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ... (elapsed {time.monotonic() - start:.0f} s)", flush=True)
        extra = TARGET_ARGS.get(name, []) if args.targets else []
        bargs = parser(name).parse_args((["--quick"] if args.quick else []) + ["--out", str(out)] + extra)
        bargs.reuse = results.get("ablation")  # peers: our ZeRO-3 / ZeRO++ runs of the same job, not run twice
        try:
            results[name], pngs = execute(name, bargs, out, progress=lambda s: print(s, flush=True),
                                         command=command, machine=info)
        except Exception as e:  # one broken benchmark must not lose the others' results
            traceback.print_exc()
            results[name], pngs = {"benchmark": name, "skipped": f"crashed: {type(e).__name__}: {e}", "rows": [],
                                   "date": time.strftime("%Y-%m-%d %H:%M"), "load_average_start": "?"}, []
        images[name] = {p.stem: str(p) for p in pngs} if args.no_docs else report.copy_images(pngs)
        print(f"[{i}/{len(names)}] {name} done in {results[name].get('seconds', 0):.0f} s", flush=True)
    seconds = time.monotonic() - start
    kept = earlier_results(out, names)  # a partial run keeps the others' results
    merged = {**kept, **results}
    t_items = targets(merged)
    report.write_json(out / "suite.json", {
        "machine": info, "command": command, "quick": args.quick, "seconds": seconds, "targets": t_items,
        "timings": {n: r.get("seconds") for n, r in results.items()}, "results": merged,
        **({"kept_from_earlier_runs": sorted(kept)} if kept else {})})
    if kept:
        print(f"\nkept from earlier runs in {out}: {', '.join(sorted(kept))}")
    print("\nissue 17's targets:\n" + "\n".join(targets_markdown(t_items)))
    if not args.no_docs:
        publish(merged, images, info, command, t_items, names)
        print(f"wrote {report.DOCS} ({', '.join(names)} and the summary) and {report.DOCS_IMAGES}/")
    print(f"suite done in {seconds:.0f} s ({seconds / 60:.1f} min); results in {out}")
    return 0


if __name__ == "__main__":
    from scripts.bench import suite  # this file as the package's module: the one whose Quick the benchmarks use

    sys.exit(suite.main())
