"""Perplexity of quantized exports: qwZ-fine-tuned export vs the fp model vs RTN (issue 6, paper Table 2).

    python scripts/bench/quantized_perplexity.py                       # full run, ~10-15 min on 2 cores
    python scripts/bench/quantized_perplexity.py --quick               # smoke run, ~2 min
    python scripts/bench/quantized_perplexity.py --update-docs         # also write the docs/export.md section

In one run, on Tiny Shakespeare (../shared/data/tinyshakespeare.txt; skipped with a message if absent):

1. pretrains a small LLaMA-architecture base model in fp32 with `train.py` under ZeRO-3 on one
   process (sharded checkpoint), `--steps` steps;
2. fine-tunes it `--finetune-steps` more steps (`--resume <base> --train.steps N+K`) once without
   qwZ (the fp reference) and once per bit width b with qwZ at b bits (same block size for all;
   the sharded checkpoint is resharded from the ZeRO-3 layout to qwZ's aligned one on resume);
3. exports with scripts/export_quantized.py: each qwZ run at its own bits (exact: the weights its
   forward used) and the fp run with round-to-nearest (RTN) at every b;
4. evaluates the mean token NLL of the fp model, of RTN-b and of qwZ-b (each export loaded with
   models.export.load_lowbit) over the WHOLE validation split train.py uses (data.valid_fraction
   0.05 of the seq_len-128 samples, a random split fixed by train.seed; the same tokens for all);
5. writes results.json, results.csv, table.md and quantized_perplexity.png under --out, and with
   --update-docs the "Perplexity of quantized exports" section of docs/export.md plus
   docs/benchmarks/quantized_perplexity.png.

As a check of the export's exactness, each qwZ export's loss over the batches train.py's own final
evaluation used is compared with the validation loss train.py printed (its forward was qwZ's).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.bench import suite  # noqa: E402

DATA = "../shared/data/tinyshakespeare.txt"
SECTION = "## Perplexity of quantized exports"
DOC_PLOT = Path("docs/benchmarks/quantized_perplexity.png")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/quantized_perplexity", help="output directory")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps (results are not meaningful)")
    p.add_argument("--steps", type=int, help="pretraining steps of the base model (default 500; quick 30)")
    p.add_argument("--finetune-steps", type=int, help="fine-tuning steps per run (default 150; quick 10)")
    p.add_argument("--bits", default="8,6,4,3,2", help="comma-separated bit widths (8, 6, 4, 3, 2)")
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
    p.add_argument("--data", default=DATA)
    p.add_argument("--update-docs", action="store_true",
                   help="write the table into docs/export.md and the plot into docs/benchmarks/")
    p.add_argument("--docs-only", action="store_true",
                   help="no runs: rewrite the docs section and plot from <out>/results.json of an earlier run")
    args = p.parse_args(argv)
    args.steps = args.steps or (30 if args.quick else 500)
    args.finetune_steps = args.finetune_steps or (10 if args.quick else 150)
    args.bits = [int(b) for b in args.bits.split(",") if b.strip()]
    if args.block_size % 32:
        p.error("--block-size must be a multiple of 32 (GGUF-exact blocks)")
    return args


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], log: Path) -> str:
    """Run `cmd` from the repo root, tee its output to `log`; returns the output, raises on failure."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout)
    if proc.returncode:
        print(proc.stdout[-4000:])
        raise SystemExit(f"quantized_perplexity.py: command failed ({proc.returncode}), log in {log}")
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return proc.stdout


