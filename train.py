"""Pretrain a GPT-2 / OPT / LLaMA-style model.

    python train.py --config configs/quickstart.yaml
    torchrun --nproc-per-node 2 train.py --config configs/shakespeare.yaml --train.steps 500
    python train.py --config configs/quickstart.yaml --resume latest

Every config key can be overridden as --section.key value; --help lists them all.
"""

import sys

from trainer.preemption import catch_early

catch_early()  # first: a preemption warning while torch loads or data is prepared must not kill the rank
from trainer.config import ConfigError, parse_args  # noqa: E402
from trainer.loop import run_main, train  # noqa: E402


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        sys.exit(f"train.py: config error: {e}")
    run_main("train.py", train, cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
