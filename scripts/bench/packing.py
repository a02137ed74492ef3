"""Sequence packing (data.packing) against padding: padding share and training speed, side by side in one run.

    python -m scripts.bench.packing --data ../shared/data/alpaca_en_demo.json --seq-len 512 --steps 20 \
        --pairs ../shared/data/hh-rlhf-harmless-base-test.jsonl.gz

A gpt2-tiny model (the configs' preset; max_seq_len raised to --seq-len) is written as a Hugging Face
directory with a byte-level BPE tokenizer trained on the data set, then fine-tuned by trainer.loop's
Trainer once padded and once packed, one process, fp32, the same micro-batches of examples. The padding
share is over the epoch's micro-batches (slots computed that hold no token); the speed is steps/s over
--steps steps after two warm-up steps, timed in alternating rounds of 4 steps so that both paths see the
machine's same load; tokens/s counts real (non-padding) tokens only, CPU s the process's CPU time.
"""

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import finetune
from data.datasets import PreferenceDataset
from data.packing import pack
from data.tokenizer import load_tokenizer
from models.config import ModelConfig
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.transformer import Transformer
from rlhf.common import ModelRuntime
from rlhf.config import RLHFConfig
from rlhf.pairs import _pair_batch, _response_logprob_sums
from scripts.bench.memory import write_bpe_tokenizer
from trainer.config import parse_args
from trainer.loop import Trainer

ROUND = 4  # steps timed on one path before the other's turn


def hf_model(data: Path, seq_len: int, directory: Path) -> Path:
    tokenizer_dir = directory / "tokenizer"
    tokenizer_dir.mkdir()
    write_bpe_tokenizer(tokenizer_dir, data)
    torch.manual_seed(0)
    vocab_size = load_tokenizer(tokenizer_dir).vocab_size
    config = ModelConfig.from_preset("gpt2-tiny", vocab_size=vocab_size, max_seq_len=seq_len)
    save_hf_checkpoint(Transformer(config), directory / "model", tokenizer_dir=tokenizer_dir,
                       token_ids={"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    return directory / "model"


def padding(trainer: Trainer, micro: list[list[int]]) -> dict[str, float]:
    """The share of computed slots that hold no token, over the micro-batches `micro`."""
    slots = real = 0
    for indices in micro:
        inputs, _ = trainer.data.batch(indices, torch.device("cpu"))
        slots += inputs["tokens"].numel()
        real += sum(len(trainer.data.dataset[i]["tokens"]) - 1 for i in indices)
    return {"padding share": 1 - real / slots, "slots per micro-batch": slots / len(micro),
            "real tokens per step": real / len(micro) * trainer.cfg.train.grad_accum}


def timed_steps(trainer: Trainer, batches, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of `steps` training steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        trainer.train_step(batches)
    return time.perf_counter() - wall, time.process_time() - cpu


def dpo_pairs(args, model_dir: Path, trainer: Trainer) -> dict[str, list[float]]:
    """DPO's policy forward + backward (rlhf.pairs) on batches of --micro-batch-size pairs, padded and
    packed by ModelRuntime: (padding share, steps/s), timed in alternating rounds as the SFT steps."""
    batch_pairs, max_len = args.micro_batch_size, args.seq_len
    prefs = PreferenceDataset(str(args.pairs), load_tokenizer(model_dir), max_len)
    batches = [_pair_batch(SimpleNamespace(dataset=prefs), list(range(i, i + batch_pairs)), 2, torch.device("cpu"))
               for i in range(0, len(prefs) - batch_pairs + 1, batch_pairs)]
    lengths = [b["attention_mask"].sum(-1).tolist() for b in batches]
    slots = {"padded": sum(b["tokens"].numel() for b in batches),
             "packed": sum(pack(n, b["tokens"].shape[1]).document_ids().numel() for n, b in zip(lengths, batches))}
    models = {}
    for name in ("padded", "packed"):
        cfg = RLHFConfig()
        cfg.train.precision, cfg.data.packing = "fp32", name == "packed"
        torch.manual_seed(0)
        models[name] = ModelRuntime("policy", (load_hf_checkpoint(model_dir), None), cfg, trainer.env, lr=1e-6)
    seconds = dict.fromkeys(models, 0.0)
    for start in range(0, args.steps, ROUND):
        for name, model in models.items():
            began = time.perf_counter()
            for batch in batches[start:start + ROUND]:
                _response_logprob_sums(model, batch).sum().backward()
            seconds[name] += time.perf_counter() - began
    for model in models.values():
        model.close()
    real = sum(sum(n) for n in lengths)
    return {name: [1 - real / slots[name], min(args.steps, len(batches)) / seconds[name]] for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per path, in rounds of 4")
    parser.add_argument("--pairs", type=Path, help="also DPO's forward + backward on these preference pairs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = hf_model(args.data, args.seq_len, Path(tmp))
        trainers = {}
        for name, packing in (("padded", "false"), ("packed", "true")):
            trainers[name] = Trainer(parse_args(
                ["--finetune.hf_checkpoint", str(model_dir), "--data.path", str(args.data), "--data.seq_len",
                 str(args.seq_len), "--data.packing", packing, "--data.cache_dir", f"{tmp}/cache",
                 "--train.out_dir", f"{tmp}/run-{name}", "--train.micro_batch_size", str(args.micro_batch_size),
                 "--train.precision", "fp32", "--train.tensorboard", "false", "--train.progress_bar", "false"],
                finetune.defaults()))
        try:
            mbs = args.micro_batch_size
            ids = trainers["padded"].data.train_indices.tolist()
            micro = [ids[i:i + mbs] for i in range(0, len(ids) - mbs + 1, mbs)]
            rows = {name: padding(trainer, micro) for name, trainer in trainers.items()}
            batches = {name: iter(micro * (args.steps // len(micro) + 2)) for name in trainers}
            times = {name: [0.0, 0.0] for name in trainers}
            for name, trainer in trainers.items():  # warm-up
                timed_steps(trainer, batches[name], 2)
            for _ in range(args.steps // ROUND):  # alternating rounds: both see the machine's same load
                for name, trainer in trainers.items():
                    times[name] = [a + b for a, b in zip(times[name], timed_steps(trainer, batches[name], ROUND))]
        finally:
            for trainer in trainers.values():
                trainer.close()
        if args.pairs:
            pairs = dpo_pairs(args, model_dir, trainers["padded"])
    steps = args.steps // ROUND * ROUND
    print(f"{args.data.name}, seq_len {args.seq_len}, micro-batch {args.micro_batch_size} examples, "
          f"gpt2-tiny, fp32, {torch.get_num_threads()} threads")
    print("| path | padding share | slots per micro-batch | steps/s | real tokens/s | CPU s per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        wall, cpu = times[name]
        print(f"| {name} | {r['padding share']:.1%} | {r['slots per micro-batch']:.0f} | {steps / wall:.2f} | "
              f"{steps * r['real tokens per step'] / wall:.0f} | {cpu / steps:.2f} |")
    if args.pairs:
        print(f"\nDPO policy forward + backward, {args.pairs.name}, {args.micro_batch_size} pairs a batch, "
              f"max_len {args.seq_len}")
        print("| path | padding share | batches/s |\n| --- | --- | --- |")
        for name, (share, speed) in pairs.items():
            print(f"| {name} | {share:.1%} | {speed:.2f} |")

if __name__ == "__main__":
    main()
