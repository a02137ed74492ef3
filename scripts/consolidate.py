"""Consolidate a training checkpoint (DDP's or ZeRO-3's sharded form) into a Hugging Face directory.

    python scripts/consolidate.py runs/x/checkpoints/step_00000300 runs/x/hf [--tokenizer PATH]
    python scripts/consolidate.py runs/x/checkpoints runs/x/adapter --peft-adapter   # LoRA run: adapters alone

Needs no process group, and never holds the model: each weight is read from the checkpoint (for
ZeRO-3's shards, just the ranges of each rank's file that hold it), converted and written before
the next one, so the peak memory is about the largest tensor (docs/export.md). The output is
written atomically; the tokenizer defaults to the one the run recorded. Every file is verified
against the checkpoint's checksums first. A qwZ run is exported with the weights its
forward computed with (its quantization grid), as its losses were measured; --master-weights
exports the fp32 master copy instead.
"""

import argparse
import sys

from export.peft import export_peft_adapter
from trainer.checkpoint import CheckpointError, export_hf, export_note, resolve_checkpoint


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ dir (its latest)")
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", help="a SentencePiece .model or a Hugging Face tokenizer dir")
    parser.add_argument("--master-weights", action="store_true",
                        help="a qwZ run: export the fp32 master weights, not the quantized ones it computed with")
    parser.add_argument("--peft-adapter", action="store_true",
                        help="a LoRA run: write its adapters alone as a PEFT adapter dir (docs/export.md)")
    parser.add_argument("--max-shard-size", type=int, metavar="BYTES",
                        help="split the weights into safetensors shards of at most BYTES, with an index file")
    parser.add_argument("--base-model", help="--peft-adapter: the base_model_name_or_path to record; default: "
                                             "the run's finetune.hf_checkpoint")
    args = parser.parse_args(argv)
    try:
        path = resolve_checkpoint(args.checkpoint, ".")
        if args.peft_adapter:
            print(export_peft_adapter(path, args.out_dir, args.base_model))
            return
        print(export_hf(path, args.out_dir, args.tokenizer, as_trained=not args.master_weights,
                        max_shard_size=args.max_shard_size))
        note = export_note(path, args.master_weights)
        if note:
            print(note, file=sys.stderr)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"consolidate.py: {e}")


if __name__ == "__main__":
    main()
