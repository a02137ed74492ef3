"""Pretrain a GPT-2 / OPT / LLaMA-style model.

    python train.py --config configs/quickstart.yaml
    torchrun --nproc-per-node 2 train.py --config configs/shakespeare.yaml --train.steps 500
    python train.py --config configs/quickstart.yaml --resume latest

Every config key can be overridden as --section.key value; --help lists them all (the finetune
section, for fine-tuning a Hugging Face model: finetune.py --help). A user error (a config key or
value, data, a checkpoint) ends the run with one line; --debug (or ZEROPP_DEBUG=1) shows the traceback.
"""

import sys

from trainer.preemption import catch_early

catch_early()  # first: a preemption warning while torch loads or data is prepared must not kill the rank
from trainer.config import parse_args  # noqa: E402
from trainer.loop import run_main, train  # noqa: E402

USAGE = f"usage: python train.py [--config FILE] [--section.key VALUE ...] [--debug]\n{__doc__}"


def main(argv: list[str]) -> None:
    run_main("train.py", argv, lambda args: parse_args(args, usage=USAGE, hide=("finetune",)), train)


if __name__ == "__main__":
    main(sys.argv[1:])
