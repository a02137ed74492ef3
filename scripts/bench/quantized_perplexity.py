"""Perplexity of quantized exports: qwZ-fine-tuned export vs the fp model vs RTN (issue 6, paper Table 2).

    python scripts/bench/quantized_perplexity.py                       # full run, ~10-15 min on 2 cores
    python scripts/bench/quantized_perplexity.py --quick               # smoke run, ~2 min
    python scripts/bench/quantized_perplexity.py --update-docs         # also write its section of docs/export.md

On Tiny Shakespeare: pretrain a small LLaMA in fp32 (train.py, ZeRO-3, one process), fine-tune it once
without qwZ and once per bit width with qwZ, export (each qwZ run at its own bits, exact; the fp run by
RTN at every width) and evaluate each export over the whole validation split train.py uses. Each qwZ
export's loss over train.py's own evaluation batches is checked against the loss train.py logged.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from pathlib import Path

from scripts.bench import report, runner
from scripts.bench.convergence import DATA
from scripts.bench.report import ROOT
from scripts.bench.suite import Quick, main_one, options

TITLE = "## Perplexity of quantized exports"
DOCS = ROOT / "docs" / "export.md"


def add_args(p) -> None:
    p.add_argument("--steps", type=int, default=Quick(500, 30),
                   help="pretraining steps of the base model (default %(default)s)")
    p.add_argument("--finetune-steps", type=int, default=Quick(150, 10),
                   help="fine-tuning steps per run (default %(default)s)")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4, 3, 2], help="bit widths (8, 6, 4, 3, 2)")
    p.add_argument("--block-size", type=int, default=64, help="qwZ / export block size (a multiple of 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="pretraining peak lr (cosine to lr/10)")
    p.add_argument("--finetune-lr", type=float, default=3e-4,
                   help="fine-tuning lr (constant; the pretraining schedule ends at --lr / 10)")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=352)
    p.add_argument("--vocab-size", type=int, default=2048, help="SentencePiece vocabulary trained on the data")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--data", type=Path, default=DATA)


def _run(cmd: list, log: Path, progress) -> str:
    """Run `cmd` from the repo root, its output to `log`; returns the output, raises on failure."""
    t0 = time.monotonic()
    rc, output = runner.launch(cmd, nproc=None, timeout=3600, log=log)
    if rc:
        raise RuntimeError(f"command failed ({rc}), log in {log}: {runner.error_tail(output)}")
    progress(f"  {log.stem}: {Path(cmd[1]).name} ({time.monotonic() - t0:.1f} s, output in {log})")
    return output


def _train_cmd(a, out_dir: Path, steps: int, *extra) -> list:
    return [sys.executable, ROOT / "train.py", "--model.preset", a.preset, "--model.d_model", a.d_model,
            "--model.n_layer", a.n_layer, "--model.d_ff", a.d_ff, "--data.path", a.data,
            "--data.vocab_size", a.vocab_size, "--data.seq_len", a.seq_len, "--train.steps", steps,
            "--train.micro_batch_size", a.micro_batch_size, "--train.log_interval", max(1, steps // 10),
            "--train.eval_interval", 10**9, "--train.eval_batches", 1000, "--train.out_dir", out_dir,
            "--train.tensorboard", "false", "--train.progress_bar", "false", "--train.precision", "fp32",
            *runner.zero_args(stage=3, zero_quantization_block_size=a.block_size), *extra]


def evaluate(model, data, micro_batch_size: int, trainer_batches: int) -> dict:
    """Mean token NLL over the whole validation split (in order, batches of micro_batch_size), and over its
    first `trainer_batches` full batches: the tokens train.py's own evaluation used."""
    import torch
    import torch.nn.functional as F

    model.eval()
    valid = [int(i) for i in data.valid_indices]
    nll = n = sub_nll = sub_n = 0.0
    with torch.no_grad():
        for b, start in enumerate(range(0, len(valid), micro_batch_size)):
            tokens, labels = data.batch(valid[start:start + micro_batch_size], torch.device("cpu"))
            loss = F.cross_entropy(model(tokens).float().flatten(0, -2), labels.flatten(), reduction="sum").item()
            nll, n = nll + loss, n + labels.numel()
            if b < trainer_batches and start + micro_batch_size <= len(valid):
                sub_nll, sub_n = sub_nll + loss, sub_n + labels.numel()
    return {"nll": nll / n, "ppl": math.exp(min(nll / n, 50)), "tokens": int(n),
            "trainer_subset_nll": sub_nll / max(sub_n, 1)}


