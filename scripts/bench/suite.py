"""The benchmark suite that reproduces the ZeRO++ paper's tables on one machine (issue 5).

    python scripts/bench/suite.py --quick                  # reduced set, < 5 minutes on 2 cores
    python scripts/bench/suite.py                          # everything, < 30 minutes on 2 cores
    python scripts/bench/suite.py --out runs/bench/full --only ablation peers   # refreshes those sections only
    python scripts/bench/suite.py --quick --no-docs        # leave docs/benchmarks.md alone

Runs, in this order (cheapest first; each is also a script of its own, `--help` for each):

  comm_volume  paper Table 4: per-collective ledger bytes (and, on the emulated cluster,
               physical bytes) of one step, ZeRO-3 vs ZeRO++              scripts/bench/comm_volume.py
  kernels      quantization kernels vs memory-copy bandwidth              scripts/bench/kernels.py
  ablation     paper Fig. 10 / Table 1: ZeRO-3, +qwZ, +hpZ, +qgZ, ZeRO++ on 2 emulated nodes x 2
               ranks at 2 link rates and 2 tokens-per-rank settings      scripts/bench/ablation.py
  peers        DDP, PyTorch FSDP2, DeepSpeed ZeRO-3 (+hpZ) on the same cluster, model, data and
               optimizer                                                  scripts/bench/peers.py
  convergence  paper Table 5 / Fig. 9: validation loss of ZeRO-3 vs ZeRO++ with 8/6/4-bit qwZ
               on Tiny Shakespeare                                        scripts/bench/convergence.py

Writes `<out>/<name>.json` and `<name>.csv` per benchmark, `<out>/plots/*.png`, `<out>/suite.json`
(everything plus the summary), and — unless `--no-docs` — `docs/benchmarks.md` with the plots
copied to `docs/benchmarks/`. The cluster parts need root and iproute2; without them they say
so and the rest still runs. Without DeepSpeed the peers table says "not installed".

This module also holds the report helpers the benchmark scripts share (tables, plots, the docs).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_IMAGES = ROOT / "docs" / "benchmarks"
BENCHMARKS = ["comm_volume", "kernels", "ablation", "peers", "convergence"]    # run order: cheapest first
DOC_ORDER = ["ablation", "peers", "comm_volume", "convergence", "kernels"]     # sections 1-5 of the docs
TITLE = "# Benchmarks: the ZeRO++ paper's tables on an emulated cluster"

# ---------------------------------------------------------------- report helpers (shared)


def pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError (caught by make_plots) when not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_fig(fig, out_dir: Path, name: str) -> Path:
    path = Path(out_dir) / "plots" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def make_plots(plots, result: dict, out_dir: Path, progress=print) -> list[Path]:
    """Run a benchmark's plots(); without matplotlib say so and go on (the tables are written anyway)."""
    try:
        return plots(result, out_dir)
    except ImportError as e:
        result.setdefault("notes", []).append(f"no plots: {e} (pip install -r requirements-bench.txt)")
        progress(f"  no plots: {e} (pip install -r requirements-bench.txt)")
        return []


def rate_bits(rate: str) -> float:
    from scripts.bench.cluster import parse_rate

    return parse_rate(rate)


def fmt(value, spec: str) -> str:
    if value is None or value == "":
        return "–"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown table lines; `columns` = (key, header, format spec); missing values show '–'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(columns))) + " |"]
    for r in rows:
        if not r.get("ok", True):
            cells = [fmt(r.get(k), f) for k, _, f in columns[:2]]
            lines.append("| " + " | ".join(cells + [f"failed: {str(r.get('error', '?'))[:160]}"]
                                           + [""] * (len(columns) - 3)) + " |")
            continue
        lines.append("| " + " | ".join(fmt(r.get(k), f) for k, _, f in columns) + " |")
    return lines