def _train_cmd(args, out_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "train.py", "--model.preset", args.preset, "--model.d_model", str(args.d_model),
            "--model.n_layer", str(args.n_layer), "--model.d_ff", str(args.d_ff),
            "--data.path", args.data, "--data.vocab_size", str(args.vocab_size), "--data.seq_len", str(args.seq_len),
            "--train.steps", str(steps), "--train.micro_batch_size", str(args.micro_batch_size),
            "--train.log_interval", str(max(1, steps // 10)), "--train.eval_interval", str(10**9),
            "--train.eval_batches", "1000", "--train.out_dir", str(out_dir), "--train.tensorboard", "false",
            "--train.progress_bar", "false", "--train.precision", "fp32",
            "--zero_optimization.stage", "3", "--zero_optimization.zero_quantization_block_size", str(args.block_size)]


def _final_val_loss(output: str) -> float:
    found = re.findall(r"^validation loss ([0-9.naif]+) \|", output, re.M)
    if not found:
        raise SystemExit("quantized_perplexity.py: train.py printed no final validation loss")
    return float(found[-1])


def _latest(out_dir: Path) -> Path:
    root = out_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


@torch.no_grad()
def evaluate(model, data, micro_batch_size: int, trainer_batches: int) -> dict:
    """Mean token NLL over the whole validation split (in order, batches of micro_batch_size), and
    over its first `trainer_batches` full batches: the tokens train.py's own evaluation used."""
    model.eval()
    valid = [int(i) for i in data.valid_indices]
    nll = n = 0.0
    sub_nll = sub_n = 0.0
    for b, start in enumerate(range(0, len(valid), micro_batch_size)):
        tokens, labels = data.batch(valid[start:start + micro_batch_size], torch.device("cpu"))
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum").double().item()
        nll += loss
        n += labels.numel()
        if b < trainer_batches and start + micro_batch_size <= len(valid):
            sub_nll += loss
            sub_n += labels.numel()
    return {"nll": nll / n, "ppl": math.exp(min(nll / n, 50)), "tokens": int(n),
            "trainer_subset_nll": sub_nll / max(sub_n, 1)}


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.2f}%"


def markdown_table(res: dict) -> str:
    fp = res["fp"]["ppl"]
    lines = ["| bits | fp ppl | RTN ppl (vs fp) | qwZ fine-tuned ppl (vs fp) |", "| --- | --- | --- | --- |"]
    for row in res["rows"]:
        lines.append(f"| {row['bits']} | {fp:.3f} | {row['rtn_ppl']:.3f} ({_pct(row['rtn_ppl'], fp)}) | "
                     f"{row['qwz_ppl']:.3f} ({_pct(row['qwz_ppl'], fp)}) |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = [r["bits"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(bits, [res["fp"]["ppl"]] * len(bits), "k--", label="fp32 (fine-tuned, unquantized)")
    ax.plot(bits, [r["rtn_ppl"] for r in res["rows"]], "o-", label="RTN of the fp model")
    ax.plot(bits, [r["qwz_ppl"] for r in res["rows"]], "s-", label="qwZ fine-tuned export (exact)")
    ax.set_xlabel("weight bits")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_yscale("log")
    ax.set_xticks(bits)
    ax.invert_xaxis()
    ax.set_title(f"Tiny Shakespeare, {res['model']['preset']} {res['model']['n_params'] / 1e6:.2f}M params, "
                 f"block {res['block_size']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def docs_section(res: dict, command: str) -> str:
    m, a = res["machine"], res["settings"]
    rows = res["rows"]
    worst = max(abs(r["exactness_diff"]) for r in rows)
    cfg = res["model"]["config"]
    return f"""{SECTION}

`scripts/bench/quantized_perplexity.py` (issue 6, the paper's Table 2). Measured {res['date']} on {m['cpu']},
{m['cores']} cores (shared with other jobs), torch {m['torch']}; the whole run took {res['wall_s'] / 60:.1f} min:

```bash
{command}
```

Setup. A LLaMA-architecture model (preset `{res['model']['preset']}` widened: d_model {a['d_model']},
{a['n_layer']} layers, d_ff {a['d_ff']}, {cfg['n_head']} heads / {cfg['n_kv_head']} KV heads, RMSNorm, SwiGLU, RoPE,
untied head; {res['model']['n_params'] / 1e6:.2f}M parameters; SentencePiece vocabulary {a['vocab_size']} trained on
the data, seq_len {a['seq_len']}) is pretrained in fp32 on Tiny Shakespeare for {a['steps']} steps (batch
{a['micro_batch_size']}, lr {a['lr']:g} cosine to {a['lr'] / 10:g}) with `train.py` under ZeRO-3 on one process
(sharded checkpoint). From that base, {a['finetune_steps']} more steps (`--resume <base step dir> --train.steps
{a['steps'] + a['finetune_steps']}`, constant lr {a['finetune_lr']:g}) are run once without qwZ (the fp reference)
and once per bit width with qwZ at that width (`zero_quantization_block_size` {res['block_size']} for all; the
checkpoint is resharded from the ZeRO-3 layout to qwZ's aligned one on resume). Each qwZ run is exported at its
own bits (exact: the weights its forward used), the fp run by RTN at every width, all with
`scripts/export_quantized.py`, and each export is loaded back with `load_lowbit`. Perplexity is exp of the mean
token NLL over the whole validation split `train.py` uses ({rows[0]['tokens']} target tokens: the random
`data.valid_fraction` = 0.05 of the 128-token samples fixed by `train.seed` 1234), the same tokens for every
model. The base model before fine-tuning: {res['base']['ppl']:.3f}. Relative increase vs the fp model in
parentheses.

{markdown_table(res)}
![perplexity vs bits]({DOC_PLOT.relative_to('docs').as_posix()})

Exactness check: over the batches `train.py`'s own final evaluation used, each qwZ export's loss equals the
validation loss its qwZ run printed (the qwZ forward's) within {worst:.1e}, i.e. within the 4 printed decimals.

{res['findings']}
"""


def update_docs(res: dict, command: str, plot_path: Path) -> None:
    doc = ROOT / "docs/export.md"
    text = doc.read_text()
    section = docs_section(res, command)
    if SECTION in text:  # replace our own section only: from its heading to the next "## " heading or the end
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[nxt + 1:] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)
    (ROOT / DOC_PLOT).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plot_path, ROOT / DOC_PLOT)
    print(f"updated {doc} and {ROOT / DOC_PLOT}")


def findings(res: dict) -> str:
    fp, rows = res["fp"]["ppl"], res["rows"]
    out = []
    ordered = [r["bits"] for r in rows if r["qwz_ppl"] <= r["rtn_ppl"]]
    out.append(f"qwZ fine-tuning beats RTN at {', '.join(map(str, ordered)) or 'no'} bits"
               + (f"; RTN is better or equal at {', '.join(str(r['bits']) for r in rows if r['bits'] not in ordered)}"
                  if len(ordered) < len(rows) else "") + ".")
    r4 = next((r for r in rows if r["bits"] == 4), None)
    if r4:
        out.append(f"At 4 bits: qwZ {_pct(r4['qwz_ppl'], fp)}, RTN {_pct(r4['rtn_ppl'], fp)} vs fp; the paper's "
                   f"'within 0.4%' is {'met' if r4['qwz_rel'] <= 0.004 else 'not met'} here.")
    r2 = next((r for r in rows if r["bits"] == 2), None)
    if r2:
        out.append(f"At 2 bits: qwZ {_pct(r2['qwz_ppl'], fp)}, RTN {_pct(r2['rtn_ppl'], fp)} vs fp"
                   + (" (qwZ far ahead of post-training quantization, as in the paper)."
                      if r2["rtn_ppl"] - fp > 2 * (r2["qwz_ppl"] - fp) else "."))
    out.append("Each qwZ row is a different fine-tuned model (trained with its own quantized forward), the RTN rows "
               "one fp model rounded, so differences below about 0.1% (8 and 6 bits) are the noise of the "
               "fine-tuning trajectory, not quantization error.")
    return " ".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.chdir(ROOT)
    command = "python scripts/bench/quantized_perplexity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.docs_only:
        res = json.loads((Path(args.out) / "results.json").read_text())
        res["findings"] = findings(res)
        plot(res, Path(args.out) / "quantized_perplexity.png")
        update_docs(res, res.get("command", "python scripts/bench/quantized_perplexity.py --update-docs"),
                    Path(args.out) / "quantized_perplexity.png")
        return
    if not Path(args.data).is_file():
        print(f"quantized_perplexity.py: skipped: {args.data} not found (the shared data sets live in ../shared/data "
              f"beside the project)")
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.perf_counter()
    out = Path(args.out)
    if out.exists():  # an earlier run of ours is replaced; anything else is left alone
        if any(out.iterdir()) and not ((out / "logs").is_dir() or (out / "results.json").is_file()):
            raise SystemExit(f"quantized_perplexity.py: --out {out} exists and is not an earlier output of this "
                             f"script; pick another directory")
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    logs = out / "logs"

    # 1. the fp32 base model
    base_out = out / "base"
    _run(_train_cmd(args, base_out, args.steps) + ["--optim.lr", str(args.lr), "--optim.min_lr", str(args.lr / 10),
                                                 "--optim.warmup_steps", str(max(1, args.steps // 20))],
         logs / "base.log")
    base_ckpt = _latest(base_out)

    # 2. fine-tunes: fp reference, and qwZ at each width
    total = args.steps + args.finetune_steps
    ft = ["--resume", str(base_ckpt), "--optim.lr", str(args.finetune_lr), "--optim.decay", "constant"]
    runs = {"fp": out / "ft_fp"}
    printed = {"fp": _final_val_loss(_run(_train_cmd(args, runs["fp"], total) + ft, logs / "ft_fp.log"))}
    for b in args.bits:
        runs[b] = out / f"ft_qwz{b}"
        qwz = ["--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_quantized_weights_bits",
               str(b)]
        printed[b] = _final_val_loss(_run(_train_cmd(args, runs[b], total) + ft + qwz, logs / f"ft_qwz{b}.log"))

    # 3. exports
    exports = {}
    for b in args.bits:
        exports[("rtn", b)] = out / "exports" / f"fp_rtn{b}"
        text = _run([sys.executable, "scripts/export_quantized.py", str(_latest(runs["fp"])), str(exports[("rtn", b)]),
                     "--format", "safetensors", "--bits", str(b), "--block-size", str(args.block_size)],
                    logs / f"export_rtn{b}.log")
        assert "RTN baseline" in text, text
        exports[("qwz", b)] = out / "exports" / f"qwz{b}"
        text = _run([sys.executable, "scripts/export_quantized.py", str(_latest(runs[b])), str(exports[("qwz", b)]),
                     "--format", "safetensors"], logs / f"export_qwz{b}.log")
        assert "exact" in text and f"{b} bits, block size {args.block_size}" in text, text

    # 4. evaluation on the validation split train.py uses
    from models.export import load_lowbit
    from trainer.checkpoint import load_source
    from trainer.config import DataSection
    from trainer.pretrain_data import prepare_pretraining

    data = prepare_pretraining(DataSection(path=args.data, vocab_size=args.vocab_size, seq_len=args.seq_len),
                               args.seq_len, 1234)
    trainer_batches = min(1000, max(1, len(data.valid_indices) // args.micro_batch_size))
    ev = lambda model: evaluate(model, data, args.micro_batch_size, trainer_batches)  # noqa: E731
    base_model = load_source(base_ckpt).model
    n_params = sum(p.numel() for p in base_model.parameters())
    res = {"date": datetime.date.today().isoformat(), "machine": suite.machine_info(), "block_size": args.block_size,
           "settings": {k: v for k, v in vars(args).items() if k not in ("out", "update_docs", "docs_only")},
           "model": {"preset": args.preset, "n_params": n_params, "config": base_model.config.__dict__},
           "command": command.strip(), "eval_split": "train.py's validation split (data.valid_fraction 0.05, seed 1234), every sample",
           "base": ev(base_model)}
    del base_model
    res["fp"] = ev(load_source(_latest(runs["fp"])).model)
    res["fp"]["train_py_val_loss"] = printed["fp"]
    rows = []
    for b in args.bits:
        rtn = ev(load_lowbit(exports[("rtn", b)])[0])
        qwz = ev(load_lowbit(exports[("qwz", b)])[0])
        rows.append({"bits": b, "fp_ppl": res["fp"]["ppl"], "rtn_nll": rtn["nll"], "rtn_ppl": rtn["ppl"],
                     "rtn_rel": rtn["ppl"] / res["fp"]["ppl"] - 1, "qwz_nll": qwz["nll"], "qwz_ppl": qwz["ppl"],
                     "qwz_rel": qwz["ppl"] / res["fp"]["ppl"] - 1, "tokens": qwz["tokens"],
                     "qwz_train_py_val_loss": printed[b],
                     "exactness_diff": qwz["trainer_subset_nll"] - printed[b]})
        print(f"{b} bits: fp {res['fp']['ppl']:.3f} | RTN {rtn['ppl']:.3f} | qwZ {qwz['ppl']:.3f} "
              f"(qwZ export vs train.py's printed loss: {rows[-1]['exactness_diff']:+.2e})", flush=True)
    res["rows"] = rows
    res["wall_s"] = time.perf_counter() - t_start
    res["findings"] = findings(res)

    # 5. outputs
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "table.md").write_text(markdown_table(res))
    plot(res, out / "quantized_perplexity.png")
    print(markdown_table(res))
    print(res["findings"])
    print(f"wrote {out}/results.json, results.csv, table.md, quantized_perplexity.png ({res['wall_s'] / 60:.1f} min)")
    if args.update_docs:
        update_docs(res, command.strip(), out / "quantized_perplexity.png")


if __name__ == "__main__":
    main()
