"""The quantization kernels' torch path timed against a plain memory copy, round-robin (not named kernels.py: run
as a script, that would shadow the `kernels` package).

    python scripts/bench/kernel_bandwidth.py                # 1M and 16M elements, 8 and 4 bits, 1 and all threads
    python scripts/bench/kernel_bandwidth.py --quick        # 1M only, a few seconds
    git show REV:kernels/quant.py > /tmp/quant_before.py    # another version of kernels/quant.py ...
    python scripts/bench/kernel_bandwidth.py --sizes 16777216 --threads 1 --baseline /tmp/quant_before.py
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
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
OPS = ["copy_", "quantize", "quantize_transposed", "dequantize", "dequant_reduce", "dequant_reduce_quant"]
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


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
    q = K.quantize(x, bits, BLOCK, impl=IMPL)
    out, acc = torch.empty(x.numel()), torch.zeros(chunk)
    return {
        "quantize": (lambda: mod.quantize(x, bits, BLOCK, codes_out=q.codes, scales_out=q.scales, impl=IMPL),
                     _nbytes(x)),
        "quantize_transposed": (lambda: mod.quantize_transposed(stage, bits, BLOCK, impl=IMPL), _nbytes(stage)),
        "dequantize": (lambda: mod.dequantize(q.codes, q.scales, x.numel(), bits, BLOCK, out=out, impl=IMPL),
                       _nbytes(q.codes, q.scales)),
        "dequant_reduce": (lambda: mod.dequant_reduce(codes, scales, K_CHUNKS, chunk, bits, BLOCK, out=acc,
                                                      accumulate=True, impl=IMPL), _nbytes(codes, scales)),
        "dequant_reduce_quant": (lambda: mod.dequant_reduce_quant(codes, scales, K_CHUNKS, chunk, bits, BLOCK,
                                                                  impl=IMPL), _nbytes(codes, scales)),
    }


def _bits(result):
    """The bytes of a result, for the baseline check (accumulating results are not comparable)."""
    if hasattr(result, "codes"):
        return [result.codes.clone(), result.scales.view(torch.uint8).clone()]
    return [result.view(torch.uint8).clone()]


def measure(sizes, bits_list, dtype_name="fp32", repeats=10, baseline=None, clock="wall"):
    """Yields {op, numel, bits, version, seconds, best_seconds, input_gbps, vs_copy[, same_bits]}, copy_ first
    for each size; `baseline` = a kernels/quant.py measured alongside (version "baseline"). clock="cpu"
    counts this thread's CPU time, which leaves out the time other processes hold the core (1 thread only)."""
    dtype, now = DTYPES[dtype_name], CLOCKS[clock]
    versions = {"current": K, **({"baseline": _load(baseline)} if baseline else {})}
    for numel in sizes:
        src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
        cases, first, same = {("copy_", None, "current"): (lambda: dst.copy_(src), _nbytes(src))}, {}, {}
        for bits in bits_list:
            inputs = _inputs(numel, bits, dtype)
            for version, mod in versions.items():
                for op, case in _cases(mod, inputs, bits).items():
                    cases[op, bits, version] = case
                    got = _bits(case[0]())  # warm-up, and the bits to compare
                    if op != "dequant_reduce":
                        ref = first.setdefault((op, bits), got)
                        same[op, bits, version] = all(torch.equal(a, b) for a, b in zip(ref, got))
        times = {key: [] for key in cases}
        for _ in range(repeats):  # round-robin: every case sees the same moments of a shared machine
            for key, (fn, _) in cases.items():
                start = now()
                fn()
                times[key].append(now() - start)
        copy_s = statistics.median(times["copy_", None, "current"])
        for (op, bits, version), ts in times.items():
            s = statistics.median(ts)
            row = dict(op=op, numel=numel, bits=bits, version=version, seconds=s, best_seconds=min(ts),
                       input_gbps=cases[op, bits, version][1] / s / 1e9, vs_copy=s / copy_s)
            if baseline and (op, bits, version) in same:
                row["same_bits"] = same[op, bits, version]
            yield row


