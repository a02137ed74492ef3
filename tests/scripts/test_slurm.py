"""Slurm launchers (scripts/slurm/) against a real Slurm: a local cluster of 2 emulated nodes.

The module starts its own cluster with scripts/slurm/local_cluster.sh (munged, slurmctld and
two `slurmd -N nX`, all 127.0.0.1) in a temporary directory on free ports, submits real
jobs with `sbatch scripts/slurm/launch.sbatch ...`, polls `scontrol show job` (there is no
slurmdbd, so no sacct), and stops exactly those daemons at the end. Each job trains or fails
on 2 nodes x 2 ranks; every wait has a deadline after which the job is cancelled.

Without the Slurm binaries (apt-get install -y slurm-wlm munge; .ci/run installs them) the
cluster tests skip; the launcher-environment tests at the bottom need no Slurm.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.distributed import LauncherError, init_distributed, parse_tasks_per_node, slurm_rank_env

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "scripts" / "slurm"
BINARIES = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", "srun", "slurmctld", "slurmd", "munged", "mungekey")
MISSING = [b for b in BINARIES if shutil.which(b) is None]
needs_slurm = pytest.mark.skipif(
    bool(MISSING), reason=f"Slurm not installed ({', '.join(MISSING)} missing): apt-get install -y slurm-wlm munge"
)

STEPS = 16
# A tiny GPT on 2 nodes x 2 ranks with ZeRO++ (qwZ int8, hpZ over one node, qgZ int4 in two
# hops), whose groups follow the node layout the launcher reports; its resume is bit-exact,
# so runs compare exactly. A warm-up of 4 steps (the preset's is 30): it learns within STEPS.
TRAIN = [
    "--config", "configs/quickstart.yaml", "--train.steps", str(STEPS), "--train.log_interval", "1",
    "--optim.warmup_steps", "4",
    "--train.micro_batch_size", "4", "--train.eval_batches", "2", "--train.progress_bar", "false",
    "--train.tensorboard", "false", "--data.cache_dir", str(REPO / "cache"), "--zero_optimization.stage", "3",
    "--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_hpz_partition_size", "0",
    "--zero_optimization.zero_quantized_gradients", "true",
]
LAYOUT = "topology: 2 node(s) x 2 rank(s) per node"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def _free_port_block(n: int) -> int:
    """A base port with base..base+n-1 all free (the cluster's slurmctld and slurmd ports)."""
    for _ in range(200):
        base = random.randrange(7000, 9900)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports for the local Slurm cluster")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class Cluster:
    def __init__(self, run_dir: Path, env: dict[str, str]):
        self.dir = run_dir
        self.env = env

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def submit(self, log_dir: Path, entry: str, *args: str, launcher: str = "torchrun", env=None,
               sbatch_opts=()) -> Job:
        log_dir.mkdir(parents=True, exist_ok=True)
        job_env = {**self.env, "LAUNCHER": launcher, **(env or {})}
        out = subprocess.run(
            # 10 minutes: the script's time-limit warning (B:USR1@120) must not come during a test
            ["sbatch", "--parsable", f"--output={log_dir}/%j.out", "--time=10", *sbatch_opts,
             str(SLURM / "launch.sbatch"), entry, *args],
            env=job_env, cwd=REPO, capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        job_id = int(out.stdout.strip().split(";")[0])
        return Job(self, job_id, log_dir / f"{job_id}.out")


class Job:
    def __init__(self, cluster: Cluster, job_id: int, log: Path):
        self.cluster, self.id, self.log = cluster, job_id, log
        self.elapsed = 0.0

    def info(self) -> dict[str, str]:
        out = self.cluster.run("scontrol", "show", "job", "-o", str(self.id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log yet)"

    def cancel(self) -> None:
        self.cluster.run("scancel", str(self.id), check=False)

    def wait(self, timeout: float) -> dict[str, str]:
        """Poll until the job is finished for good (a requeued job goes back to PENDING)."""
        start = time.monotonic()
        while True:
            info = self.info()
            if info.get("JobState") in FINAL:
                self.elapsed = time.monotonic() - start
                return info
            if time.monotonic() - start > timeout:
                self.cancel()
                pytest.fail(f"job {self.id} still {info.get('JobState')} after {timeout}s; log:\n{self.text()[-4000:]}")
            time.sleep(0.2)


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if "lm loss" in r]
    assert len(steps) == len(set(steps)), f"steps logged twice (a restart from scratch?): {steps}"
    return {r["step"]: r["lm loss"] for r in rows if "lm loss" in r}


def _wait_for_steps(job: Job, out: Path, steps: int, timeout: float = 120) -> None:
    """Until the run in `out` logged `steps` steps; fails (and cancels the job) past the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count('"lm loss"') >= steps:
            return
        if job.info().get("JobState") in FINAL or time.monotonic() > deadline:
            job.cancel()
            pytest.fail(f"job {job.id} did not start training; log:\n{job.text()[-4000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if MISSING:
        pytest.skip(f"Slurm not installed ({', '.join(MISSING)} missing): apt-get install -y slurm-wlm munge")
    run_dir = tmp_path_factory.mktemp("slurm")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(SLURM_LOCAL_DIR=str(run_dir), SLURM_LOCAL_PORT=str(_free_port_block(3)), SLURM_LOCAL_NODES="2",
               SLURM_LOCAL_CPUS="2", SLURM_LOCAL_GPUS="2", SLURM_CONF=str(run_dir / "etc" / "slurm.conf"))
    script = str(SLURM / "local_cluster.sh")
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        subprocess.run([script, "down"], env=env, capture_output=True, timeout=60)
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(run_dir.glob("**/*.log")))
        pytest.fail(f"local_cluster.sh up failed: {up.stdout}{up.stderr}\n{logs}")
    # Build the default corpus and tokenizer once here, so that no job spends its time on it.
    from trainer.config import parse_args
    from trainer.pretrain_data import prepare_pretraining

    cfg = parse_args(TRAIN)
    prepare_pretraining(cfg.data, cfg.data.seq_len, cfg.train.seed)
    yield Cluster(run_dir, env)
    pid_files = list(run_dir.glob("**/*.pid"))
    pids = [int(p.read_text()) for p in pid_files]
    down = subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not [p for p in pid_files if p.exists()], "down left PID files behind"
    assert not [pid for pid in pids if _running(pid)], "down left daemons running"


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The uninterrupted run: plain srun form (one task per rank), 2 nodes x 2 ranks."""
    tmp = tmp_path_factory.mktemp("reference")
    job = cluster.submit(tmp / "logs", "train.py", *TRAIN, "--train.out_dir", str(tmp / "out"), launcher="srun")
    info = job.wait(timeout=150)
    return job, info, tmp / "out"


# --------------------------------------------------------------------------------------------
# On the local cluster


@needs_slurm
def test_local_cluster_up_is_idempotent(cluster):
    nodes = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
    assert sorted(line.split()[0] for line in nodes if line) == ["n1", "n2"]
    pid_files = sorted(cluster.dir.glob("**/*.pid"))
    assert [p.name for p in pid_files] == ["munged.pid", "slurmctld.pid", "slurmd-n1.pid", "slurmd-n2.pid"]
    before = {p.name: p.read_text() for p in pid_files}
    again = cluster.run(str(SLURM / "local_cluster.sh"), "up", timeout=60)
    assert "cluster up" in again.stdout
    assert {p.name: p.read_text() for p in pid_files} == before  # the same daemons, none started twice


@needs_slurm
def test_srun_form_trains_on_two_nodes(reference):
    job, info, out = reference
    log = job.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert "via srun" in log
    # SLURM_PROCID/NTASKS/LOCALID/tasks per node -> RANK/WORLD_SIZE/LOCAL_WORLD_SIZE: the
    # sharded runtime built its intra-/inter-node groups (hpZ's secondary partition, qgZ's two
    # hops) on the real nodes without any flag.
    assert "ZeRO-3 + qwZ int8 + hpZ + qgZ int4" in log and LAYOUT in log, log[-4000:]
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS] < got[1] - 0.5, got


@needs_slurm
def test_torchrun_form_preempted_requeued_and_resumed_exactly(cluster, reference, tmp_path):
    """The time-limit warning (here `scancel --batch --signal=USR1`, as `--signal=B:USR1@T` sends
    it) reaches the batch script, which forwards it to the ranks (torchrun's agents ignore it);
    they checkpoint and exit 0; the script requeues the job, which resumes with --resume auto
    and continues the uninterrupted run's trajectory bit for bit."""
    out = tmp_path / "out"
    job = cluster.submit(tmp_path / "logs", "train.py", *TRAIN, "--train.out_dir", str(out), "--resume", "auto",
                         env={"REQUEUE_ON_PREEMPT": "1"})
    _wait_for_steps(job, out, 2)  # the trainer's handler is installed by then
    cluster.run("scancel", "--batch", "--signal=USR1", str(job.id))
    info = job.wait(timeout=150)
    log = job.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert info["Restarts"] == "1", log[-4000:]
    assert "received SIGUSR1; forwarding it to the ranks" in log
    match = re.search(r"preempted at step (\d+): saved checkpoint (\S+)", log)
    assert match, log[-4000:]
    step = int(match.group(1))
    assert 2 <= step < STEPS
    assert Path(match.group(2)).name == f"step_{step:08d}"
    assert "requeueing job" in log and "(restart 1)" in log and "via torchrun" in log
    assert log.count(LAYOUT) == 2  # both runs took the node layout from the launcher
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))  # resumed at step+1, not from scratch
    _, _, ref_out = reference
    assert got == losses(ref_out)
    final = f"checkpoints/step_{STEPS:08d}"
    shards = sorted(p.name for p in (ref_out / final).glob("*.safetensors"))
    assert len(shards) == 4 and shards == sorted(p.name for p in (out / final).glob("*.safetensors"))
    for name in shards:  # weights and optimizer state of every rank, bit-identical
        ours, theirs = load_file(str(out / final / name)), load_file(str(ref_out / final / name))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), f"{name} differs from the uninterrupted run"


