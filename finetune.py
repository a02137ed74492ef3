"""Fine-tune a Hugging Face GPT-2 / OPT / LLaMA / Qwen / Mistral checkpoint on an SFT data set (Alpaca or HH).

    python finetune.py --config configs/finetune_alpaca.yaml --finetune.hf_checkpoint path/to/hf_model
    torchrun --nproc-per-node 4 finetune.py --config configs/finetune_alpaca_lora_zeropp.yaml \\
        --finetune.hf_checkpoint path/to/hf_model --zero_optimization.ranks_per_node 2
    python finetune.py --config configs/finetune_alpaca.yaml --finetune.hf_checkpoint ... --resume latest

The same trainer, checkpoints and config keys as train.py (docs/finetune.md); here
finetune.hf_checkpoint is required and the run ends by writing <out_dir>/hf, a Hugging Face
directory with any LoRA adapters merged. --help lists every key. A user error ends the run with
one line; --debug (or ZEROPP_DEBUG=1) shows the traceback.
"""

import sys

from trainer.preemption import catch_early

catch_early()  # first: a preemption warning while torch loads or data is prepared must not kill the rank
from trainer.config import Config, ConfigError, parse_args  # noqa: E402
from trainer.loop import run_main, train  # noqa: E402

USAGE = (f"usage: python finetune.py --finetune.hf_checkpoint DIR [--config FILE] [--section.key VALUE ...] "
         f"[--debug]\n{__doc__}")
# Keys of pretraining from scratch: a fine-tune's model and tokenizer come from its Hugging Face directory.
HIDDEN = ("model", "data.json_key", "data.vocab_size")


def defaults() -> Config:
    """train.py's defaults, except that the result is exported as a Hugging Face directory."""
    cfg = Config()
    cfg.train.export_hf = True
    cfg.train.out_dir = "runs/finetune"
    return cfg


def parse(argv: list[str]) -> Config:
    cfg = parse_args(argv, defaults(), usage=USAGE, hide=HIDDEN)
    if cfg.finetune.hf_checkpoint is None:
        raise ConfigError("finetune.py needs --finetune.hf_checkpoint: a Hugging Face model directory "
                          "(config.json, model.safetensors and the tokenizer files)")
    return cfg


def main(argv: list[str]) -> None:
    run_main("finetune.py", argv, parse, train)


if __name__ == "__main__":
    main(sys.argv[1:])