def add_args(parser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=Quick([1 << 20, 16 << 20], [1 << 20]),
                        help="elements (default 1M 16M, quick 1M)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--repeats", type=int, default=Quick(15, 5), help="timed rounds (default %(default)s)")
    parser.add_argument("--threads", type=int, nargs="+", help="torch thread counts (default: 1 and torch's)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="cpu: this thread's CPU time (--threads 1)")
    parser.add_argument("--baseline", metavar="QUANT_PY",
                        help="another kernels/quant.py to time in the same rounds and check for identical output")


def run(args, progress=print) -> dict:
    default = torch.get_num_threads()
    threads = args.threads or sorted({1, default})
    if args.clock == "cpu" and threads != [1]:
        raise SystemExit("--clock cpu times one thread: use it with --threads 1")
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            progress(f"  kernels: {t} thread(s), median of {args.repeats}, {args.clock} clock")
            for r in measure(args.sizes, args.bits, args.dtype, args.repeats, args.baseline, args.clock):
                rows.append(dict(r, threads=t, ms=r["seconds"] * 1e3, ok=True))
                progress(f"  {r['op']:<22}{r['numel']:>10}{r['bits'] or '-':>5}{r['version']:>9}"
                         f"{r['seconds'] * 1e3:>9.2f} ms (best {r['best_seconds'] * 1e3:.2f}){r['vs_copy']:>7.2f}x copy"
                         + ("  DIFFERENT BITS" if r.get("same_bits") is False else ""))
    finally:
        torch.set_num_threads(default)
    return dict(torch=torch.__version__, threads=threads, impl=IMPL, dtype=args.dtype, block_size=BLOCK,
                repeats=args.repeats, sizes=args.sizes, baseline=args.baseline, clock=args.clock, rows=rows)


def _size(numel: int) -> str:
    return f"{numel >> 20}M" if numel >= 1 << 20 and numel % (1 << 20) == 0 else str(numel)


def plots(result: dict, out_dir) -> list:
    rows = [r for r in result["rows"] if r["version"] == "current" and r["op"] != "copy_"]
    labels = sorted({(r["op"], r["bits"]) for r in rows}, key=lambda k: (OPS.index(k[0]), -k[1]))
    x_copy = {(r["op"], r["bits"], r["numel"], r["threads"]): r["vs_copy"] for r in rows}
    return [report.bar_chart(out_dir, "kernel_bandwidth", [f"{op}\n{bits} bit" for op, bits in labels],
                             {f"{_size(n)} elements, {t} thread(s)": [x_copy.get((*k, n, t)) for k in labels]
                              for n in result["sizes"] for t in result["threads"]},
                             f"quantization kernels ({result['impl']}), block {result['block_size']}",
                             "time / copy_ of as many fp32 elements", figsize=(10, 4), line_at=1.0)]


def markdown(result: dict) -> str:
    measured = [("ms", "ms", "{:.3f}"), ("gbps", "GB/s", "{:.1f}"), ("x", "x copy", "{:.2f}")]
    measured += [("bx", "baseline x copy", "{:.2f}")] if result["baseline"] else []
    cols = [("op", "op", "{}"), ("bits", "bits", "{}")] + [
        (f"{key}@{n}@{t}", f"{_size(n)}, {t} thr: {header}", spec)
        for n in result["sizes"] for t in result["threads"] for key, header, spec in measured]
    table = {}
    for r in result["rows"]:
        row = table.setdefault((r["op"], r["bits"]), {"op": r["op"], "bits": r["bits"] or "-"})
        at = f"{r['numel']}@{r['threads']}"
        if r["version"] == "current":
            row.update({f"ms@{at}": r["ms"], f"gbps@{at}": r["input_gbps"], f"x@{at}": r["vs_copy"]})
        else:
            row[f"bx@{at}"] = r["vs_copy"]
    rows = [table[k] for k in sorted(table, key=lambda k: (OPS.index(k[0]), -(k[1] or 99)))]
    baseline = f"; baseline {result['baseline']}, timed in the same rounds" if result["baseline"] else ""
    return "\n".join([f"Setup: the {result['impl']} path, {result['dtype']} input, block {result['block_size']}, "
                      f"median of {result['repeats']} calls on the {result['clock']} clock{baseline}.", "",
                      *report.md_table(rows, cols)])


if __name__ == "__main__":
    sys.exit(main_one("kernel_bandwidth"))