FAILING = """\
import os, signal, sys, time
import torch.distributed as dist
from trainer.distributed import init_distributed

env = init_distributed(float(os.environ["FAIL_TIMEOUT"]))
print(f"rank {env.rank} of {env.world_size}, LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}", flush=True)
dist.barrier()
if os.environ["FAIL_MODE"] == "kill" and env.rank == 2:  # the first rank of the second node
    os.kill(os.getpid(), signal.SIGKILL)
if env.rank == env.world_size - 1:  # on the second node
    if os.environ["FAIL_MODE"] == "exit":
        sys.exit(7)
    if os.environ["FAIL_MODE"] == "hang":
        time.sleep(3600)  # never joins the next collective
try:
    dist.barrier()
except RuntimeError as e:  # as the entry points end: one line naming this rank
    sys.exit(f"failing.py: error: rank {env.rank}: {str(e).splitlines()[0]}")
"""


@needs_slurm
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_failing_rank_exit_code_becomes_the_jobs(cluster, tmp_path, launcher):
    entry = tmp_path / "failing.py"
    entry.write_text(FAILING)
    job = cluster.submit(tmp_path / "logs", str(entry), launcher=launcher,
                         env={"FAIL_MODE": "exit", "PYTHONPATH": str(REPO), "FAIL_TIMEOUT": "60"})
    info = job.wait(timeout=90)
    log = job.text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "7:0", log[-4000:]
    assert "a rank failed with exit code 7" in log
    assert "LOCAL_WORLD_SIZE=2" in log
    # The other ranks, blocked in a collective, were killed at once, not by their timeout.
    assert job.elapsed < 45, f"job took {job.elapsed:.0f}s"


