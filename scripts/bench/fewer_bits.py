"""Fewer bits, same model (issue 35, F1-F4): 2-bit weights, int2 gradients with error feedback, the Q4 export
of a qwZ-4 run against round-to-nearest of a normally trained model, SEPARATE at CR 16; all against ZeRO-3.

    python scripts/bench/fewer_bits.py                   # F1-F4, ~25 min on 2 cores
    python scripts/bench/fewer_bits.py --quick           # every run at 60 steps (a smoke run, no verdicts)
    python scripts/bench/fewer_bits.py --runs zero3 w2 g2ef --parts training

The held-out corpus is the dialogues of ../shared/data's Anthropic HH preference pairs (the chosen side),
written out as plain text: no test and no other benchmark pretrains on it. The model, optimizer and layout are
section 4's (convergence.py: gpt2-tiny, 0.68M parameters, 4 ranks as 2 nodes x 2, same seed for every run).
F4 runs on Tiny Shakespeare (the default config the issue names) for its own step count.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from scripts.bench import convergence, report, runner
from scripts.bench.report import ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## 10. Fewer bits, same model (issue 35, F1-F4)"
HH = ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
G2 = {"stage": 3, "zero_quantized_gradients": True, "zero_quantized_gradients_bits": 2}
LOCO = {**G2, "zero_quantized_gradients_error_feedback": True, "zero_quantized_gradients_error_beta": 0.8,
        "zero_quantized_gradients_error_reset": 1024}
# run key -> (label, zero_optimization keys, the target it answers)
RUNS = {
    "zero3": ("ZeRO-3 (bf16)", {"stage": 3}, "baseline"),
    "w4": ("ZeRO++ 4-bit qwZ, hpZ, 4-bit qgZ", {**convergence.ZPP, "zero_quantized_weights_bits": 4}, "context"),
    "w2": ("ZeRO++ 2-bit qwZ, hpZ, 4-bit qgZ", {**convergence.ZPP, "zero_quantized_weights_bits": 2}, "F1"),
    "w2b64": ("ZeRO++ 2-bit qwZ, hpZ, 4-bit qgZ, blocks of 64",
              {**convergence.ZPP, "zero_quantized_weights_bits": 2, "zero_quantization_block_size": 64}, "F1"),
    "w2d": ("ZeRO++ 2-bit qwZ deltas, hpZ, 4-bit qgZ",
            {**convergence.ZPP, "zero_quantized_weights_bits": 2, "zero_quantized_weights_delta": True}, "F1"),
    "g2": ("ZeRO-3 + int2 qgZ", G2, "F2"),
    "g2ef": ("ZeRO-3 + int2 qgZ, error feedback", {**G2, "zero_quantized_gradients_error_feedback": True}, "F2"),
    "g2loco": ("ZeRO-3 + int2 qgZ, LoCo error feedback (beta 0.8, reset 1024)", LOCO, "F2"),
    "g2loco64": ("ZeRO-3 + int2 qgZ, LoCo error feedback, blocks of 64",
                 {**LOCO, "zero_quantization_block_size": 64}, "F2"),
    "qwz4": ("ZeRO-3 + 4-bit qwZ (the forward on the export grid)",
             {"stage": 3, "zero_quantized_weights": True, "zero_quantized_weights_bits": 4}, "F3"),
}
SEPARATE_RUNS = {  # F4, on Tiny Shakespeare
    "zero3": ("ZeRO-3 (bf16)", {"stage": 3}),
    "sep16": ("ZeRO-3 + SEPARATE CR 16 (the defaults)", {"stage": 3, "gradient_compression.method": "separate",
                                                         "gradient_compression.ratio": 16}),
    "sep16vc": ("ZeRO-3 + SEPARATE CR 16, variance_correction", {
        "stage": 3, "gradient_compression.method": "separate", "gradient_compression.ratio": 16,
        "gradient_compression.variance_correction": True}),
}


def add_args(p) -> None:
    p.add_argument("--parts", nargs="+", choices=["training", "export", "separate"],
                   default=["training", "export", "separate"])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="training runs (default all)")
    p.add_argument("--steps", type=int, default=Quick(500, 60), help="training steps (default %(default)s)")
    p.add_argument("--separate-steps", type=int, default=Quick(300, 60), help="F4's steps (default %(default)s)")
    p.add_argument("--finetune-steps", type=int, default=Quick(100, 20),
                   help="F3's quantization-aware fine-tune of the ZeRO-3 model (default %(default)s)")
    p.add_argument("--block-size", type=int, default=256, help="quantization block (default %(default)s)")
    p.add_argument("--export-block-size", type=int, default=32,
                   help="F3's block: the 4-bit grid of its qwZ runs and exports (default %(default)s: GGUF Q4_0's)")
    p.add_argument("--eval-interval", type=int, help="default: steps / 10")
    for name, default in [("eval-batches", 8), ("micro-batch", 4), ("seq", 128), ("lr", 2e-3), ("timeout", 1800.0)]:
        p.add_argument(f"--{name}", type=type(default), default=default)


def corpus(out: Path) -> Path:
    """The chosen dialogues of the HH pairs, one after the other, as a text file under `out`."""
    path = out / "hh_chosen.txt"
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(HH, "rt") as f:
            text = "\n\n".join(json.loads(line)["chosen"].strip() for line in f if line.strip())
        path.write_text(text + "\n")
    return path


def plan_for(args, data: Path, steps: int) -> dict:
    return {**options(args), "data": str(data), "steps": steps,
            "eval_interval": args.eval_interval or max(1, steps // 10)}


def train(plan: dict, key: str, label: str, zero: dict, work: Path, extra=(), checkpoint=False, block=None) -> dict:
    """One train.py run on 4 ranks (2 x 2): its validation curve, final losses and step time."""
    out = work / key
    ckpt = ["--train.checkpoint_interval", str(plan["steps"])] if checkpoint else []
    zargs = runner.zero_args(**{"zero_quantization_block_size": block or plan["block_size"], **zero})
    return {"key": key, "label": label, **convergence.training_summary(convergence.curve_run(
        [sys.executable, ROOT / "train.py", *convergence.train_args(plan), "--train.out_dir", out, *ckpt, *zargs,
         *extra], out, plan["timeout"]))}


def export_perplexity(plan: dict, work: Path, runs: dict[str, Path], progress) -> list[dict]:
    """F3: each checkpoint exported at 4 bits (the qwZ run exactly on its grid, the others by RTN), loaded back
    and evaluated (token perplexity) on the whole validation split train.py uses."""
    import torch

    from export import load_lowbit, load_source
    from scripts.bench.quantized_perplexity import evaluate
    from trainer.config import DataSection
    from trainer.pretrain_data import prepare_pretraining

    torch.set_num_threads(1)
    data = prepare_pretraining(DataSection(path=plan["data"], vocab_size=2048, seq_len=plan["seq"],
                                           cache_dir=str(ROOT / "cache")), plan["seq"], 1234)
    rows = []
    for key, ckpt in runs.items():
        target = work / "exports" / key
        cmd = [sys.executable, ROOT / "scripts" / "export_quantized.py", ckpt, target, "--format", "safetensors",
               "--bits", "4", "--block-size", plan["export_block_size"]]
        rc, text = runner.launch(cmd, nproc=None, timeout=900)
        if rc:
            raise RuntimeError(f"export of {ckpt} failed: {runner.error_tail(text)}")
        exact = "exact" in text and "RTN baseline" not in text
        fp = evaluate(load_source(ckpt).model, data, plan["micro_batch"])
        q4 = evaluate(load_lowbit(target)[0], data, plan["micro_batch"])
        rows.append({"key": key, "exact": exact, "fp_ppl": fp["ppl"], "q4_ppl": q4["ppl"], "tokens": q4["tokens"]})
        progress(f"  export {key}: fp {fp['ppl']:.3f}, Q4 {'(exact grid)' if exact else '(RTN)'} {q4['ppl']:.3f}")
    return rows


def run(args, progress=print) -> dict:
    if not HH.is_file() or not convergence.DATA.is_file():
        return {"skipped": f"{HH} or {convergence.DATA} not found (../shared/data beside the project)"}
    out = args.out / "fewer_bits"
    data = corpus(out)
    plan = plan_for(args, data, args.steps)
    result = {"plan": plan, "rows": [], "exports": [], "separate": [],
              "model": runner.model_summary(config_args=convergence.train_args(plan))}
    work = out / "runs"
    keys = list(dict.fromkeys(["zero3", *args.runs] + (["qwz4"] if "export" in args.parts else [])))
    if "training" in args.parts or "export" in args.parts:
        for i, key in enumerate(keys, 1):
            label, zero, target = RUNS[key]
            row = train(plan, key, label, zero, work, checkpoint=key in ("zero3", "qwz4"),
                        block=plan["export_block_size"] if key == "qwz4" else None)
            result["rows"].append({**row, "target": target})
            progress(f"  fewer bits [{i}/{len(keys)}] {label}: " + (
                f"validation {row['final_val_loss']:.4f}" if row["ok"] else row["error"]) + f" ({row['wall_s']:.0f} s)")
        convergence.relative_to_zero3(result["rows"])
    if "export" in args.parts:
        ft = dict(plan, steps=args.steps + args.finetune_steps)
        resume = ["--resume", work / "zero3" / "checkpoints", "--optim.lr", str(args.lr / 10),
                  "--optim.decay", "constant"]
        for key, zero in [("ft_fp", {"stage": 3}), ("ft_qwz4", RUNS["qwz4"][1])]:
            row = train(ft, key, key, zero, work, resume, checkpoint=True, block=plan["export_block_size"])
            if not row["ok"]:
                raise RuntimeError(f"{key}: {row['error']}")
            progress(f"  {key}: validation {row['final_val_loss']:.4f} ({row['wall_s']:.0f} s)")
        runs = {k: work / k / "checkpoints" for k in ("zero3", "qwz4", "ft_fp", "ft_qwz4")}
        result["exports"] = export_perplexity(plan, work, runs, progress)
    if "separate" in args.parts:
        splan = plan_for(args, convergence.DATA, args.separate_steps)
        for key, (label, zero) in SEPARATE_RUNS.items():
            row = train(splan, key, label, zero, out / "separate")
            result["separate"].append(row)
            progress(f"  F4 {label}: " + (f"validation {row['final_val_loss']:.4f}" if row["ok"] else row["error"]))
        convergence.relative_to_zero3(result["separate"])
    return result


def targets(result: dict) -> list[dict]:
    """F1-F4 from the runs."""
    rows = {r["key"]: r for r in result["rows"] if r.get("ok")}
    ex = {r["key"]: r for r in result["exports"]}
    sep = {r["key"]: r for r in result["separate"] if r.get("ok")}
    out = []

    def add(fid, what, value, goal, met, fmt="{:+.2%}"):
        verdict = met if isinstance(met, str) else ("yes" if met else "no")
        out.append({"id": fid, "measure": what, "value": fmt.format(value) if value is not None else "–",
                    "goal": goal, "met": "–" if value is None else verdict})

    for key in ("w2", "w2b64", "w2d"):
        if key in rows:
            v = rows[key].get("rel_diff")
            add("F1", f"validation loss, {RUNS[key][0]} ÷ ZeRO-3 - 1", v, "within 1%", v is not None and v <= 0.01)
    for key in ("g2", "g2ef", "g2loco", "g2loco64"):
        if key in rows:
            v = rows[key].get("rel_diff")
            add("F2", f"validation loss, {RUNS[key][0]} ÷ ZeRO-3 - 1", v, "within 1%", v is not None and v <= 0.01)
    for trained, normal, how in [("qwz4", "zero3", "trained with 4-bit weights from step 0"),
                                 ("ft_qwz4", "ft_fp", f"ZeRO-3 model + {result['plan']['finetune_steps']} "
                                                      "steps on the 4-bit grid")]:
        if trained in ex and normal in ex:
            ratio = ex[trained]["q4_ppl"] / ex[normal]["q4_ppl"]
            gap = ex[normal]["q4_ppl"] - ex[normal]["fp_ppl"]
            closed = (ex[normal]["q4_ppl"] - ex[trained]["q4_ppl"]) / gap if gap > 0 else None
            verdict = f"≤ 0.97: {'yes' if ratio <= 0.97 else 'no'}; half: " + \
                ("–" if closed is None else "yes" if closed >= 0.5 else "no")
            add("F3", f"Q4 export perplexity, {how} ÷ RTN-4 of the normally trained one (closes "
                      f"{'–' if closed is None else f'{closed:.0%}'} of RTN's loss vs fp)", ratio,
                "≤ 0.97 (close ≥ half of RTN's loss vs fp)", verdict, "{:.3f}")
    for key, what in [("sep16", "(defaults)"), ("sep16vc", "with variance_correction")]:
        if key in sep:
            v = sep[key].get("rel_diff")
            add("F4", f"validation loss, SEPARATE CR 16 {what} ÷ ZeRO-3 - 1, {result['plan']['separate_steps']} "
                      "steps, Tiny Shakespeare", v, "within 3%", v is not None and v <= 0.03)
    return out


COLUMNS = [("label", "run", "{}"), ("target", "for", "{}"), ("final_val_loss", "final validation loss", "{:.4f}"),
           ("rel_diff", "vs ZeRO-3", "{:+.2%}"), ("final_train_loss", "final training loss", "{:.4f}"),
           ("step_ms", "ms/step", "{:.0f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result["rows"] if r.get("ok")]
    fig, ax = report.pyplot().subplots(figsize=(7, 4.2))
    report.curves(ax, {r["label"]: r["val_curve"] for r in rows}, "step", "validation loss", marker="o", ms=3)
    ax.set_title("HH dialogues (held out), 4 ranks as 2 nodes x 2", fontsize=9)
    return [report.save(fig, out_dir, "fewer_bits")]


def markdown(result: dict) -> str:
    plan, m = result["plan"], result["model"]
    lines = [f"Setup: the chosen dialogues of the HH pairs as plain text (SentencePiece vocabulary 2048 trained on "
             f"them); {runner.model_words(m)}; {plan['micro_batch']}x{plan['seq']} tokens per rank, {plan['steps']} "
             f"steps, lr {plan['lr']:g} (cosine to a tenth), block size {plan['block_size']}; validation every "
             f"{plan['eval_interval']} steps on {plan['eval_batches']} batches per rank. The whole run took "
             f"{result['seconds'] / 60:.1f} min.", "",
             *report.md_table(targets(result), [("id", "id", "{}"), ("measure", "measure", "{}"),
                                                ("value", "measured", "{}"), ("goal", "goal", "{}"),
                                                ("met", "met", "{}")]), "",
             *report.md_table(result["rows"], COLUMNS)]
    if result["exports"]:
        lines += ["", f"Exports at 4 bits, block {plan['export_block_size']} (the qwZ runs F3 compares trained on "
                      "that grid; low-bit safetensors, which GGUF Q4_0 holds as they are), perplexity over the whole "
                      "validation split:", "",
                  *report.md_table(result["exports"], [("key", "checkpoint", "{}"), ("exact", "export on its grid",
                                                                                  "{}"),
                                                       ("fp_ppl", "fp32 perplexity", "{:.3f}"),
                                                       ("q4_ppl", "4-bit export perplexity", "{:.3f}")])]
    if result["separate"]:
        lines += ["", f"F4 (Tiny Shakespeare, {plan['separate_steps']} steps):", "",
                  *report.md_table(result["separate"], COLUMNS[:1] + COLUMNS[2:])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_one("fewer_bits"))
