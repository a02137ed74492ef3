"""GRPO on the math task, one process beside 2 nodes x 2 ranks under ZeRO++ (issue 32's R4): the held-out
reward of every seed from the SFT model to the end, same seed, same SFT model, same global batch.

    python scripts/bench/grpo_math.py             # seeds 1 2 3, 300 GRPO steps each (about 40 minutes)
    python scripts/bench/grpo_math.py --quick     # seed 1, 20 steps

Learning does not depend on the link's speed, so the 4 ranks run on this machine's loopback (their mesh is
still 2 nodes x 2: hpZ, qgZ's two hops and the node-aware gathers as on the emulated cluster).
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import report, runner
from scripts.bench.runner import NODES, RANKS_PER_NODE, ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## 11. GRPO on the math task: one process and 2 x 2 ZeRO++ (issue 32, R4)"
CONFIG = ROOT / "configs" / "rlhf_grpo_math.yaml"
PROMPTS_PER_STEP = 4  # the config's micro-batch in one process; 1 per rank on 4 ranks
# The ZeRO++ of the README: qwZ int8 weights, hpZ inside the node, qgZ int4 gradients (every key stated).
ZEROPP = {"stage": 3, "ranks_per_node": RANKS_PER_NODE, "zero_quantized_weights": True,
          "zero_quantized_weights_bits": 8, "zero_hpz_partition_size": 0, "zero_quantized_gradients": True}
RUNTIMES = {"one": ("one process", None, {"stage": 0}),
            "zeropp": (f"ZeRO++ {NODES} x {RANKS_PER_NODE} (qwZ int8, hpZ, qgZ int4)", NODES * RANKS_PER_NODE, ZEROPP)}
HELD_OUT = ("held-out reward (greedy)", "held-out reward (sampled)")


def add_args(p) -> None:
    p.add_argument("--seeds", type=int, nargs="+", default=Quick([1, 2, 3], [1]), help="default %(default)s")
    p.add_argument("--steps", type=int, default=Quick(300, 20), help="GRPO steps per run (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")


def _launch(args: list, nproc: int | None, timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    rc, output = runner.launch([sys.executable, ROOT / "rlhf.py", *args], nproc=nproc, timeout=timeout)
    return rc, output, time.monotonic() - start


def standard_error(mean: float, n: int) -> float:
    """An upper bound of a mean's standard error over n rewards in [0, 1] with this mean (the variance
    of such a reward is at most mean x (1 - mean))."""
    return math.sqrt(max(mean * (1 - mean), 0.0) / max(n, 1))


def grpo_run(key: str, seed: int, plan: dict, sft: Path, work: Path) -> dict:
    """One `rlhf.py grpo` run from the seed's SFT model: its held-out rewards at every evaluation and its
    logged training rewards."""
    label, nproc, zero = RUNTIMES[key]
    out = work / f"{key}-{seed}"
    micro_batch = PROMPTS_PER_STEP // (nproc or 1)
    rc, output, seconds = _launch(
        ["grpo", "--config", CONFIG, "--train.out_dir", out, "--models.sft", sft, "--train.seed", seed,
         "--train.micro_batch_size", micro_batch, "--grpo.steps", plan["steps"], *runner.zero_args(**zero)],
        nproc, plan["timeout"])
    metrics = runner.read_metrics(out / "grpo")
    run = {"key": key, "label": label, "seed": seed, "seconds": seconds, "ok": rc == 0}
    if rc != 0:
        return {**run, "error": f"exit {rc}: {runner.error_tail(output)}"}
    evals = [m for m in metrics if HELD_OUT[0] in m]
    run["held_out"] = [{"step": m["step"], "greedy": m[HELD_OUT[0]], "sampled": m[HELD_OUT[1]],
                        "prompts": int(m["held-out prompts"])} for m in evals]
    run["reward"] = [(m["step"], m["reward"]) for m in metrics if "reward" in m]
    shutil.rmtree(out, ignore_errors=True)
    return run


def run(args, progress=print) -> dict:
    plan = options(args)
    result = {"plan": plan, "nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "runs": [], "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-grpo-math-") as tmp:
        work = Path(tmp)
        for seed in plan["seeds"]:
            base = work / f"sft-{seed}"
            rc, output, seconds = _launch(["sft", "--config", CONFIG, "--train.out_dir", base, "--train.seed", seed,
                                           *runner.zero_args(stage=0)], None, plan["timeout"])
            progress(f"  grpo_math: seed {seed}: SFT model in {seconds:.0f} s" + (f" FAILED: exit {rc}" if rc else ""))
            if rc != 0:
                result["runs"] += [{"key": k, "label": RUNTIMES[k][0], "seed": seed, "ok": False,
                                    "error": f"sft: exit {rc}: {runner.error_tail(output)}"} for k in RUNTIMES]
                continue
            for key in RUNTIMES:
                r = grpo_run(key, seed, plan, base / "sft" / "hf", work)
                result["runs"].append(r)
                text = (f"held-out greedy {r['held_out'][0]['greedy']:.3f} -> {r['held_out'][-1]['greedy']:.3f}"
                        if r["ok"] else f"FAILED: {r['error']}")
                progress(f"  grpo_math: seed {seed}, {r['label']}: {text} ({r['seconds']:.0f} s)")
    result["rows"] = rows(result["runs"])
    return result


def rows(runs: list[dict]) -> list[dict]:
    """One row per run: held-out rewards at the start and the end, whether the greedy one rose by more than
    twice its standard error, and (ZeRO++ rows) whether its end is the one process's within noise (two
    standard errors of the difference)."""
    out = []
    ones = {r["seed"]: r for r in runs if r["key"] == "one" and r["ok"]}
    for r in runs:
        row = {"key": r["key"], "label": r["label"], "seed": r["seed"], "ok": r["ok"]}
        if not r["ok"]:
            out.append({**row, "error": r["error"]})
            continue
        start, end = r["held_out"][0], r["held_out"][-1]
        se = math.hypot(standard_error(start["greedy"], start["prompts"]), standard_error(end["greedy"], end["prompts"]))
        rewards = [v for _, v in r["reward"]]
        fifth = max(1, len(rewards) // 5)
        row.update(prompts=end["prompts"], start_greedy=start["greedy"], end_greedy=end["greedy"],
                   start_sampled=start["sampled"], end_sampled=end["sampled"], rise=end["greedy"] - start["greedy"],
                   rise_se=se, rose=end["greedy"] - start["greedy"] > 2 * se,
                   train_first=sum(rewards[:fifth]) / fifth, train_last=sum(rewards[-fifth:]) / fifth,
                   minutes=r["seconds"] / 60)
        one = ones.get(r["seed"])
        if r["key"] != "one" and one is not None:
            o = one["held_out"][-1]
            noise = math.hypot(standard_error(o["greedy"], o["prompts"]), standard_error(end["greedy"], end["prompts"]))
            row.update(vs_one=end["greedy"] - o["greedy"], vs_one_se=noise,
                       same=abs(end["greedy"] - o["greedy"]) <= 2 * noise)
        out.append(row)
    return out


COLUMNS = [("seed", "seed", "{}"), ("label", "runtime", "{}"),
           ("start_greedy", "held-out greedy: start", "{:.3f}"), ("end_greedy", "end", "{:.3f}"),
           ("rise", "rise", "{:+.3f}"), ("rise_se", "its standard error", "{:.3f}"),
           ("start_sampled", "held-out sampled: start", "{:.3f}"), ("end_sampled", "end", "{:.3f}"),
           ("train_first", "training reward: first fifth", "{:.3f}"), ("train_last", "last fifth", "{:.3f}"),
           ("vs_one", "end - one process's", "{:+.3f}"), ("minutes", "minutes", "{:.1f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    seeds = sorted({r["seed"] for r in result["runs"]})
    for r in (r for r in result["runs"] if r["ok"]):  # a colour per seed; ZeRO++ dashed
        ax.plot([h["step"] for h in r["held_out"]], [h["greedy"] for h in r["held_out"]],
                label=f"{r['label']}, seed {r['seed']}", color=f"C{seeds.index(r['seed'])}",
                linestyle="--" if r["key"] == "zeropp" else "-")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out reward (greedy)")
    ax.legend(fontsize=7)
    ax.set_title("GRPO on the math task: one process and 2 x 2 ZeRO++")
    return [report.save(fig, out_dir, "grpo_math")]


def markdown(result: dict) -> str:
    plan, ok = result["plan"], [r for r in result["rows"] if r["ok"]]
    prompts = ok[0]["prompts"] if ok else 0
    lines = [f"Setup: `{CONFIG.relative_to(ROOT)}` (gpt2-tiny over the character tokenizer, one-step problems "
             f"with numbers up to 5); per seed one SFT model (one process), then {plan['steps']} GRPO steps of "
             f"{PROMPTS_PER_STEP} prompts x 8 samples from it in one process (micro-batch {PROMPTS_PER_STEP}) and "
             f"on {result['nodes']} x {result['ranks_per_node']} ranks under ZeRO++ (micro-batch 1), the same "
             f"seed; held-out reward on {prompts} prompts (1 for the right answer, 0.1 for another number) at "
             f"step 0 and every 50 steps. The ranks sample from their own random streams, so the runs agree "
             f"within noise, not step for step.", "", *report.md_table(result["rows"], COLUMNS)]
    zpp = [r for r in ok if r["key"] == "zeropp"]
    if zpp:
        rose, same = sum(r["rose"] for r in zpp), sum(r.get("same", False) for r in zpp)
        verdict = "met" if rose == same == len(plan["seeds"]) == len(zpp) else "not met"
        lines += ["", f"- R4 ({verdict}): under ZeRO++ the held-out greedy reward rose by more than twice its "
                      f"standard error on {rose} of {len(plan['seeds'])} seeds, and ended within two standard errors "
                      f"of the one process's on {same} of {len(plan['seeds'])}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("grpo_math"))
