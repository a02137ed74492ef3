"""Fault injection: kill, freeze, starve, flip and poison training runs, then check what survives.

    python -m scripts.chaos --trials 64 --flips 20 --out /tmp/chaos      # the release run: >= 100 faults (an hour)
    python -m scripts.chaos --trials 5 --ranks 0 --scenarios kill        # a quick look

Kill trials: a run is killed with SIGKILL (its whole process tree) at a random moment, about
half of them inside a checkpoint save (the harness watches for the save's temporary directory
and kills within a few milliseconds of it appearing). After each kill it checks every
checkpoint against its checksums and the `latest` pointer, then resumes with --resume auto to
the end and compares every step's losses (metrics.jsonl, exact floats) and every tensor of the
final checkpoint with an uninterrupted run's: bit-identical or not. The trials are spread over
the layouts (--layouts): one process; 4 ranks under torchrun as 2 nodes x 2 with ZeRO++ (qwZ,
hpZ, qgZ), and with int4 qwZ deltas; 2 ranks of tensor parallelism with AccTFM's planned
partitions (tensor_parallel.partitions 0); RLHF (rlhf.py ppo: its SFT stage, then PPO).

Other scenarios, each checked against an uninterrupted run:
  rank-kill      one of 4 ranks SIGKILLed: the job ends at once, the launcher names the rank;
  rank-freeze    one of 4 ranks SIGSTOPped: every other rank names it (trainer.heartbeat);
  agent-signal   SIGUSR1 to the torchrun agent: every rank saves one checkpoint and exits 0;
  preempt        the preemption signal to the ranks (SIGUSR1 on 4 ranks, SIGTERM with
                 --train.preempt_signal SIGTERM on 1 process): exit 0 with a checkpoint, and the
                 resume ends bit-identical;
  elastic        torchrun --max-restarts 1, a rank killed: the restart resumes bit-identically;
  reshard        4 ranks of ZeRO-3 killed, resumed on 2: the global batch is kept (grad_accum
                 re-derived), every step draws the same samples, and the losses stay within
                 RESHARD_TOLERANCE of the uninterrupted 4-rank run (the reductions' order changes);
  bit-flip       one random bit of a random file of the newest checkpoint (half the trials also
                 without its checksums.json): the resume must refuse it, naming the checkpoint;
  overwrite      --train.overwrite true with a bad value over a finished run: refused, and the
                 old run intact byte for byte; with good values: the run is replaced;
  full-disk      a small tmpfs (needs root): one-line error, nothing half-written;
  nan            lr 1e6: the run stops, no non-finite checkpoint.

It ends with a table of the kill trials (corrupt checkpoints, dangling pointers, failed
resumes, steps lost, bit-identical resumes), one line per other scenario, and the number of
faults injected. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from trainer.checkpoint import CHECKSUMS, LATEST, is_complete, verify_checkpoint
from trainer.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 24, 4
RESHARD_TOLERANCE = 1e-4  # |loss difference| per step after a 4 -> 2 rank resume of fp32 ZeRO-3
TINY = ["--model.preset", "gpt2-tiny", "--data.vocab_size", "512", "--data.seq_len", "32", "--data.workers", "1",
        "--train.micro_batch_size", "4", "--train.steps", str(STEPS), "--train.log_interval", "1",
        "--train.eval_interval", str(STEPS), "--train.eval_batches", "2", "--train.checkpoint_interval",
        str(INTERVAL), "--train.tensorboard", "false", "--train.progress_bar", "false", "--optim.warmup_steps", "2"]
ZEROPP = ("--train.micro_batch_size", "1", "--zero_optimization.stage", "3", "--zero_optimization.ranks_per_node",
          "2", "--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_hpz_partition_size",
          "2", "--zero_optimization.zero_quantized_gradients", "true",
          "--zero_optimization.zero_quantization_block_size", "64")
DELTAS = (*ZEROPP, "--zero_optimization.zero_quantized_weights_bits", "4",
          "--zero_optimization.zero_quantized_weights_delta", "true")
TENSOR_PARALLEL = ("--tensor_parallel.size", "2", "--tensor_parallel.partitions", "0")
ZERO3_FP32 = ("--train.micro_batch_size", "1", "--zero_optimization.stage", "3",
              "--zero_optimization.communication_data_type", "fp32")
RLHF = ["--config", "configs/rlhf_tiny.yaml", "--data.task_samples", "200", "--sft.steps", "6", "--ppo.steps",
        str(STEPS), "--train.micro_batch_size", "4", "--train.log_interval", "1", "--generation.max_new_tokens", "6",
        "--train.checkpoint_interval", str(INTERVAL), "--reward.source", "task", "--train.precision", "fp32"]


@dataclass
class Layout:
    name: str
    ranks: int  # 0: one plain process
    extra: tuple | None = None  # the layout's own arguments (None: ZeRO++ on several ranks)
    rlhf: bool = False  # `rlhf.py ppo` (its SFT stage first) instead of train.py

    def command(self, out: Path, cache: Path, *extra: str) -> list[str]:
        own = self.extra if self.extra is not None else (ZEROPP if self.ranks else ())
        if self.rlhf:
            script = [str(ROOT / "rlhf.py"), "ppo"]
            args = [*RLHF, "--train.out_dir", str(out), *own, *extra]
        else:
            script = [str(ROOT / "train.py")]
            args = [*TINY, "--data.cache_dir", str(cache), "--train.out_dir", str(out), *own, *extra]
        if not self.ranks:
            return [sys.executable, *script, *args]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.ranks),
                "--master-port", str(free_port()), *script, *args]

    def run_dir(self, out: Path) -> Path:
        """Where its checkpoints and metrics.jsonl are."""
        return out / "ppo" if self.rlhf else out

    def losses(self, out: Path) -> dict[int, object]:
        keys = ("policy loss", "value loss", "reward") if self.rlhf else ("lm loss",)
        return losses(self.run_dir(out), keys)


LAYOUTS = {layout.name: layout for layout in (
    Layout("1-process", 0), Layout("4-ranks-ZeRO++", 4), Layout("4-ranks-ZeRO++-int4-deltas", 4, DELTAS),
    Layout("2-ranks-tensor-parallel", 2, TENSOR_PARALLEL), Layout("1-process-RLHF-PPO", 0, rlhf=True))}


@dataclass
class Tally:
    trials: int = 0
    in_save: int = 0
    corrupt: int = 0
    dangling: int = 0
    failed_resumes: int = 0
    steps_lost: list[int] = field(default_factory=list)
    identical: int = 0
    problems: list[str] = field(default_factory=list)


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: the kill takes every rank


def run(cmd: list[str], log: Path, timeout: float = 600) -> int:
    proc = start(cmd, log)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return -9


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a run and every rank: torchrun starts its ranks in sessions of their own, so the
    process group's kill does not reach them (and they would save and exit on the agent's death)."""
    ranks = list(ranks_of(proc).values()) if proc.poll() is None else []
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in ranks:
        while _state(pid) not in ("Z", "X"):
            time.sleep(0.01)


