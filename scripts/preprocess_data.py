#!/usr/bin/env python
"""Tokenize a text / JSON / JSONL(.gz) file into Megatron `.bin`/`.idx` files.

    python scripts/preprocess_data.py --input corpus.jsonl --json-key text \\
        --tokenizer path/to/tokenizer --output-prefix data/corpus --workers 8

With `--train-sentencepiece VOCAB_SIZE` instead of `--tokenizer`, a SentencePiece model is
first trained on the input and saved as `tokenizer.model` beside the output files.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from data.indexed import tokenize_to_indexed
from data.sources import documents_as_text, require_file
from data.tokenizer import SP_FIXED_PIECES, load_tokenizer, train_sentencepiece


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True,
                        help="text file (documents separated by blank lines) or .json/.jsonl, optionally .gz")
    parser.add_argument("--json-key", default="text", help="field holding the document text in JSON records")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer",
                        help="SentencePiece .model file, or a directory with tokenizer.json / tokenizer.model")
    source.add_argument("--train-sentencepiece", type=int, metavar="VOCAB_SIZE",
                        help="train a SentencePiece model on the input into OUTPUT_PREFIX's directory first")
    parser.add_argument("--sp-model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                        help="do not end each document with the EOS token")
    args = parser.parse_args(argv)
    if args.train_sentencepiece is not None and args.train_sentencepiece <= SP_FIXED_PIECES:
        parser.error(f"--train-sentencepiece: {args.train_sentencepiece} is too small; expected a vocabulary above "
                     f"{SP_FIXED_PIECES} (4 special and 256 byte pieces, plus the text's characters)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    require_file(args.input, "input file")
    output_dir = Path(args.output_prefix).parent
    if args.train_sentencepiece:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=output_dir) as tmp:
            text = documents_as_text(args.input, args.json_key, Path(tmp) / "documents.txt")
            tokenizer = train_sentencepiece([text], output_dir / "tokenizer", args.train_sentencepiece,
                                            args.sp_model_type)
        print(f"trained SentencePiece ({args.sp_model_type}, vocab {tokenizer.vocab_size}) -> {tokenizer.path} "
              f"in {time.perf_counter() - start:.1f} s")
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    dataset = tokenize_to_indexed(args.input, tokenizer, args.output_prefix, json_key=args.json_key,
                                  workers=args.workers, append_eod=args.append_eod)
    print(f"{len(dataset)} documents, {dataset.num_tokens} tokens ({dataset.dtype}) -> "
          f"{args.output_prefix}.bin/.idx in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {e}")
