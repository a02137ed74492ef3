"""Issue 34's A1-A4: `plan.auto` against a hand sweep of every configuration it could have chosen, on the
emulated cluster (2 nodes x 2 ranks) unshaped and at each link rate, for two models and two micro-batch sizes.

    python scripts/bench/autoplan.py --quick          # one model, one batch, loopback and 100mbit
    python scripts/bench/autoplan.py --out runs/bench/autoplan --update-docs          # every cell (A1-A4)

A cell (link, model, micro-batch) is one launch: every rank builds, trains and closes one Trainer per
configuration in turn (`--worker`), so the cell pays torch's start-up once. The hand sweep is every candidate
`zeropp.autoplan.candidates` prices (ZeRO-3 and its single options, ZeRO++, int4 deltas, int4 weights, DDP);
then the run with `--plan.auto true` and nothing else chosen. Measured: the median step time after the
warm-up of each run; the auto run's predicted step time (A3) and the seconds its probes and planning took (A4).
A1 compares auto with the fastest hand configuration its fidelity floor allows (plan.min_weight_bits 8: no
int4 weights), A2 with plain ZeRO-3 (`--zero_optimization.stage 3`), all three measured anew in a second launch,
best-auto-ZeRO-3-ZeRO-3-auto-best (the sweep picked the best as the fastest of nine noisy runs: its sweep time is
biased low; one run against one is the machine's noise against its noise). A3 and A4 use every auto run of the
cell (three: each probes and plans anew).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import report, runner
from scripts.bench.suite import Quick, main_one, options
from scripts.cluster import parse_rate

TITLE = "## 9. One knob: plan.auto against a hand sweep (issue 34, A1-A4)"
MODELS = {  # name -> the model arguments of its runs
    "gpt2-tiny": ["--model.preset", "gpt2-tiny"],  # the quickstart's model: 0.36M parameters, 2 blocks
    "gpt2-4x128": ["--model.preset", "gpt2-small-cpu", "--model.n_layer", "4", "--model.d_model", "128",
                   "--model.max_seq_len", "128"],  # 1.3M parameters, 4 blocks
}
AUTO = "auto"
FLOOR = 8  # plan.min_weight_bits' default: the hand configurations below it are not A1's competition


def hand_configs() -> dict[str, tuple[list[str], int]]:
    """Every candidate the planner prices, as the train.py arguments a user would type: name -> (arguments,
    the bits of the weights its forward computes with)."""
    from zeropp.autoplan import candidates, weight_bits
    from zeropp.config import ZeroConfig

    default = dataclasses.asdict(ZeroConfig())
    out = {}
    for name, cfg in candidates(ZeroConfig(stage=3)).items():
        keys = {k: v for k, v in dataclasses.asdict(cfg).items() if v != default[k] and k != "ranks_per_node"}
        out[name] = (runner.zero_args(**keys), weight_bits(cfg, False))
    return out


def add_args(p) -> None:
    p.add_argument("--rates", nargs="+", default=Quick(["loopback", "1gbit", "100mbit", "10mbit"],
                                                        ["loopback", "100mbit"]),
                   help="link rates; loopback = 4 unshaped local ranks as 2 nodes x 2 (default %(default)s)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=Quick(list(MODELS), ["gpt2-tiny"]))
    p.add_argument("--micro-batches", type=int, nargs="+", default=Quick([4, 16], [4]),
                   help="sequences of 128 tokens per rank and step (default %(default)s)")
    p.add_argument("--steps", type=int, default=Quick(10, 6), help="steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed (default %(default)s)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32",
                   help="--train.precision of every run (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per cell (default %(default)s)")


def cell_args(model: str, micro_batch: int, steps: int, precision: str, loopback: bool) -> list[str]:
    """The train.py arguments every run of a cell shares."""
    return [*runner.train_args(micro_batch, steps, model=MODELS[model]), "--train.precision", precision,
            *(runner.zero_args(ranks_per_node=runner.RANKS_PER_NODE) if loopback else [])]


def worker(argv: list[str]) -> int:
    """`--worker RESULT_JSON CONFIGS_JSON WORK_DIR [train.py arguments]`: one rank of a cell. Trains one Trainer per
    configuration of CONFIGS_JSON ({name: arguments}) in turn; rank 0 writes each one's logged step times, its
    plan (the auto run) and the seconds the plan took to RESULT_JSON."""
    from trainer.config import parse_args
    from trainer.distributed import init_distributed
    from trainer.loop import Trainer

    result_path, configs_path, work, *shared = argv
    env = init_distributed()
    rows = []
    for name, args in json.loads(Path(configs_path).read_text()).items():
        out = Path(work) / name.replace(" ", "_").replace("/", "_")
        trainer = Trainer(parse_args([*shared, *args, "--train.out_dir", str(out)]), env)
        try:
            trainer.run()
        finally:
            trainer.close()
        if env.is_main:
            steps = [m[runner.STEP_KEY] for m in runner.read_metrics(out) if runner.STEP_KEY in m]
            rows.append({"name": name, "step_ms_all": steps, "runtime": trainer.runtime.describe(),
                         "plan": trainer.plan, "plan_seconds": trainer.plan_seconds})
        del trainer
        gc.collect()  # the next configuration starts without this one's memory
    if env.is_main:
        Path(result_path).write_text(json.dumps(rows))
    return 0


def run_cell(cluster, model: str, micro_batch: int, plan: dict, work: Path, configs: dict) -> list[dict]:
    """One launch: every configuration of `configs` ({name: arguments}) trained in turn; -> a row per run."""
    tag = f"{model}-mb{micro_batch}-{time.time_ns() % 10**10}"
    result, listing = work / f"{tag}.json", work / f"{tag}-configs.json"
    listing.write_text(json.dumps(configs))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", result, listing, work / tag,
           *cell_args(model, micro_batch, plan["steps"], plan["precision"], cluster is None)]
    rc, output = runner.launch(cmd, cluster, timeout=plan["timeout"])
    if rc != 0 or not result.is_file():
        return [{"name": name, "ok": False, "error": runner.error_tail(output)} for name in configs]
    rows = []
    for r in json.loads(result.read_text()):
        timed = r["step_ms_all"][plan["warmup"]:]
        ok = len(r["step_ms_all"]) == plan["steps"]
        rows.append({**r, "ok": ok, "step_ms": statistics.median(timed) if ok else None,
                     **({} if ok else {"error": f"{len(r['step_ms_all'])} of {plan['steps']} steps logged"})})
    return rows


def run(args, progress=print) -> dict:
    plan = options(args)
    result = {"plan": plan, "models": {m: runner.model_summary(MODELS[m]) for m in plan["models"]}, "rows": []}
    if any(rate != "loopback" for rate in plan["rates"]) and (why := runner.cluster_unavailable()):
        result["skipped"] = f"emulated cluster unavailable: {why}"
        return result
    hand = hand_configs()
    configs = {name: args for name, (args, _) in hand.items()}
    configs[AUTO] = ["--plan.auto", "true"]
    result["weight_bits"] = {name: bits for name, (_, bits) in hand.items()}
    with tempfile.TemporaryDirectory(prefix="bench-autoplan-") as tmp:
        for rate in plan["rates"]:
            with runner.cluster_at(None if rate == "loopback" else rate) as cluster:
                for model in plan["models"]:
                    for mb in plan["micro_batches"]:
                        start = time.monotonic()
                        rows = run_cell(cluster, model, mb, plan, Path(tmp), configs)
                        repeat = repeat_configs(rows, configs, result["weight_bits"])
                        again = run_cell(cluster, model, mb, plan, Path(tmp), repeat) if repeat else []
                        for r in again:
                            r["repeat_of"] = r["name"].split(": ", 1)[1]
                        rows += again
                        predicted = next((r["plan"] or {} for r in rows if r["name"] == AUTO and r["ok"]), {})
                        for r in rows:
                            r.update(setting=rate, model=model, micro_batch=mb)
                            if r["ok"] and r["name"] in predicted.get("predicted", {}):
                                r["predicted_ms"] = predicted["predicted"][r["name"]] * 1e3
                                r["predicted_ratio"] = r["predicted_ms"] / r["step_ms"]
                        result["rows"] += rows
                        progress(f"  autoplan {model} mb {mb} @ {rate}: {cell_words(rows, result['weight_bits'])} "
                                 f"({time.monotonic() - start:.0f} s, load {os.getloadavg()[0]:.1f})")
    result["cells"] = cells(result)
    return result


BASELINE = "ZeRO-3"  # A2's: plain ZeRO-3 defaults
# the second launch per cell: the sweep's best, auto and plain ZeRO-3 measured anew side by side, each at the same
# mean position (best-auto-ZeRO-3-ZeRO-3-auto-best; best-auto-auto-best where the best is ZeRO-3)
REPEAT = ("best", AUTO, BASELINE, BASELINE, AUTO, "best")


def best_allowed(rows: list[dict], bits: dict[str, int]) -> dict | None:
    """The hand sweep's fastest run whose weights are at the planner's fidelity floor or wider."""
    allowed = [r for r in rows if r["ok"] and bits.get(r["name"], 0) >= FLOOR]
    return min(allowed, key=lambda r: r["step_ms"], default=None)


def repeat_configs(rows: list[dict], configs: dict[str, list[str]], bits: dict[str, int]) -> dict[str, list[str]]:
    """A1's and A2's repeat: the sweep's best, auto and plain ZeRO-3 again (REPEAT's order). The best's own sweep
    time is the fastest of nine noisy runs, biased low, and one run of each is noise against noise; measured anew
    twice each, side by side, they are not. Nothing where auto or every allowed run failed."""
    best = best_allowed(rows, bits)
    if best is None or not any(r["name"] == AUTO and r["ok"] for r in rows):
        return {}
    order = [best["name"] if who == "best" else who for who in REPEAT
             if not (who == BASELINE and best["name"] == BASELINE)]
    return {f"repeat {i + 1}: {name}": configs[name] for i, name in enumerate(order)}


def repeated(rows: list[dict], who: str) -> list[float]:
    """The step times of `who`'s successful runs in A1's repeat."""
    return [r["step_ms"] for r in rows if r.get("repeat_of") == who and r["ok"]]


def cell_words(rows: list[dict], bits: dict[str, int]) -> str:
    auto = next((r for r in rows if r["name"] == AUTO), None)
    if auto is None or not auto["ok"]:
        return f"auto FAILED: {auto and auto.get('error')}"
    best = best_allowed(rows, bits)
    again = {who: repeated(rows, who) for who in (AUTO, best and best["name"])}
    return (f"auto chose {auto['plan']['chosen']}: {auto['step_ms']:.0f} ms (predicted "
            f"{auto['plan']['step_seconds'] * 1e3:.0f}); best by hand {best and best['name']}: "
            f"{best and best['step_ms']:.0f} ms; repeated: {again}")


def cells(result: dict) -> list[dict]:
    """A1-A4 per cell: auto's step time against the fastest allowed hand configuration and plain ZeRO-3 (both from
    the repeat, where it ran), its prediction against its measurement and its planning time in steps (over every
    auto run of the cell: each probes and plans anew)."""
    bits, out = result.get("weight_bits", {}), []
    keys = dict.fromkeys((r["setting"], r["model"], r["micro_batch"]) for r in result["rows"])
    for key in keys:
        here = [r for r in result["rows"] if (r["setting"], r["model"], r["micro_batch"]) == key]
        rows = {r["name"]: r for r in here if "repeat_of" not in r}
        auto, zero3, best = rows.get(AUTO), rows.get(BASELINE), best_allowed(list(rows.values()), bits)
        cell = dict(zip(("setting", "model", "micro_batch"), key), ok=bool(auto and auto["ok"] and best))
        if cell["ok"]:
            again = {who: repeated(here, who) for who in (AUTO, best["name"], BASELINE)}
            if again[AUTO] and again[best["name"]]:  # A1 from the repeat, where it ran: measured anew, side by side
                cell.update(auto_again_ms=statistics.mean(again[AUTO]),
                            best_again_ms=statistics.mean(again[best["name"]]))
            if again[AUTO] and again[BASELINE]:
                cell.update(zero3_again_ms=statistics.mean(again[BASELINE]))
            autos = [auto] + [r for r in here if r.get("repeat_of") == AUTO and r["ok"]]
            measured = statistics.mean(r["step_ms"] for r in autos)
            predicted_ms = statistics.mean(r["plan"]["step_seconds"] for r in autos) * 1e3
            plan_s = statistics.mean(r["plan_seconds"] for r in autos)
            same = rows.get(auto["plan"]["chosen"])  # the chosen configuration's own hand run: the run-to-run noise
            if same and same["ok"]:
                cell.update(chosen_hand_ms=same["step_ms"], choice=same["step_ms"] / best["step_ms"])
            if "zero3_again_ms" in cell:
                a2 = cell["auto_again_ms"] / cell["zero3_again_ms"]
            else:
                a2 = auto["step_ms"] / zero3["step_ms"] if zero3 and zero3["ok"] else None
            cell.update(chosen=auto["plan"]["chosen"], auto_ms=auto["step_ms"], best=best["name"],
                        best_ms=best["step_ms"], a1_sweep=auto["step_ms"] / best["step_ms"],
                        a1=cell["auto_again_ms"] / cell["best_again_ms"] if "auto_again_ms" in cell else None,
                        a2=a2, auto_runs=len(autos), auto_mean_ms=measured, predicted_ms=predicted_ms,
                        a3=predicted_ms / measured, plan_s=plan_s, a4=plan_s * 1e3 / measured)
        out.append(cell)
    return out


GOALS = {"a1": ("<=", 1.05), "a2": ("<=", 1.0), "a3": ("within", 0.15), "a4": ("<=", 3.0)}


def met(key: str, value: float | None) -> bool | None:
    if value is None:
        return None
    how, goal = GOALS[key]
    return abs(value - 1) <= goal if how == "within" else value <= goal


COLUMNS = [("setting", "link", "{}"), ("model", "model", "{}"), ("micro_batch", "micro-batch", "{}"),
           ("chosen", "auto chose", "{}"), ("auto_ms", "auto ms", "{:.0f}"), ("best", "best by hand", "{}"),
           ("best_ms", "best ms", "{:.0f}"), ("a1_sweep", "sweep: auto / best", "{:.3f}"),
           ("auto_again_ms", "repeat: auto ms", "{:.0f}"), ("best_again_ms", "repeat: best ms", "{:.0f}"),
           ("a1", "A1 repeat: auto / best (<= 1.05)", "{:.3f}"),
           ("chosen_hand_ms", "chosen, hand run ms", "{:.0f}"), ("choice", "chosen's hand run / best", "{:.3f}"),
           ("zero3_again_ms", "repeat: ZeRO-3 ms", "{:.0f}"), ("a2", "A2 auto / ZeRO-3 (<= 1.0)", "{:.3f}"),
           ("auto_runs", "auto runs", "{}"), ("auto_mean_ms", "auto, all runs ms", "{:.0f}"),
           ("predicted_ms", "predicted ms", "{:.0f}"),
           ("a3", "A3 predicted / measured (±15%)", "{:.2f}"), ("plan_s", "plan s", "{:.2f}"),
           ("a4", "A4 plan / step (<= 3)", "{:.2f}")]


def markdown(result: dict) -> str:
    plan, models = result["plan"], result["models"]
    words = "; ".join(f"{name}: {runner.model_words(m)}" for name, m in models.items())
    lines = [f"Setup: 2 emulated nodes x 2 ranks; {words}; 128 tokens per sequence; {plan['precision']} compute; "
             f"{plan['steps']} steps per run, the median of the last {plan['steps'] - plan['warmup']}. The hand sweep "
             f"is every configuration the planner prices; A1's best is the fastest at {FLOOR}-bit or wider weights "
             f"(the planner's default floor), run again with auto and plain ZeRO-3 (`--zero_optimization.stage 3`, "
             f"A2's baseline) in a second launch, best-auto-ZeRO-3-ZeRO-3-auto-best (the fastest of nine noisy runs "
             f"is biased low, and one run against one is noise against noise; A1 and A2 are the means of the two "
             f"fresh runs of each); A3 and A4 over every auto run of the cell (the sweep's and the repeat's, each "
             f"probing and planning anew): the mean prediction over the mean measured step.", ""]
    cell_rows = cells(result) if result["rows"] else []
    lines += report.md_table(cell_rows, COLUMNS)
    for key, what in (("a1", "A1"), ("a2", "A2"), ("a3", "A3"), ("a4", "A4")):
        verdicts = [met(key, c.get(key)) for c in cell_rows if c["ok"]]
        if verdicts:
            lines += ["", f"- {what}: met in {sum(bool(v) for v in verdicts)} of {len(verdicts)} cells"
                      + ("." if all(verdicts) else " (goal MISSED).")]
    sweep = [("setting", "link", "{}"), ("model", "model", "{}"), ("micro_batch", "micro-batch", "{}"),
             ("name", "configuration", "{}"), ("step_ms", "step ms", "{:.0f}"),
             ("predicted_ms", "auto's prediction ms", "{:.0f}"), ("predicted_ratio", "predicted / measured", "{:.2f}")]
    lines += ["", "Every run (the hand sweep and auto) and the cost model's prediction of each candidate:", "",
              *report.md_table(sorted(result["rows"], key=lambda r: (parse_rate(r["setting"]) if r["setting"] !=
                                                                      "loopback" else 0, r["model"], r["micro_batch"])),
                               sweep)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("autoplan"))
