"""Convergence of ZeRO++ against ZeRO-3 (the ZeRO++ paper's Table 5 / Fig. 9): `train.py` on Tiny Shakespeare,
4 local ranks laid out as 2 nodes x 2, the same seed for every run.

    python scripts/bench/convergence.py                   # ZeRO-3; ZeRO++ 8-, 6-, 4-bit qwZ, 4-bit deltas; 250 steps
    python scripts/bench/convergence.py --quick           # ZeRO-3 and ZeRO++ 8-bit, 60 steps
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import report, runner
from scripts.bench.report import ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## 4. Convergence (paper Table 5 / Fig. 9)"
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
# A tiny GPT-2: 2 layers, d_model 128, 4 heads, 128-token context (+ the 2048-token vocabulary: 0.68M)
MODEL_ARGS = ["--config", str(ROOT / "configs" / "shakespeare.yaml"), "--model.preset", "gpt2-tiny",
              "--model.n_layer", "2", "--model.d_model", "128", "--model.d_ff", "512", "--model.n_head", "4",
              "--model.max_seq_len", "128"]
ZPP = {"stage": 3, "zero_hpz_partition_size": 0, "zero_quantized_gradients": True,
       "zero_quantized_gradients_bits": 4, "zero_quantized_weights": True}


def add_args(p) -> None:
    p.add_argument("--steps", type=int, default=Quick(250, 60), help="training steps (default %(default)s)")
    p.add_argument("--bits", type=int, nargs="+", default=Quick([8, 6, 4], [8]),
                   help="qwZ bit widths (default %(default)s)")
    p.add_argument("--delta-bits", type=int, nargs="*", default=Quick([4], []),
                   help="qwZ delta bit widths (zero_quantized_weights_delta; default %(default)s)")
    p.add_argument("--eval-interval", type=int, help="default: steps / 10 (quick: steps / 4)")
    for name, default in [("eval-batches", 8), ("micro-batch", 4), ("seq", 128), ("lr", 2e-3), ("data", DATA),
                          ("timeout", 1200.0)]:
        p.add_argument(f"--{name}", type=type(default), default=default)


def resolve(args) -> dict:
    return {**options(args), "data": str(args.data),
            "eval_interval": args.eval_interval or max(1, args.steps // (4 if args.quick else 10))}


def train_args(plan: dict) -> list[str]:
    steps, lr = plan["steps"], plan["lr"]
    return [*MODEL_ARGS, "--data.path", plan["data"], "--data.seq_len", str(plan["seq"]),
            "--data.cache_dir", str(ROOT / "cache"), "--train.steps", str(steps),
            "--train.micro_batch_size", str(plan["micro_batch"]), "--train.log_interval", str(max(1, steps // 40)),
            "--train.eval_interval", str(plan["eval_interval"]), "--train.eval_batches", str(plan["eval_batches"]),
            "--train.checkpoint_interval", "0", "--train.progress_bar", "false", "--train.tensorboard", "false",
            "--optim.lr", str(lr), "--optim.min_lr", str(lr / 10), "--optim.warmup_steps", str(max(1, steps // 10)),
            *runner.zero_args(ranks_per_node=2)]


def fp32_curve_args(plan: dict, **zero) -> list[str]:
    """This job logging every step and evaluating at step 0, computing in fp32, with these zero_optimization keys
    (separate.py's and tensor_parallel.py's convergence runs)."""
    return [*train_args(plan), "--train.log_interval", "1", "--train.eval_at_start", "true",
            "--train.precision", "fp32", *runner.zero_args(**zero)]


def data_missing(path) -> str | None:
    """Why a benchmark on Tiny Shakespeare cannot run (None when it can)."""
    return None if Path(path).is_file() else f"{path} not found (Tiny Shakespeare lives in ../shared/data beside it)"


def curve_run(cmd: list, out: Path, timeout: float, nproc: int | None = 4) -> dict:
    """Run a train.py job that evaluates as it goes (its --train.out_dir `out`): {"ok", "wall_s", "runtime",
    "error"}, or its validation curve and logged steps ("metrics")."""
    start = time.monotonic()
    rc, text = runner.launch(cmd, nproc=nproc, timeout=timeout)
    row = {"wall_s": time.monotonic() - start, "runtime": runner.said(text, "runtime")}
    val = runner.validation_curve(out)
    if rc or not val:
        return {**row, "ok": False, "error": f"exit {rc}: {runner.error_tail(text)}"}
    return {**row, "ok": True, "final_val_loss": val[-1][1], "val_curve": val,
            "metrics": [m for m in runner.read_metrics(out) if runner.STEP_KEY in m]}


def training_summary(row: dict) -> dict:
    """A curve_run's row with its logged steps condensed: the training curve, the final training loss and
    the mean step time (the first step, which builds everything, left out)."""
    if row["ok"]:
        steps = row.pop("metrics")
        times = [m[runner.STEP_KEY] for m in steps]
        row.update(train_curve=[(m["step"], m["lm loss"]) for m in steps], final_train_loss=steps[-1]["lm loss"],
                   step_ms=statistics.mean(times[1:] or times))
    return row


def run(args, progress=print) -> dict:
    plan = resolve(args)
    result = {"plan": plan, "rows": []}
    if why := data_missing(plan["data"]):
        return {**result, "skipped": why}
    result["model"] = runner.model_summary(config_args=train_args(plan))
    runs = {"zero3": ("ZeRO-3 (bf16)", runner.zero_args(stage=3))}
    for b in plan["bits"]:
        runs[f"zeropp-w{b}"] = (f"ZeRO++ {b}-bit qwZ, hpZ, 4-bit qgZ",
                                runner.zero_args(**ZPP, zero_quantized_weights_bits=b))
    for b in plan["delta_bits"]:
        runs[f"zeropp-d{b}"] = (f"ZeRO++ {b}-bit qwZ deltas, hpZ, 4-bit qgZ", runner.zero_args(
            **ZPP, zero_quantized_weights_bits=b, zero_quantized_weights_delta=True))
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        for i, (key, (label, zargs)) in enumerate(runs.items(), 1):
            out = Path(tmp) / key
            row = {"key": key, "label": label, **training_summary(curve_run(
                [sys.executable, ROOT / "train.py", *train_args(plan), "--train.out_dir", out, *zargs], out,
                plan["timeout"]))}
            result["rows"].append(row)
            progress(f"  convergence [{i}/{len(runs)}] {label}: "
                     + (f"final validation loss {row['final_val_loss']:.4f}" if row["ok"] else row["error"])
                     + f" ({row['wall_s']:.0f} s)")
    relative_to_zero3(result["rows"])
    return result


def relative_to_zero3(rows: list[dict]) -> None:
    """Each successful row's final validation loss relative to the "zero3" row's ("rel_diff"), where that ran."""
    if base := next((r for r in rows if r["key"] == "zero3" and r["ok"]), None):
        for r in (r for r in rows if r["ok"]):
            r["rel_diff"] = (r["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]


COLUMNS = [("label", "run", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
           ("rel_diff", "vs ZeRO-3", "{:+.2%}"), ("final_train_loss", "final training loss", "{:.4f}"),
           ("step_ms", "ms/step", "{:.0f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result["rows"] if r["ok"]]
    fig, (ax, ax2) = report.pyplot().subplots(1, 2, figsize=(11, 4.2))
    report.curves(ax, {r["label"]: r["val_curve"] for r in rows}, "step", "validation loss", marker="o", ms=3)
    report.curves(ax2, {r["label"]: r["train_curve"] for r in rows}, "step", "training loss (logged steps)", lw=1)
    ax.set_title("Tiny Shakespeare, 4 ranks as 2 nodes x 2")
    return [report.save(fig, out_dir, "convergence")]


def markdown(result: dict) -> str:
    plan, m = result["plan"], result["model"]
    return "\n".join([
        f"Setup: Tiny Shakespeare (SentencePiece vocabulary); {runner.model_words(m)}; {plan['micro_batch']}x"
        f"{plan['seq']} tokens per rank, {plan['steps']} steps, lr {plan['lr']:g}; validation every "
        f"{plan['eval_interval']} steps on {plan['eval_batches']} batches per rank.", "",
        *report.md_table(result["rows"], COLUMNS)])


if __name__ == "__main__":
    sys.exit(main_one("convergence"))
