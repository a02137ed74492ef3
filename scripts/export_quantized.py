"""Export a model as low-bit safetensors, GGUF (Q8_0 / Q4_0, or a K-quant mix) or compressed-tensors (int,
group scales: what transformers and vLLM load), from our own block quantization.

    python scripts/export_quantized.py runs/x/checkpoints runs/x/int4 --format safetensors
    python scripts/export_quantized.py runs/x/checkpoints runs/x/model-q8.gguf --format gguf --bits 8
    python scripts/export_quantized.py runs/x/checkpoints runs/x/model.gguf --format gguf --gguf-type Q4_K_M
    python scripts/export_quantized.py path/to/hf-llama out.gguf --format gguf --bits 4 --block-size 32
    python scripts/export_quantized.py runs/x/checkpoints runs/x/w4-ct --format compressed-tensors --bits 4

CHECKPOINT: one of our training checkpoints (a step dir, or a run's checkpoints/ dir for its
latest; full or ZeRO-3 sharded), a Hugging Face model dir, or a low-bit export dir. A
checkpoint trained with qwZ defaults to its bits and block size, and the export then holds
exactly the weights its training forward computed with; otherwise this is round-to-nearest
post-training quantization. The tokenizer defaults to the checkpoint's. The weights are read,
quantized and written one tensor at a time: the peak memory is about the largest tensor, not the
model. See docs/export.md.
"""

import argparse
import sys

from export import export_gguf, export_lowbit, gguf_qtype, load_source
from export.compressed import export_compressed_tensors
from export.kquants import kquant_summary
from export.quantized import GGUF_MIXES
from kernels.quant import on_grid
from trainer.checkpoint import CheckpointError


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out", help="output directory (safetensors) or .gguf file; an existing one is replaced")
    parser.add_argument("--format", choices=("safetensors", "gguf", "compressed-tensors"), required=True)
    parser.add_argument("--bits", type=int, help="8, 6, 4, 3 or 2 (GGUF: 8 or 4); default: the qwZ bits "
                                                 "the checkpoint was trained with")
    parser.add_argument("--block-size", type=int, help="elements per scale; default: the checkpoint's qwZ "
                                                       "block size, else 256")
    parser.add_argument("--gguf-type", choices=GGUF_MIXES,
                        help="GGUF: a llama.cpp K-quant mix instead of Q8_0 / Q4_0 (which --bits picks); a qwZ "
                             "run's grid is held exactly where the types can (Q4_K_M / Q4_K: <= 4 bits, Q6_K: <= 6 "
                             "bits; blocks a multiple of 256), else the weights are quantized again as "
                             "llama-quantize does")
    parser.add_argument("--tokenizer", help="a SentencePiece .model or a tokenizer dir; default: the checkpoint's")
    args = parser.parse_args(argv)
    try:
        source = load_source(args.checkpoint)
        grid = source.grid
        kquant = args.format == "gguf" and args.gguf_type is not None
        if args.gguf_type is not None and args.format != "gguf":
            raise ValueError(f"--gguf-type is for --format gguf, not {args.format}")
        bits = args.bits or (grid.bits if grid else None)
        if bits is None and not kquant:
            raise ValueError(f"{args.checkpoint} was not trained with qwZ, so there is no bit width to default to: "
                             "pass --bits")
        block_size = args.block_size or (grid.block_size if grid else 256)
        exact = grid is not None and (grid.bits, grid.block_size) == (bits, block_size)
        tokenizer = args.tokenizer or source.tokenizer
        if tokenizer is None:
            raise ValueError(f"{args.checkpoint} names no tokenizer ({source.kind}); pass --tokenizer with a "
                             "SentencePiece .model file or a directory containing tokenizer.json or tokenizer.model")
        weights, config = source.weights, source.config  # read one tensor at a time by the exporters
        vectors = exact and grid.vectors
        if args.format == "gguf":
            out = export_gguf(weights, config, args.out, args.gguf_type if kquant else gguf_qtype(bits), tokenizer,
                              block_size, vectors_on_grid=vectors, grid_bits=bits if kquant and exact else None)
        elif args.format == "compressed-tensors":
            out = export_compressed_tensors(weights, config, args.out, bits, block_size, tokenizer,
                                            vectors_on_grid=vectors)
        else:
            out = export_lowbit(weights, config, args.out, bits, block_size, tokenizer, vectors_on_grid=vectors)
    except (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, CheckpointError) as e:
        sys.exit(f"export_quantized.py: {e}")
    if kquant:
        how = kquant_summary(out, (bits, block_size) if exact else None)
        if exact and source.merged:
            how += (f"; the {len(source.merged)} LoRA-merged weights among them are off that grid and rounded onto it "
                    f"(relative RMS error up to {merged_error(source, bits, block_size):.2e})")
        print(f"{out}: gguf {args.gguf_type}; {how}")
        return
    if not exact:
        how = "round-to-nearest post-training quantization (RTN baseline)"
    elif source.kind == "lowbit":
        how = "exact: the codes of the source export"
    elif source.merged:
        how = (f"the base weights exact (the qwZ grid the training forward computed with); the {len(source.merged)} "
               f"weights a LoRA adapter is merged into are off that grid and quantized again round-to-nearest "
               f"(relative RMS error up to {merged_error(source, bits, block_size):.2e}); the run's exact forward is "
               f"the quantized base with the adapter beside it (scripts/consolidate.py --peft-adapter, "
               f"docs/export.md)")
    else:
        how = "exact: the weights the qwZ training forward computed with"
    print(f"{out}: {args.format}, {bits} bits, block size {block_size}; {how}")


def merged_error(source, bits: int, block_size: int) -> float:
    """The largest ||W - dequant(quant(W))|| / ||W|| over the LoRA-merged weights (one at a time)."""
    worst = 0.0
    for name in source.merged:
        w = source.weights[name]
        worst = max(worst, float((w - on_grid(w, bits, block_size)).norm() / w.norm().clamp_min(1e-30)))
    return worst


if __name__ == "__main__":
    main()
