"""Benchmark: gloo's native reduce-scatter vs our send/recv ring vs an all-reduce, side by side.

    python scripts/bench/reduce_scatter.py --ranks 4 --numel 4000000

Why: on gloo `reduce_scatter` moves about as much data as an all-reduce, so the ZeRO-3
baseline uses the faster exact ring from zeropp.comm. Prints seconds per call and ratios.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.spawn import run_ranks  # noqa: E402
from zeropp.comm import Comm  # noqa: E402
from zeropp.config import DTYPES  # noqa: E402
from zeropp.topology import build_topology  # noqa: E402


def _timed(fn, repeats):
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def worker(rank, world, numel, dtype, repeats):
    comm = Comm(build_topology())
    full = torch.randn(numel).to(dtype)
    out = torch.empty(numel // world, dtype=torch.float32)
    native_out = torch.empty(numel // world, dtype=dtype)
    times = {
        "native reduce_scatter": _timed(lambda: dist.reduce_scatter_single(native_out, full), repeats),
        "ring reduce_scatter (zeropp)": _timed(lambda: comm.reduce_scatter(out, full), repeats),
        "all_reduce": _timed(lambda: dist.all_reduce(full.clone()), repeats),
    }
    comm.close()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    numel = -(-args.numel // args.ranks) * args.ranks
    times = run_ranks(worker, args.ranks, args=(numel, DTYPES[args.dtype], args.repeats), timeout=600)[0]
    ring = times["ring reduce_scatter (zeropp)"]
    print(f"{args.ranks} ranks, {numel} x {args.dtype}, gloo")
    for name, t in times.items():
        print(f"  {name:30s} {t * 1e3:8.1f} ms   {t / ring:5.2f}x the ring")


if __name__ == "__main__":
    main()