def run(args, progress=print) -> dict:
    if args.block_size % 32:
        raise ValueError("--block-size must be a multiple of 32 (GGUF-exact blocks)")
    if not Path(args.data).is_file():
        return {"skipped": f"{args.data} not found (the shared data sets live in ../shared/data beside the project)"}
    t_start, out = time.monotonic(), args.out / "quantized_perplexity"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # 1. the fp32 base model; 2. fine-tunes: the fp reference and qwZ at each width. A run's checkpoints/
    # dir stands for its latest checkpoint wherever a checkpoint is read (resume, export, load_source).
    _run(_train_cmd(args, out / "base", args.steps, "--optim.lr", args.lr, "--optim.min_lr", args.lr / 10,
                    "--optim.warmup_steps", max(1, args.steps // 20)), logs / "base.log", progress)
    base = out / "base" / "checkpoints"
    ft = ["--resume", base, "--optim.lr", args.finetune_lr, "--optim.decay", "constant"]
    total, runs, logged = args.steps + args.finetune_steps, {}, {}
    for b in ["fp", *args.bits]:
        run_dir = out / f"ft_{'fp' if b == 'fp' else f'qwz{b}'}"
        qwz = [] if b == "fp" else runner.zero_args(zero_quantized_weights=True, zero_quantized_weights_bits=b)
        _run(_train_cmd(args, run_dir, total, *ft, *qwz), logs / f"{run_dir.name}.log", progress)
        runs[b] = run_dir / "checkpoints"
        logged[b] = [m for m in runner.read_metrics(run_dir) if "validation loss" in m][-1]["validation loss"]
    # 3. exports
    exports = {}
    for b in args.bits:
        exports["rtn", b], exports["qwz", b] = out / "exports" / f"fp_rtn{b}", out / "exports" / f"qwz{b}"
        text = _run([sys.executable, ROOT / "scripts" / "export_quantized.py", runs["fp"], exports["rtn", b],
                     "--format", "safetensors", "--bits", b, "--block-size", args.block_size],
                    logs / f"export_rtn{b}.log", progress)
        assert "RTN baseline" in text, text
        text = _run([sys.executable, ROOT / "scripts" / "export_quantized.py", runs[b], exports["qwz", b],
                     "--format", "safetensors"], logs / f"export_qwz{b}.log", progress)
        assert "exact" in text and f"{b} bits, block size {args.block_size}" in text, text
    # 4. evaluation on the validation split train.py uses
    import torch

    from export import load_lowbit, load_source
    from trainer.config import DataSection
    from trainer.pretrain_data import prepare_pretraining

    torch.set_num_threads(1)
    data = prepare_pretraining(DataSection(path=str(args.data), vocab_size=args.vocab_size, seq_len=args.seq_len),
                               args.seq_len, 1234)
    trainer_batches = min(1000, max(1, len(data.valid_indices) // args.micro_batch_size))

    def ev(model):
        return evaluate(model, data, args.micro_batch_size, trainer_batches)

    base_model = load_source(base).model
    result = {"date": datetime.date.today().isoformat(), "block_size": args.block_size,
              "settings": options(args),
              "model": {"preset": args.preset, "n_params": sum(p.numel() for p in base_model.parameters()),
                        "config": base_model.config.__dict__},
              "eval_split": "train.py's validation split (data.valid_fraction 0.05, seed 1234), every sample",
              "base": ev(base_model), "fp": {**ev(load_source(runs["fp"]).model),
                                             "train_py_val_loss": logged["fp"]}, "rows": []}
    fp = result["fp"]["ppl"]
    for b in args.bits:
        rtn, qwz = ev(load_lowbit(exports["rtn", b])[0]), ev(load_lowbit(exports["qwz", b])[0])
        result["rows"].append({
            "bits": b, "fp_ppl": fp, "rtn_nll": rtn["nll"], "rtn_ppl": rtn["ppl"], "rtn_rel": rtn["ppl"] / fp - 1,
            "qwz_nll": qwz["nll"], "qwz_ppl": qwz["ppl"], "qwz_rel": qwz["ppl"] / fp - 1, "tokens": qwz["tokens"],
            "qwz_train_py_val_loss": logged[b], "exactness_diff": qwz["trainer_subset_nll"] - logged[b]})
        progress(f"  {b} bits: fp {fp:.3f} | RTN {rtn['ppl']:.3f} | qwZ {qwz['ppl']:.3f} "
                 f"(qwZ export vs train.py's logged loss: {result['rows'][-1]['exactness_diff']:+.2e})")
    result["wall_s"] = time.monotonic() - t_start
    return result


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = result["rows"]
    fig, ax = report.pyplot().subplots(figsize=(6, 4))
    report.curves(ax, {"fp32 (fine-tuned, unquantized)": [(r["bits"], result["fp"]["ppl"]) for r in rows],
                       "RTN of the fp model": [(r["bits"], r["rtn_ppl"]) for r in rows],
                       "qwZ fine-tuned export (exact)": [(r["bits"], r["qwz_ppl"]) for r in rows]},
                  "weight bits", "held-out perplexity (log scale)", marker="o")
    ax.set_yscale("log")
    ax.set_xticks([r["bits"] for r in rows])
    ax.invert_xaxis()
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"Tiny Shakespeare, {result['model']['preset']} {result['model']['n_params'] / 1e6:.2f}M params, "
                 f"block {result['block_size']}", fontsize=9)
    return [report.save(fig, out_dir, "quantized_perplexity")]


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.2f}%"


def findings(result: dict) -> str:
    fp, rows = result["fp"]["ppl"], result["rows"]
    better = [r["bits"] for r in rows if r["qwz_ppl"] <= r["rtn_ppl"]]
    out = [f"qwZ fine-tuning beats RTN at {', '.join(map(str, better)) or 'no'} bits"
           + (f"; RTN is better or equal at {', '.join(str(r['bits']) for r in rows if r['bits'] not in better)}"
              if len(better) < len(rows) else "") + "."]
    by_bits = {r["bits"]: r for r in rows}
    if 4 in by_bits:
        r4 = by_bits[4]
        out.append(f"At 4 bits: qwZ {_pct(r4['qwz_ppl'], fp)}, RTN {_pct(r4['rtn_ppl'], fp)} vs fp; the paper's "
                   f"'within 0.4%' is {'met' if r4['qwz_rel'] <= 0.004 else 'not met'} here.")
    if 2 in by_bits:
        r2 = by_bits[2]
        out.append(f"At 2 bits: qwZ {_pct(r2['qwz_ppl'], fp)}, RTN {_pct(r2['rtn_ppl'], fp)} vs fp"
                   + (" (qwZ far ahead of post-training quantization, as in the paper)."
                      if r2["rtn_ppl"] - fp > 2 * (r2["qwz_ppl"] - fp) else "."))
    out.append("Each qwZ row is a different fine-tuned model (trained with its own quantized forward), the RTN rows "
               "one fp model rounded, so differences below about 0.1% (8 and 6 bits) are the noise of the "
               "fine-tuning trajectory, not quantization error.")
    return " ".join(out)


def markdown(result: dict) -> str:
    a, rows, cfg = result["settings"], result["rows"], result["model"]["config"]
    fp = result["fp"]["ppl"]
    table = [dict(r, rtn=f"{r['rtn_ppl']:.3f} ({_pct(r['rtn_ppl'], fp)})",
                  qwz=f"{r['qwz_ppl']:.3f} ({_pct(r['qwz_ppl'], fp)})") for r in rows]
    return "\n".join([
        f"`scripts/bench/quantized_perplexity.py` (issue 6, the paper's Table 2); the whole run took "
        f"{result['wall_s'] / 60:.1f} min.", "",
        f"Setup. A LLaMA-architecture model (preset `{a['preset']}` widened: d_model {a['d_model']}, {a['n_layer']} "
        f"layers, d_ff {a['d_ff']}, {cfg['n_head']} heads / {cfg['n_kv_head']} KV heads, RMSNorm, SwiGLU, RoPE, untied "
        f"head; {result['model']['n_params'] / 1e6:.2f}M parameters; SentencePiece vocabulary {a['vocab_size']} "
        f"trained on the data, seq_len {a['seq_len']}) is pretrained in fp32 on Tiny Shakespeare for {a['steps']} "
        f"steps (batch {a['micro_batch_size']}, lr {a['lr']:g} cosine to {a['lr'] / 10:g}) with `train.py` under "
        f"ZeRO-3 on one process (sharded checkpoint). From that base, {a['finetune_steps']} more steps (`--resume "
        f"<base step dir> --train.steps {a['steps'] + a['finetune_steps']}`, constant lr {a['finetune_lr']:g}) are "
        "run once without qwZ (the fp reference) and once per bit width with qwZ at that width "
        f"(`zero_quantization_block_size` {result['block_size']} for all; the checkpoint is resharded from the "
        "ZeRO-3 layout to qwZ's aligned one on resume). Each qwZ run is exported at its own bits (exact: the "
        "weights its forward used), the fp run by RTN at every width, all with `scripts/export_quantized.py`, and "
        "each export is loaded back with `load_lowbit`. Perplexity is exp of the mean token NLL over the whole "
        f"validation split `train.py` uses ({rows[0]['tokens']} target tokens: the random `data.valid_fraction` = "
        "0.05 of the 128-token samples fixed by `train.seed` 1234), the same tokens for every model. The base "
        f"model before fine-tuning: {result['base']['ppl']:.3f}. Relative increase vs the fp model in parentheses.",
        "", *report.md_table(table, [("bits", "bits", "{}"), ("fp_ppl", "fp ppl", "{:.3f}"),
                                     ("rtn", "RTN ppl (vs fp)", "{}"), ("qwz", "qwZ fine-tuned ppl (vs fp)", "{}")]),
        "", "Exactness check: over the batches `train.py`'s own final evaluation used, each qwZ export's loss equals "
        "the validation loss its qwZ run logged (the qwZ forward's) within "
        f"{max(abs(r['exactness_diff']) for r in rows):.1e}.", "",
        findings(result)])


if __name__ == "__main__":
    sys.exit(main_one("quantized_perplexity"))
