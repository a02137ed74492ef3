"""The one runner of the benchmarks' training jobs: `train.py` or a peer runtime (`peers.py --worker KEY`)
launched with torchrun on the emulated cluster (or on 4 loopback ranks laid out as 2 nodes x 2), and what
each job measured: the median logged step time after the warm-up (issue 17's protocol) and, on the cluster,
each node's veth bytes between those step boundaries (start-up, evaluation and checkpoint left out).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.cluster import ClusterRequirementError, EmulatedCluster, check_requirements

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # name -> the model (and vocabulary) arguments of a comparison's jobs
    # the suite's reference: gpt2-small-cpu with 12 layers and the default corpus' 4096-token vocabulary: 10.56M
    "suite": ["--model.preset", "gpt2-small-cpu", "--model.n_layer", "12", "--model.max_seq_len", "128"],
    # issue 17's reference shape: GPT-2 of 4 layers, d_model 384, d_ff 1536, vocabulary 8192 (10.29M parameters)
    "issue": ["--model.preset", "gpt2-small-cpu", "--model.n_layer", "4", "--model.d_model", "384",
              "--model.d_ff", "1536", "--model.max_seq_len", "128", "--data.vocab_size", "8192"],
}
SEQ = 128
NODES, RANKS_PER_NODE = 2, 2
STEP_KEY = "elapsed time per iteration (ms)"
# a timed job logs every step and does nothing else in the steps (no evaluation, checkpoint, progress bar)
TIMED = ["--train.log_interval", "1", "--train.eval_interval", str(10**6), "--train.eval_batches", "1",
         "--train.checkpoint_interval", "0", "--train.progress_bar", "false", "--train.tensorboard", "false"]


def train_args(micro_batch: int, steps: int, shape: str = "suite", model: list[str] | None = None,
               seq: int = SEQ) -> list[str]:
    """The config arguments every runtime of a comparison gets (the model: SHAPES[shape], or `model`)."""
    return ["--config", str(ROOT / "configs" / "quickstart.yaml"), *(model or SHAPES[shape]),
            "--data.seq_len", str(seq), "--data.cache_dir", str(ROOT / "cache"),
            "--train.micro_batch_size", str(micro_batch), "--train.steps", str(steps), *TIMED]


def zero_args(**keys) -> list[str]:
    """train.py arguments setting these zero_optimization keys."""
    return [a for k, v in keys.items()
            for a in (f"--zero_optimization.{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def model_summary(config_args: list[str] | None = None, shape: str = "suite") -> dict:
    """model_facts of the model a job with these arguments (default: SHAPES[shape]'s) builds."""
    from trainer.config import parse_args
    from trainer.loop import build_model_config

    cfg = parse_args(config_args or train_args(1, 1, shape))
    return model_facts(build_model_config(cfg, cfg.data.vocab_size), cfg.model.preset, cfg.data.seq_len)


def model_facts(mc, preset: str, seq_len: int) -> dict:
    """What the docs say of a model (a models.config.ModelConfig); FLOPs as the Trainer logs them."""
    from models.config import flops_per_token, num_params

    return {"preset": preset, "n_layer": mc.n_layer, "d_model": mc.d_model, "d_ff": mc.d_ff, "n_head": mc.n_head,
            "vocab_size": mc.vocab_size, "seq_len": seq_len, "params": num_params(mc),
            "params_non_embedding": num_params(mc, include_embeddings=False),
            "flops_per_token": flops_per_token(mc, seq_len)}


def model_words(m: dict) -> str:
    """A model (model_facts) as the docs' setup lines state it."""
    return (f"{m['preset']}, {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, vocabulary "
            f"{m['vocab_size']}: {m['params'] / 1e6:.2f}M parameters")


# ---------------------------------------------------------------- the cluster


def cluster_unavailable() -> str | None:
    """Why the emulated cluster cannot run here (None when it can)."""
    try:
        check_requirements()
    except ClusterRequirementError as e:
        return str(e)
    return None


def cluster_at(rate: str | None):
    """The emulated cluster at this link rate, as a context torn down on every exit path (None: loopback)."""
    return EmulatedCluster(nodes=NODES, rate=rate) if rate else nullcontext()


class LinkSampler(threading.Thread):
    """Samples every node's link counters with rank 0's logged step count, 20 times a second, so that
    `window(a, b)` gives per-node bytes between the first samples at which a and b steps had been logged."""

    def __init__(self, cluster, metrics: Path, interval: float = 0.05):
        super().__init__(daemon=True)
        self.cluster, self.metrics, self.interval = cluster, metrics, interval
        self.samples: list[tuple[float, int, list[tuple[int, int]]]] = []  # (time, steps, [(tx, rx) per node])
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                steps = self.metrics.read_text().count(f'"{STEP_KEY}"') if self.metrics.is_file() else 0
                self.samples.append((time.monotonic(), steps,
                                     [(c["tx"], c["rx"]) for c in self.cluster.link_counters()]))
            except (OSError, StopIteration, ValueError):
                pass
            self._halt.wait(self.interval)

    def __enter__(self) -> LinkSampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._halt.set()
        self.join(timeout=5)

    def window(self, first: int, last: int) -> dict | None:
        a, b = (next((s for s in self.samples if s[1] >= steps), None) for steps in (first, last))
        if a is None or b is None or b[0] <= a[0]:
            return None
        return {"seconds": b[0] - a[0], "tx": [bb[0] - aa[0] for aa, bb in zip(a[2], b[2])],
                "rx": [bb[1] - aa[1] for aa, bb in zip(a[2], b[2])]}


# ---------------------------------------------------------------- launching


def launch(cmd: list[str], cluster=None, nproc: int | None = NODES * RANKS_PER_NODE, timeout: float = 900,
           log: Path | None = None, per_node: int = RANKS_PER_NODE) -> tuple[int, str]:
    """Run `python script args` with torchrun on every node of `cluster` (`per_node` ranks each), or on
    `nproc` local ranks, or (nproc None) as one plain process; -> (exit code, output). 124: timed out."""
    cmd = [str(c) for c in cmd]
    if cluster is not None:
        result = cluster.run(cmd, nproc_per_node=per_node, cwd=ROOT, timeout=timeout)
        rc, output = result.returncode, "\n".join(result.node_outputs)
    else:
        if nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   *cmd[1:]]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = 124, f"timed out after {timeout:.0f} s: {(e.stdout or b'')[-2000:]!r}"
    if log:
        log.write_text(output)
    return rc, output


