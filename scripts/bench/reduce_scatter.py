"""gloo's native reduce-scatter vs our send/recv ring vs an all-reduce, side by side.

    python scripts/bench/reduce_scatter.py --ranks 4 --numel 4000000

Why: on gloo `reduce_scatter` moves about as much data as an all-reduce, so ZeRO-3 uses the exact ring
from zeropp.comm.
"""

import sys
import time

from scripts.bench.report import md_table
from scripts.bench.suite import main_one

TITLE = "## gloo's reduce-scatter vs our ring"


def _timed(fn, repeats):
    import torch.distributed as dist

    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def _measure(rank, world, numel, dtype, repeats):
    import torch
    import torch.distributed as dist

    from zeropp.comm import Comm
    from zeropp.config import DTYPES
    from zeropp.topology import build_mesh

    comm, full = Comm(build_mesh()), torch.randn(numel).to(DTYPES[dtype])
    out, native_out = torch.empty(numel // world), torch.empty(numel // world, dtype=full.dtype)
    times = {"native reduce_scatter": _timed(lambda: dist.reduce_scatter_single(native_out, full), repeats),
             "ring reduce_scatter (zeropp)": _timed(lambda: comm.reduce_scatter(out, full), repeats),
             "all_reduce": _timed(lambda: dist.all_reduce(full.clone()), repeats)}
    comm.close()
    return times


def add_args(p) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--numel", type=int, default=4_000_000)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=5)


def run(args, progress=print) -> dict:
    from trainer.spawn import run_ranks

    numel = -(-args.numel // args.ranks) * args.ranks
    times = run_ranks(_measure, args.ranks, args=(numel, args.dtype, args.repeats), timeout=600)[0]
    ring = times["ring reduce_scatter (zeropp)"]
    return {"ranks": args.ranks, "numel": numel, "dtype": args.dtype,
            "rows": [{"op": op, "ms": t * 1e3, "vs_ring": t / ring} for op, t in times.items()]}


def markdown(result: dict) -> str:
    return "\n".join([f"{result['ranks']} ranks, {result['numel']} x {result['dtype']}, gloo, ms per call.", "",
                      *md_table(result["rows"], [("op", "collective", "{}"), ("ms", "ms", "{:.1f}"),
                                                 ("vs_ring", "x the ring", "{:.2f}")])])


if __name__ == "__main__":
    sys.exit(main_one("reduce_scatter"))
