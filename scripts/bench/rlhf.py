"""RLHF on the emulated cluster: `rlhf.py ppo` under ZeRO-3 and under ZeRO++ on 2 nodes x 2 ranks, the runs
interleaved on one cluster, from SFT and reward models made once beforehand (so only PPO is timed).

    python scripts/bench/rlhf.py                  # 6-layer model, 2 x (ZeRO-3, ZeRO++) x 6 PPO steps
    python scripts/bench/rlhf.py --quick          # 3-layer model, 1 x (ZeRO-3, ZeRO++) x 4 PPO steps
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import report, runner
from scripts.bench.runner import NODES, RANKS_PER_NODE, ROOT, STEP_KEY
from scripts.bench.suite import Quick, main_one, options

TITLE = "## 6. RLHF: PPO generation and step time, ZeRO++ vs ZeRO-3"
# Every zero_optimization key either configuration sets, stated in full: the base config
# (configs/rlhf_tiny.yaml) enables ZeRO++, and neither run may inherit what the other sets.
ZERO3 = {"stage": 3, "communication_data_type": "bf16", "zero_quantized_weights": False,
         "zero_quantized_weights_bits": 8, "zero_quantized_weights_delta": False,
         "zero_hpz_partition_size": 1, "zero_quantized_gradients": False,
         "zero_quantized_nontrainable_weights": False}
ZEROPP = {**ZERO3, "zero_quantized_weights": True, "zero_hpz_partition_size": 0, "zero_quantized_gradients": True,
          "zero_quantized_nontrainable_weights": True}
PREP = {**ZERO3, "stage": 0}  # one process: no sharding
# qwZ deltas: each rank keeps its node's copy of the weights and receives only their change, int4 or
# int2 codes (docs/zeropp.md), so a rollout after an optimizer step syncs the generator with the change.
ZEROPP_DELTAS = {**ZEROPP, "zero_quantized_weights_delta": True}
D4 = {**ZEROPP_DELTAS, "zero_quantized_weights_bits": 4}
# key -> (label, zero_optimization, more rlhf.py arguments). The last two sample each step's rollout one
# update ahead (generation.staleness 1): on a thread while the step learns, or before it (the same samples).
CONFIGS = {"zero3": ("ZeRO-3 (bf16 wire)", ZERO3, []),
           "zeropp": ("ZeRO++ (qwZ int8, hpZ, qgZ int4, frozen int8)", ZEROPP, []),
           "zeropp-d4": ("ZeRO++ with qwZ int4 deltas", D4, []),
           "zeropp-d2": ("ZeRO++ with qwZ int2 deltas", {**ZEROPP_DELTAS, "zero_quantized_weights_bits": 2}, []),
           "ahead": ("int4 deltas, rollout sampled ahead, overlapped", D4, ["--generation.staleness", "1"]),
           "ahead-inline": ("int4 deltas, rollout sampled ahead, not overlapped", D4,
                            ["--generation.staleness", "1", "--generation.overlap", "false"])}
SYNC_GOAL = 0.15  # issue 32's R3: the cross-node bytes of a weight sync / the actor's bf16 bytes
OVERLAP_GOAL = 0.7  # issue 32's R2: the step time overlapped / not, the same staleness-1 recipe
BASE_CONFIG = ROOT / "configs" / "rlhf_tiny.yaml"
PRESET = "gpt2-small-cpu"
# DeepSpeed's ZeRO++ blog (DeepSpeed-Chat RLHF with ZeRO++ vs ZeRO on GPU clusters, models far larger than
# ours): ZeRO++ / ZeRO speedups of generation and of training.
DEEPSPEED = {"generation": 2.25, "training": 1.26}  # the first is issue 32's R1 goal
METRICS = {  # row key -> the metric rlhf/ppo.py logs per step
    "step_ms": STEP_KEY, "gen_tokens_per_s": "generation tokens/s", "train_tokens_per_s": "training tokens/s",
    "cross_gen_mb": "cross-node generation (MB)", "cross_exp_mb": "cross-node experience (MB)",
    "cross_train_mb": "cross-node training (MB)", "inference_copy_mb": "inference copy (MB)",
    "response_length": "response length",
}
MIB = {"cross_gen_mb", "cross_exp_mb", "cross_train_mb", "inference_copy_mb"}  # logged in MiB, shown in MB


def add_args(p) -> None:
    p.add_argument("--rate", default="100mbit", help="link rate of each node (default 100mbit)")
    p.add_argument("--n-layer", type=int, default=Quick(6, 3), help=f"{PRESET} layers (default %(default)s)")
    p.add_argument("--d-model", type=int, help="its width (default the preset's)")
    p.add_argument("--steps", type=int, default=Quick(6, 4), help="PPO steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=Quick(2, 1), help="steps of each run not timed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=Quick(2, 1), help="runs per configuration (default %(default)s)")
    p.add_argument("--micro-batch", type=int, default=8, help="prompts per rank and PPO step")
    p.add_argument("--max-new-tokens", type=int, default=8, help="response length limit")
    p.add_argument("--min-new-tokens", type=int, default=0, help="no EOS before this many tokens (equal to "
                   "--max-new-tokens: fixed-length responses, as DeepSpeed-Chat's benchmarks sample)")
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs per rollout (1, as DeepSpeed-Chat)")
    p.add_argument("--prep-steps", type=int, default=6, help="sft and reward steps of the prepared models")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=600, help="seconds per PPO run")


def common_args(plan: dict, out_dir: Path) -> list[str]:
    """The rlhf.py arguments of the preparation and of every PPO run: the built-in task, no data files."""
    return ["--config", str(BASE_CONFIG), "--data.task", "word", "--reward.source", "model",
            "--train.out_dir", str(out_dir), "--train.micro_batch_size", str(plan["micro_batch"]),
            "--train.seed", "1234", *runner.TIMED]


def prepare(plan: dict, work: Path) -> tuple[dict, str | None]:
    """The SFT and reward models, made once in one process (DDP runtime, no cluster):
    -> ({"sft", "reward": HF directories, "seconds"}, error or None)."""
    out = work / "prep"
    model = ["--model.preset", PRESET, "--model.n_layer", str(plan["n_layer"])]
    model += ["--model.d_model", str(plan["d_model"])] if plan["d_model"] else []
    cmd = [sys.executable, ROOT / "rlhf.py", "reward", *common_args(plan, out), *model,
           "--sft.steps", str(plan["prep_steps"]), "--reward.steps", str(plan["prep_steps"]),
           *runner.zero_args(**PREP)]
    start = time.monotonic()
    rc, output = runner.launch(cmd, None, nproc=None, timeout=plan["timeout"])
    paths = {"sft": out / "sft" / "hf", "reward": out / "reward" / "hf", "seconds": time.monotonic() - start}
    if rc != 0 or not all((paths[k] / "config.json").is_file() for k in ("sft", "reward")):
        return paths, f"exit {rc}: {runner.error_tail(output)}"
    return paths, None


def model_info(sft_dir: Path) -> dict:
    """The actor (the reference is the same model; the critic and reward model add a 1-output score head)."""
    from models.hf import config_from_hf

    mc = config_from_hf(json.loads((sft_dir / "config.json").read_text()), str(sft_dir / "config.json"))
    return runner.model_facts(mc, PRESET, mc.max_seq_len)


def ppo_run(key: str, repeat: int, plan: dict, models: dict, work: Path, cluster) -> dict:
    """One `rlhf.py ppo` run on the cluster: its timed steps' metrics and what the links carried."""
    label, zero, extra = CONFIGS[key]
    out_dir = work / f"{key}-{repeat}"
    cmd = [sys.executable, ROOT / "rlhf.py", "ppo", *common_args(plan, out_dir),
           "--models.sft", models["sft"], "--models.reward", models["reward"],
           "--ppo.steps", str(plan["steps"]), "--ppo.epochs", str(plan["epochs"]),
           "--generation.max_new_tokens", str(plan["max_new_tokens"]),
           "--generation.min_new_tokens", str(plan["min_new_tokens"]),
           # the first units' gathers would otherwise leave with the previous step's optimizer step (the rollout
           # keeps them): the whole weight sync in the generation phase, where R3 reads it
           *runner.zero_args(prefetch_across_steps=False, **zero), *extra]
    run = {"key": key, "label": label, "repeat": repeat, **runner.measured_launch(
        cmd, out_dir / "ppo" / "metrics.jsonl", cluster, plan["steps"], plan["warmup"], plan["timeout"])}
    shutil.rmtree(out_dir, ignore_errors=True)
    if run["ok"]:
        metrics = run.pop("metrics")
        run.update(steps=[{k: m.get(name) for k, name in METRICS.items()} for m in metrics[plan["warmup"]:]],
                   step_ms_all=[m[STEP_KEY] for m in metrics], reward=[m.get("reward") for m in metrics])
    return run


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(key: str, runs: list[dict], plan: dict, params: int) -> dict:
    """One row per configuration: medians over the timed steps of all its runs. `params`: the actor's, for the
    weight sync's bytes over its bf16 bytes (R3: what every rank sent across nodes while a rollout gathered
    the actor, which is the generator's whole weight traffic of the step, over 2 bytes a parameter)."""
    ok = [r for r in runs if r["key"] == key and r["ok"]]
    row = {"key": key, "label": CONFIGS[key][0], "setting": plan["rate"], "runs": len(ok)}
    if not ok:
        return {**row, "ok": False, "error": next((r["error"] for r in runs if r["key"] == key), "not run")}
    steps = [s for r in ok for s in r["steps"]]
    row.update(ok=True, timed_steps=len(steps))
    for k in METRICS:
        v = _median([s[k] for s in steps])
        row[k] = v * 2**20 / 1e6 if (k in MIB and v is not None) else v
    rollouts = plan["micro_batch"] * NODES * RANKS_PER_NODE
    row["gen_s"] = _median([s["response_length"] * rollouts / s["gen_tokens_per_s"] for s in steps
                            if s["response_length"] and s["gen_tokens_per_s"]])
    if row["cross_gen_mb"] is not None:
        row["sync_ratio"] = row["cross_gen_mb"] * 1e6 * NODES * RANKS_PER_NODE / (2 * params)
    parts = [row[k] for k in ("cross_gen_mb", "cross_exp_mb", "cross_train_mb")]
    row["cross_total_mb"] = sum(parts) if None not in parts else None
    for k in ("phys_tx_mb_node", "wire_ms"):
        row[k] = _median([r.get(k) for r in ok])
    if row.get("wire_ms") and row.get("step_ms"):
        row["link_busy_pct"] = 100 * row["wire_ms"] / row["step_ms"]
    return row


