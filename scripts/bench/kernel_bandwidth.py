"""The quantization kernels' torch path against a plain memory copy (not named kernels.py: run as a
script, that would shadow the `kernels` package).

    python scripts/bench/kernel_bandwidth.py                # 1M and 16M elements, 8 and 4 bits, 1 and all threads
    python scripts/bench/kernel_bandwidth.py --quick        # 1M only, a few seconds
    git show REV:kernels/quant.py > /tmp/quant_before.py    # another version of kernels/quant.py ...
    python scripts/bench/kernel_bandwidth.py --sizes 16777216 --threads 1 --baseline /tmp/quant_before.py

Each case is timed relative to `copy_` of `numel` elements of the input dtype: a pass over the
full-precision side bounds how fast any of them can be. Every round times copy_ and each case once, in
turn, so on a shared machine they all see the same noise; `--baseline` adds another kernels/quant.py to
those rounds (the "before" of a change) and checks that it produces the same bits.
"""

import importlib.util
import statistics
import sys
import time

import torch

import kernels as K
from scripts.bench import report
from scripts.bench.suite import Quick, main_one

TITLE = "## 5. Quantization kernels vs memory-copy bandwidth"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK = 256
IMPL = "torch"  # the inputs are CPU tensors: Triton would only run in its interpreter
K_CHUNKS = 4
A, B, STAGES = 8, 4, 2  # quantize_transposed reads stage 1 of an [A, B, STAGES, C] buffer


def _load(path):
    """A kernels/quant.py from another revision, as a module of its own."""
    spec = importlib.util.spec_from_file_location("kernels_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(numel, bits, dtype):
    """The tensors every implementation reads (built once per size and bit width)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(numel, generator=g).to(dtype)
    stage = torch.randn(A, B, STAGES, numel // (A * B), generator=g).to(dtype)[:, :, 1]
    chunk = numel // K_CHUNKS
    parts = [K.quantize(x[i * chunk:(i + 1) * chunk], bits, BLOCK, impl=IMPL) for i in range(K_CHUNKS)]
    return x, stage, chunk, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts])


def _cases(mod, inputs, bits):
    """name -> (callable returning what to compare, bytes of input it reads), each with its own outputs."""
    x, stage, chunk, codes, scales = inputs
    numel = x.numel()
    q = K.quantize(x, bits, BLOCK, impl=IMPL)
    out, acc = torch.empty(numel), torch.zeros(chunk)
    qbytes = q.codes.numel() + q.scales.numel() * q.scales.element_size()
    kbytes = codes.numel() + scales.numel() * scales.element_size()
    return {
        "quantize": (lambda: mod.quantize(x, bits, BLOCK, codes_out=q.codes, scales_out=q.scales, impl=IMPL),
                     x.numel() * x.element_size()),
        "quantize_transposed": (lambda: mod.quantize_transposed(stage, bits, BLOCK, impl=IMPL),
                                stage.numel() * stage.element_size()),
        "dequantize": (lambda: mod.dequantize(q.codes, q.scales, numel, bits, BLOCK, out=out, impl=IMPL), qbytes),
        "dequant_reduce": (lambda: mod.dequant_reduce(codes, scales, K_CHUNKS, chunk, bits, BLOCK, out=acc,
                                                      accumulate=True, impl=IMPL), kbytes),
        "dequant_reduce_quant": (lambda: mod.dequant_reduce_quant(codes, scales, K_CHUNKS, chunk, bits, BLOCK,
                                                                  impl=IMPL), kbytes),
    }


def _bits(result):
    """The bytes of a result, for the baseline check (accumulating results are not comparable)."""
    if hasattr(result, "codes"):
        return [result.codes.clone(), result.scales.view(torch.uint8).clone()]
    return [result.view(torch.uint8).clone()]


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def measure(sizes, bits_list, dtype_name="fp32", repeats=10, baseline=None, clock="wall"):
    """Yields {op, numel, bits, version, seconds, best_seconds, input_gbps, vs_copy[, same_bits]}, copy_ first
    for each size; `baseline` = a kernels/quant.py measured alongside (version "baseline"). clock="cpu"
    counts this thread's CPU time, which leaves out the time other processes hold the core (1 thread only)."""
    dtype, now = DTYPES[dtype_name], CLOCKS[clock]
    versions = {"current": K}
    if baseline:
        versions["baseline"] = _load(baseline)
    for numel in sizes:
        src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
        fns, nbytes, same = {("copy_", None, "current"): lambda: dst.copy_(src)}, {}, {}
        for bits in bits_list:
            inputs = _inputs(numel, bits, dtype)
            first = {}
            for version, mod in versions.items():
                for op, (fn, n) in _cases(mod, inputs, bits).items():
                    fns[op, bits, version], nbytes[op, bits, version] = fn, n
                    got = _bits(fn())  # warm-up, and the bits to compare
                    if op != "dequant_reduce":
                        ref = first.setdefault((op, bits), got)
                        same[op, bits, version] = all(torch.equal(a, b) for a, b in zip(ref, got))
        times = {key: [] for key in fns}
        for _ in range(repeats):  # round-robin: every case sees the same moments of a shared machine
            for key, fn in fns.items():
                start = now()
                fn()
                times[key].append(now() - start)
        copy_s = statistics.median(times["copy_", None, "current"])
        for (op, bits, version), ts in times.items():
            s = statistics.median(ts)
            row = dict(op=op, numel=numel, bits=bits, version=version, seconds=s, best_seconds=min(ts),
                       input_gbps=nbytes.get((op, bits, version), numel * src.element_size()) / s / 1e9,
                       vs_copy=s / copy_s)
            if baseline and (op, bits, version) in same:
                row["same_bits"] = same[op, bits, version]
            yield row


def add_args(parser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=Quick([1 << 20, 16 << 20], [1 << 20]),
                        help="elements (default 1M 16M, quick 1M)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--repeats", type=int, default=Quick(15, 5),
                        help="timed rounds, median kept (default %(default)s)")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="torch thread counts to measure (default: 1 and torch's choice; on a busy machine "
                             "1 thread is the steadier figure)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall time, or this thread's CPU time (steadier on a shared machine; needs --threads 1)")
    parser.add_argument("--baseline", metavar="QUANT_PY",
                        help="another version of kernels/quant.py (e.g. from `git show REV:kernels/quant.py`) to "
                             "time in the same rounds, and to check for identical output")


