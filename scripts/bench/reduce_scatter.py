"""gloo's native reduce-scatter and all-gather vs zeropp.comm's (an all-reduce beside them), side by side.

    python scripts/bench/reduce_scatter.py --ranks 4 --numel 4000000

Why: on gloo `reduce_scatter` moves about as much data as an all-reduce, so ZeRO-3 uses the exact ring
from zeropp.comm; gloo's all-gather receives into a flat copy of the output first, so zeropp.comm sends each
shard straight to every member, received in place.
"""

import sys
import time

from scripts.bench.report import md_table
from scripts.bench.suite import main_one

TITLE = "## gloo's reduce-scatter and all-gather vs ours"


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
    shard = native_out.clone()
    times = [("native reduce_scatter", "reduce_scatter", lambda: dist.reduce_scatter_single(native_out, full)),
             ("ring reduce_scatter (zeropp)", "reduce_scatter", lambda: comm.reduce_scatter(out, full)),
             ("native all_gather", "all_gather", lambda: dist.all_gather_single(full, shard)),
             ("exchange all_gather (zeropp)", "all_gather", lambda: comm.all_gather(full, shard)),
             ("all_reduce", "reduce_scatter", lambda: dist.all_reduce(full.clone()))]
    times = [(op, kind, _timed(fn, repeats)) for op, kind, fn in times]
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
    ours = {kind: t for op, kind, t in times if "(zeropp)" in op}  # each kind against ours
    return {"ranks": args.ranks, "numel": numel, "dtype": args.dtype,
            "rows": [{"op": op, "ms": t * 1e3, "vs_ours": t / ours[kind]} for op, kind, t in times]}


def markdown(result: dict) -> str:
    return "\n".join([f"{result['ranks']} ranks, {result['numel']} x {result['dtype']} (the full tensor), gloo, ms per "
                      f"call; x ours: against zeropp's collective of the same kind (the all-reduce: against the ring "
                      f"reduce-scatter).", "",
                      *md_table(result["rows"], [("op", "collective", "{}"), ("ms", "ms", "{:.1f}"),
                                                 ("vs_ours", "x ours", "{:.2f}")])])


if __name__ == "__main__":
    sys.exit(main_one("reduce_scatter"))
