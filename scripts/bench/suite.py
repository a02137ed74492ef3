"""The benchmark suite that reproduces the ZeRO++ paper's tables on one machine, and the one CLI of
every benchmark.

    python scripts/bench/suite.py --quick                  # reduced set, < 5 minutes on 2 cores
    python scripts/bench/suite.py                          # everything, < 30 minutes on 2 cores
    python scripts/bench/suite.py --out runs/bench/full --only ablation peers   # refreshes those sections only
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
    p.add_argument("--out", type=Path, help=f"results directory (default runs/bench/{name}-<time>)")
    p.add_argument("--update-docs", action="store_true", help="also refresh this benchmark's docs section")
    p.add_argument("--render", type=Path, metavar="RESULT_JSON",
                   help=f"run nothing: the plots and (with --update-docs) the docs section from a saved {name}.json")
    return p


def execute(name: str, args, out: Path, progress=print, **extra) -> tuple[dict, list[Path]]:
    """Run one benchmark; write its results and plots (a missing matplotlib is noted, not fatal)."""
    start = time.monotonic()
    result = {"benchmark": name, **extra, **module(name).run(args, progress=progress)}
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
        args.out = out = args.out or ROOT / "runs" / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
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


def summary(results: dict) -> list[dict]:
    """The issue's target ratios, as the sections below compute them (None when not measured)."""
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


def write_docs(results: dict, images: dict[str, dict], info: dict, command: str, quick: bool, seconds: float,
               items: list[dict]) -> None:
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
        "suite run; absolute numbers are not a GPU cluster's.", "",
        "Commands (every benchmark also runs alone, with the same options; `--update-docs` refreshes only its "
        "section):", "",
        "```bash",
        "pip install -r requirements-bench.txt               # DeepSpeed (CPU build) and matplotlib",
        "python scripts/bench/suite.py [--quick] [--out DIR] [--only NAME ...] [--no-docs] [--render SUITE_JSON]",
        "python scripts/bench/comm_volume.py [--physical]    # Table 4, one step, 4 local ranks as 2x2",
        "python scripts/bench/kernel_bandwidth.py [--quick]",
        "python scripts/bench/ablation.py [--quick]          # needs root + iproute2",
        "python scripts/bench/peers.py [--quick]             # needs root + iproute2",
        "python scripts/bench/rlhf.py [--quick]              # PPO, ZeRO++ vs ZeRO-3; needs root + iproute2",
        "python scripts/bench/convergence.py [--quick]       # needs ../shared/data/tinyshakespeare.txt",
        "```", "",
        "## Summary: the issue's targets", "",
        *summary_markdown(items), "",
        "Targets are measured, not tuned for: a **no** is the honest result on this machine. "
        "Each ratio's inputs are in the sections below.", ""]) + "\n"
    for name in DOC_ORDER:
        if name in results:
            text += "\n" + report.section(name, markdown(name, results[name], images.get(name, {})))
    report.DOCS.write_text(text)


def render(path: Path) -> int:
    """Plots and docs/benchmarks.md again from a suite.json (e.g. after editing the report code)."""
    saved = json.loads(path.read_text())
    results, out = saved["results"], path.parent
    images = {name: report.copy_images(plots(name, result, out)) for name, result in results.items()}
    items = summary(results)
    write_docs(results, images, saved["machine"], saved["command"], saved["quick"], saved["seconds"], items)
    report.write_json(path, {**saved, "summary": items})
    print("\n".join(summary_markdown(items)))
    print(f"wrote {report.DOCS} and {report.DOCS_IMAGES}/ from {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced set, under 5 minutes on 2 cores")
    p.add_argument("--out", type=Path, help="results directory (default runs/bench/suite-<time>)")
    p.add_argument("--only", nargs="+", choices=SUITE, help="run only these benchmarks")
    p.add_argument("--skip", nargs="+", choices=SUITE, default=[], help="leave these out")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--render", type=Path, metavar="SUITE_JSON",
                   help="run nothing: redraw the plots and rewrite docs/benchmarks.md from a saved suite.json")
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    out = args.out or ROOT / "runs" / "bench" / f"suite-{'quick-' * args.quick}{time.strftime('%Y%m%d-%H%M%S')}"
    names = [n for n in (args.only or SUITE) if n not in args.skip]
    info = report.machine_info()
    command = shlex.join(["python", "scripts/bench/suite.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"suite ({'quick' if args.quick else 'full'}): {', '.join(names)} -> {out}")
    print(f"machine: {report.machine_line(info)}", flush=True)
    start = time.monotonic()
    results, images = {}, {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ... (elapsed {time.monotonic() - start:.0f} s)", flush=True)
        bargs = parser(name).parse_args((["--quick"] if args.quick else []) + ["--out", str(out)])
        bargs.reuse = results.get("ablation")  # peers: our ZeRO-3 / ZeRO++ runs of the same job, not run twice
        try:
            results[name], pngs = execute(name, bargs, out, progress=lambda s: print(s, flush=True))
        except Exception as e:  # one broken benchmark must not lose the others' results
            traceback.print_exc()
            results[name], pngs = {"benchmark": name, "skipped": f"crashed: {type(e).__name__}: {e}", "rows": []}, []
        images[name] = {p.stem: str(p) for p in pngs} if args.no_docs else report.copy_images(pngs)
        print(f"[{i}/{len(names)}] {name} done in {results[name].get('seconds', 0):.0f} s", flush=True)
    seconds = time.monotonic() - start
    items = summary(results)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    report.write_json(out / "suite.json", {
        "machine": info, "command": command, "quick": args.quick, "seconds": seconds, "summary": items,
        "timings": {n: r.get("seconds") for n, r in results.items()}, "results": results})
    print("\nsummary:\n" + "\n".join(summary_markdown(items)))
    if not args.no_docs and names == SUITE:
        write_docs(results, images, info, command, args.quick, seconds, items)
        print(f"wrote {report.DOCS} and {report.DOCS_IMAGES}/")
    elif not args.no_docs:  # a partial run refreshes its own sections and leaves the rest (and the summary) be
        for name in names:
            report.update_docs_section(report.DOCS, name, markdown(name, results[name], images[name],
                                                                   report.stamp(info, command)))
        print(f"updated the {', '.join(names)} section(s) of {report.DOCS}")
    print(f"suite done in {seconds:.0f} s ({seconds / 60:.1f} min); results in {out}")
    return 0


if __name__ == "__main__":
    from scripts.bench import suite  # this file as the package's module: the one whose Quick the benchmarks use

    sys.exit(suite.main())