@needs_slurm
def test_hung_rank_fails_the_job_after_dist_timeout(cluster, tmp_path):
    entry = tmp_path / "failing.py"
    entry.write_text(FAILING)
    job = cluster.submit(tmp_path / "logs", str(entry), launcher="srun",
                         env={"FAIL_MODE": "hang", "PYTHONPATH": str(REPO), "FAIL_TIMEOUT": "3"})
    info = job.wait(timeout=90)
    log = job.text()
    # The waiting ranks' collective times out after 3 s; srun then kills the hung rank.
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log[-4000:]
    # The job's last line carries the first failure's one-line error.
    last = log.strip().splitlines()[-1]
    assert re.fullmatch(r"launch: exit code 1 \(first failure: failing.py: error: rank [0-2]: .*[Tt]imed out.*\)",
                        last), log[-4000:]
    assert job.elapsed < 60, f"job took {job.elapsed:.0f}s"


SHORT = [*TRAIN, "--train.steps", "8"]  # (the later --train.steps wins)
TERM = {"PREEMPT_SIGNAL": "TERM", "REQUEUE_ON_PREEMPT": "1"}


@needs_slurm
def test_sigterm_to_the_whole_batch_step_saves_a_diloco_run_with_its_exchange_in_flight_and_resumes(cluster, tmp_path):
    """Issue 19, defect 11 (a, c, e). With PREEMPT_SIGNAL=TERM, `scancel --full --signal=TERM`
    signals the batch shell's process group: the shell traps it and forwards it to the ranks;
    srun, in a process group of its own, does not get it (it would SIGKILL every rank); the
    torchrun agents leave SIGTERM to their ranks (--signals-to-handle without it) instead of
    shutting them down and exiting 143. One checkpoint, exit 0, requeued, resumed, logged.
    The run is DiLoCo over ZeRO++ with diloco.site_size 0: a site per Slurm node
    (SLURM_NTASKS_PER_NODE), 2 fragments of H 2 and delay 1, so an exchange is in flight after
    every step: the checkpoint holds it with each rank's outer state, and the resumed run ends."""
    out = tmp_path / "out"
    job = cluster.submit(tmp_path / "logs", "train.py", *SHORT, "--train.out_dir", str(out), "--resume", "auto",
                         "--train.preempt_signal", "SIGTERM",
                         "--diloco.enabled", "true", "--diloco.inner_steps", "2", "--diloco.fragments", "2",
                         "--diloco.delay", "1", "--diloco.mixing", "0.5", "--diloco.compression", "int4", env=TERM)
    _wait_for_steps(job, out, 2)
    cluster.run("scancel", "--full", "--signal=TERM", str(job.id))
    info = job.wait(timeout=150)
    log = job.text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", log[-4000:]
    assert "launch: received SIGTERM; forwarding it to the ranks" in log and "forcing job termination" not in log
    assert "DiLoCo on: 2 sites x 2 ranks, H 2, 2 fragments" in log, log[-4000:]
    match = re.search(r"preempted at step (\d+): saved checkpoint (\S+)", log)
    assert match, log[-4000:]
    step, saved = int(match.group(1)), Path(match.group(2))
    assert "requeueing job" in log
    assert sorted(p.name for p in saved.glob("site*")) == ["site000", "site001"]
    for rank in range(4):  # fragment (step % 2 == 0: 0, else 1) sent after the saved step, due after the next
        in_flight = load_file(str(saved / f"diloco_rank{rank:05d}.safetensors"))["in_flight"].tolist()
        assert in_flight == [[step % 2, step + 1]], (rank, in_flight)
    # The resumed run says which checkpoint it loaded, and continues from it.
    assert f"resumed from checkpoint {saved} (step {step}," in log, log[-4000:]
    assert sorted(losses(out)) == list(range(1, 9))


