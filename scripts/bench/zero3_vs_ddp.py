"""Step time of our ZeRO-3 and ZeRO++ against plain DDP, same model, ranks and batch, side by side.

    python scripts/bench/zero3_vs_ddp.py --ranks 4 --ranks-per-node 2 --steps 12
    python scripts/bench/zero3_vs_ddp.py --nodes 2 --ranks-per-node 2 --rate 100mbit   # emulated cluster

Each configuration is a `train.py` run (torchrun on loopback, or one torchrun per emulated
node with `--rate`); the step time is the mean "elapsed time per iteration" the trainer
logs, skipping the first log window (warm-up). Runs alternate (DDP, ZeRO-3, DDP, ...) so a
slow phase of the machine hits both. Prints ms/step and the ratio; `--json` keeps them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNTIMES = {
    "DDP (fp32 all-reduce)": ["--zero_optimization.stage", "0"],
    "ZeRO-3 (bf16)": ["--zero_optimization.stage", "3"],
    "ZeRO++ (qwZ int8, hpZ, qgZ int4)": ["--zero_optimization.stage", "3", "--zero_optimization.zero_quantized_weights",
                                         "true", "--zero_optimization.zero_hpz_partition_size", "0",
                                         "--zero_optimization.zero_quantized_gradients", "true"],
}


def train_args(args, out_dir: Path, runtime: list[str]) -> list[str]:
    return [str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--model.preset", args.preset, "--data.seq_len", str(args.seq), "--data.cache_dir", str(ROOT / "cache"),
            "--train.micro_batch_size", str(args.micro_batch), "--train.steps", str(args.steps),
            "--train.log_interval", str(args.log_interval), "--train.eval_interval", str(10 * args.steps),
            "--train.eval_batches", "1", "--train.out_dir", str(out_dir), "--train.progress_bar", "false",
            "--train.tensorboard", "false", *runtime]


def step_ms(out_dir: Path) -> float:
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    times = [m["elapsed time per iteration (ms)"] for m in metrics if "elapsed time per iteration (ms)" in m]
    return statistics.mean(times[1:] or times)


def run_local(args, out_dir: Path, runtime: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           *train_args(args, out_dir, runtime), "--zero_optimization.ranks_per_node", str(args.ranks_per_node)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def run_cluster(args, cluster, out_dir: Path, runtime: list[str]) -> dict:
    result = cluster.run([sys.executable, *train_args(args, out_dir, runtime)], nproc_per_node=args.ranks_per_node,
                         cwd=ROOT, timeout=args.timeout)
    if result.returncode:
        sys.exit(f"run failed ({result.returncode}):\n{result.node_outputs[0][-3000:]}")
    return result.link_bytes[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-tiny")
    parser.add_argument("--ranks", type=int, default=4, help="loopback runs: total ranks")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2, help="emulated cluster runs (--rate): nodes")
    parser.add_argument("--rate", help="run on the emulated cluster with this link rate, e.g. 100mbit")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    times: dict[str, list[float]] = {name: [] for name in RUNTIMES}
    link: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = None
        if args.rate:
            from scripts.bench.cluster import EmulatedCluster

            cluster = EmulatedCluster(nodes=args.nodes, rate=args.rate).setup()
        try:
            for repeat in range(args.repeats):
                for name, runtime in RUNTIMES.items():
                    out = Path(tmp) / f"{list(RUNTIMES).index(name)}-{repeat}"
                    if cluster:
                        link[name] = run_cluster(args, cluster, out, runtime)
                    else:
                        run_local(args, out, runtime)
                    times[name].append(step_ms(out))
                    print(f"{name}: {times[name][-1]:.1f} ms/step", flush=True)
        finally:
            if cluster:
                cluster.teardown()
    best = {name: min(t) for name, t in times.items()}
    ddp = best["DDP (fp32 all-reduce)"]
    where = f"emulated {args.nodes} nodes x {args.ranks_per_node} at {args.rate}" if args.rate else \
        f"{args.ranks} ranks ({args.ranks_per_node} per node) on loopback"
    print(f"{args.preset}, micro-batch {args.micro_batch} x {args.seq} tokens per rank, {where}")
    for name, ms in best.items():
        print(f"{name}: {ms:.1f} ms/step, {ms / ddp:.2f}x DDP's step time")
    if args.json:
        args.json.write_text(json.dumps({"times_ms": times, "link_bytes_node0": link, "best_ms": best,
                                         "setup": vars(args) | {"json": str(args.json)}}, indent=1))


if __name__ == "__main__":
    main()
