"""Our ZeRO-3 / ZeRO++ against DDP, PyTorch FSDP2 and DeepSpeed ZeRO-3 on the same emulated cluster.

    python scripts/bench/peers.py                 # 100mbit (2 nodes x 2) and unshaped loopback
    python scripts/bench/peers.py --quick         # 100mbit only: ZeRO++, DDP, FSDP2, DeepSpeed (fp32)
    python scripts/bench/peers.py --runtimes zero3-fp32 deepspeed-fp32 --settings loopback

Every runtime trains the same model (ablation.MODEL_ARGS: a 10.56M-parameter GPT-2), the same
data (train.py's default-corpus pipeline: each rank gets the very same samples), with the same
AdamW, schedule and clipping, micro-batch 4 x 128 tokens per rank on 2 nodes x 2 ranks. Ours
and DDP run through `train.py`; FSDP2 and DeepSpeed through `scripts/bench/peer_train.py`,
which wraps our model with `fully_shard` / `deepspeed.initialize` (their loss curves equal
train.py's, which the table shows as the final loss). Step times are the mean after the
warm-up steps, measured the same way in both scripts.

Wire dtypes: DDP all-reduces fp32 gradients. Our ZeRO-3 sends bf16 by default
(communication_data_type) while computing in fp32; `zero3-fp32` sends fp32. FSDP2 and DeepSpeed
gather in the dtype they compute in: `fp32`, or `bf16`, which also makes them COMPUTE in bf16
(several times slower than fp32 on a CPU). "Same wire dtype" comparisons therefore pair
zero3-fp32 with deepspeed-fp32 (both fp32 compute: the fair one) and zero3-bf16 with
deepspeed-bf16 (DeepSpeed pays for bf16 compute). DeepSpeed's ZeRO++ quantization flags
(zero_quantized_weights / _gradients) need its CUDA quantizer and fail on CPU: `deepspeed-zeropp`
records that error; its hpZ runs.

DeepSpeed's defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keep a model
this small gathered from the forward to the backward: it makes 2 collectives per step (forward
gather, gradient reduce) where ZeRO-3 proper (ours) makes 3. The `deepspeed-*` rows use those
defaults, as a user would get them; hpZ only acts on the backward re-gather, so its row
(`deepspeed-hpz-regather-fp32`) sets both to 0 (`deepspeed-regather-fp32`: the same without hpZ).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench import suite  # noqa: E402
from scripts.bench.ablation import (  # noqa: E402
    CONFIGS, NODES, RANKS_PER_NODE, SEQ, ClusterSession, Job, cluster_unavailable, describe_row, model_summary, run_job,
)

_Z3 = CONFIGS["zero3"][1]
RUNTIMES = {  # key -> (label, family, kind, args)
    "zeropp": ("ZeRO++ (ours: qwZ int8, hpZ, qgZ int4)", "ours", "train", CONFIGS["zeropp"][1]),
    "zero3-bf16": ("ZeRO-3 (ours, bf16 wire, fp32 compute)", "ours", "train", _Z3),
    "zero3-fp32": ("ZeRO-3 (ours, fp32 wire)", "ours", "train",
                   _Z3 + ["--zero_optimization.communication_data_type", "fp32"]),
    "ddp": ("DDP (train.py stage 0, fp32 all-reduce)", "ddp", "train", ["--zero_optimization.stage", "0"]),
    "fsdp2-fp32": ("FSDP2 fully_shard (fp32)", "fsdp2", "peer", ["--runtime", "fsdp2"]),
    "fsdp2-bf16": ("FSDP2 fully_shard (bf16 gather + reduce, bf16 compute)", "fsdp2", "peer",
                   ["--runtime", "fsdp2", "--dtype", "bf16"]),
    "deepspeed-fp32": ("DeepSpeed ZeRO-3 (fp32)", "deepspeed", "peer", ["--runtime", "deepspeed"]),
    "deepspeed-bf16": ("DeepSpeed ZeRO-3 (bf16, bf16 compute)", "deepspeed", "peer",
                       ["--runtime", "deepspeed", "--dtype", "bf16"]),
    "deepspeed-hpz-fp32": ("DeepSpeed ZeRO-3 + hpZ (fp32)", "deepspeed", "peer",
                           ["--runtime", "deepspeed", "--hpz", str(RANKS_PER_NODE)]),
    "deepspeed-regather-fp32": ("DeepSpeed ZeRO-3 (fp32, re-gather for backward)", "deepspeed", "peer",
                                ["--runtime", "deepspeed", "--ds-regather"]),
    "deepspeed-hpz-regather-fp32": ("DeepSpeed ZeRO-3 + hpZ (fp32, re-gather for backward)", "deepspeed", "peer",
                                    ["--runtime", "deepspeed", "--hpz", str(RANKS_PER_NODE), "--ds-regather"]),
    "deepspeed-zeropp": ("DeepSpeed ZeRO++ (qwZ + qgZ + hpZ)", "deepspeed", "peer",
                         ["--runtime", "deepspeed", "--hpz", str(RANKS_PER_NODE), "--ds-quantized"]),
}
FULL = {"100mbit": ["zeropp", "zero3-bf16", "zero3-fp32", "ddp", "fsdp2-fp32", "fsdp2-bf16", "deepspeed-fp32",
                    "deepspeed-bf16", "deepspeed-hpz-regather-fp32"],
        "loopback": ["zeropp", "zero3-bf16", "zero3-fp32", "deepspeed-fp32", "deepspeed-bf16", "deepspeed-zeropp"]}
QUICK = {"100mbit": ["zeropp", "ddp", "fsdp2-fp32", "deepspeed-fp32"]}
MICRO_BATCH = 4


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="100mbit", help="the slow link (default 100mbit)")
    p.add_argument("--settings", nargs="+", choices=["slow", "loopback"], default=None,
                   help="slow = the emulated cluster at --rate; loopback = 4 local ranks, unshaped")
    p.add_argument("--runtimes", nargs="+", choices=list(RUNTIMES), default=None)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 5, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default 2, quick 1)")
    p.add_argument("--timeout", type=float, default=900)


def resolve(args) -> dict:
    quick = getattr(args, "quick", False)
    table = QUICK if quick else FULL
    settings = args.settings or (["slow"] if quick else ["slow", "loopback"])
    plan = {}
    for s in settings:
        key = args.rate if s == "slow" else "loopback"
        base = table.get("100mbit" if s == "slow" else "loopback", [])
        plan[key] = [r for r in (args.runtimes or base) if r in RUNTIMES]
    return {"rate": args.rate, "settings": plan, "micro_batch": args.micro_batch,
            "steps": args.steps or (2 if quick else 5), "warmup": args.warmup if args.warmup is not None else
            (1 if quick else 2), "timeout": args.timeout}


def _reusable(reuse: dict | None, key: str, setting: str, plan: dict) -> dict | None:
    """A row of the ablation run in the same suite with the very same job (our ZeRO-3 bf16 / ZeRO++),
    timed the same way (steps, warm-up)."""
    ab_key = {"zeropp": "zeropp", "zero3-bf16": "zero3"}.get(key)
    if not reuse or not ab_key:
        return None
    for r in reuse.get("rows", []):
        if (r.get("ok") and r["key"] == ab_key and r.get("rate") == setting and r["micro_batch"] == plan["micro_batch"]
                and r.get("steps") == plan["steps"] and r.get("warmup") == plan["warmup"]):
            return r
    return None


def run(args, progress=print) -> dict:
    plan = resolve(args)
    reuse = getattr(args, "reuse", None)
    result = {"benchmark": "peers", "plan": plan, "model": model_summary(), "nodes": NODES,
              "ranks_per_node": RANKS_PER_NODE, "rows": [], "notes": []}
    have_ds = deepspeed_installed()
    if not have_ds:
        result["notes"].append("DeepSpeed: not installed (pip install -r requirements-bench.txt)")
    why = cluster_unavailable()
    total = sum(len(v) for v in plan["settings"].values())
    done = 0
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for setting, keys in plan["settings"].items():
            if setting != "loopback" and why:
                result["notes"].append(f"{setting}: skipped, emulated cluster unavailable: {why}")
                progress(f"  peers: {setting} skipped ({why})")
                done += len(keys)
                continue
            with ClusterSession(None if setting == "loopback" else setting) as cluster:
                for key in keys:
                    label, family, kind, rargs = RUNTIMES[key]
                    done += 1
                    base = {"key": key, "label": label, "family": family, "setting_key": setting,
                            "micro_batch": plan["micro_batch"]}
                    if family == "deepspeed" and not have_ds:
                        row = {**base, "ok": False, "error": "not installed (pip install -r requirements-bench.txt)"}
                        result["rows"].append(row)
                        progress(f"  peers [{done}/{total}] {label} @ {setting}: DeepSpeed not installed")
                        continue
                    t0 = time.monotonic()
                    prior = _reusable(reuse, key, setting, plan)
                    if prior:
                        row = {**prior, **base, "reused_from": "ablation"}
                    else:
                        row = run_job(Job(key, label, kind, rargs), plan["micro_batch"], plan["steps"], plan["warmup"],
                                      Path(tmp), cluster, plan["timeout"])
                        row.update(base)
                    result["rows"].append(row)
                    progress(f"  peers [{done}/{total}] {label} @ {setting}: {describe_row(row)}"
                             + (" (from the ablation run)" if prior else f" ({time.monotonic() - t0:.0f} s)"))
    add_ratios(result["rows"])
    return result


def add_ratios(rows: list[dict]) -> None:
    for setting in {r["setting_key"] for r in rows}:
        same = [r for r in rows if r["setting_key"] == setting and r.get("ok")]
        zpp = next((r for r in same if r["key"] == "zeropp"), None)
        for r in same:
            if zpp:
                r["zeropp_speedup"] = zpp["tokens_per_s"] / r["tokens_per_s"]
        for dtype in ("fp32", "bf16"):
            ours = next((r for r in same if r["key"] == f"zero3-{dtype}"), None)
            ds = next((r for r in same if r["key"] == f"deepspeed-{dtype}"), None)
            if ours and ds:
                ours["vs_deepspeed_same_dtype"] = ours["tokens_per_s"] / ds["tokens_per_s"]


COLUMNS = [("label", "runtime", "{}"), ("setting_key", "link", "{}"), ("step_ms", "step ms", "{:.0f}"),
           ("tokens_per_s", "tokens/s", "{:.0f}"), ("tflops_per_rank", "TFLOP/s per rank", "{:.4f}"),
           ("zeropp_speedup", "ZeRO++ speedup over it", "{:.2f}x"),
           ("vs_deepspeed_same_dtype", "ours / DeepSpeed, same wire dtype", "{:.2f}x"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"), ("wire_ms", "wire time ms", "{:.0f}"),
           ("final_loss", "loss at last step", "{:.4f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result.get("rows", []) if r.get("ok")]
    if not rows:
        return []
    plt = suite.pyplot()
    settings = list(result["plan"]["settings"])
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        mine = [r for r in rows if r["setting_key"] == setting]
        colors = {"ours": "tab:orange", "ddp": "tab:gray", "fsdp2": "tab:green", "deepspeed": "tab:blue"}
        ax.barh([r["label"] for r in mine], [r["tokens_per_s"] for r in mine],
                color=[colors.get(r["family"], "tab:gray") for r in mine])
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (4 ranks)")
        ax.set_title("unshaped loopback" if setting == "loopback" else f"{setting} links, 2 nodes x 2 ranks")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return [suite.save_fig(fig, out_dir, "peers_throughput")]


def markdown(result: dict, images: dict[str, str]) -> str:
    m, plan = result["model"], result["plan"]
    lines = ["## 2. Peers: DDP, PyTorch FSDP2, DeepSpeed ZeRO-3", "",
             f"Same model ({m['params'] / 1e6:.2f}M-parameter GPT-2), data, AdamW and {plan['micro_batch']}x{SEQ} "
             f"tokens per rank on {result['nodes']} nodes x {result['ranks_per_node']} ranks; {plan['steps']} steps "
             f"per run, the first {plan['warmup']} not timed. FSDP2 and DeepSpeed run through "
             "`scripts/bench/peer_train.py` (our model wrapped with `fully_shard` / `deepspeed.initialize`); their "
             "loss at the last step equals train.py's, i.e. they train the same thing. FSDP2 and DeepSpeed gather "
             "in the dtype they compute in, so their bf16 rows also compute in bf16 (slow on CPU); the fair "
             "same-wire-dtype comparison is fp32 vs fp32. Rows marked (ablation) are the ablation's runs of the "
             "same job in this suite run.", "",
             "Bytes: at the same wire dtype our ZeRO-3 (forward gather, backward gather, ring reduce-scatter) and "
             "DeepSpeed ZeRO-3 with its defaults (see below) move about the same bytes; FSDP2 moves more on gloo because gloo's reduce-scatter costs about an all-reduce (see "
             "[zero3.md](zero3.md); our runtime uses a send/recv ring instead); DDP all-reduces fp32 gradients once "
             "(1.5x the model's fp32 bytes per node through gloo's ring). DeepSpeed with its defaults "
             "(stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keeps a model this small gathered from "
             "the forward to the backward, so it gathers once per step where ZeRO-3 proper gathers twice, but its "
             "gradient reduce on gloo costs about an all-reduce. hpZ only acts on a backward re-gather, so the hpZ "
             "row sets both limits to 0 (re-gather, as ZeRO-3 proper). DeepSpeed's ZeRO++ quantization "
             "(zero_quantized_weights / zero_quantized_gradients) needs its CUDA quantizer kernels and fails on CPU "
             "(the row shows its error).", ""]
    for note in result.get("notes", []):
        lines += [f"- {note}"]
    if result.get("notes"):
        lines.append("")
    rows = [dict(r, label=r["label"] + (" (ablation)" if r.get("reused_from") else "")) for r in result["rows"]]
    lines += suite.md_table(rows, COLUMNS)
    lines.append("")
    if "peers_throughput" in images:
        lines += [f"![peers_throughput]({images['peers_throughput']})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    suite.add_common_args(p)
    args = p.parse_args(argv)
    return suite.run_standalone("peers", run, plots, markdown, args)


if __name__ == "__main__":
    sys.exit(main())
