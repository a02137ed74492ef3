"""Generate text with KV-cache decoding from a checkpoint, a Hugging Face dir or a low-bit export.

    python scripts/generate.py runs/x/checkpoints --prompt "Return the" --max-new-tokens 40
    python scripts/generate.py runs/x/int4 --prompt "Return the" --temperature 0.8 --top-k 50 --seed 1

MODEL: one of our training checkpoints (a step dir or a run's checkpoints/ dir), a Hugging Face
model dir, or a low-bit export dir (scripts/export_quantized.py; run with its dequantized
weights). Prints the prompt and its continuation, decoded together with the model's tokenizer.
Temperature 0 (the default) is greedy. The prompt gets no BOS unless --bos is given: our
pretraining documents start without one.
"""

import argparse
import sys

import torch

from data.tokenizer import load_tokenizer
from export import load_source
from models.generate import generate
from trainer.checkpoint import CheckpointError


class TokenizerVocab(torch.nn.Module):
    """The model with the logits of its padded vocabulary rows at -inf: train.py pads the embedding
    past the tokenizer (make_vocab_size_divisible_by), and those ids are no token to decode."""

    def __init__(self, model, n_tokens: int):
        super().__init__()
        self.model, self.config, self.n_tokens = model, model.config, n_tokens

    def forward(self, tokens, **kwargs):
        logits = self.model(tokens, **kwargs)
        logits[..., self.n_tokens:] = float("-inf")
        return logits


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling generator")
    parser.add_argument("--bos", action="store_true", help="start the prompt with the tokenizer's BOS token")
    parser.add_argument("--tokenizer", help="a SentencePiece .model or a tokenizer dir; default: the model's")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        source = load_source(args.model)
        if args.tokenizer is None and source.tokenizer is None:
            raise ValueError(f"{args.model} names no tokenizer ({source.kind}); pass --tokenizer with a "
                             "SentencePiece .model file or a directory containing tokenizer.json or tokenizer.model")
        tokenizer = load_tokenizer(args.tokenizer or source.tokenizer)
        prompt = tokenizer.encode(args.prompt)
        if args.bos:
            if tokenizer.bos_id is None:
                raise ValueError(f"--bos: tokenizer {tokenizer.path} has no BOS token")
            prompt = [tokenizer.bos_id] + prompt
        device = torch.device(args.device)
        model = TokenizerVocab(source.model.to(device), tokenizer.vocab_size)
        new = generate(model, [prompt], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                       generator=torch.Generator(device).manual_seed(args.seed))[0]
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        sys.exit(f"generate.py: {e}")
    print(tokenizer.decode(prompt + new))  # the prompt's text too: a continuation alone may decode differently


if __name__ == "__main__":
    main()
