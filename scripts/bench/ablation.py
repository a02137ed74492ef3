"""Throughput ablation on the emulated cluster (ZeRO++ paper, Fig. 10 / Table 1).

    python scripts/bench/ablation.py                      # 2 rates x 2 tokens-per-rank x 5 configurations
    python scripts/bench/ablation.py --quick              # ZeRO-3 and ZeRO++ at 100mbit, 4 x 128 tokens
    python scripts/bench/ablation.py --rates 100mbit --micro-batches 4 --configs zero3 zeropp --steps 6

ZeRO-3, ZeRO-3 + qwZ (int8 weights), + hpZ (secondary partition = one node), + qgZ (int4
gradients, 2 hops) and full ZeRO++ train the same GPT-2 model (`train.py`, default corpus) on
2 emulated nodes x 2 ranks (`scripts/bench/cluster.py`: network namespaces, tbf-shaped links),
at each link rate and micro-batch size. Per run: step time (mean of the steps after the
warm-up, as logged by train.py), tokens/s, TFLOP/s per rank (model FLOPs, see below), speedup
over ZeRO-3 at the same rate and batch, the ledger's cross-node MB per rank and step, and the
PHYSICAL bytes each node's link carried per step. Physical bytes per step come from the node's
veth counters sampled at step boundaries (a sampler reads the counters 20 times a second, with
the number of steps rank 0 has logged to metrics.jsonl), over the steps after the warm-up — so
start-up, the final evaluation and the checkpoint are not counted.

Model FLOPs (models.config.flops_per_token, as train.py logs them): 6·N per token for the
weight matmuls (N = parameters without the position table; the tied LM head counts) plus
12·n_layer·d_model·seq for the attention scores and values, no discount for causal masking.

This module also holds the job runner the other cluster benchmarks (peers.py) use.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench import suite  # noqa: E402  (report helpers)

# ---------------------------------------------------------------- the reference workload

# The reference model: a GPT-2 architecture of ~10.3M parameters. gpt2-small-cpu
# (d_model 256, 8 heads, d_ff 1024) with 12 layers and the default corpus' 4096-token
# vocabulary: 10.56M parameters (10.53M without the position table).
MODEL_ARGS = ["--model.preset", "gpt2-small-cpu", "--model.n_layer", "12", "--model.max_seq_len", "128"]
SEQ = 128
NODES, RANKS_PER_NODE = 2, 2

CONFIGS = {  # key -> (label, train.py zero_optimization arguments)
    "zero3": ("ZeRO-3", ["--zero_optimization.stage", "3"]),
    "qwz": ("ZeRO-3 + qwZ", ["--zero_optimization.stage", "3", "--zero_optimization.zero_quantized_weights", "true"]),
    "hpz": ("ZeRO-3 + hpZ", ["--zero_optimization.stage", "3", "--zero_optimization.zero_hpz_partition_size", "0"]),
    "qgz": ("ZeRO-3 + qgZ", ["--zero_optimization.stage", "3",
                             "--zero_optimization.zero_quantized_gradients", "true"]),
    "zeropp": ("ZeRO++", ["--zero_optimization.stage", "3", "--zero_optimization.zero_quantized_weights", "true",
                          "--zero_optimization.zero_hpz_partition_size", "0",
                          "--zero_optimization.zero_quantized_gradients", "true"]),
}
RATES = ["100mbit", "1gbit"]
MICRO_BATCHES = [4, 8]


def common_train_args(micro_batch: int, steps: int, model_args: list[str] | None = None) -> list[str]:
    """train.py arguments shared by every runtime of a comparison (peer_train.py takes the same)."""
    return ["--config", str(ROOT / "configs" / "quickstart.yaml"), *(model_args or MODEL_ARGS),
            "--data.seq_len", str(SEQ), "--data.cache_dir", str(ROOT / "cache"),
            "--train.micro_batch_size", str(micro_batch), "--train.steps", str(steps),
            "--train.log_interval", "1", "--train.eval_interval", str(10**6), "--train.eval_batches", "1",
            "--train.progress_bar", "false", "--train.tensorboard", "false"]


def model_summary(model_args: list[str] | None = None) -> dict:
    """Parameter counts and FLOPs per token of the model the runs build (vocabulary from the config)."""
    from models.config import flops_per_token, num_params
    from trainer.config import parse_args
    from trainer.loop import build_model_config

    cfg = parse_args(common_train_args(1, 1, model_args))
    mc = build_model_config(cfg, cfg.data.vocab_size)
    return {"preset": cfg.model.preset, "n_layer": mc.n_layer, "d_model": mc.d_model, "n_head": mc.n_head,
            "vocab_size": mc.vocab_size, "seq_len": cfg.data.seq_len, "params": num_params(mc),
            "params_non_embedding": num_params(mc, include_embeddings=False),
            "flops_per_token": flops_per_token(mc, cfg.data.seq_len)}


# ---------------------------------------------------------------- cluster access


def cluster_unavailable() -> str | None:
    """Why the emulated cluster cannot run here (None when it can)."""
    try:
        from scripts.bench.cluster import check_requirements

        check_requirements()
    except Exception as e:  # ClusterRequirementError, or an import problem
        return str(e)
    return None


class LinkSampler(threading.Thread):
    """Samples every node's veth counters with rank 0's logged step count, 20 times a second.

    Counters are read from /proc/<pid>/net/dev of a `sleep` started inside each node's
    namespace (no process spawn per sample). `window(a, b)` gives per-node bytes between the
    first samples at which a and b steps had been logged.
    """

    def __init__(self, cluster, metrics: Path, interval: float = 0.05):
        super().__init__(daemon=True)
        self.cluster, self.metrics, self.interval = cluster, metrics, interval
        self.samples: list[tuple[float, int, list[tuple[int, int]]]] = []
        self._halt = threading.Event()
        self._sleepers = [subprocess.Popen(["ip", "netns", "exec", node.ns, "sleep", "86400"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True) for node in cluster.nodes]
        time.sleep(0.2)   # let `ip netns exec` enter the namespace and exec sleep

    def _counters(self) -> list[tuple[int, int]]:
        out = []
        for node, proc in zip(self.cluster.nodes, self._sleepers):
            text = Path(f"/proc/{proc.pid}/net/dev").read_text()
            line = next(ln for ln in text.splitlines() if ln.strip().startswith(node.ifname + ":"))
            fields = line.split(":", 1)[1].split()
            out.append((int(fields[8]), int(fields[0])))   # (tx bytes, rx bytes)
        return out

    def _steps(self) -> int:
        try:
            return self.metrics.read_text().count('"elapsed time per iteration (ms)"')
        except OSError:
            return 0

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.samples.append((time.monotonic(), self._steps(), self._counters()))
            except (OSError, StopIteration, ValueError):
                pass
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        for proc in self._sleepers:   # ours, killed by pid
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=5)

    def window(self, first: int, last: int) -> dict | None:
        a = next((s for s in self.samples if s[1] >= first), None)
        b = next((s for s in self.samples if s[1] >= last), None)
        if a is None or b is None or b[0] <= a[0]:
            return None
        return {"seconds": b[0] - a[0],
                "tx": [bb[0] - aa[0] for aa, bb in zip(a[2], b[2])],
                "rx": [bb[1] - aa[1] for aa, bb in zip(a[2], b[2])]}


@dataclass
class Job:
    """One training run: `kind` "train" (train.py) or "peer" (peer_train.py) with its runtime args."""
    key: str
    label: str
    kind: str
    args: list[str]
    meta: dict = field(default_factory=dict)


def _command(job: Job, common: list[str], out_dir: Path) -> list[str]:
    if job.kind == "train":
        return [sys.executable, str(ROOT / "train.py"), *common, "--train.out_dir", str(out_dir), *job.args]
    return [sys.executable, str(ROOT / "scripts" / "bench" / "peer_train.py"), *job.args, "--out", str(out_dir),
            *common]


def _metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "elapsed time per iteration (ms)" in r]


def _error_tail(text: str, lines: int = 6) -> str:
    keep = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    errors = [ln for ln in keep if re.search(r"Error|error:|Exception|Traceback|Killed", ln)]
    return " | ".join((errors or keep)[-lines:])[-600:]


def run_job(job: Job, micro_batch: int, steps: int, warmup: int, work: Path, cluster=None,
            timeout: float = 900, model_args: list[str] | None = None) -> dict:
    """Run `job` for `steps` steps (on `cluster`, or 4 loopback ranks as 2 nodes x 2); measure.

    Step time: mean of the per-step times logged after `warmup` steps. On the cluster also the
    physical bytes per step of each node's link over those steps (LinkSampler) and the wire time
    they need at the link rate.
    """
    out_dir = work / f"{job.key}-mb{micro_batch}-{int(time.time() * 1000) % 10**8}"
    common = common_train_args(micro_batch, steps, model_args)
    cmd = _command(job, common, out_dir)
    world = NODES * RANKS_PER_NODE
    row = {"key": job.key, "label": job.label, "kind": job.kind, "micro_batch": micro_batch,
           "tokens_per_rank": micro_batch * SEQ, "steps": steps, "warmup": warmup,
           "setting": f"{cluster.rate_bits / 1e6:g} Mbit/s" if cluster else "loopback (unshaped)",
           "rate_mbit": cluster.rate_bits / 1e6 if cluster else None, **job.meta}
    start = time.monotonic()
    sampler = None
    if cluster is not None:
        sampler = LinkSampler(cluster, out_dir / "metrics.jsonl")
        sampler.start()
        try:
            result = cluster.run(cmd, nproc_per_node=RANKS_PER_NODE, cwd=ROOT, timeout=timeout)
        finally:
            sampler.stop()
        rc, output = result.returncode, "\n".join(result.node_outputs)
        row["link_bytes_run"] = result.link_bytes
    else:
        if job.kind == "train":
            cmd += ["--zero_optimization.ranks_per_node", str(RANKS_PER_NODE)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        try:
            proc = subprocess.run(torchrun + cmd[1:], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = 124, f"timed out after {timeout:.0f} s: {(e.stdout or b'')[-2000:]!r}"
    row["wall_s"] = time.monotonic() - start
    metrics = _metrics(out_dir)
    peer_result = out_dir / "result.json"
    if peer_result.is_file():
        info = json.loads(peer_result.read_text())
        row["version"] = info.get("version")
        if info.get("error"):
            row["error"] = info["error"]
    if rc != 0 or len(metrics) < steps:
        row["ok"] = False
        row.setdefault("error", f"exit {rc}: {_error_tail(output)}")
        shutil.rmtree(out_dir, ignore_errors=True)
        return row
    times = [m["elapsed time per iteration (ms)"] for m in metrics]
    measured = times[warmup:] or times
    step_s = statistics.mean(measured) / 1e3
    # TFLOP per step is constant: recover it from any logged row (TFLOP/s per rank x seconds x world)
    m0 = metrics[-1]
    tflop_per_step = m0["TFLOP/s per rank"] * m0["elapsed time per iteration (ms)"] / 1e3 * world
    tokens_per_step = micro_batch * SEQ * world
    row.update(ok=True, step_ms=step_s * 1e3, step_ms_median=statistics.median(measured) * 1.0,
               step_ms_all=times, tokens_per_s=tokens_per_step / step_s,
               tflops_per_rank=tflop_per_step / step_s / world, final_loss=metrics[-1]["lm loss"],
               losses=[m["lm loss"] for m in metrics])
    # the engine's per-step timings (train.py logs them for stage 3): waiting for gathers / reductions,
    # weight encode / decode, in ms; the rest of the step is compute and everything else
    kinds = sorted({k[:-5] for m in metrics for k in m if k.endswith(" (ms)") and not k.startswith("elapsed")})
    if kinds:
        timed = metrics[warmup:] or metrics
        row["timing_kinds"] = kinds
        for kind in kinds:
            row[f"{kind} ms"] = statistics.mean(m.get(f"{kind} (ms)", 0.0) for m in timed)
        row["rest ms"] = row["step_ms"] - sum(row[f"{kind} ms"] for kind in kinds)
    if "cross-node sent (MB)" in m0:
        row["ledger_cross_mb_rank"] = m0["cross-node sent (MB)"] * 2**20 / 1e6   # logged in MiB
        row["ledger_comm_mb_rank"] = m0["comm sent (MB)"] * 2**20 / 1e6
    if sampler is not None:
        win = sampler.window(warmup, steps)
        if win:
            n = steps - warmup
            row["phys_tx_mb_node"] = statistics.mean(win["tx"]) / n / 1e6   # per node and step
            row["phys_rx_mb_node"] = statistics.mean(win["rx"]) / n / 1e6
            busiest = max(max(win["tx"]), max(win["rx"])) / n
            row["wire_ms"] = busiest * 8 / cluster.rate_bits * 1e3          # at exactly the tbf rate
            row["link_busy_pct"] = 100 * row["wire_ms"] / row["step_ms"]
    shutil.rmtree(out_dir, ignore_errors=True)
    return row


def describe_row(row: dict) -> str:
    if not row.get("ok"):
        return f"FAILED: {row.get('error', '?')}"
    text = f"{row['step_ms']:.0f} ms/step, {row['tokens_per_s']:.0f} tokens/s"
    if "phys_tx_mb_node" in row:
        text += f", {row['phys_tx_mb_node']:.1f} MB/step/node on the link"
    return text


class ClusterSession:
    """One emulated cluster per link rate, torn down on every exit path (None rate: loopback)."""

    def __init__(self, rate: str | None):
        self.rate, self.cluster = rate, None

    def __enter__(self):
        if self.rate:
            from scripts.bench.cluster import EmulatedCluster

            self.cluster = EmulatedCluster(nodes=NODES, rate=self.rate).setup()
        return self.cluster

    def __exit__(self, *exc):
        if self.cluster is not None:
            self.cluster.teardown()


# ---------------------------------------------------------------- the ablation


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", nargs="+", default=None, help=f"link rates (default {' '.join(RATES)})")
    p.add_argument("--micro-batches", type=int, nargs="+", default=None,
                   help=f"micro-batch sizes x {SEQ} tokens per rank (default {' '.join(map(str, MICRO_BATCHES))})")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 5, quick 4)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed")
    p.add_argument("--timeout", type=float, default=900)


def resolve(args) -> dict:
    quick = getattr(args, "quick", False)
    return {"rates": args.rates or (["100mbit"] if quick else RATES),
            "micro_batches": args.micro_batches or ([4] if quick else MICRO_BATCHES),
            "configs": args.configs or (["zero3", "zeropp"] if quick else list(CONFIGS)),
            "steps": args.steps or (4 if quick else 5), "warmup": args.warmup, "timeout": args.timeout}


def run(args, progress=print) -> dict:
    plan = resolve(args)
    result = {"benchmark": "ablation", "plan": plan, "model": model_summary(), "nodes": NODES,
              "ranks_per_node": RANKS_PER_NODE, "rows": []}
    why = cluster_unavailable()
    if why:
        result["skipped"] = f"emulated cluster unavailable: {why}"
        progress(f"ablation: skipped ({result['skipped']})")
        return result
    total = len(plan["rates"]) * len(plan["micro_batches"]) * len(plan["configs"])
    done = 0
    with tempfile.TemporaryDirectory(prefix="bench-ablation-") as tmp:
        for rate in plan["rates"]:
            with ClusterSession(rate) as cluster:
                for mb in plan["micro_batches"]:
                    for key in plan["configs"]:
                        label, zargs = CONFIGS[key]
                        done += 1
                        t0 = time.monotonic()
                        row = run_job(Job(key, label, "train", zargs), mb, plan["steps"], plan["warmup"], Path(tmp),
                                      cluster, plan["timeout"])
                        row["rate"] = rate
                        result["rows"].append(row)
                        progress(f"  ablation [{done}/{total}] {label} @ {rate}, {mb}x{SEQ} tokens/rank: "
                                 f"{describe_row(row)} ({time.monotonic() - t0:.0f} s)")
    add_speedups(result["rows"])
    return result


def add_speedups(rows: list[dict]) -> None:
    base = {(r["rate"], r["micro_batch"]): r for r in rows if r["key"] == "zero3" and r.get("ok")}
    for r in rows:
        b = base.get((r["rate"], r["micro_batch"]))
        if not (b and r.get("ok")):
            continue
        r["speedup_vs_zero3"] = b["step_ms"] / r["step_ms"]
        if "phys_tx_mb_node" in r and b.get("phys_tx_mb_node"):
            r["phys_ratio_vs_zero3"] = r["phys_tx_mb_node"] / b["phys_tx_mb_node"]
        if "ledger_cross_mb_rank" in r and b.get("ledger_cross_mb_rank"):
            r["ledger_ratio_vs_zero3"] = r["ledger_cross_mb_rank"] / b["ledger_cross_mb_rank"]


COLUMNS = [("label", "configuration", "{}"), ("rate", "link", "{}"), ("tokens_per_rank", "tokens/rank", "{}"),
           ("step_ms", "step ms", "{:.0f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
           ("tflops_per_rank", "TFLOP/s per rank", "{:.4f}"), ("speedup_vs_zero3", "speedup vs ZeRO-3", "{:.2f}x"),
           ("ledger_cross_mb_rank", "ledger cross-node MB/rank/step", "{:.2f}"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"),
           ("phys_ratio_vs_zero3", "physical / ZeRO-3", "{:.3f}"),
           ("wire_ms", "wire time ms", "{:.0f}"), ("link_busy_pct", "link busy %", "{:.0f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result.get("rows", []) if r.get("ok")]
    if not rows:
        return []
    plt = suite.pyplot()
    groups = sorted({(r["rate"], r["micro_batch"]) for r in rows}, key=lambda g: (suite.rate_bits(g[0]), g[1]))
    labels = [CONFIGS[k][0] for k in result["plan"]["configs"]]
    paths = []
    for metric, ylabel, name in (("tokens_per_s", "tokens/s (4 ranks)", "ablation_throughput"),
                                 ("phys_tx_mb_node", "physical MB per step per node link", "ablation_bytes")):
        fig, ax = plt.subplots(figsize=(9, 4.2))
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            ys = []
            for g in groups:
                r = next((r for r in rows if (r["rate"], r["micro_batch"]) == g and r["label"] == label), None)
                ys.append(r.get(metric, 0) if r else 0)
            ax.bar([x + i * width for x in range(len(groups))], ys, width, label=label)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(groups))])
        ax.set_xticklabels([f"{g[0]}\n{g[1]}x{SEQ} tokens/rank" for g in groups])
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['model']['params'] / 1e6:.1f}M-parameter GPT-2, 2 nodes x 2 ranks (emulated)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(suite.save_fig(fig, out_dir, name))
    return paths


def markdown(result: dict, images: dict[str, str]) -> str:
    lines = ["## 1. Throughput ablation (paper Fig. 10 / Table 1)", ""]
    if result.get("skipped"):
        return "\n".join(lines + [f"Skipped: {result['skipped']}.", ""])
    m = result["model"]
    plan = result["plan"]
    lines += [f"`train.py` on {result['nodes']} emulated nodes x {result['ranks_per_node']} ranks (network namespaces, "
              f"tbf-shaped links), model {m['preset']} with {m['n_layer']} layers: **{m['params'] / 1e6:.2f}M "
              f"parameters** (d_model {m['d_model']}, vocabulary {m['vocab_size']}, {m['seq_len']} tokens per "
              f"sample), default corpus, AdamW. {plan['steps']} steps per run, the first {plan['warmup']} not timed. "
              "TFLOP/s are model FLOPs: 6·N per token (N without the position table, tied head counted) plus "
              "12·n_layer·d_model·seq for attention. Physical bytes: what each node's link sent per step "
              "(veth counters at step boundaries, frame bytes); wire time = the busier direction's bytes at the "
              "tbf rate, i.e. the least time the step can take on that link.", ""]
    lines += suite.md_table(result["rows"], COLUMNS)
    lines.append("")
    lines += profile_lines(result)
    for name in ("ablation_throughput", "ablation_bytes"):
        if name in images:
            lines += [f"![{name}]({images[name]})", ""]
    return "\n".join(lines)


def profile_lines(result: dict) -> list[str]:
    """Where the time goes: the engine's per-step timings (train.py), wire time, and the compute floor."""
    rows = [r for r in result.get("rows", []) if r.get("ok")]
    rates = sorted({r["rate"] for r in rows}, key=suite.rate_bits)
    if not rows:
        return []
    kinds = sorted({k for r in rows for k in r.get("timing_kinds", [])})
    table = []
    if kinds:
        cols = [("label", "configuration", "{}"), ("rate", "link", "{}"), ("tokens_per_rank", "tokens/rank", "{}"),
                ("step_ms", "step ms", "{:.0f}"), ("wire_ms", "wire time ms", "{:.0f}")]
        cols += [(f"{k} ms", f"{k} ms", "{:.0f}") for k in kinds]
        cols += [("rest ms", "rest (compute, other) ms", "{:.0f}")]
        table = ["", "Where the time goes, per step on rank 0 (the engine's timings as train.py logs them, mean over "
                 "the timed steps): time the training thread waited for gathers and for reductions, and spent "
                 "encoding (quantizing, once per step) and decoding weights; the rest is compute and everything "
                 "else.", ""] + suite.md_table(rows, cols)
    out = ["The \"wire time\" column is what the busier direction of a node's link needs for the bytes it carried "
           "(at exactly the tbf rate): the least time the step can take on that link."]
    slow, fast = rates[0], rates[-1]
    for mb in sorted({r["micro_batch"] for r in rows}):
        z3 = next((r for r in rows if (r["key"], r["rate"], r["micro_batch"]) == ("zero3", slow, mb)), None)
        zs = next((r for r in rows if (r["key"], r["rate"], r["micro_batch"]) == ("zeropp", slow, mb)), None)
        zf = next((r for r in rows if (r["key"], r["rate"], r["micro_batch"]) == ("zeropp", fast, mb)), None)
        if not (z3 and zs):
            continue
        text = (f"At {slow} and {mb}x{SEQ} tokens per rank, ZeRO-3's step is {z3['step_ms']:.0f} ms, "
                f"{z3.get('wire_ms', 0):.0f} ms of it wire time; ZeRO++'s is {zs['step_ms']:.0f} ms with "
                f"{zs.get('wire_ms', 0):.0f} ms of wire time")
        if zf and fast != slow:
            text += (f"; at {fast} ZeRO++ takes {zf['step_ms']:.0f} ms, about its compute floor on this machine, so "
                     f"ZeRO++ could be at most {z3['step_ms'] / zf['step_ms']:.2f}x faster than ZeRO-3 at {slow} "
                     "here, however few bytes it sent")
        out.append(text + ".")
    return [" ".join(out[:1]), ""] + [line for t in out[1:] for line in (t, "")] + table[1:] + ([""] if table else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    suite.add_common_args(p)
    args = p.parse_args(argv)
    return suite.run_standalone("ablation", run, plots, markdown, args)


if __name__ == "__main__":
    sys.exit(main())