def write_results(result: dict, out_dir: Path, name: str) -> list[Path]:
    """<name>.json (everything) and <name>.csv (the rows, scalar columns only)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json"]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    rows = result.get("rows") or []
    if rows:
        keys = []
        for r in rows:
            keys += [k for k, v in r.items() if k not in keys and not isinstance(v, (list, dict))]
        path = out_dir / f"{name}.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        paths.append(path)
    return paths


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "kernel": platform.release(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    try:
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    except Exception:
        info["deepspeed"] = None
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def machine_line(info: dict) -> str:
    ds = info.get("deepspeed") or "not installed"
    return (f"{info['cpu']}, {info['cores']} cores, {info.get('memory_gib', '?')} GiB, Linux {info['kernel']}, "
            f"Python {info['python']}, torch {info['torch']}, DeepSpeed {ds}; load average at the start "
            f"{info['load_average'][0]}")


def _section(name: str, body: str) -> str:
    return f"<!-- section:{name} -->\n{body.rstrip()}\n<!-- /section:{name} -->\n"


def copy_images(pngs: list[Path]) -> dict[str, str]:
    """Copy plots into docs/benchmarks/; name -> path relative to docs/ (for the markdown)."""
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    out = {}
    for p in pngs:
        shutil.copy2(p, DOCS_IMAGES / p.name)
        out[p.stem] = f"benchmarks/{p.name}"
    return out


def update_docs_section(name: str, body: str, info: dict, command: str) -> None:
    """Replace (or append) one benchmark's section of docs/benchmarks.md, noting when and how."""
    stamp = (f"_{_dt.date.today().isoformat()}, {machine_line(info)}. Command: `{command}`._\n\n")
    section = _section(name, stamp + body)
    text = DOCS.read_text() if DOCS.is_file() else f"{TITLE}\n\n"
    pattern = re.compile(rf"<!-- section:{name} -->.*?<!-- /section:{name} -->\n?", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    DOCS.write_text(text)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the reduced set the suite's --quick runs")
    p.add_argument("--out", type=Path, help="results directory (default runs/bench/<name>-<time>)")
    p.add_argument("--update-docs", action="store_true",
                   help="also refresh this benchmark's section of docs/benchmarks.md (plots to docs/benchmarks/)")


def run_standalone(name: str, run, plots, markdown, args) -> int:
    """What every benchmark script's main() does: run, write JSON/CSV/PNG, print, maybe the docs."""
    out = args.out or ROOT / "runs" / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    info = machine_info()
    start = time.monotonic()
    result = run(args, progress=lambda s: print(s, flush=True))
    result["seconds"] = time.monotonic() - start
    result["machine"] = info
    pngs = make_plots(plots, result, out)
    files = write_results(result, out, name)
    print()
    print(markdown(result, {p.stem: str(p) for p in pngs}))
    print(f"wrote {', '.join(str(f) for f in files + pngs)} ({result['seconds']:.0f} s)")
    if args.update_docs:
        update_docs_section(name, markdown(result, copy_images(pngs)), info, shlex.join(["python", *sys.argv]))
        print(f"updated {DOCS}")
    rows = result.get("rows")
    return 1 if rows and not any(r.get("ok", True) for r in rows) else 0


# ---------------------------------------------------------------- the summary


def _find(rows, **match):
    return next((r for r in rows if r.get("ok") and all(r.get(k) == v for k, v in match.items())), None)


def summary(results: dict) -> list[dict]:
    """The issue's target ratios, each with what was measured (None when not measured)."""
    out = []
    abl = results.get("ablation", {})
    rows = abl.get("rows", [])
    ref_rate, ref_mb = "100mbit", 4
    z3, zpp = _find(rows, key="zero3", rate=ref_rate, micro_batch=ref_mb), _find(rows, key="zeropp", rate=ref_rate,
                                                                               micro_batch=ref_mb)
    out.append({"what": "ZeRO++ / our ZeRO-3 throughput, 100 Mbit/s, 4x128 tokens/rank", "target": ">= 3",
                "value": zpp["tokens_per_s"] / z3["tokens_per_s"] if z3 and zpp else None, "ok": lambda v: v >= 3})
    out.append({"what": "physical cross-node bytes per step, ZeRO++ / ZeRO-3 (node link, tx)", "target": "<= 0.28",
                "value": zpp["phys_tx_mb_node"] / z3["phys_tx_mb_node"]
                if z3 and zpp and z3.get("phys_tx_mb_node") and zpp.get("phys_tx_mb_node") else None,
                "ok": lambda v: v <= 0.28})
    cv = results.get("comm_volume", {})
    out.append({"what": "ledger cross-node bytes of one step, ZeRO++ / ZeRO-3 (comm_volume, scales included)",
                "target": "<= 0.28", "value": cv.get("total_ratio"), "ok": lambda v: v <= 0.28})
    peers = results.get("peers", {})
    prow = peers.get("rows", [])
    slow = peers.get("plan", {}).get("rate", ref_rate)
    ours = _find(prow, key="zeropp", setting_key=slow)
    rivals = [r for r in prow if r.get("ok") and r.get("setting_key") == slow and r.get("family") in
              ("ddp", "fsdp2", "deepspeed")]
    best = max(rivals, key=lambda r: r["tokens_per_s"], default=None)
    out.append({"what": f"ZeRO++ / fastest of DDP, FSDP2, DeepSpeed ZeRO-3 at {slow}"
                        + (f" (fastest: {best['label']})" if best else ""),
                "target": ">= 3", "value": ours["tokens_per_s"] / best["tokens_per_s"] if ours and best else None,
                "ok": lambda v: v >= 3})
    for setting in (slow, "loopback"):
        for dtype in ("fp32", "bf16"):
            a = _find(prow, key=f"zero3-{dtype}", setting_key=setting)
            b = _find(prow, key=f"deepspeed-{dtype}", setting_key=setting)
            where = "unshaped loopback" if setting == "loopback" else setting
            note = " (DeepSpeed bf16 also computes in bf16)" if dtype == "bf16" else ""
            out.append({"what": f"our ZeRO-3 / DeepSpeed ZeRO-3 throughput, {dtype} wire, {where}{note}",
                        "target": ">= 1.2", "value": a["tokens_per_s"] / b["tokens_per_s"] if a and b else None,
                        "ok": lambda v: v >= 1.2})
    conv = results.get("convergence", {})
    steps = conv.get("plan", {}).get("steps")
    for r in conv.get("rows", []):
        if r.get("key") == "zeropp-w8" and r.get("ok"):
            out.append({"what": f"convergence: final validation loss after {steps} steps, ZeRO++ (8-bit qwZ) vs "
                                "ZeRO-3, relative",
                        "target": "within 1%", "value": r.get("rel_diff"), "ok": lambda v: abs(v) <= 0.01,
                        "percent": True})
    for item in out:
        v = item["value"]
        item["met"] = None if v is None else bool(item.pop("ok")(v))
        item.pop("ok", None)
    return out


def summary_markdown(items: list[dict]) -> list[str]:
    lines = ["| ratio | target | measured | met |", "| --- | ---: | ---: | :---: |"]
    for it in items:
        v = it["value"]
        shown = "not measured" if v is None else (f"{100 * v:+.2f}%" if it.get("percent") else f"{v:.3f}")
        met = "–" if it["met"] is None else ("yes" if it["met"] else "**no**")
        lines.append(f"| {it['what']} | {it['target']} | {shown} | {met} |")
    return lines


# ---------------------------------------------------------------- the orchestrator


def module(name: str):
    return importlib.import_module(f"scripts.bench.{name}")


def bench_args(name: str, quick: bool, out: Path):
    p = argparse.ArgumentParser()
    mod = module(name)
    mod.add_args(p)
    add_common_args(p)
    argv = (["--quick"] if quick else []) + ["--out", str(out)]
    return p.parse_args(argv)


def write_docs(results: dict, images: dict[str, dict], info: dict, command: str, quick: bool, seconds: float,
               items: list[dict]) -> None:
    mode = ("`--quick`: a reduced set (fewer configurations, rates and steps) to check that everything "
            "works; run the suite without `--quick` for the full tables") if quick else "full"
    head = [TITLE, "",
            f"Generated by `{command}` on {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} in {seconds / 60:.1f} "
            f"minutes ({mode}).", "",
            f"Machine: {machine_line(info)}.", "",
            "Every figure comes from one machine: the 'nodes' are network namespaces whose links are shaped with "
            "tbf ([cluster.md](cluster.md)), and all ranks of all nodes share its CPU cores, so compute does not "
            "scale with nodes and a busy machine slows every run. Compare configurations measured in the same "
            "suite run; absolute numbers are not a GPU cluster's.", "",
            "Commands (each benchmark also runs alone; `--update-docs` refreshes only its section):", "",
            "```bash",
            "pip install -r requirements-bench.txt               # DeepSpeed (CPU build) for the peers",
            "python scripts/bench/suite.py [--quick] [--out DIR] [--only NAME ...] [--no-docs]",
            "python scripts/bench/comm_volume.py [--physical]    # Table 4, one step, 4 local ranks as 2x2",
            "python scripts/bench/kernels.py --json out.json",
            "python scripts/bench/ablation.py [--quick]          # needs root + iproute2",
            "python scripts/bench/peers.py [--quick]             # needs root + iproute2",
            "python scripts/bench/convergence.py [--quick]       # needs ../shared/data/tinyshakespeare.txt",
            "```", "",
            "## Summary: the issue's targets", ""]
    head += summary_markdown(items)
    head += ["", "Targets are measured, not tuned for: a **no** is the honest result on this machine. "
             "Each ratio's inputs are in the sections below.", ""]
    text = "\n".join(head) + "\n"
    for name in DOC_ORDER:
        if name in results:
            text += "\n" + _section(name, module(name).markdown(results[name], images.get(name, {})))
    DOCS.write_text(text)


def render(path: Path) -> int:
    """Plots and docs/benchmarks.md again from a suite.json (e.g. after editing the report code)."""
    saved = json.loads(path.read_text())
    results, out = saved["results"], path.parent
    images = {name: copy_images(make_plots(module(name).plots, result, out)) for name, result in results.items()}
    items = summary(results)
    write_docs(results, images, saved["machine"], saved["command"], saved["quick"], saved["seconds"], items)
    (out / "suite.json").write_text(json.dumps({**saved, "summary": items}, indent=1, default=str))
    print("\n".join(summary_markdown(items)))
    print(f"wrote {DOCS} and {DOCS_IMAGES}/ from {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced set, under 5 minutes on 2 cores")
    p.add_argument("--out", type=Path, help="results directory (default runs/bench/suite-<time>)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    p.add_argument("--skip", nargs="+", choices=BENCHMARKS, default=[], help="leave these out")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--render", type=Path, metavar="SUITE_JSON",
                   help="run nothing: redraw the plots and rewrite docs/benchmarks.md from a saved suite.json")
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    out = args.out or ROOT / "runs" / "bench" / f"suite-{'quick-' if args.quick else ''}{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or BENCHMARKS) if n not in args.skip]
    info = machine_info()
    command = shlex.join(["python", "scripts/bench/suite.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"suite ({'quick' if args.quick else 'full'}): {', '.join(names)} -> {out}")
    print(f"machine: {machine_line(info)}", flush=True)
    start = time.monotonic()
    results, images, timings = {}, {}, {}
    for i, name in enumerate(names, 1):
        t0 = time.monotonic()
        print(f"[{i}/{len(names)}] {name} ... (elapsed {time.monotonic() - start:.0f} s)", flush=True)
        mod = module(name)
        bargs = bench_args(name, args.quick, out)
        if name == "peers":
            bargs.reuse = results.get("ablation")   # our ZeRO-3 / ZeRO++ runs of the same job, not run twice
        try:
            result = mod.run(bargs, progress=lambda s: print(s, flush=True))
        except Exception as e:   # one broken benchmark must not lose the others' results
            import traceback

            traceback.print_exc()
            result = {"benchmark": name, "skipped": f"crashed: {type(e).__name__}: {e}", "rows": []}
        result["seconds"] = time.monotonic() - t0
        results[name] = result
        timings[name] = result["seconds"]
        pngs = make_plots(mod.plots, result, out)
        write_results(result, out, name)
        images[name] = copy_images(pngs) if not args.no_docs else {p.stem: str(p) for p in pngs}
        print(f"[{i}/{len(names)}] {name} done in {result['seconds']:.0f} s", flush=True)
    seconds = time.monotonic() - start
    items = summary(results)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    (out / "suite.json").write_text(json.dumps({"machine": info, "command": command, "quick": args.quick,
                                                "seconds": seconds, "timings": timings, "summary": items,
                                                "results": results}, indent=1, default=str))
    print("\nsummary:")
    print("\n".join(summary_markdown(items)))
    if not args.no_docs and names == BENCHMARKS:
        write_docs(results, images, info, command, args.quick, seconds, items)
        print(f"wrote {DOCS} and {DOCS_IMAGES}/")
    elif not args.no_docs:   # a partial run refreshes its own sections and leaves the rest (and the summary) be
        for name in names:
            update_docs_section(name, module(name).markdown(results[name], images[name]), info, command)
        print(f"updated the {', '.join(names)} section(s) of {DOCS}")
    print(f"suite done in {seconds:.0f} s ({seconds / 60:.1f} min); results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