def _div(a, b):
    return a / b if a is not None and b else None


def ratios(rows: list[dict]) -> dict:
    """ZeRO++ / ZeRO-3, each a speedup (> 1: ZeRO++ faster) or a byte ratio; and every row's generation
    speedup over ZeRO-3 (R1, "gen_speedup")."""
    find = {r["key"]: r for r in rows if r.get("ok")}.get
    z3, zpp = find("zero3"), find("zeropp")
    for row in rows:  # the rows that sample after their update (a rollout ahead's time leaves out its weight gather)
        if z3 and row.get("ok") and not CONFIGS[row["key"]][2]:
            row["gen_speedup"] = _div(row["gen_tokens_per_s"], z3["gen_tokens_per_s"])
    ahead, inline = find("ahead"), find("ahead-inline")
    overlap = {"overlap": _div(ahead["step_ms"], inline["step_ms"])} if ahead and inline else {}
    if not (z3 and zpp):
        return overlap
    return {**overlap, "generation": zpp["gen_speedup"],
            "generation_time": _div(z3["gen_s"], zpp["gen_s"]),
            "step": _div(z3["step_ms"], zpp["step_ms"]),
            "training": _div(zpp["train_tokens_per_s"], z3["train_tokens_per_s"]),
            "cross_node_bytes": _div(zpp["cross_total_mb"], z3["cross_total_mb"]),
            "physical_bytes": _div(zpp.get("phys_tx_mb_node"), z3.get("phys_tx_mb_node"))}


