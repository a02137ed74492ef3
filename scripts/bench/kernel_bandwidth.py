"""Benchmark: the quantization kernels' torch path against a plain memory copy (not named kernels.py:
run as a script, that would shadow the `kernels` package).

    python scripts/bench/kernel_bandwidth.py                # 1M and 16M elements, 8 and 4 bits, 1 and all threads
    python scripts/bench/kernel_bandwidth.py --quick        # 1M only, a few seconds
    python scripts/bench/kernel_bandwidth.py --update-docs  # + its section of docs/benchmarks.md

For quantize, dequantize, quantize_transposed and dequant_reduce_quant (k=4 chunks that add
up to `numel` elements) at each size and bit width: best time, GB/s of input read, and the
time relative to `copy_` of `numel` elements of the input dtype — a pass over the
full-precision side, which bounds how fast any of them can be on this machine.
"""

import sys
import time

import torch

import kernels as K
from scripts.bench import report
from scripts.bench.suite import Quick, main_one

TITLE = "## 5. Quantization kernels vs memory-copy bandwidth"

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


def measure(sizes, bits_list, dtype_name="fp32", repeats=10, impl="torch"):
    """Yields {op, numel, bits, seconds, input_gbps, vs_copy}, copy_ first for each size."""
    dtype = DTYPES[dtype_name]
    for numel in sizes:
        src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
        copy_s = _best_time(lambda: dst.copy_(src), repeats)
        yield dict(op="copy_", numel=numel, bits=None, seconds=copy_s,
                   input_gbps=numel * src.element_size() / copy_s / 1e9, vs_copy=1.0)
        for bits in bits_list:
            for op, (fn, nbytes) in _cases(numel, bits, dtype, impl).items():
                s = _best_time(fn, repeats)
                yield dict(op=op, numel=numel, bits=bits, seconds=s, input_gbps=nbytes / s / 1e9, vs_copy=s / copy_s)


def add_args(parser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=Quick([1 << 20, 16 << 20], [1 << 20]),
                        help="elements (default 1M 16M, quick 1M)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--repeats", type=int, default=Quick(10, 5),
                        help="timed calls, best kept (default %(default)s)")
    parser.add_argument("--impl", choices=["torch", "triton"], default="torch")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="torch thread counts to measure (default: 1 and torch's choice; on a busy machine "
                             "1 thread is the steadier figure)")


def run(args, progress=print) -> dict:
    default = torch.get_num_threads()
    threads = args.threads or sorted({1, default})
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            progress(f"  kernels: torch {torch.__version__}, {t} thread(s), impl={args.impl}, input {args.dtype}, "
                     f"block {BLOCK}")
            progress(f"  {'op':<22}{'numel':>10}{'bits':>5}{'ms':>9}{'in GB/s':>9}{'x copy':>8}")
            for r in measure(args.sizes, args.bits, args.dtype, args.repeats, args.impl):
                rows.append(dict(r, threads=t, ms=r["seconds"] * 1e3, ok=True))
                progress(f"  {r['op']:<22}{r['numel']:>10}{r['bits'] or '-':>5}{r['seconds'] * 1e3:>9.2f}"
                         f"{r['input_gbps']:>9.2f}{r['vs_copy']:>8.2f}")
    finally:
        torch.set_num_threads(default)
    return dict(torch=torch.__version__, threads=threads, impl=args.impl, dtype=args.dtype, block_size=BLOCK,
                repeats=args.repeats, sizes=args.sizes, rows=rows)


def _size(numel: int) -> str:
    return f"{numel >> 20}M" if numel >= 1 << 20 and numel % (1 << 20) == 0 else str(numel)


_OPS = ["copy_", "quantize", "quantize_transposed", "dequantize", "dequant_reduce_quant"]


def plots(result: dict, out_dir) -> list:
    rows = [r for r in result["rows"] if r["op"] != "copy_"]
    labels = sorted({(r["op"], r["bits"]) for r in rows}, key=lambda k: (_OPS.index(k[0]), -k[1]))
    x_copy = {(r["op"], r["bits"], r["numel"], r["threads"]): r["vs_copy"] for r in rows}
    fig, ax = report.pyplot().subplots(figsize=(10, 4))
    report.bars(ax, [f"{op}\n{bits} bit" for op, bits in labels],
                {f"{_size(n)} elements, {t} thread(s)": [x_copy.get((*k, n, t)) for k in labels]
                 for n in result["sizes"] for t in result["threads"]})
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("time / copy_ of as many fp32 elements")
    ax.set_title(f"quantization kernels ({result['impl']}), block {result['block_size']}")
    return [report.save(fig, out_dir, "kernel_bandwidth")]


def markdown(result: dict) -> str:
    cols, table = [("op", "op", "{}"), ("bits", "bits", "{}")], {}
    for numel in result["sizes"]:
        for t in result["threads"]:
            tag = f"{_size(numel)}, {t} thr"
            cols += [(f"ms@{numel}@{t}", f"{tag}: ms", "{:.3f}"), (f"gbps@{numel}@{t}", f"{tag}: GB/s", "{:.1f}"),
                     (f"x@{numel}@{t}", f"{tag}: x copy", "{:.2f}")]
    for r in result["rows"]:
        row = table.setdefault((r["op"], r["bits"]), {"op": r["op"], "bits": r["bits"] or "-"})
        at = f"{r['numel']}@{r['threads']}"
        row.update({f"ms@{at}": r["ms"], f"gbps@{at}": r["input_gbps"], f"x@{at}": r["vs_copy"]})
    rows = [table[k] for k in sorted(table, key=lambda k: (_OPS.index(k[0]), -(k[1] or 99)))]
    return "\n".join([
        f"`scripts/bench/kernel_bandwidth.py`: the {result['impl']} path, {result['dtype']} input, block "
        f"{result['block_size']}, best of {result['repeats']} calls, with 1 and all torch threads. "
        "\"x copy\" = time / `copy_` of the same number of full-precision elements with as many threads (a "
        "pass over the full-precision side bounds how fast any of them can be); GB/s counts the input read "
        "(fp32 for the quantizers, codes + scales for the others). `dequant_reduce_quant` sums k = 4 tensors "
        "of numel / 4 elements. See [kernels.md](kernels.md). On a busy machine the multi-threaded columns are "
        "unreliable (OpenMP threads wait for each other when the cores are oversubscribed: a copy_ can take "
        "100x its quiet time); the 1-thread columns are the steady ones.", "", *report.md_table(rows, cols)])


if __name__ == "__main__":
    sys.exit(main_one("kernel_bandwidth"))