def losses(out: Path, keys: tuple[str, ...] = ("lm loss",)) -> dict[int, object]:
    """Each step's training loss (a tuple for several `keys`) from out/metrics.jsonl; the last line
    for a step wins (a resumed run logs it again)."""
    found = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if keys[0] in record:
            found[record["step"]] = record[keys[0]] if len(keys) == 1 else tuple(record[k] for k in keys)
    return found


def tensors(ckpt: Path) -> dict[str, object]:
    return {f"{f.name}:{k}": v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def inspect(root: Path, tally: Tally, label: str) -> None:
    """Corrupt checkpoints and a dangling `latest`, as the kill left them (before any recovery)."""
    for ckpt in sorted(root.glob("step_*")):
        try:
            if not is_complete(ckpt):
                raise RuntimeError("incomplete under a final name")
            verify_checkpoint(ckpt)
        except Exception as e:  # noqa: BLE001 - every failure counts as corrupt
            tally.corrupt += 1
            tally.problems.append(f"{label}: corrupt {ckpt.name}: {e}")
    pointer = root / LATEST
    if pointer.is_file() and not is_complete(root / pointer.read_text().strip()):
        tally.dangling += 1
        tally.problems.append(f"{label}: latest names {pointer.read_text().strip()!r}, not a complete checkpoint")


def kill_trial(layout: Layout, work: Path, cache: Path, reference: tuple, in_save: bool, rng: random.Random,
               tally: Tally) -> None:
    label = f"{layout.name} trial {tally.trials + 1}"
    out = work / f"{layout.name}-{tally.trials}"
    root = layout.run_dir(out) / "checkpoints"
    proc = start(layout.command(out, cache), work / f"{out.name}.log")
    deadline = time.time() + 600
    if in_save:  # the first save after a random number of steps
        target = rng.randrange(1, STEPS // INTERVAL)
        while time.time() < deadline and proc.poll() is None:
            if any(root.glob(f".tmp-step_{target * INTERVAL:08d}")):
                time.sleep(rng.uniform(0, 0.004))
                break
            time.sleep(0.0005)
    else:  # a random moment of the training steps
        while time.time() < deadline and proc.poll() is None and not layout.losses(out):
            time.sleep(0.05)
        time.sleep(rng.uniform(0, reference[2]))
    if proc.poll() is not None:  # it ended first (or never saved): no trial, the caller draws again
        return
    kill_tree(proc)
    tally.trials += 1
    hit_save = any(root.glob(".tmp-step_*")) or any(root.glob(".old-step_*"))
    tally.in_save += hit_save
    killed_at = max(layout.losses(out), default=0)
    inspect(root, tally, label)
    rc = run(layout.command(out, cache, "--resume", "auto"), work / f"{out.name}-resume.log")
    resumed_from = _resumed_step(work / f"{out.name}-resume.log")
    if rc != 0:
        tally.failed_resumes += 1
        tally.problems.append(f"{label}: resume exited {rc} (see {work / f'{out.name}-resume.log'})")
        return
    tally.steps_lost.append(killed_at - resumed_from)
    same_losses = layout.losses(out) == reference[0]
    same_tensors = _equal(tensors(root / f"step_{STEPS:08d}"), reference[1])
    if same_losses and same_tensors:
        tally.identical += 1
    else:
        tally.problems.append(f"{label}: resumed run differs (losses equal: {same_losses}, "
                              f"tensors equal: {same_tensors})")


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _resumed_step(log: Path) -> int:
    for line in log.read_text().splitlines():
        found = re.search(r"resumed from checkpoint .* \(step (\d+)", line)
        if found:
            return int(found.group(1))
    return 0  # nothing to resume: a fresh start


_REFERENCES: dict[tuple[str, Path], tuple] = {}


def reference_run(layout: Layout, work: Path, cache: Path) -> tuple:
    """(losses, final tensors, seconds from the first logged step to the end) of an uninterrupted run,
    made once per layout and work directory."""
    key = (layout.name, work)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(layout, work, cache)
    return _REFERENCES[key]


def _reference_run(layout: Layout, work: Path, cache: Path) -> tuple:
    out = work / f"{layout.name}-reference"
    proc = start(layout.command(out, cache), work / f"{out.name}.log")
    watch(proc, out, 1, layout)
    began = time.time()
    if proc.wait(600) != 0:
        sys.exit(f"chaos: the uninterrupted {layout.name} run failed (rc {proc.returncode}); "
                 f"see {work / f'{out.name}.log'}")
    return (layout.losses(out), tensors(layout.run_dir(out) / "checkpoints" / f"step_{STEPS:08d}"),
            time.time() - began)


# ------------------------------------------------------------------------------ other scenarios

def watch(proc: subprocess.Popen, out: Path, step: int, layout: Layout | None = None, timeout: float = 600) -> None:
    """Wait until the run has logged `step`."""
    deadline = time.time() + timeout
    logged = layout.losses if layout is not None else losses
    while time.time() < deadline and proc.poll() is None and max(logged(out), default=0) < step:
        time.sleep(0.05)


def ranks_of(proc: subprocess.Popen, script: str = "train.py") -> dict[int, int]:
    """rank -> pid of the workers torchrun started (children of the agent running `script`)."""
    found = {}
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                           if b"=" in kv)
        except OSError:
            continue
        if any(arg.endswith(script.encode()) for arg in cmdline) and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(child)
    return found


def rank_fault(layout: Layout, work: Path, cache: Path, sig: int, name: str, timeout: float) -> str:
    out = work / f"{name}"
    log = work / f"{name}.log"
    proc = start(layout.command(out, cache, "--train.dist_timeout", str(timeout)), log)
    watch(proc, out, 3)
    workers = ranks_of(proc)
    victim = len(workers) // 2
    began = time.time()
    os.kill(workers[victim], sig)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return f"FAIL: {name}: the job was still running 120 s after the fault"
    took = time.time() - began
    text = log.read_text()
    if sig == signal.SIGSTOP:  # every survivor must name the stopped rank (trainer.heartbeat)
        named = [line.strip() for line in text.splitlines() if line.startswith("train.py: error: rank")
                 and f"rank {victim} (host " in line and "stopped responding" in line]
        named = named if len(named) == len(workers) - 1 else []
    else:  # torchrun's summary names the failed rank and its exit code
        lines = text.splitlines()
        named = [" ".join(x.strip() for x in lines[i:i + 3]) for i, x in enumerate(lines)
                 if x.strip().startswith("rank") and f"rank      : {victim}" in x]
    ok = rc != 0 and took < 60 and named
    return (f"{'ok' if ok else 'FAIL'}: {name} (rank {victim} of {len(workers)}): job ended rc {rc} {took:.0f} s "
            f"after the fault; {named[0][:220] if named else 'the victim is not named in the log'}")


def agent_signal(layout: Layout, work: Path, cache: Path) -> str:
    """SIGUSR1 to the torchrun agent, which dies of it: its ranks must notice, agree on a step,
    save one checkpoint and exit 0 (exit codes recorded by scripts/slurm/run_rank.py)."""
    out, log, codes = work / "agent-signal", work / "agent-signal.log", work / "agent-signal.ranks"
    cmd, script = layout.command(out, cache), str(ROOT / "train.py")
    cmd.insert(cmd.index(script), str(ROOT / "scripts" / "slurm" / "run_rank.py"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env(), "RANK_EXIT_DIR": str(codes)}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    watch(proc, out, 3)
    workers = ranks_of(proc, "run_rank.py")
    os.kill(proc.pid, signal.SIGUSR1)
    began, agent_rc = time.time(), proc.wait(60)
    while time.time() < began + 120 and any(_state(w) not in ("Z", "X") for w in workers.values()):
        time.sleep(0.1)
    alive = [r for r, w in workers.items() if _state(w) not in ("Z", "X")]
    for r in alive:
        os.kill(workers[r], signal.SIGKILL)
    recorded = {r: (codes / f"rank-{r}").read_text().split()[1] if (codes / f"rank-{r}").is_file() else None
                for r in workers}
    root = out / "checkpoints"
    tally = Tally()
    inspect(root, tally, "agent signal")
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    ok = not alive and set(recorded.values()) == {"0"} and latest and not tally.problems and len(workers) > 1
    return (f"{'ok' if ok else 'FAIL'}: SIGUSR1 to the torchrun agent: agent rc {agent_rc}, ranks' exit codes "
            f"{recorded}, {len(alive)} still running {time.time() - began:.0f} s later, latest {latest}, "
            f"problems {tally.problems[:2]}")


def elastic_restart(layout: Layout, work: Path, cache: Path, reference: tuple) -> str:
    """torchrun --max-restarts 1 with --resume auto: a rank SIGKILLed after the first checkpoint;
    the restarted ranks must resume from it and finish with the uninterrupted run's losses and tensors."""
    out, log = work / "elastic", work / "elastic.log"
    cmd = layout.command(out, cache, "--resume", "auto")
    cmd.insert(cmd.index("--nproc-per-node"), "--max-restarts=1")
    proc = start(cmd, log)
    watch(proc, out, INTERVAL + 1)
    workers = ranks_of(proc)
    os.kill(workers[len(workers) - 1], signal.SIGKILL)
    try:
        rc = proc.wait(600)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        rc = -9
    resumed = _resumed_step(log)
    same = losses(out) == reference[0] and (out / "checkpoints" / f"step_{STEPS:08d}").is_dir() and \
        _equal(tensors(out / "checkpoints" / f"step_{STEPS:08d}"), reference[1])
    return (f"{'ok' if rc == 0 and resumed and same else 'FAIL'}: elastic restart (--max-restarts 1, rank "
            f"{len(workers) - 1} killed): rc {rc}, resumed from step {resumed}, bit-identical to the "
            f"uninterrupted run: {same}")


def preempt(layout: Layout, work: Path, cache: Path, reference: tuple, sig: int) -> str:
    """The preemption signal to every rank (as Slurm's --signal sends it to the steps) in the middle
    of training: exit 0 with one checkpoint of the step they agreed on; the resume ends bit-identical."""
    name = f"preempt-{signal.Signals(sig).name}"
    out, log = work / name, work / f"{name}.log"
    extra = ("--train.preempt_signal", signal.Signals(sig).name)
    proc = start(layout.command(out, cache, *extra), log)
    watch(proc, out, 3, layout)
    for pid in (ranks_of(proc).values() if layout.ranks else [proc.pid]):
        os.kill(pid, sig)
    try:
        rc = proc.wait(300)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        rc = -9
    saved = [line for line in log.read_text().splitlines() if "preempted at step" in line]
    rc2 = run(layout.command(out, cache, *extra, "--resume", "auto"), work / f"{name}-resume.log")
    final = layout.run_dir(out) / "checkpoints" / f"step_{STEPS:08d}"
    same = rc2 == 0 and layout.losses(out) == reference[0] and final.is_dir() and \
        _equal(tensors(final), reference[1])
    ok = rc == 0 and saved and same
    return (f"{'ok' if ok else 'FAIL'}: SIG{signal.Signals(sig).name[3:]} to the ranks of {layout.name}: rc {rc}, "
            f"{saved[0].strip()[:80] if saved else 'no preemption checkpoint'}; resumed: rc {rc2}, "
            f"bit-identical {same}")


def reshard(work: Path, cache: Path) -> str:
    """4 ranks of fp32 ZeRO-3 killed after a checkpoint and resumed on 2 with the same micro-batch:
    the global batch stays 4 (grad_accum 1 -> 2), every step draws the same samples, and the losses
    after the resume stay within RESHARD_TOLERANCE of the uninterrupted 4-rank run's."""
    four, two = Layout("4-ranks-ZeRO-3", 4, ZERO3_FP32), Layout("2-ranks-ZeRO-3", 2, ZERO3_FP32)
    reference = reference_run(four, work, cache)
    out, log = work / "reshard", work / "reshard.log"
    proc = start(four.command(out, cache), log)
    watch(proc, out, INTERVAL + 2, four)
    kill_tree(proc)
    rc = run(two.command(out, cache, "--resume", "auto"), work / "reshard-resume.log")
    text = (work / "reshard-resume.log").read_text()
    resumed = _resumed_step(work / "reshard-resume.log")
    got = four.losses(out)
    worst = max((abs(got[s] - reference[0][s]) for s in range(resumed + 1, STEPS + 1) if s in got), default=None)
    kept = "global batch 4 kept from the checkpoint: train.grad_accum 1 -> 2" in text and \
        "global batch 4 = micro-batch 1 x grad_accum 2 x 2 data-parallel ranks" in text
    ok = rc == 0 and resumed and kept and worst is not None and worst <= RESHARD_TOLERANCE and \
        sorted(got) == list(range(1, STEPS + 1))
    return (f"{'ok' if ok else 'FAIL'}: reshard 4 -> 2 ranks (fp32 ZeRO-3): rc {rc}, resumed from step {resumed}, "
            f"global batch kept {kept}, largest loss difference {worst if worst is None else f'{worst:.1e}'} "
            f"(tolerance {RESHARD_TOLERANCE:g})")


def _digest(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def bit_flip(work: Path, cache: Path, reference_out: Path, rng: random.Random, trial: int) -> str:
    """A copy of a finished 1-process run with one random bit of a random file of its newest
    checkpoint flipped (odd trials also delete its checksums.json, which must not turn the
    verification off): --resume auto must refuse it, naming the checkpoint, and change nothing."""
    out = work / f"bit-flip-{trial}"
    shutil.copytree(reference_out, out)
    ckpt = out / "checkpoints" / f"step_{STEPS:08d}"
    files = sorted(f for f in ckpt.iterdir() if f.is_file() and f.name != CHECKSUMS)
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    bit = rng.randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    victim.write_bytes(bytes(data))
    if trial % 2:
        (ckpt / CHECKSUMS).unlink()
    before = _digest(out)
    rc = run(Layout("1-process", 0).command(out, cache, "--resume", "auto", "--train.steps", str(STEPS + 2)),
             work / f"bit-flip-{trial}.log")
    last = (work / f"bit-flip-{trial}.log").read_text().strip().splitlines()[-1:] or [""]
    refused = rc == 1 and last[0].startswith("train.py: error:") and ckpt.name in last[0]
    untouched = all(_digest(out).get(k) == v for k, v in before.items())
    ok = refused and untouched
    return (f"{'ok' if ok else 'FAIL'}: bit {bit % 8} of byte {bit // 8} of {victim.name} flipped"
            f"{' and checksums.json deleted' if trial % 2 else ''}: rc {rc}, checkpoint files unchanged "
            f"{untouched}; {last[0][:160]}")


BAD_VALUES = [("--data.path", "/nonexistent/corpus.txt"), ("--model.n_head", "3"), ("--train.micro_batch_size", "0"),
              ("--optim.lr", "-1"), ("--zero_optimization.stage", "2"), ("--model.preset", "gpt9"),
              ("--data.vocab_size", "0"), ("--train.dist_timeout", "0")]


def overwrite(work: Path, cache: Path, reference_out: Path, reference: tuple) -> list[str]:
    """--train.overwrite true over a finished run: each bad value is refused with the old run
    intact byte for byte; with good values the run is replaced (and equals the uninterrupted one)."""
    out = work / "overwrite"
    shutil.copytree(reference_out, out)
    before = _digest(out)
    lines = []
    for key, value in BAD_VALUES:
        log = work / f"overwrite{key.replace('.', '-')}.log"
        rc = run(Layout("1-process", 0).command(out, cache, "--train.overwrite", "true", key, value), log)
        last = log.read_text().strip().splitlines()[-1:] or [""]
        intact = _digest(out) == before
        ok = rc == 1 and intact and last[0].startswith("train.py:") and "Traceback" not in log.read_text()
        lines.append(f"{'ok' if ok else 'FAIL'}: --train.overwrite true {key} {value}: rc {rc}, old run intact "
                     f"{intact}; {last[0][:120]}")
    rc = run(Layout("1-process", 0).command(out, cache, "--train.overwrite", "true"), work / "overwrite.log")
    logged = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"lm loss"' in line]
    same = rc == 0 and len(logged) == STEPS and losses(out) == reference[0] and \
        _equal(tensors(out / "checkpoints" / f"step_{STEPS:08d}"), reference[1])
    lines.append(f"{'ok' if same else 'FAIL'}: --train.overwrite true with good values: rc {rc}, the run replaced "
                 f"and equal to the uninterrupted one: {same}")
    return lines


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return "X"


def full_disk(work: Path, cache: Path) -> str:
    mount = work / "tmpfs"
    mount.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)]).returncode:
        return "skipped: full disk (mounting a tmpfs needs root)"
    try:
        out = mount / "run"
        rc = run(Layout("single", 0).command(out, cache, "--train.checkpoint_interval", "1"), work / "full-disk.log")
        text = (work / "full-disk.log").read_text()
        root = out / "checkpoints"
        tally = Tally()
        inspect(root, tally, "full disk")
        leftovers = [p.name for p in root.glob(".*")] if root.is_dir() else []
        saved = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        ok = rc != 0 and "No space left" in text and not tally.problems and not leftovers and saved
        return (f"{'ok' if ok else 'FAIL'}: full disk: rc {rc}, {len(saved)} intact checkpoints, latest "
                f"{(root / LATEST).read_text().strip() if (root / LATEST).is_file() else None}, "
                f"leftovers {leftovers}, problems {tally.problems[:2]}")
    finally:
        subprocess.run(["umount", str(mount)])


