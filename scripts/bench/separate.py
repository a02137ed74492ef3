"""SEPARATE gradient compression against uncompressed ZeRO-3, ZeRO++ and torch's PowerSGD under DDP: convergence,
and wall-clock to a target validation loss (the setup and the run keys: docs/separate.md, section "Measured").

    python scripts/bench/separate.py                      # both parts, 300 steps, into runs/bench/separate
    python scripts/bench/separate.py --quick              # both parts, 50 steps, fewer runs (a few minutes)
    python scripts/bench/separate.py --parts wallclock --wall-runs zero3 sep16 zeropp --target 5.5

Run keys: zero3, zeropp, ddp, powersgd, or [zpp-|qh-|ddp-]sepN[g][ef] (SEPARATE at CR N, e.g. sep16, zpp-sep16).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from scripts.bench import convergence, report, runner
from scripts.bench.report import ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## Measured"
DOCS = ROOT / "docs" / "separate.md"
OUT = "separate"  # the results directory under runs/bench/ (default: no time stamp)
STEP = runner.STEP_KEY
PLAIN = {"zero3": ("ZeRO-3", {"stage": 3}), "zeropp": ("ZeRO++ (qwZ int8, hpZ, qgZ int4)", convergence.ZPP),
         "ddp": ("DDP", {"stage": 0}), "powersgd": ("DDP + PowerSGD rank 4", {
             "stage": 0, "gradient_compression.method": "powersgd", "gradient_compression.powersgd_rank": 4})}
BASES = {None: ("ZeRO-3", {"stage": 3}), "ddp-": ("DDP", {"stage": 0}),
         "zpp-": ("ZeRO++ (qwZ int8, hpZ, qgZ int4 carrying the projections)", convergence.ZPP),
         "qh-": ("ZeRO-3 + qwZ + hpZ", {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 0})}
RUNS, QUICK_RUNS = ["zero3", "sep16", "sep64", "sep16ef", "ddp", "powersgd", "ddp-sep16"], ["zero3", "sep16", "powersgd"]
WALL_RUNS = ["zero3", "sep16", "sep64", "zeropp", "zpp-sep16", "ddp", "powersgd"]
QUICK_WALL_RUNS = ["zero3", "sep16", "zeropp", "powersgd"]
KINDS = ["gradient compression", "waiting for reductions", "waiting for gathers", "weight decode", "weight encode"]


def config(key: str, plan: dict) -> tuple[str, dict]:
    """(label, zero_optimization keys) of a run key."""
    if key in PLAIN:
        return PLAIN[key]
    m = re.fullmatch(r"(zpp-|qh-|ddp-)?sep(\d+)(g?)(ef)?", key)
    if not m:
        raise ValueError(f"unknown run {key!r}: zero3, zeropp, ddp, powersgd, [zpp-|qh-|ddp-]sepN[g][ef]")
    (label, base), gauss = BASES[m.group(1)], bool(m.group(3))
    sep = {"method": "separate", "ratio": m.group(2), "projection": "gaussian" if gauss else "hadamard",
           "block_size": plan["block_size"] or (256 if gauss else 1024),
           **({"reconstruction": "contractive", "beta": 0.95} if m.group(4) else {}),
           **dict(kv.split("=", 1) for kv in plan["sep_set"])}
    notes = [f"gaussian, block {sep['block_size']}"] * gauss + ["error feedback beta 0.95"] * bool(m.group(4))
    return (f"{label} + SEPARATE CR {m.group(2)}" + (f" ({', '.join(notes)})" if notes else ""),
            {**base, **{f"gradient_compression.{k}": v for k, v in sep.items()}})


def add_args(p) -> None:
    p.add_argument("--parts", nargs="+", choices=["convergence", "wallclock"], default=["convergence", "wallclock"])
    p.add_argument("--steps", type=int, default=Quick(300, 50), help="steps of every run (default %(default)s)")
    p.add_argument("--runs", nargs="+", default=Quick(RUNS, QUICK_RUNS), help="convergence runs (default %(default)s)")
    p.add_argument("--wall-runs", nargs="+", default=Quick(WALL_RUNS, QUICK_WALL_RUNS),
                   help="wall-clock runs (default %(default)s)")
    p.add_argument("--rate", default="100mbit", help="link rate of the wall-clock part (default %(default)s)")
    p.add_argument("--target", type=float, help="target validation loss (default: the highest of the runs' best)")
    p.add_argument("--block-size", type=int, help="SEPARATE block size (default 1024, gaussian 256)")
    p.add_argument("--sep-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more gradient_compression keys of every SEPARATE run")
    p.add_argument("--model-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="model keys of every run, e.g. n_layer=6 d_model=384 (default: convergence.py's model)")
    p.add_argument("--eval-interval", type=int, help="default: steps / 20 (quick: steps / 5)")
    for name, typ, default, what in [("eval-batches", int, 8, "per rank"), ("micro-batch", int, 4, "per rank"),
                                     ("seq", int, 128, "tokens"), ("lr", float, 2e-3, "peak"),
                                     ("warmup", int, 2, "steps left out of the per-step means"),
                                     ("quiet-load", float, 1.2, "1-minute load the timed part waits to fall below"),
                                     ("quiet-wait", float, 1200, "longest wait for a quiet machine, s"),
                                     ("data", Path, convergence.DATA, "Tiny Shakespeare"), ("timeout", float, 1800, "s")]:
        p.add_argument(f"--{name}", type=typ, default=default, help=f"{what} (default %(default)s)")


def resolve(args) -> dict:
    return {**options(args), "data": str(args.data),
            "eval_interval": args.eval_interval or max(1, args.steps // (5 if args.quick else 20))}


def train_args(plan: dict) -> list[str]:
    """convergence.py's job (its model with `model_set`'s changes), logging every step, evaluating at step 0,
    computing in fp32 everywhere."""
    model = [arg for kv in plan["model_set"] for arg in (f"--model.{kv.partition('=')[0]}", kv.partition("=")[2])]
    return [*convergence.fp32_curve_args(plan, param_dtype="fp32"), *model]


def run_one(key: str, plan: dict, part: str, work: Path, cluster=None) -> dict:
    label, zkeys = config(key, plan)
    out = work / f"{part}-{key}"
    cmd = [sys.executable, ROOT / "train.py", *train_args(plan), "--train.out_dir", out, *runner.zero_args(**zkeys)]
    evals = [*range(0, plan["steps"], plan["eval_interval"]), plan["steps"]]
    # the link windows leave out the steps that hold an evaluation (the one before and after it)
    segments = [(max(e + 1, plan["warmup"]), f - 1) for e, f in zip(evals, evals[1:])]
    row = {"key": key, "label": label, "part": part, **runner.measured_launch(
        cmd, out / "metrics.jsonl", cluster, plan["steps"], plan["warmup"], plan["timeout"], segments)}
    if not row["ok"]:
        return row
    steps, val = row.pop("metrics"), runner.validation_curve(out)
    clock = {0: 0.0, **dict(zip((m["step"] for m in steps), itertools.accumulate(m[STEP] / 1e3 for m in steps)))}
    stats = runner.step_stats(steps, plan["warmup"], rest_of="mean")  # step time: the mean here
    row.update(stats, step_ms=stats["step_ms_mean"], val_curve=val, val_time=[(clock[s], v) for s, v in val],
               final_val_loss=val[-1][1], train_s=clock[plan["steps"]])
    return row


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """First time the (seconds, loss) curve reaches `target`, linear between evaluations."""
    for (t0, l0), (t1, l1) in zip([curve[0]] + curve, curve):
        if l1 <= target:
            return t1 if l0 <= target else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def run(args, progress=print) -> dict:
    plan = resolve(args)
    for key in {*plan["runs"], *plan["wall_runs"]}:
        config(key, plan)  # an unknown key fails before anything runs
    result = {"plan": plan, "rows": []}
    if why := convergence.data_missing(plan["data"]):
        return {**result, "skipped": why}
    result["model"] = runner.model_summary(config_args=train_args(plan))

    def one(i, key, part, runs, cluster=None):
        result["rows"].append(row := run_one(key, plan, part, Path(tmp), cluster))
        progress(f"  separate {part} [{i}/{len(runs)}] {row['label']}: " + (
            f"{row['step_ms']:.0f} ms/step, final validation loss {row['final_val_loss']:.4f}" if row["ok"]
            else row["error"]) + f" ({row['wall_s']:.0f} s)")
        return row

    with tempfile.TemporaryDirectory(prefix="bench-separate-") as tmp:
        for i, key in enumerate(plan["runs"] if "convergence" in plan["parts"] else [], 1):
            one(i, key, "convergence", plan["runs"])
        why = runner.cluster_unavailable() if "wallclock" in plan["parts"] else None
        if why:
            result["wallclock_skipped"] = f"emulated cluster unavailable: {why}"
        elif "wallclock" in plan["parts"]:
            result["quiet"] = runner.wait_quiet(plan["quiet_wait"], plan["quiet_load"], progress)
            since = time.monotonic()
            progress(f"  timed part starts at load {result['quiet']['load_1min']} (quiet: {result['quiet']['quiet']})")
            with runner.cluster_at(plan["rate"]) as cluster:
                for i, key in enumerate(plan["wall_runs"], 1):  # and no one else's jobs during a timed run
                    busy = runner.wait_quiet(plan["quiet_wait"] - (time.monotonic() - since), 1e9, progress)["busy"]
                    one(i, key, "wallclock", plan["wall_runs"], cluster).update(
                        others_at_start=busy, load_at_end=round(os.getloadavg()[0], 2))
    analyse(result)
    return result


def analyse(result: dict) -> None:
    plan, ok = result["plan"], [r for r in result["rows"] if r["ok"]]
    find = {(r["part"], r["key"]): r for r in ok}.get
    for r in ok:
        for base in ("zero3", "ddp"):
            if b := find((r["part"], base)):
                r[f"vs_{base}"] = r["final_val_loss"] / b["final_val_loss"] - 1
    wall, z3 = [r for r in ok if r["part"] == "wallclock"], find(("wallclock", "zero3"))
    if wall:  # the default target: a loss every run reaches
        result["target"] = target = plan["target"] or max(min(v for _, v in r["val_curve"]) for r in wall)
        for r in wall:
            r["time_to_target_s"] = time_to(r["val_time"], target)
        for r in wall if z3 else []:
            if z3["time_to_target_s"] and r["time_to_target_s"] is not None:
                r["time_ratio_vs_zero3"] = r["time_to_target_s"] / z3["time_to_target_s"]
            r["step_ratio_vs_zero3"] = r["step_ms"] / z3["step_ms"]
            if r.get("phys_tx_mb_node") and z3.get("phys_tx_mb_node"):
                r["phys_ratio_vs_zero3"] = r["phys_tx_mb_node"] / z3["phys_tx_mb_node"]


CONV_COLUMNS = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
                ("vs_zero3", "vs ZeRO-3", "{:+.2%}"), ("vs_ddp", "vs DDP", "{:+.2%}"), ("step_ms", "ms/step", "{:.0f}")]
WALL_COLUMNS = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
                ("time_to_target_s", "seconds to target", "{:.1f}"), ("time_ratio_vs_zero3", "/ ZeRO-3", "{:.2f}"),
                ("step_ms", "step ms", "{:.0f}"), ("step_ratio_vs_zero3", "step / ZeRO-3", "{:.2f}"),
                ("ledger_cross_mb_rank", "ledger cross-node MB/rank/step", "{:.2f}"),
                ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"),
                ("phys_ratio_vs_zero3", "physical / ZeRO-3", "{:.3f}"), ("wire_ms", "wire time ms", "{:.0f}")]


def kinds(rows: list[dict]) -> list[str]:
    """The runtime's timings any of these rows has."""
    return [k for k in KINDS if any(f"{k} ms" in r for r in rows)]