@needs_slurm
def test_plain_scancel_cancels_and_never_requeues(cluster, tmp_path):
    """Issue 19, defect 11 (b). With PREEMPT_SIGNAL=TERM and REQUEUE_ON_PREEMPT=1 a plain
    `scancel` (SIGTERM to every process, then SIGKILL) used to be taken for a preemption: the
    ranks saved and exited 0 and the job requeued itself, so it could not be cancelled. Slurm has
    the job CANCELLED (COMPLETING) by then: no forwarding, no requeue."""
    out = tmp_path / "out"
    job = cluster.submit(tmp_path / "logs", "train.py", *TRAIN, "--train.out_dir", str(out), "--resume", "auto",
                         "--train.preempt_signal", "SIGTERM", launcher="srun", env=TERM)
    _wait_for_steps(job, out, 1)
    cluster.run("scancel", str(job.id))
    info = job.wait(timeout=60)  # a requeue would come before the job ends (and so show here)
    log = job.text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log[-4000:]
    assert "not a preemption; not forwarded, no requeue" in log, log[-4000:]
    assert "requeueing job" not in log and "(restart 1)" not in log


@needs_slurm
def test_preemption_signal_to_the_steps_only_is_known_by_the_ranks_records(cluster, tmp_path):
    """A preemption's SIGTERM in its GraceTime (here `scancel --signal=TERM`) reaches the steps,
    not the batch shell: the ranks save and record that they stopped for it (run_rank.py), and the
    batch script requeues on that. The requeued job can still be cancelled."""
    out = tmp_path / "out"
    job = cluster.submit(tmp_path / "logs", "train.py", *SHORT, "--train.out_dir", str(out), "--resume", "auto",
                         "--train.preempt_signal", "SIGTERM", launcher="srun", env=TERM)
    _wait_for_steps(job, out, 1)
    cluster.run("scancel", "--signal=TERM", str(job.id))
    deadline = time.monotonic() + 60
    while (info := job.info()).get("Restarts") == "0" and info.get("JobState") not in FINAL:
        if time.monotonic() > deadline:
            job.cancel()
            pytest.fail(f"job {job.id} was not requeued; log:\n{job.text()[-4000:]}")
        time.sleep(0.2)
    log = job.text()
    assert info["Restarts"] == "1", log[-4000:]
    assert "launch: received" not in log, log[-4000:]  # the batch shell never saw it
    assert "launch: 4 rank(s) stopped for SIGTERM and saved" in log and "requeueing job" in log, log[-4000:]
    assert re.search(r"preempted at step \d+: saved checkpoint", log), log[-4000:]
    job.cancel()
    assert job.wait(timeout=60)["JobState"] == "CANCELLED"


