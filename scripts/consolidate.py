"""Consolidate a training checkpoint (DDP's or ZeRO-3's sharded form) into a Hugging Face directory.

    python scripts/consolidate.py runs/x/checkpoints/step_00000300 runs/x/hf [--tokenizer PATH]

Needs no process group: sharded checkpoints are read shard file by shard file. The output
is written atomically; the tokenizer defaults to the one the run recorded.
"""

import argparse
import sys

from trainer.checkpoint import CheckpointError, export_hf, resolve_checkpoint


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ dir (its latest)")
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", help="a SentencePiece .model or a Hugging Face tokenizer dir")
    args = parser.parse_args(argv)
    try:
        path = resolve_checkpoint(args.checkpoint, ".")
        print(export_hf(path, args.out_dir, args.tokenizer))
    except (CheckpointError, FileNotFoundError) as e:
        sys.exit(f"consolidate.py: {e}")


if __name__ == "__main__":
    main()