def markdown(result: dict) -> str:
    plan, m, rows = result["plan"], result["model"], result["rows"]
    sep = next((r["runtime"] for r in rows if "sep" in r["key"] and r["ok"]), None)
    conv, wall = ([r for r in rows if r["part"] == part] for part in ("convergence", "wallclock"))
    lines = [f"Setup: {runner.model_words(m)}; {plan['micro_batch']}x{plan['seq']} tokens per "
             f"rank, {plan['steps']} steps, lr {plan['lr']:g}; validation every {plan['eval_interval']} steps on "
             f"{plan['eval_batches']} batches per rank; SEPARATE block size {plan['block_size'] or 1024} unless the "
             "label says otherwise" + (f"; runtime: `{sep}`" if sep else "") + "."]
    if conv:
        lines += ["", "### Convergence (4 loopback ranks)", "", *report.md_table(conv, CONV_COLUMNS), ""]
        lines += [f"- {r['label']} ends {r['vs_zero3']:+.2%} from uncompressed ZeRO-3 (target: within 3%): "
                  f"{'met' if abs(r['vs_zero3']) <= 0.03 else '**not met**'}." for r in conv
                  if r["ok"] and r["key"].startswith("sep") and "vs_zero3" in r]
    if result.get("wallclock_skipped"):
        lines += ["", f"Wall-clock part skipped: {result['wallclock_skipped']}."]
    if wall:
        lines += ["", f"### Wall-clock to a target loss (2 emulated nodes x 2 ranks, {plan['rate']})", "",
                  f"Target: validation loss {result.get('target', float('nan')):.4f}"
                  + (" (given). " if plan["target"] else " (the highest of the runs' best). ")
                  + runner.quiet_words(result["quiet"]) + ".", "", *report.md_table(wall, WALL_COLUMNS), ""]
        lines += [f"- {r['label']} / ZeRO-3, time to the target: {r['time_ratio_vs_zero3']:.2f} (goal <= 0.6): "
                  f"{'met' if r['time_ratio_vs_zero3'] <= 0.6 else '**not met**'}; its step takes "
                  f"{r['step_ratio_vs_zero3']:.2f} of ZeRO-3's, with {r.get('phys_ratio_vs_zero3', float('nan')):.2f} "
                  "of its physical bytes." for r in wall
                  if r["ok"] and "sep" in r["key"] and r.get("time_ratio_vs_zero3") is not None]
        cols = [("label", "run", "{}"), ("step_ms", "step ms", "{:.0f}"), ("wire_ms", "wire time ms", "{:.0f}"),
                *report.time_columns(kinds(wall))]
        lines += ["", f"Where a step's time goes (rank 0, mean over the steps after the first {plan['warmup']}):", "",
                  *report.md_table([r for r in wall if r["ok"]], cols)]
    return "\n".join(lines)


