"""Fault injection: kill, freeze, starve and poison training runs, then check what survives.

    python -m scripts.chaos --trials 30 --out /tmp/chaos                 # the full harness (minutes)
    python -m scripts.chaos --trials 4 --ranks 0 --scenarios kill        # a quick look

Kill trials: a run (1 process; and 4 ranks with ZeRO++ under torchrun, 2 nodes x 2) is killed
with SIGKILL at a random moment, about half of them inside a checkpoint save (the harness
watches for the save's temporary directory and kills within a few milliseconds of it
appearing). After each kill it checks every checkpoint against its checksums and the
`latest` pointer, then resumes with --resume auto to the end and compares every step's loss
(metrics.jsonl, exact floats) and every tensor of the final checkpoint with an uninterrupted
run's: bit-identical or not.

Other scenarios, 4 ranks: one rank killed, one rank frozen (SIGSTOP; every other rank must
time out after train.dist_timeout and name the frozen rank), the preemption signal to the torchrun
agent (the ranks must save one checkpoint and exit 0), an elastic restart (torchrun
--max-restarts 1, a rank killed: the restart must resume bit-identically); 1 process: a full
disk (a small tmpfs, needs root) and divergence (lr 1e6).

It ends with a table: trials, corrupt checkpoints, dangling pointers, failed resumes, steps
lost, bit-identical resumes; and one line per other scenario. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from trainer.checkpoint import LATEST, is_complete, verify_checkpoint
from trainer.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 24, 4
TINY = ["--model.preset", "gpt2-tiny", "--data.vocab_size", "512", "--data.seq_len", "32", "--data.workers", "1",
        "--train.micro_batch_size", "4", "--train.steps", str(STEPS), "--train.log_interval", "1",
        "--train.eval_interval", str(STEPS), "--train.eval_batches", "2", "--train.checkpoint_interval",
        str(INTERVAL), "--train.tensorboard", "false", "--train.progress_bar", "false", "--optim.warmup_steps", "2"]
ZEROPP = ["--train.micro_batch_size", "1", "--zero_optimization.stage", "3", "--zero_optimization.ranks_per_node",
          "2", "--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_hpz_partition_size",
          "2", "--zero_optimization.zero_quantized_gradients", "true",
          "--zero_optimization.zero_quantization_block_size", "64"]


@dataclass
class Layout:
    name: str
    ranks: int  # 0: one plain process

    def command(self, out: Path, cache: Path, *extra: str) -> list[str]:
        args = [*TINY, "--data.cache_dir", str(cache), "--train.out_dir", str(out), *extra]
        if not self.ranks:
            return [sys.executable, str(ROOT / "train.py"), *args]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.ranks),
                "--master-port", str(free_port()), str(ROOT / "train.py"), *args, *ZEROPP]


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


def losses(out: Path) -> dict[int, float]:
    """Each step's training loss; the last line for a step wins (a resumed run logs it again)."""
    found = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if "lm loss" in record:
            found[record["step"]] = record["lm loss"]
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
    root = out / "checkpoints"
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
        while time.time() < deadline and proc.poll() is None and not losses(out):
            time.sleep(0.05)
        time.sleep(rng.uniform(0, reference[2]))
    if proc.poll() is not None:  # it ended first (or never saved): no trial, the caller draws again
        return
    kill_tree(proc)
    tally.trials += 1
    hit_save = any(root.glob(".tmp-step_*")) or any(root.glob(".old-step_*"))
    tally.in_save += hit_save
    killed_at = max(losses(out), default=0)
    inspect(root, tally, label)
    rc = run(layout.command(out, cache, "--resume", "auto"), work / f"{out.name}-resume.log")
    resumed_from = _resumed_step(work / f"{out.name}-resume.log")
    if rc != 0:
        tally.failed_resumes += 1
        tally.problems.append(f"{label}: resume exited {rc} (see {work / f'{out.name}-resume.log'})")
        return
    tally.steps_lost.append(killed_at - resumed_from)
    same_losses = losses(out) == reference[0]
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
        if "resumed from checkpoint" in line:
            return int(line.split("(step ")[1].split(",")[0])
    return 0  # nothing to resume: a fresh start


def reference_run(layout: Layout, work: Path, cache: Path) -> tuple:
    """(losses, final tensors, seconds from the first logged step to the end) of an uninterrupted run."""
    out = work / f"{layout.name}-reference"
    proc = start(layout.command(out, cache), work / f"{out.name}.log")
    watch(proc, out, 1)
    began = time.time()
    if proc.wait(600) != 0:
        sys.exit(f"chaos: the uninterrupted {layout.name} run failed (rc {proc.returncode}); "
                 f"see {work / f'{out.name}.log'}")
    return losses(out), tensors(out / "checkpoints" / f"step_{STEPS:08d}"), time.time() - began


# ------------------------------------------------------------------------------ other scenarios

def watch(proc: subprocess.Popen, out: Path, step: int, timeout: float = 600) -> None:
    """Wait until the run has logged `step`."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and max(losses(out), default=0) < step:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30, help="kill trials in all (split over the layouts)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the ZeRO++ layout; 0 skips it")
    parser.add_argument("--multi-rank-share", type=float, default=0.3, help="share of the kill trials on --ranks")
    parser.add_argument("--scenarios", default="kill,rank-kill,rank-freeze,agent-signal,elastic,full-disk,nan",
                        help="comma-separated subset")
    parser.add_argument("--dist-timeout", type=float, default=20, help="train.dist_timeout of the fault runs")
    parser.add_argument("--out", default="/tmp/chaos")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    work = Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = work / "cache"
    rng = random.Random(args.seed)
    layouts = [Layout("1-process", 0)] + ([Layout(f"{args.ranks}-ranks-ZeRO++", args.ranks)] if args.ranks else [])
    rows, others = [], []
    if "kill" in scenarios:
        multi = round(args.trials * args.multi_rank_share) if args.ranks else 0
        for layout, n in zip(layouts, (args.trials - multi, multi)):
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
    multi = Layout("ranks", args.ranks)
    if args.ranks and "rank-kill" in scenarios:
        others.append(rank_fault(multi, work, cache, signal.SIGKILL, "rank-kill", args.dist_timeout))
    if args.ranks and "rank-freeze" in scenarios:
        others.append(rank_fault(multi, work, cache, signal.SIGSTOP, "rank-freeze", args.dist_timeout))
    if args.ranks and "agent-signal" in scenarios:
        others.append(agent_signal(multi, work, cache))
    if args.ranks and "elastic" in scenarios:
        others.append(elastic_restart(multi, work, cache, reference_run(multi, work, cache)))
    if "full-disk" in scenarios:
        others.append(full_disk(work, cache))
    if "nan" in scenarios:
        others.append(divergence(work, cache))
    if rows:
        print(table(rows))
    for line in others:
        print(line)
    problems = [p for _, t in rows for p in t.problems]
    for p in problems:
        print(f"  {p}")
    return 1 if problems or any(line.startswith("FAIL") for line in others) else 0


if __name__ == "__main__":
    sys.exit(main())