def run(args, progress=print) -> dict:
    default = torch.get_num_threads()
    threads = args.threads or sorted({1, default})
    if args.clock == "cpu" and threads != [1]:
        raise SystemExit("--clock cpu times one thread: use it with --threads 1")
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            progress(f"  kernels: torch {torch.__version__}, {t} thread(s), impl={IMPL}, input {args.dtype}, "
                     f"block {BLOCK}, median of {args.repeats}, {args.clock} clock"
                     + (f", baseline {args.baseline}" if args.baseline else ""))
            progress(f"  {'op':<22}{'numel':>10}{'bits':>5}{'version':>9}{'ms':>9}{'best':>8}{'in GB/s':>9}"
                     f"{'x copy':>8}{'copy/op':>8}")
            for r in measure(args.sizes, args.bits, args.dtype, args.repeats, args.baseline, args.clock):
                rows.append(dict(r, threads=t, ms=r["seconds"] * 1e3, ok=True))
                same = {True: "", False: "  DIFFERENT BITS", None: ""}[r.get("same_bits")]
                progress(f"  {r['op']:<22}{r['numel']:>10}{r['bits'] or '-':>5}{r['version']:>9}"
                         f"{r['seconds'] * 1e3:>9.2f}{r['best_seconds'] * 1e3:>8.2f}{r['input_gbps']:>9.2f}"
                         f"{r['vs_copy']:>8.2f}{1 / r['vs_copy']:>8.2f}{same}")
    finally:
        torch.set_num_threads(default)
    return dict(torch=torch.__version__, threads=threads, impl=IMPL, dtype=args.dtype, block_size=BLOCK,
                repeats=args.repeats, sizes=args.sizes, baseline=args.baseline, clock=args.clock, rows=rows)