def draw(ax, curves: dict, xlabel: str) -> None:
    """report.curves, each line in its own style: identical runs (ZeRO-3 and DDP) stay visible."""
    report.curves(ax, curves, xlabel, "validation loss", marker="o", ms=2)
    for line, ls in zip(ax.get_lines(), itertools.cycle(["-", "--", "-.", ":"])):
        line.set_linestyle(ls)
    ax.legend(fontsize=7)


def plots(result: dict, out_dir: Path) -> list[Path]:
    plt, paths = report.pyplot(), []
    conv, wall = ([r for r in result["rows"] if r["ok"] and r["part"] == p] for p in ("convergence", "wallclock"))
    if conv:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, {r["label"]: r["val_curve"][1:] for r in conv}, "step")
        ax.set_title("Tiny Shakespeare, 4 ranks as 2 nodes x 2 (step 0 left out)")
        paths.append(report.save(fig, out_dir, "separate_convergence"))
    if wall:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
        draw(ax, {r["label"]: r["val_time"][1:] for r in wall}, "training seconds")
        ax.axhline(result["target"], color="grey", ls="--", lw=1)
        ax.set_title(f"2 emulated nodes x 2 ranks at {result['plan']['rate']}; dashed: target")
        report.time_bars(ax2, wall, kinds(wall),
                         [textwrap.fill(r["label"], 32) for r in wall],
                         "ms per step (rank 0); rest = compute and other", fontsize=7)
        paths.append(report.save(fig, out_dir, "separate_wallclock"))
    return paths


if __name__ == "__main__":
    sys.exit(main_one("separate"))