def output_lines(text: str) -> list[str]:
    """A job's output lines, stripped, without torchrun's "[rankN]:" prefixes."""
    return [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in text.splitlines()]


def said(output: str, what: str) -> str | None:
    """What a job's log line "<what>: ..." says (the Trainer logs "runtime: ..." and "compute: ...")."""
    found = re.search(rf"{what}: (.*)", output)
    return found.group(1).strip() if found else None


def error_tail(text: str, lines: int = 6) -> str:
    """The exception a failed job died of, else the last lines of its output."""
    keep = [ln for ln in output_lines(text) if ln and "Warning" not in ln and "warn(" not in ln]
    raised = [ln for ln in keep if re.match(r"^[\w.]+(Error|Exception|Interrupt): ", ln) and "ChildFailed" not in ln]
    if raised:
        return raised[-1][:600]
    errors = [ln for ln in keep if re.search(r"Error|error:|Exception|Traceback|Killed", ln)]
    return " | ".join((errors or keep)[-lines:])[-600:]


def read_metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def validation_curve(out_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of every evaluation a run logged."""
    return [(m["step"], m["validation loss"]) for m in read_metrics(out_dir) if "validation loss" in m]


def wait_quiet(limit_s: float, max_load: float, progress=print) -> dict:
    """Wait (up to limit_s) for a 1-minute load below max_load and no one else's training, suite or tests."""
    start = time.monotonic()
    while True:
        busy = []
        for d in (d for d in Path("/proc").iterdir() if d.name.isdigit() and int(d.name) != os.getpid()):
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            busy += [f"{d.name}: {cmd[:100]}"] if re.search(r"train\.py|suite\.py|pytest", cmd) else []
        load, waited = os.getloadavg()[0], time.monotonic() - start
        if (load < max_load and not busy) or waited > limit_s:
            return {"load_1min": round(load, 2), "waited_s": round(waited), "quiet": load < max_load and not busy,
                    "busy": busy[:5]}
        progress(f"  waiting for a quiet machine: load {load:.2f}, {len(busy)} other processes ({waited:.0f} s)")
        time.sleep(30)


def quiet_words(q: dict) -> str:
    """How quiet the machine was when a timed part started (wait_quiet's answer), for the docs."""
    return (f"The timed part started at 1-minute load {q['load_1min']} after waiting {q['waited_s']} s"
            + ("" if q["quiet"] else f" (NOT quiet: {'; '.join(q['busy']) or 'load'})"))


@dataclass
class Job:
    """One training run: `script` (train.py, or the peers' worker) with its runtime's arguments, at a
    micro-batch size, on the emulated cluster at link rate `setting` (or on "loopback"), training the
    model SHAPES[shape]; `compute` = what its matmuls run in ("bf16" or "fp32")."""
    key: str
    label: str
    args: list[str]
    micro_batch: int
    setting: str
    script: list[str] = field(default_factory=lambda: [str(ROOT / "train.py")])
    shape: str = "suite"
    compute: str | None = None


def run_jobs(name: str, jobs: list[Job], steps: int, warmup: int, timeout: float, progress=print) -> list[dict]:
    """Run and measure the jobs in order, on one emulated cluster per run of jobs at the same rate."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        for setting, group in itertools.groupby(jobs, key=lambda j: j.setting):
            with cluster_at(None if setting == "loopback" else setting) as cluster:
                for job in group:
                    t0 = time.monotonic()
                    rows.append(run_job(job, steps, warmup, Path(tmp), cluster, timeout))
                    progress(f"  {name} [{len(rows)}/{len(jobs)}] {job.label} [{job.compute or '?'} compute] @ "
                             f"{setting}, {job.micro_batch}x{SEQ} tokens/rank: {describe_row(rows[-1])} "
                             f"({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")
    return rows


def run_job(job: Job, steps: int, warmup: int, work: Path, cluster=None, timeout: float = 900) -> dict:
    """Run `job` for `steps` steps (on `cluster`, or 4 loopback ranks as 2 nodes x 2) and measure it."""
    out_dir = work / f"{job.key}-mb{job.micro_batch}-{time.time_ns() % 10**10}"
    cmd = [sys.executable, *job.script, *train_args(job.micro_batch, steps, job.shape), "--train.out_dir",
           str(out_dir), *job.args] + ([] if cluster else zero_args(ranks_per_node=RANKS_PER_NODE))  # loopback: 2 x 2
    row = {**asdict(job), "args": [str(a) for a in job.args], "script": shown(job.script),
           "tokens_per_rank": job.micro_batch * SEQ, "steps": steps, "warmup": warmup,
           "load_start": round(os.getloadavg()[0], 2),
           **measured_launch(cmd, out_dir / "metrics.jsonl", cluster, steps, warmup, timeout)}
    shutil.rmtree(out_dir, ignore_errors=True)
    if not row["ok"]:
        return row
    metrics = row.pop("metrics")
    last = metrics[-1]
    row.update(step_stats(metrics, warmup))
    step_s = row["step_ms"] / 1e3
    row.update(tokens_per_s=row["tokens_per_rank"] * NODES * RANKS_PER_NODE / step_s,
               # every step does the same FLOPs: the last logged step's rate at the median step time
               tflops_per_rank=last["TFLOP/s per rank"] * last[STEP_KEY] / 1e3 / step_s,
               final_loss=last["lm loss"], losses=[m["lm loss"] for m in metrics])
    if "wire_ms" in row:
        row["link_busy_pct"] = 100 * row["wire_ms"] / row["step_ms"]
    return row


def step_stats(metrics: list[dict], warmup: int, rest_of: str = "median") -> dict:
    """The logged steps after the warm-up: step time (median, mean; all of them), the runtime's per-step
    timings (waiting for gathers / reductions, weight encode / decode, ...: means, ms; "rest ms" = the median
    or mean step time minus them: compute and everything else) and the ledger's cross-node MB per rank."""
    timed = metrics[warmup:] or metrics
    times = [m[STEP_KEY] for m in timed]
    out = {"step_ms": statistics.median(times), "step_ms_mean": statistics.mean(times),
           "step_ms_all": [m[STEP_KEY] for m in metrics],
           "timing_kinds": sorted({k[:-5] for m in metrics for k in m if k.endswith(" (ms)") and k != STEP_KEY})}
    out.update({f"{kind} ms": statistics.mean(m.get(f"{kind} (ms)", 0.0) for m in timed)
                for kind in out["timing_kinds"]})
    out["rest ms"] = out["step_ms" if rest_of == "median" else "step_ms_mean"] - sum(
        out[f"{kind} ms"] for kind in out["timing_kinds"])
    if ledger := statistics.median(m.get("cross-node sent (MB)", 0.0) for m in timed):
        out["ledger_cross_mb_rank"] = ledger * 2**20 / 1e6  # logged in MiB
    return out


def measured_launch(cmd: list, metrics: Path, cluster, steps: int, warmup: int, timeout: float,
                    segments: list[tuple[int, int]] | None = None, per_node: int = RANKS_PER_NODE,
                    keep_lines=None) -> dict:
    """Launch a job that logs STEP_KEY per step into `metrics`: {"ok", "wall_s", "error" or "metrics" (the
    logged steps), "runtime" and, on the cluster, what each node's link carried per step over `segments` (step
    windows; default: after the warm-up to the end): MB sent and received (mean over nodes) and the wire
    time, the busier direction's bytes at the tbf rate}; "log": the distinct output lines `keep_lines` keeps."""
    start, sampler = time.monotonic(), LinkSampler(cluster, metrics) if cluster else None
    with sampler or nullcontext():
        rc, output = launch(cmd, cluster, timeout=timeout, per_node=per_node)
    out = {"wall_s": time.monotonic() - start, "runtime": said(output, "runtime"),  # what the Trainer ran,
           "compute_logged": said(output, "compute")}  # and what it computed in (trainer/precision.py)
    if keep_lines:
        out["log"] = [ln for ln in dict.fromkeys(output_lines(output)) if keep_lines(ln)][:40]
    logged = [m for m in read_metrics(metrics.parent) if STEP_KEY in m]
    if rc != 0 or len(logged) < steps:
        return {**out, "ok": False, "error": error_tail(output) if rc else f"{len(logged)} of {steps} steps logged"}
    wins = [(w, b - a) for a, b in (segments or [(warmup, steps)]) if sampler and b > a and (w := sampler.window(a, b))]
    if n := sum(k for _, k in wins):
        tx, rx = ([sum(w[d][i] for w, _ in wins) / n for i in range(len(cluster.nodes))] for d in ("tx", "rx"))
        out.update(phys_tx_mb_node=statistics.mean(tx) / 1e6, phys_rx_mb_node=statistics.mean(rx) / 1e6,
                   wire_ms=max(tx + rx) * 8 / cluster.rate_bits * 1e3)
    return {**out, "ok": True, "metrics": logged}


def shown(args) -> str:
    """Arguments as the docs show them: paths relative to the checkout."""
    return " ".join(str(a).replace(str(ROOT) + "/", "") for a in args)


def describe_row(row: dict) -> str:
    if not row["ok"]:
        return f"FAILED: {row['error']}"
    return f"{row['step_ms']:.0f} ms/step, {row['tokens_per_s']:.0f} tokens/s" + (
        f", {row['phys_tx_mb_node']:.1f} MB/step/node on the link" if "phys_tx_mb_node" in row else "")
