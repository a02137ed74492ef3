"""Benchmark: the quantization kernels' torch path against a plain memory copy.

    python scripts/bench/kernels.py --out runs/bench_kernels.json
    python scripts/bench/kernels.py --quick

For quantize, dequantize, quantize_transposed and dequant_reduce_quant (k=4 chunks that add
up to `numel` elements) at each size and bit width: best time, GB/s of input read, and the
time relative to `copy_` of `numel` elements of the input dtype — a pass over the
full-precision side, which bounds how fast any of them can be on this machine.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import kernels as K  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK = 256
K_CHUNKS = 4
A, B, STAGES = 8, 4, 2  # quantize_transposed reads stage 1 of an [A, B, STAGES, C] buffer


def _best_time(fn, repeats):
    """Fastest of `repeats` calls after a warm-up: the machine is shared, noise only adds time."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _cases(numel, bits, dtype, impl):
    """name -> (callable, bytes of input it reads)."""
    x = torch.randn(numel).to(dtype)
    q = K.quantize(x, bits, BLOCK, impl=impl)
    stage = torch.randn(A, B, STAGES, numel // (A * B)).to(dtype)[:, :, 1]
    chunk = numel // K_CHUNKS
    parts = [K.quantize(x[i * chunk:(i + 1) * chunk], bits, BLOCK, impl=impl) for i in range(K_CHUNKS)]
    codes, scales = torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])
    out = torch.empty(numel)
    qbytes = q.codes.numel() + q.scales.numel() * q.scales.element_size()
    return {
        "quantize": (lambda: K.quantize(x, bits, BLOCK, codes_out=q.codes, scales_out=q.scales, impl=impl),
                     x.numel() * x.element_size()),
        "dequantize": (lambda: K.dequantize(q.codes, q.scales, numel, bits, BLOCK, out=out, impl=impl), qbytes),
        "quantize_transposed": (lambda: K.quantize_transposed(stage, bits, BLOCK, impl=impl),
                                stage.numel() * stage.element_size()),
        "dequant_reduce_quant": (lambda: K.dequant_reduce_quant(codes, scales, K_CHUNKS, chunk, bits, BLOCK, impl=impl),
                                 codes.numel() + scales.numel() * scales.element_size()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 16 << 20])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--impl", choices=["torch", "triton"], default="torch")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="1M elements, 3 repeats: a few seconds")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = [1 << 20], 3
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, impl={args.impl}, input {args.dtype}, "
          f"block {BLOCK}")
    print(f"{'op':<22}{'numel':>10}{'bits':>5}{'ms':>9}{'in GB/s':>9}{'x copy':>8}")
    for numel in args.sizes:
        src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
        copy_s = _best_time(lambda: dst.copy_(src), args.repeats)
        copy_bytes = numel * src.element_size()
        rows.append(dict(op="copy_", numel=numel, bits=None, seconds=copy_s, input_gbps=copy_bytes / copy_s / 1e9,
                         vs_copy=1.0))
        print(f"{'copy_':<22}{numel:>10}{'-':>5}{copy_s * 1e3:>9.2f}{copy_bytes / copy_s / 1e9:>9.2f}{1.0:>8.2f}")
        for bits in args.bits:
            for op, (fn, nbytes) in _cases(numel, bits, dtype, args.impl).items():
                s = _best_time(fn, args.repeats)
                rows.append(dict(op=op, numel=numel, bits=bits, seconds=s, input_gbps=nbytes / s / 1e9,
                                 vs_copy=s / copy_s))
                print(f"{op:<22}{numel:>10}{bits:>5}{s * 1e3:>9.2f}{nbytes / s / 1e9:>9.2f}{s / copy_s:>8.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(),
                                            impl=args.impl, dtype=args.dtype, block_size=BLOCK, rows=rows), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