def _size(numel: int) -> str:
    return f"{numel >> 20}M" if numel >= 1 << 20 and numel % (1 << 20) == 0 else str(numel)


_OPS = ["copy_", "quantize", "quantize_transposed", "dequantize", "dequant_reduce", "dequant_reduce_quant"]


def _current(rows):
    return [r for r in rows if r.get("version", "current") == "current"]


def plots(result: dict, out_dir) -> list:
    rows = [r for r in _current(result["rows"]) if r["op"] != "copy_"]
    labels = sorted({(r["op"], r["bits"]) for r in rows}, key=lambda k: (_OPS.index(k[0]), -k[1]))
    x_copy = {(r["op"], r["bits"], r["numel"], r["threads"]): r["vs_copy"] for r in rows}
    return [report.bar_chart(out_dir, "kernel_bandwidth", [f"{op}\n{bits} bit" for op, bits in labels],
                             {f"{_size(n)} elements, {t} thread(s)": [x_copy.get((*k, n, t)) for k in labels]
                              for n in result["sizes"] for t in result["threads"]},
                             f"quantization kernels ({result['impl']}), block {result['block_size']}",
                             "time / copy_ of as many fp32 elements", figsize=(10, 4), line_at=1.0)]


def markdown(result: dict) -> str:
    cols, table = [("op", "op", "{}"), ("bits", "bits", "{}")], {}
    before = any(r.get("version") == "baseline" for r in result["rows"])
    for numel in result["sizes"]:
        for t in result["threads"]:
            tag = f"{_size(numel)}, {t} thr"
            cols += [(f"ms@{numel}@{t}", f"{tag}: ms", "{:.3f}"), (f"gbps@{numel}@{t}", f"{tag}: GB/s", "{:.1f}"),
                     (f"x@{numel}@{t}", f"{tag}: x copy", "{:.2f}")]
            if before:
                cols.append((f"bx@{numel}@{t}", f"{tag}: baseline x copy", "{:.2f}"))
    for r in result["rows"]:
        row = table.setdefault((r["op"], r["bits"]), {"op": r["op"], "bits": r["bits"] or "-"})
        at = f"{r['numel']}@{r['threads']}"
        if r.get("version", "current") == "current":
            row.update({f"ms@{at}": r["ms"], f"gbps@{at}": r["input_gbps"], f"x@{at}": r["vs_copy"]})
        else:
            row[f"bx@{at}"] = r["vs_copy"]
    rows = [table[k] for k in sorted(table, key=lambda k: (_OPS.index(k[0]), -(k[1] or 99)))]
    stat = "median" if "best_seconds" in (result["rows"] or [{}])[0] else "best"
    return "\n".join([
        f"`scripts/bench/kernel_bandwidth.py`: the {result['impl']} path, {result['dtype']} input, block "
        f"{result['block_size']}, {stat} of {result['repeats']} calls"
        + (" (CPU time)" if result.get("clock") == "cpu" else "") + ", with 1 and all torch threads. "
        "\"x copy\" = time / `copy_` of the same number of full-precision elements with as many threads (a "
        "pass over the full-precision side bounds how fast any of them can be; its inverse is the throughput "
        "ratio); GB/s counts the input read (fp32 for the quantizers, codes + scales for the others). "
        "`dequant_reduce` (into an fp32 buffer) and `dequant_reduce_quant` sum k = 4 tensors of numel / 4 "
        "elements." + (f" \"baseline\": {result.get('baseline')}, timed in the same rounds." if before else "")
        + " See [kernels.md](kernels.md). On a busy machine the multi-threaded columns are "
        "unreliable (OpenMP threads wait for each other when the cores are oversubscribed: a copy_ can take "
        "100x its quiet time); the 1-thread columns are the steady ones.", "", *report.md_table(rows, cols)])


if __name__ == "__main__":
    sys.exit(main_one("kernel_bandwidth"))