@needs_slurm
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_a_killed_rank_is_the_first_failure_not_its_survivors(cluster, tmp_path, launcher):
    """Issue 19, defect 11 (d). Rank 2 dies of SIGKILL; the others' collectives fail (exit 1):
    the job's code is the killed rank's, 128 + 9, and the summary names it."""
    entry = tmp_path / "failing.py"
    entry.write_text(FAILING)
    job = cluster.submit(tmp_path / "logs", str(entry), launcher=launcher,
                         env={"FAIL_MODE": "kill", "PYTHONPATH": str(REPO), "FAIL_TIMEOUT": "60"})
    info = job.wait(timeout=90)
    log = job.text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "137:0", log[-4000:]
    assert "launch: a rank failed with exit code 137 (rank 2 killed by SIGKILL, the first to fail" in log, log[-4000:]


# --------------------------------------------------------------------------------------------
# The launcher environment, without Slurm


def _srun_env(rank: int, **extra) -> dict[str, str]:
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": str(rank % 2),
           "SLURM_NODEID": str(rank // 2), "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env.update(extra)
    return env


def test_tasks_per_node_lists():
    assert parse_tasks_per_node("2(x2)") == [2, 2]
    assert parse_tasks_per_node("8(x3),4") == [8, 8, 8, 4]
    assert parse_tasks_per_node("1") == [1]
    with pytest.raises(LauncherError, match="cannot parse"):
        parse_tasks_per_node("2(y2)")


def test_srun_variables_become_torchrun_variables():
    assert slurm_rank_env(_srun_env(3)) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert slurm_rank_env(_srun_env(0))["LOCAL_WORLD_SIZE"] == "2"
    # Uneven nodes: this node's own count.
    uneven = _srun_env(2, SLURM_STEP_NUM_TASKS="3", SLURM_NTASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1",
                       SLURM_LOCALID="0", SLURM_NODEID="1")
    assert slurm_rank_env(uneven) == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def test_srun_variables_are_ignored_outside_a_step_or_under_torchrun():
    assert slurm_rank_env({}) == {}
    batch_shell = {k: v for k, v in _srun_env(0).items() if not k.startswith("SLURM_STEP_")}
    assert slurm_rank_env(batch_shell) == {}  # the batch script's SLURM_NTASKS is not a world
    assert slurm_rank_env(_srun_env(1, RANK="5", WORLD_SIZE="8")) == {}  # torchrun's numbering wins


def test_srun_launch_errors_name_what_to_set():
    env = _srun_env(1)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    with pytest.raises(LauncherError, match="MASTER_ADDR and MASTER_PORT are not set"):
        slurm_rank_env(env)
    cyclic = _srun_env(1, SLURM_LOCALID="0", SLURM_NODEID="1")  # rank 1 on the second node
    with pytest.raises(LauncherError, match="node-major"):
        slurm_rank_env(cyclic)


def test_init_distributed_exports_the_layout_for_a_one_task_step(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    one = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}
    for key, value in one.items():
        monkeypatch.setenv(key, value)
    env = init_distributed()  # one rank: no MASTER_* needed, no process group
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    assert os.environ["LOCAL_WORLD_SIZE"] == "1" and os.environ["WORLD_SIZE"] == "1"


@pytest.mark.parametrize("body, code, how", [
    ("import sys; sys.exit(5)", 5, "exited"),
    ("raise RuntimeError('boom')", 1, "exited"),
    ("import sys; sys.exit('config error: x')", 1, "exited"),
    ("import sys; assert __name__ == '__main__' and sys.argv[1:] == ['--a', 'b']", 0, "exited"),
    # The warning signal before the trainer handles it (or after) does not kill the rank.
    ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", 0, "exited"),
    # ... and where the trainer saw it (and so stopped early), the record says so.
    ("import os, signal\nfrom trainer.preemption import PreemptionSignal, catch_early\ncatch_early()\n"
     "os.kill(os.getpid(), signal.SIGUSR1)\nassert PreemptionSignal('SIGUSR1').received", 0, "preempted"),
    ("import os, signal\nfrom trainer.preemption import PreemptionSignal\np = PreemptionSignal('SIGUSR1')\n"
     "p.close()\nos.kill(os.getpid(), signal.SIGUSR1)", 0, "exited"),  # after the last look: finished
    # A collective that lost its peer (gloo's words), directly or as the cause of the entry point's
    # one-line error: a consequence of another rank's death.
    ("raise RuntimeError('[pair.cc:537] Read error [127.0.0.1]:59108: Connection reset by peer.')", 1, "peer"),
    ("import sys\ntry:\n    raise RuntimeError('Connection closed by peer')\nexcept RuntimeError:\n"
     "    sys.exit('train.py: error: rank 1: a collective failed')", 1, "peer"),
])
def test_run_rank_records_the_exit_code(tmp_path, body, code, how):
    script = tmp_path / "entry.py"
    script.write_text(body + "\n")
    env = {**os.environ, "RANK_EXIT_DIR": str(tmp_path / "ranks"), "RANK": "3", "PREEMPT_SIGNAL": "USR1"}
    proc = subprocess.run([sys.executable, str(SLURM / "run_rank.py"), str(script), "--a", "b"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    lines = (tmp_path / "ranks" / "rank-3").read_text().splitlines()
    when, recorded, recorded_how = lines[0].split()
    assert (int(recorded), recorded_how) == (code, how) and float(when) > 0
    # A one-line error is the record's second line (the launcher's last line repeats the first failure's).
    assert lines[1:] == ([body.split("sys.exit(")[-1].strip(")'")] if "sys.exit('" in body else []), lines


def test_a_rank_killed_by_a_signal_is_recorded_by_its_watcher(tmp_path):
    """The killed rank cannot write its line; its watcher (rank_watcher.py) writes the time of
    death and the signal, read while the rank is not reaped yet (here: until we wait for it)."""
    script = tmp_path / "entry.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    ranks = tmp_path / "ranks"
    env = {**os.environ, "RANK_EXIT_DIR": str(ranks), "RANK": "2"}
    proc = subprocess.Popen([sys.executable, str(SLURM / "run_rank.py"), str(script)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        before = time.time()
        proc.kill()
        deadline = time.monotonic() + 30
        while not (ranks / "rank-2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        when, code, how = (ranks / "rank-2").read_text().split()
        assert (code, how) == ("137", "signal:SIGKILL") and before <= float(when) < before + 30
    finally:
        proc.kill()
        proc.wait()


def test_dist_timeout_is_set_by_the_config_key_only(monkeypatch, tmp_path):
    """DIST_TIMEOUT once set the collective timeout beside train.dist_timeout (and silently lost to
    it): both the launcher and init_distributed refuse it, naming the key."""
    monkeypatch.setenv("DIST_TIMEOUT", "30")
    with pytest.raises(LauncherError, match="DIST_TIMEOUT=30 is not read any more: set the timeout with "
                                            "--train.dist_timeout"):
        init_distributed()
    env = {**os.environ, "DIST_TIMEOUT": "30"}
    proc = subprocess.run(["bash", str(SLURM / "launch.sbatch"), "train.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pass --train.dist_timeout 30 to train.py" in proc.stderr, proc.stderr