def divergence(work: Path, cache: Path) -> str:
    out = work / "nan"
    rc = run(Layout("single", 0).command(out, cache, "--optim.lr", "1e6", "--train.checkpoint_interval", "1"),
             work / "nan.log")
    text = (work / "nan.log").read_text()
    tally = Tally()
    inspect(out / "checkpoints", tally, "nan")
    bad = [c.name for c in (out / "checkpoints").glob("step_*")
           if any(not bool(t.isfinite().all()) for t in tensors(c).values())]
    ok = rc != 0 and "non-finite" in text and not bad and not tally.problems
    last = [line for line in text.splitlines() if "error" in line][-1:] or ["(no error line)"]
    return f"{'ok' if ok else 'FAIL'}: lr 1e6: rc {rc}, non-finite checkpoints {bad}; {last[0][:160]}"


# ------------------------------------------------------------------------------ main

def table(rows: list[tuple[str, Tally]]) -> str:
    head = ("layout", "trials", "in a save", "corrupt ckpts", "dangling pointers", "failed resumes",
            "steps lost (max)", "bit-identical")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in rows:
        cells = (name, t.trials, t.in_save, t.corrupt, t.dangling, t.failed_resumes, max(t.steps_lost, default=0),
                 f"{t.identical}/{t.trials}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


SCENARIOS = "kill,rank-kill,rank-freeze,agent-signal,preempt,elastic,reshard,bit-flip,overwrite,full-disk,nan"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30, help="kill trials in all, spread over the layouts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layouts of the kill trials")
    parser.add_argument("--flips", type=int, default=6, help="bit-flip trials")
    parser.add_argument("--scenarios", default=SCENARIOS, help="comma-separated subset")
    parser.add_argument("--dist-timeout", type=float, default=20, help="train.dist_timeout of the rank-fault runs")
    parser.add_argument("--out", default="/tmp/chaos")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    unknown = scenarios - set(SCENARIOS.split(",")) or set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown scenario or layout {sorted(unknown)}: scenarios {SCENARIOS}; layouts {','.join(LAYOUTS)}")
    work = Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = work / "cache"
    rng = random.Random(args.seed)
    layouts = [LAYOUTS[name] for name in args.layouts.split(",")]
    rows, others = [], []

    def report(line: str) -> None:
        others.append(line)
        print(line, flush=True)

    if "kill" in scenarios:
        for k, layout in enumerate(layouts):
            n = args.trials // len(layouts) + (k < args.trials % len(layouts))
            if not n:
                continue
            reference = reference_run(layout, work, cache)
            tally = Tally()
            for _ in range(3 * n):
                if tally.trials == n:
                    break
                kill_trial(layout, work, cache, reference, in_save=tally.trials % 2 == 0, rng=rng, tally=tally)
                print(f"{layout.name}: {tally.trials} trials, {tally.identical} bit-identical", flush=True)
            rows.append((layout.name, tally))
    zeropp, single = LAYOUTS["4-ranks-ZeRO++"], LAYOUTS["1-process"]
    if "rank-kill" in scenarios:
        report(rank_fault(zeropp, work, cache, signal.SIGKILL, "rank-kill", args.dist_timeout))
    if "rank-freeze" in scenarios:
        report(rank_fault(zeropp, work, cache, signal.SIGSTOP, "rank-freeze", args.dist_timeout))
    if "agent-signal" in scenarios:
        report(agent_signal(zeropp, work, cache))
    needs_zeropp, needs_single = {"preempt", "elastic"} & scenarios, {"preempt", "bit-flip", "overwrite"} & scenarios
    zeropp_reference = reference_run(zeropp, work, cache) if needs_zeropp else None
    single_reference = reference_run(single, work, cache) if needs_single else None
    if "preempt" in scenarios:
        report(preempt(zeropp, work, cache, zeropp_reference, signal.SIGUSR1))
        report(preempt(single, work, cache, single_reference, signal.SIGTERM))
    if "elastic" in scenarios:
        report(elastic_restart(zeropp, work, cache, zeropp_reference))
    if "reshard" in scenarios:
        report(reshard(work, cache))
    for trial in range(args.flips if "bit-flip" in scenarios else 0):
        report(bit_flip(work, cache, work / f"{single.name}-reference", rng, trial))
    if "overwrite" in scenarios:
        for line in overwrite(work, cache, work / f"{single.name}-reference", single_reference):
            report(line)
    if "full-disk" in scenarios:
        report(full_disk(work, cache))
    if "nan" in scenarios:
        report(divergence(work, cache))
    if rows:
        print(table(rows))
    for line in others:
        print(line)
    problems = [p for _, t in rows for p in t.problems]
    for p in problems:
        print(f"  {p}")
    faults = sum(t.trials for _, t in rows) + sum(not line.startswith("skipped") for line in others)
    failed = len(problems) + sum(line.startswith("FAIL") for line in others)
    print(f"faults injected: {faults} ({sum(t.trials for _, t in rows)} kills, {len(others)} other scenarios); "
          f"failed checks: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