def run(args, progress=print) -> dict:
    plan = {**options(args), "preset": PRESET}
    result = {"plan": plan, "nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "rows": [], "runs": []}
    why = runner.cluster_unavailable()
    if why:
        result["skipped"] = f"emulated cluster unavailable: {why}"
        return result
    with tempfile.TemporaryDirectory(prefix="bench-rlhf-") as tmp:
        work = Path(tmp)
        progress(f"  rlhf: preparing the sft and reward models ({PRESET}, {plan['n_layer']} layers, "
                 f"{plan['prep_steps']} steps each, one process)")
        models, error = prepare(plan, work)
        result["prep_seconds"] = models["seconds"]
        if error:
            result["skipped"] = f"preparing the sft and reward models failed ({error})"
            return result
        result["model"] = model_info(models["sft"])
        progress(f"  rlhf: {result['model']['params'] / 1e6:.2f}M parameters per model, prepared in "
                 f"{models['seconds']:.0f} s")
        order = [key for _ in range(plan["repeats"]) for key in plan["configs"]]  # interleaved
        with runner.cluster_at(plan["rate"]) as cluster:
            for i, key in enumerate(order):
                r = ppo_run(key, i // len(plan["configs"]), plan, models, work, cluster)
                result["runs"].append(r)
                text = (f"{_median([s['step_ms'] for s in r['steps']]):.0f} ms/step" if r["ok"]
                        else f"FAILED: {r['error']}")
                progress(f"  rlhf [{i + 1}/{len(order)}] {r['label']} @ {plan['rate']}: {text} ({r['wall_s']:.0f} s)")
    result["rows"] = [aggregate(key, result["runs"], plan, result["model"]["params"]) for key in plan["configs"]]
    result["ratios"] = ratios(result["rows"])
    if notes := [f"{r['label']}, run {r['repeat'] + 1}: failed: {r['error']}" for r in result["runs"] if not r["ok"]]:
        result["notes"] = notes
    return result


COLUMNS = [("label", "configuration", "{}"), ("setting", "link", "{}"),
           ("gen_tokens_per_s", "generation tokens/s", "{:.1f}"), ("gen_speedup", "/ ZeRO-3 (R1)", "{:.2f}"),
           ("gen_s", "generation s/step", "{:.2f}"), ("sync_ratio", "weight sync / bf16 actor (R3)", "{:.3f}"),
           ("step_ms", "PPO step ms", "{:.0f}"), ("train_tokens_per_s", "training tokens/s", "{:.1f}"),
           ("cross_gen_mb", "cross-node MB/rank: generation", "{:.2f}"),
           ("cross_exp_mb", "experience", "{:.2f}"), ("cross_train_mb", "training", "{:.2f}"),
           ("inference_copy_mb", "inference copy MB", "{:.2f}"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.1f}"), ("wire_ms", "wire time ms", "{:.0f}"),
           ("link_busy_pct", "link busy %", "{:.0f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows, rat, paths = [r for r in result["rows"] if r.get("ok")], result.get("ratios") or {}, []
    if "generation" in rat:
        series = {"ZeRO-3": [1.0, 1.0, 1.0],
                  "ZeRO++ (ours, CPU emulation)": [rat.get("generation"), rat.get("step"), rat.get("training")],
                  "ZeRO++ (DeepSpeed blog, GPUs)": [DEEPSPEED["generation"], DEEPSPEED["training"],
                                                    DEEPSPEED["training"]]}
        paths.append(report.bar_chart(
            out_dir, "rlhf_speedup", ["generation tokens/s", "PPO step (1 / time)", "training tokens/s"], series,
            f"PPO, {result['model']['params'] / 1e6:.1f}M-parameter models, 2 nodes x 2 ranks at "
            f"{result['plan']['rate']} (emulated)", "speed relative to ZeRO-3",
            labels={k: [f"{v:.2f}x" if v else "" for v in vs] for k, vs in series.items() if k != "ZeRO-3"}))
    if rows:
        phases = [("cross_gen_mb", "generation"), ("cross_exp_mb", "experience"), ("cross_train_mb", "training")]
        paths.append(report.bar_chart(out_dir, "rlhf_bytes", [p for _, p in phases],
                                      {r["label"]: [r.get(k) for k, _ in phases] for r in rows},
                                      "Cross-node bytes per phase (ledger)", "cross-node MB per PPO step (rank 0)"))
    return paths


def markdown(result: dict) -> str:
    plan, rat = result["plan"], result["ratios"]
    min_words = f" (at least {plan['min_new_tokens']})" if plan.get("min_new_tokens") else ""  # older results lack it
    lines = [
        f"Setup: {runner.model_words(result['model'])} each; {result['nodes']} nodes x {result['ranks_per_node']} "
        f"ranks at {plan['rate']}; {plan['micro_batch']} prompts per rank and step "
        f"({plan['micro_batch'] * NODES * RANKS_PER_NODE} rollouts), responses of at most {plan['max_new_tokens']} "
        f"tokens{min_words}, {plan['epochs']} PPO epoch(s) per rollout; SFT and reward models made once "
        f"({plan['prep_steps']} steps each, {result['prep_seconds']:.0f} s); {plan['repeats']} run(s) per "
        f"configuration, {plan['steps']} PPO steps each, the first {plan['warmup']} not timed.", "",
        *report.md_table(result["rows"], COLUMNS)]
    if "generation" in rat:
        ds_gen, ds_train = (f"{DEEPSPEED[k]:.2f}x" for k in ("generation", "training"))
        table = [("generation throughput (tokens/s)", "generation", "{:.2f}x", ds_gen),
                 ("generation time per step", "generation_time", "{:.2f}x", None),
                 ("PPO step (1 / step time)", "step", "{:.2f}x", f"{ds_train} (their training figure)"),
                 ("training phase (training tokens/s)", "training", "{:.2f}x", f"{ds_train} (the same figure)"),
                 ("cross-node bytes per step (ledger, rank 0)", "cross_node_bytes", "{:.3f}", None)]
        lines += ["", *report.md_table([{"what": what, "ours": report.fmt(rat.get(key), spec), "theirs": theirs}
                                        for what, key, spec, theirs in table],
                                       [("what", "ZeRO++ / ZeRO-3", "{}"), ("ours", "ours (CPU emulation)", "{}"),
                                        ("theirs", "DeepSpeed's ZeRO++ blog (GPUs)", "{}")])]
    rows = [r for r in result["rows"] if r.get("ok") and r["key"] != "zero3" and not CONFIGS[r["key"]][2]]
    goals = [("R1", "generation tokens/s / ZeRO-3's", "gen_speedup", "{:.2f}", f">= {DEEPSPEED['generation']}",
              lambda v: v >= DEEPSPEED["generation"]),
             ("R3", "cross-node bytes of a rollout's weight sync / the actor's bf16 bytes", "sync_ratio", "{:.3f}",
              f"<= {SYNC_GOAL}", lambda v: v <= SYNC_GOAL)]
    for name, what, key, spec, goal, holds in goals:
        measured = [(r["label"], r[key]) for r in rows if r.get(key) is not None]
        if measured:
            lines += ["", f"- {name}, {what} (goal {goal}): " + "; ".join(
                f"{label} {spec.format(v)} ({'met' if holds(v) else 'not met'})" for label, v in measured) + "."]
    if rat.get("overlap") is not None:
        verdict = "met" if rat["overlap"] <= OVERLAP_GOAL else "not met"
        lines += ["", f"- R2, PPO step time with the rollout sampled ahead on a thread / sampled ahead before the "
                      f"update (the same staleness-1 samples and updates; goal <= {OVERLAP_GOAL}): "
                      f"{rat['overlap']:.2f} ({verdict})."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("rlhf"))
