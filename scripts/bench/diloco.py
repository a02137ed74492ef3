"""Issue 33's D1-D5: DiLoCo over ZeRO++ across 2 sites (a site = an emulated node of 2 ranks) side by side with
ZeRO-3, ZeRO++, ZeRO++ with qwZ deltas, DeepSpeed ZeRO-3 and DDP, the inter-site link shaped to 100 and
10 Mbit/s: time to a target validation loss, tokens/s, cross-site bytes per step, the loss at equal tokens.

    python scripts/bench/diloco.py --quick     # 50 steps; timed at 10mbit and unshaped: 9 min at load 5, 15 at 9
    python scripts/bench/diloco.py --out runs/bench/diloco --update-docs     # 500 steps; 100mbit, 10mbit and
                              # unshaped: ~25 min at load 5, ~40 at load 9 (estimated from the quick runs)
    python scripts/bench/diloco.py --inner-steps 50 --fragments 4 --delay 2  # --delay: diloco.delay (tau)
    python scripts/bench/diloco.py --diloco-set outer_lr=1 outer_momentum=0  # any other diloco.* key

Two parts, because a whole run at 10 Mbit/s would take DeepSpeed hours on this machine. (1) Every runtime's
loss trajectory, once, on 4 unshaped loopback ranks laid out as 2 nodes x 2, evaluating as it goes: the
collectives are deterministic, so the trajectory does not depend on the link (checked here: the timed runs'
logged losses, shaped against unshaped, of the same job). (2) A short timed segment of each job on the
emulated cluster at every link and on loopback: step time after the warm-up (the median; DiLoCo's the MEAN
over whole cycles of H steps, so its syncs are counted), the link's bytes and the ledger's cross-node bytes
per step. Time to the target = the step at which the validation curve first reaches it (linear between
evaluations) x that link's step time: training time, without start-up and evaluation.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.bench import convergence, peers, report, runner
from scripts.bench.ablation import CONFIGS
from scripts.bench.separate import draw, time_to
from scripts.bench.suite import Quick, main_one, options
from scripts.cluster import parse_rate

TITLE = "## 8. DiLoCo across sites: time to a target loss over slow links (issue 33, D1-D5)"
ZPP = CONFIGS["zeropp"][1]  # qwZ int8, hpZ over the node, qgZ int4 (the ablation's and peers' ZeRO++)
DELTAS = {**ZPP, "zero_quantized_weights_bits": 4, "zero_quantized_weights_delta": True}  # peers' zeropp-delta
RUNTIMES = {  # key -> (label, zero_optimization keys; None: DeepSpeed through peers.py --worker)
    "zero3": ("ZeRO-3 (ours, bf16 wire)", {"stage": 3}),
    "zeropp": ("ZeRO++ (qwZ int8, hpZ, qgZ int4)", ZPP),
    "zeropp-delta": ("ZeRO++ with qwZ int4 deltas", DELTAS),
    "deepspeed": ("DeepSpeed ZeRO-3", None),
    "ddp": ("DDP (stage 0, fp32 all-reduce over the world)", {"stage": 0}),
    "diloco": ("DiLoCo over ZeRO++", ZPP),
}
NO_CURVE = {"ddp"}  # timed only: D1's denominator (its trajectory is ZeRO-3's)
LEDGER = "cross-node sent (MB)"  # logged per step, in MiB
BASELINES = ("zero3", "zeropp", "zeropp-delta", "deepspeed")  # what the target must be reachable by


def add_args(p) -> None:
    p.add_argument("--steps", type=int, default=Quick(500, 50), help="trajectory steps (default %(default)s)")
    p.add_argument("--eval-interval", type=int, default=Quick(25, 5), help="steps between evaluations (default "
                   "%(default)s; a divisor of H puts DiLoCo's evaluations on its syncs)")
    p.add_argument("--inner-steps", type=int, default=25, help="DiLoCo's H (default %(default)s)")
    p.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's F (default %(default)s)")
    p.add_argument("--delay", type=int, default=0, help="diloco.delay: a fragment's exchange applied this many inner "
                   "steps later (Streaming DiLoCo's tau; default %(default)s: not passed)")
    p.add_argument("--diloco-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more diloco keys of the DiLoCo run, e.g. outer_lr=0.5 outer_momentum=0")
    p.add_argument("--compression", choices=["none", "int8", "int4"], default="int4",
                   help="DiLoCo's pseudo-gradient on the wire (default %(default)s)")
    p.add_argument("--links", nargs="+", default=Quick(["100mbit", "10mbit"], ["10mbit"]),
                   help="shaped inter-site links of the timed part, besides unshaped loopback (default %(default)s)")
    p.add_argument("--runtimes", nargs="+", choices=list(RUNTIMES), default=list(RUNTIMES))
    p.add_argument("--timed-steps", type=int, default=Quick(8, 4),
                   help="timed steps after the warm-up, runtimes other than DiLoCo (default %(default)s)")
    p.add_argument("--cycles", type=int, default=Quick(2, 1), help="DiLoCo's timed cycles of H steps (default "
                   "%(default)s)")
    p.add_argument("--target", type=float, help="target validation loss (default: ZeRO-3's final + --margin, or "
                   "the highest best of ZeRO-3, ZeRO++ (deltas) and DeepSpeed if one of them stays above that)")
    p.add_argument("--margin", type=float, default=0.02, help="of ZeRO-3's final loss (default %(default)s)")
    for name, typ, default, what in [("warmup", int, 2, "steps not timed"), ("eval-batches", int, 8, "per rank"),
                                     ("micro-batch", int, 4, "per rank"), ("seq", int, 128, "tokens"),
                                     ("lr", float, 2e-3, "peak"), ("data", Path, convergence.DATA, "Tiny Shakespeare"),
                                     ("timeout", float, 1800, "s per run")]:
        p.add_argument(f"--{name}", type=typ, default=default, help=f"{what} (default %(default)s)")


def resolve(args) -> dict:
    """The plan; compute: bf16 autocast where this CPU multiplies bf16 natively, else fp32, for every row."""
    import torch

    from trainer.precision import native_bf16

    slow = min(args.links, key=parse_rate) if args.links else None
    return {**options(args), "data": str(args.data), "slow": slow,
            "compute": "bf16" if native_bf16(torch.device("cpu")) else "fp32"}


def job(key: str, plan: dict) -> tuple[str, list[str], list[str]]:
    """(label, script, its runtime's arguments) of a runtime key. DeepSpeed is peers.py's worker of the same
    compute dtype, which computes through its own mixed precision (peers.RUNTIMES)."""
    label, zero = RUNTIMES[key]
    if zero is None:
        ds = f"deepspeed-{plan['compute']}"
        return peers.RUNTIMES[ds][0], [peers.__file__, "--worker", ds], ["--train.precision", "fp32"]
    args = runner.zero_args(**zero) + ["--train.precision", plan["compute"]]
    if key == "diloco":
        label = (f"{label} (H {plan['inner_steps']}, {plan['compression']} exchange"
                 + f", {plan['fragments']} fragments" * (plan["fragments"] > 1)
                 + f", delay {plan['delay']}" * bool(plan["delay"]) + "".join(f", {kv}" for kv in plan["diloco_set"])
                 + ")")
        args += ["--diloco.enabled", "true", "--diloco.site_size", str(runner.RANKS_PER_NODE),
                 "--diloco.inner_steps", str(plan["inner_steps"]), "--diloco.compression", plan["compression"],
                 "--diloco.fragments", str(plan["fragments"])]
        args += ["--diloco.delay", str(plan["delay"])] if plan["delay"] else []
        args += [a for kv in plan["diloco_set"] for a in (f"--diloco.{kv.partition('=')[0]}", kv.partition("=")[2])]
    return label, [str(runner.ROOT / "train.py")], args


def curve_run(key: str, plan: dict, work: Path) -> dict:
    """The runtime's validation curve over the whole run, 4 loopback ranks as 2 nodes x 2."""
    label, script, args = job(key, plan)
    out = work / f"curve-{key}"
    # every step logged, evaluated at step 0; the runtime's arguments come last (its --train.precision wins)
    cmd = [sys.executable, *script, *convergence.fp32_curve_args(plan), "--train.out_dir", out, *args]
    row = {"key": key, "label": label, "part": "curve", "setting": "loopback",
           **convergence.curve_run(cmd, out, plan["timeout"])}
    if row["ok"]:
        steps = row.pop("metrics")
        row.update(train_curve=[(m["step"], m["lm loss"]) for m in steps])
    return row


def timed_steps(key: str, plan: dict) -> int:
    """A timed job's steps: the warm-up, then DiLoCo's whole cycles (each fragment's sync once per cycle) or
    --timed-steps."""
    return plan["warmup"] + (plan["cycles"] * plan["inner_steps"] if key == "diloco" else plan["timed_steps"])


def timed_run(key: str, plan: dict, setting: str, work: Path, cluster=None) -> dict:
    """A short timed segment of the same job (no evaluation, every step logged) on `cluster` or loopback."""
    label, script, args = job(key, plan)
    steps, out = timed_steps(key, plan), work / f"timed-{key}-{setting}"
    cmd = [sys.executable, *script, *convergence.train_args({**plan, "steps": steps}), *runner.TIMED,
           "--train.out_dir", out, *args]
    row = {"key": key, "label": label, "part": "timed", "setting": setting, "steps": steps,
           "load_start": round(os.getloadavg()[0], 2),
           **runner.measured_launch(cmd, out / "metrics.jsonl", cluster, steps, plan["warmup"], plan["timeout"])}
    if not row["ok"]:
        return row
    metrics = row.pop("metrics")
    stats, timed = runner.step_stats(metrics, plan["warmup"]), metrics[plan["warmup"]:]
    step_ms = stats["step_ms_mean"] if key == "diloco" else stats["step_ms"]
    ledger = [m[LEDGER] for m in timed if LEDGER in m]  # none: a peer runtime (its ledger is empty)
    row.update(stats, step_ms=step_ms, step_ms_how="mean over whole cycles" if key == "diloco" else "median",
               tokens_per_s=plan["micro_batch"] * plan["seq"] * runner.NODES * runner.RANKS_PER_NODE / step_ms * 1e3,
               # the mean, not step_stats' median: DiLoCo's outer exchange crosses at one step in H
               ledger_cross_mb_rank=statistics.mean(ledger) * 2**20 / 1e6 if ledger else None,
               losses=[m["lm loss"] for m in metrics])
    return row


def run(args, progress=print) -> dict:
    plan = resolve(args)
    result = {"plan": plan, "rows": [], "notes": []}
    if why := convergence.data_missing(plan["data"]):
        return {**result, "skipped": why}
    result["model"] = runner.model_summary(config_args=convergence.train_args(plan))
    keys = plan["runtimes"]
    if "deepspeed" in keys and not peers.deepspeed_installed():
        keys = [k for k in keys if k != "deepspeed"]
        result["notes"].append(f"DeepSpeed: {peers.NOT_INSTALLED}")
    links = plan["links"]
    if links and (why := runner.cluster_unavailable()):
        result["notes"].append(f"{', '.join(links)}: skipped, emulated cluster unavailable: {why}")
        links = []

    def done(row):
        result["rows"].append(row)
        progress(f"  diloco {row['part']} {row['label']} @ {row['setting']}: " + (
            f"{row['step_ms']:.0f} ms/step ({row['step_ms_how']})" + (
                f", {row['phys_tx_mb_node']:.4f} MB/node/step on the link" if "phys_tx_mb_node" in row else "")
            if row["ok"] and row["part"] == "timed" else f"final validation loss {row['final_val_loss']:.4f}"
            if row["ok"] else row["error"]) + f" ({row['wall_s']:.0f} s)")

    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
        for key in (k for k in keys if k not in NO_CURVE):
            done(curve_run(key, plan, Path(tmp)))
        for setting in ["loopback", *links]:
            with runner.cluster_at(None if setting == "loopback" else setting) as cluster:
                for key in keys:
                    done(timed_run(key, plan, setting, Path(tmp), cluster))
    analyse(result)
    return result


def target_loss(curves: dict, plan: dict) -> float | None:
    """--target, else ZeRO-3's final validation loss x (1 + margin), raised to the highest best loss of the
    baselines if one of them never gets that low (DiLoCo does not move it: missing it is a miss)."""
    if plan["target"] or "zero3" not in curves:
        return plan["target"]
    best = [min(v for _, v in curves[k]["val_curve"]) for k in BASELINES if k in curves]
    return max(curves["zero3"]["final_val_loss"] * (1 + plan["margin"]), *best)


def analyse(result: dict) -> None:
    """The target, each row's step and time to it, the losses' agreement shaped vs unshaped, and D1-D5."""
    plan, ok = result["plan"], [r for r in result["rows"] if r["ok"]]
    curves = {r["key"]: r for r in ok if r["part"] == "curve"}
    timed = {(r["key"], r["setting"]): r for r in ok if r["part"] == "timed"}
    result["target"] = target = target_loss(curves, plan)
    for r in curves.values():
        r["step_to_target"] = None if target is None else time_to(r["val_curve"], target)
        if (z3 := curves.get("zero3")) and r["val_curve"][-1][0] == z3["val_curve"][-1][0]:
            r["vs_zero3"] = r["final_val_loss"] / z3["final_val_loss"] - 1
    for r in timed.values():
        if (c := curves.get(r["key"])) and c["step_to_target"] is not None:
            r["time_to_target_s"] = c["step_to_target"] * r["step_ms"] / 1e3
    result["same_losses"] = [
        {"key": key, "setting": setting, "steps": len(r["losses"]),
         "max_abs_diff": max(abs(a - b) for a, b in zip(r["losses"], timed[key, "loopback"]["losses"]))}
        for (key, setting), r in timed.items() if setting != "loopback" and (key, "loopback") in timed]
    result["targets"] = d_targets(plan, curves, timed)


def d_targets(plan: dict, curves: dict, timed: dict) -> list[dict]:
    """Issue 33's D1-D5 (value None when a row it divides is missing; D2/D3 also when DiLoCo never reaches
    the target: a miss)."""
    slow, out = plan["slow"], []

    def add(tid, what, goal, value, source, missed=False):
        met = (False if missed else None) if value is None else value <= float(goal[2:]) if goal.startswith("<=") else (
            abs(value - 1) <= float(goal.split()[1].rstrip("%")) / 100 if goal.startswith("within")
            else value >= float(goal[2:]))
        out.append({"id": tid, "what": what, "goal": goal, "value": value, "met": met, "from": source})

    def ratio(a, b, field, scale=1.0):
        return a[field] / (b[field] * scale) if a and b and a.get(field) is not None and b.get(field) else None

    dl, ddp = timed.get(("diloco", slow)), timed.get(("ddp", slow))
    z3, dc = curves.get("zero3"), curves.get("diloco")
    never = dc is not None and dc["step_to_target"] is None  # DiLoCo never reached the target: D2, D3 missed
    for field, how in (("phys_tx_mb_node", "physical link bytes sent per node"),
                       ("ledger_cross_mb_rank", "ledger's cross-node bytes sent per rank")):
        add("D1", f"cross-site bytes per inner step / bf16 DDP's per step ({how}; bf16 DDP = half of DDP fp32's)",
            "<= 0.0025", ratio(dl, ddp, field, 0.5),
            f"DiLoCo {report.fmt(dl and dl.get(field), '{:.4f}')} MB, DDP fp32 "
            f"{report.fmt(ddp and ddp.get(field), '{:.4f}')} MB @ {slow}")
    for tid, key, goal in (("D2", "zeropp", ">= 5"), ("D2 (deltas)", "zeropp-delta", ">= 5"),
                           ("D3", "deepspeed", ">= 20")):
        base = timed.get((key, slow))
        add(tid, f"time to the target at {slow}, {base['label'] if base else RUNTIMES[key][0]} / DiLoCo over ZeRO++",
            goal, ratio(base, dl, "time_to_target_s"),
            "; ".join(f"{r['label']}: " + (f"{r['time_to_target_s']:.1f} s" if r.get("time_to_target_s") is not None
                                          else "never reached") for r in (base, dl) if r) or "not measured", never)
    add("D4", f"validation loss at equal tokens (step {z3 and z3['val_curve'][-1][0]}), DiLoCo over ZeRO++ (H "
        f"{plan['inner_steps']}) / ZeRO-3", "within 2%", ratio(dc, z3, "final_val_loss"),
        f"{report.fmt(dc and dc['final_val_loss'], '{:.4f}')} vs {report.fmt(z3 and z3['final_val_loss'], '{:.4f}')}")
    loop = timed.get(("diloco", "loopback"))
    add("D5", f"DiLoCo's step at {slow} / the same job unshaped (means over whole cycles)", "<= 1.1",
        ratio(dl, loop, "step_ms"), f"{report.fmt(dl and dl['step_ms'], '{:.0f}')} ms vs "
        f"{report.fmt(loop and loop['step_ms'], '{:.0f}')} ms")
    return out


D_COLUMNS = [("id", "id", "{}"), ("what", "ratio", "{}"), ("from", "from", "{}"), ("goal", "goal", "{}"),
             ("value", "measured", "{}"), ("met", "met", "{}")]
CURVE_COLUMNS = [("label", "runtime", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
                 ("vs_zero3", "vs ZeRO-3", "{:+.2%}"), ("step_to_target", "step at the target", "{:.1f}"),
                 ("wall_s", "run's wall s (loopback, with evaluations)", "{:.0f}")]
TIMED_COLUMNS = [("label", "runtime", "{}"), ("setting", "link", "{}"), ("step_ms", "step ms", "{:.0f}"),
                 ("step_ms_how", "step time", "{}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                 ("time_to_target_s", "training s to the target", "{:.1f}"),
                 ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.4f}"),
                 ("ledger_cross_mb_rank", "ledger cross-node MB/rank/step", "{:.4f}"),
                 ("wire_ms", "wire ms/step", "{:.0f}"), ("load_start", "load at start", "{:.1f}")]


def ratio_text(value: float | None, goal: str, met: bool | None) -> str:
    if value is None:
        return "target never reached" if met is False else "not measured"
    return f"1/{1 / value:.0f}" if goal == "<= 0.0025" and value > 0 else f"{value:.3f}"


def markdown(result: dict) -> str:
    plan, m = result["plan"], result["model"]
    verdict = {None: "–", True: "yes", False: "**no**"}
    rows = result["rows"]
    curves, timed = [r for r in rows if r["part"] == "curve"], [r for r in rows if r["part"] == "timed"]
    same = result.get("same_losses", [])
    lines = [
        f"Setup: {runner.model_words(m)}; Tiny Shakespeare; {plan['micro_batch']}x{plan['seq']} tokens per rank on "
        f"{runner.NODES} nodes (sites) x {runner.RANKS_PER_NODE} ranks, {plan['compute']} compute in every row; "
        f"{plan['steps']} steps, lr {plan['lr']:g}, validation every {plan['eval_interval']} steps on "
        f"{plan['eval_batches']} batches per rank; the same seed (weights, batches) everywhere. Timed segments: "
        f"{plan['warmup']} warm-up steps, then {plan['timed_steps']} steps (DiLoCo: {plan['cycles']} whole "
        f"cycle(s) of H {plan['inner_steps']}). Target: validation loss "
        + report.fmt(result.get("target"), "{:.4f}")
        + (" (given)." if plan["target"] else f" (ZeRO-3's final + {plan['margin']:.0%}, or the highest best "
           "loss of the baselines if higher)."), "",
        *report.md_table([dict(t, value=ratio_text(t["value"], t["goal"], t["met"]), met=verdict[t["met"]])
                          for t in result.get("targets", [])], D_COLUMNS, "lllrrc"), "",
        "Trajectories (4 loopback ranks as 2 nodes x 2):", "", *report.md_table(curves, CURVE_COLUMNS), "",
        "Timed segments (loopback: unshaped; the others: the emulated cluster, the link between the 2 nodes "
        "shaped):", "", *report.md_table(timed, TIMED_COLUMNS)]
    if same:
        worst = max(same, key=lambda s: s["max_abs_diff"])
        lines += ["", "The trajectory does not depend on the link: the timed runs' logged training losses, shaped "
                  f"against unshaped, differ by at most {worst['max_abs_diff']:.2e} ({len(same)} pairs, "
                  f"{worst['steps']} steps; largest: {worst['key']} @ {worst['setting']})."]
    scripts = {r["key"]: r for r in curves + timed}
    lines += ["", "Commands (each rank: `SCRIPT <common> <its arguments>`, common = "
              f"`{runner.shown(convergence.train_args(plan))}`; the trajectories add "
              "`--train.log_interval 1 --train.eval_at_start true`, the timed segments runner.TIMED and their "
              "steps):", ""]
    lines += [f"- {r['label']}: `{runner.shown(job(k, plan)[1])} {runner.shown(job(k, plan)[2])}`"
              for k, r in scripts.items()]
    return "\n".join(lines)


def plots(result: dict, out_dir: Path) -> list[Path]:
    """Validation loss against the step, and against wall-clock at each shaped link (step x its step time)."""
    plan, ok = result["plan"], [r for r in result["rows"] if r["ok"]]
    curves = [r for r in ok if r["part"] == "curve"]
    links = [s for s in dict.fromkeys(r["setting"] for r in ok if r["part"] == "timed") if s != "loopback"]
    step_s = {(r["key"], r["setting"]): r["step_ms"] / 1e3 for r in ok if r["part"] == "timed"}
    fig, axes = report.pyplot().subplots(1, 1 + len(links), figsize=(6 * (1 + len(links)), 4.5), squeeze=False)
    draw(axes[0][0], {r["label"]: r["val_curve"] for r in curves}, "step")
    axes[0][0].set_title("4 ranks as 2 nodes x 2")
    for ax, link in zip(axes[0][1:], links):
        draw(ax, {r["label"]: [(s * step_s[r["key"], link], v) for s, v in r["val_curve"] if s]
                  for r in curves if (r["key"], link) in step_s}, f"step x step time at {link} (s)")
        ax.set_xscale("log")
        ax.set_title(f"wall-clock, inter-site link {link}")
    for ax in axes[0]:
        if result.get("target"):
            ax.axhline(result["target"], color="grey", ls="--", lw=1)
    fig.suptitle(f"Tiny Shakespeare, {plan['compute']} compute; dashed: target", fontsize=9)
    return [report.save(fig, out_dir, "diloco_loss")]


if __name__ == "__main__":
    sys.exit(main_one("diloco"))
