"""The failure paths of a long run (issue 19): interrupted saves, non-finite values, bad values,
a reused out_dir, durability, corrupted or mixed-up checkpoint files, unclear errors.

Each test checks behaviour against an independent reference: an uninterrupted run's losses
and tensors (bit-identical), or the bytes saved before the damage."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import trainer.loop as loop
from data.indexed import IndexedDatasetBuilder
from trainer.checkpoint import CHECKSUMS, CheckpointError, _seal, consolidated_model
from trainer.config import ConfigError, parse_args
from trainer.loop import NonFiniteError, Trainer, train
from trainer.pretrain_data import DataError
from tests.trainer.test_train import corpus, tiny_args  # noqa: F401  (the module-scoped corpus fixture)

ROOT = Path(__file__).resolve().parents[2]


def args(corpus, tmp_path, name, *extra):  # noqa: F811 (the fixture)
    return parse_args(tiny_args(corpus, tmp_path / name, tmp_path / "cache", *extra))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reseal(ckpt: Path) -> None:
    """Record the files' current checksums: damage that the checksums would not catch."""
    record = json.loads((ckpt / CHECKSUMS).read_text())
    record["files"] = {name: _seal(ckpt / name) for name in record["files"]}
    (ckpt / CHECKSUMS).write_text(json.dumps(record))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):  # noqa: F811
    """An uninterrupted 8-step run with a checkpoint every 2 steps."""
    tmp = tmp_path_factory.mktemp("ref")
    result = train(args(corpus, tmp, "run", "--train.checkpoint_interval", "2"))
    return result, tmp / "run" / "checkpoints"


def resumed_copy(reference, tmp_path, keep: list[str]) -> Path:
    """A copy of the reference run's out_dir holding only checkpoints `keep` and `latest`."""
    out = tmp_path / "run"
    shutil.copytree(reference[1].parent, out)
    for d in (out / "checkpoints").glob("step_*"):
        if d.name not in keep:
            shutil.rmtree(d)
    return out


# ---------------------------------------------------------------------------------- defect 1

def test_kill_between_the_renames_of_a_resave_resumes_bit_identically(corpus, reference, tmp_path):  # noqa: F811
    result, _ = reference
    out = resumed_copy(reference, tmp_path, ["step_00000004", "step_00000006"])
    root = out / "checkpoints"
    # A save of step 6 again was killed between moving the old copy aside and renaming the new one
    # in: `latest` names a missing directory, the old copy is .old-, the new one a partial .tmp-.
    (root / "latest").write_text("step_00000006\n")
    os.replace(root / "step_00000006", root / ".old-step_00000006")
    (root / ".tmp-step_00000006").mkdir()
    (root / ".tmp-step_00000006" / "model.safetensors").write_bytes(b"partial")
    cfg = parse_args(tiny_args(corpus, out, tmp_path / "cache", "--resume", "auto"))
    resumed = train(cfg)
    assert sorted(resumed.losses) == [7, 8]
    assert all(resumed.losses[s] == result.losses[s] for s in (7, 8))
    assert same(weights(root / "step_00000008"), weights(reference[1] / "step_00000008"))
    assert not list(root.glob(".*")), "recovery left hidden directories behind"


def test_dangling_latest_falls_back_to_the_newest_complete_checkpoint_and_says_so(corpus, reference, tmp_path):  # noqa: F811
    result, _ = reference
    out = resumed_copy(reference, tmp_path, ["step_00000002", "step_00000004"])
    (out / "checkpoints" / "latest").write_text("step_00000006\n")  # its directory is gone
    trainer = Trainer(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--resume", "latest")))
    assert trainer.step == 4
    assert any("step_00000006" in n and "newest complete checkpoint" in n and "step_00000004" in n
               for n in trainer.notes)
    resumed = trainer.run()
    assert {s: resumed.losses[s] for s in range(5, 9)} == {s: result.losses[s] for s in range(5, 9)}


def test_a_step_is_never_saved_twice(corpus, reference, tmp_path, monkeypatch):  # noqa: F811
    saves = []
    real = loop.save_checkpoint
    monkeypatch.setattr(loop, "save_checkpoint", lambda root, step, *a: saves.append(step) or real(root, step, *a))
    # Resuming a finished run saves nothing.
    out = resumed_copy(reference, tmp_path, ["step_00000008"])
    ident = json.loads((out / "checkpoints" / "step_00000008" / "state.json").read_text())["checkpoint_id"]
    train(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--resume", "latest")))
    assert saves == []
    assert json.loads((out / "checkpoints" / "step_00000008" / "state.json").read_text())["checkpoint_id"] == ident

    # The preemption signal arriving on a checkpoint-interval step: one save of that step, then exit.
    trainer = Trainer(args(corpus, tmp_path, "pre", "--train.checkpoint_interval", "2"))
    step = trainer.train_step

    def signal_at_step_2(batches, stop=False):
        if trainer.step == 0:  # seen by the ranks' agreement at step 2, a checkpoint step
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(batches, stop)

    trainer.train_step = signal_at_step_2
    result = trainer.run()
    assert result.preempted and trainer.step == 2 and saves == [2]


# ---------------------------------------------------------------------------------- defect 2

def test_a_non_finite_step_is_skipped_and_divergence_stops_without_saving(corpus, reference, tmp_path):  # noqa: F811
    trainer = Trainer(args(corpus, tmp_path, "nan", "--train.steps", "4"))
    clip = trainer.runtime.clip_grad_norm_
    before = {}

    def nan_at_step_3(max_norm):
        norm = clip(max_norm)
        if trainer.step == 2:
            before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            return torch.tensor(float("nan"))
        return norm

    trainer.runtime.clip_grad_norm_ = nan_at_step_3
    step = trainer.train_step

    def check(batches, stop=False):
        out = step(batches, stop)
        if trainer.step == 3:  # the skipped update left every weight as it was
            assert same(before, {n: p.detach() for n, p in trainer.model.named_parameters()})
        return out

    trainer.train_step = check
    result = trainer.run()
    assert result.skipped_steps == [3] and trainer.step == 4
    assert all(np.isfinite(list(result.losses.values()))) and np.isfinite(result.val_loss)

    # lr 1e6 diverges: the run stops with a clear error after 2 non-finite steps in a row and
    # `latest` still names a checkpoint of finite weights.
    with pytest.raises(NonFiniteError, match="non-finite"):
        train(args(corpus, tmp_path, "diverge", "--optim.lr", "1e6", "--optim.warmup_steps", "0",
                   "--train.steps", "40", "--train.checkpoint_interval", "1", "--train.max_nonfinite_steps", "2"))
    root = tmp_path / "diverge" / "checkpoints"
    for ckpt in root.glob("step_*"):
        assert all(torch.isfinite(t).all() for t in weights(ckpt).values()), f"{ckpt} holds non-finite weights"


def test_non_finite_weights_in_a_checkpoint_are_refused(corpus, reference, tmp_path):  # noqa: F811
    out = resumed_copy(reference, tmp_path, ["step_00000004"])
    ckpt = out / "checkpoints" / "step_00000004"
    tensors = weights(ckpt)
    tensors["blocks.0.attn.q_proj.weight"].view(-1)[7] = float("nan")
    save_file(tensors, str(ckpt / "model.safetensors"))
    reseal(ckpt)  # so that the checksums cannot be what catches it
    with pytest.raises(CheckpointError, match="non-finite values in rank 0: blocks.0.attn.q_proj.weight"):
        Trainer(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--resume", "latest")))


# ---------------------------------------------------------------------------------- defect 7

@pytest.mark.parametrize("key,value", [
    ("train.eval_batches", "0"), ("optim.min_lr", "-1e-4"), ("optim.lr", "inf"), ("optim.lr", "nan"),
    ("optim.warmup_steps", "-1"), ("optim.weight_decay", "-0.1"), ("optim.clip_grad", "-1"),
    ("train.checkpoint_interval", "-2"), ("train.max_nonfinite_steps", "0"), ("train.dist_timeout", "0"),
])
def test_values_out_of_range_are_refused_naming_key_and_value(corpus, tmp_path, key, value):  # noqa: F811
    with pytest.raises(ConfigError, match=rf"{key}: value \S+ is out of range; expected"):
        Trainer(args(corpus, tmp_path, "x", f"--{key}", value))
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------- defect 8

def test_a_fresh_run_refuses_an_out_dir_holding_another_run(corpus, reference, tmp_path):  # noqa: F811
    out = resumed_copy(reference, tmp_path, ["step_00000008"])
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="holds another run.*--resume auto.*--train.overwrite true"):
        train(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--train.steps", "2")))
    assert (out / "metrics.jsonl").read_bytes() == before
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    # --train.overwrite deletes the old run only once the new one has passed its checks: a mistyped
    # data path fails and leaves the old run as it was.
    with pytest.raises(Exception, match="missing.txt"):
        train(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--train.steps", "2", "--train.overwrite", "true",
                                   "--data.path", str(tmp_path / "missing.txt"))))
    assert (out / "metrics.jsonl").read_bytes() == before
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    # Better: the old run is moved aside, and deleted only once the new run has a checkpoint. A run
    # that fails before its first one leaves the old run whole, in .overwritten.
    old_files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    failing = Trainer(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--train.steps", "2",
                                           "--train.overwrite", "true")))
    failing.train_step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("died in its first step"))
    with pytest.raises(RuntimeError, match="died in its first step"):
        failing.run()
    failing.close(after_failure=True)
    assert {p.relative_to(out / ".overwritten"): p.read_bytes()
            for p in (out / ".overwritten").rglob("*") if p.is_file()} == old_files
    with pytest.raises(ConfigError, match="holds another run .*overwritten"):  # not silently left behind
        train(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--train.steps", "2")))
    result = train(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--train.steps", "2",
                                        "--train.overwrite", "true")))
    assert not (out / ".overwritten").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][0] == 2
    assert result.losses == {s: reference[0].losses[s] for s in (1, 2)}


# ---------------------------------------------------------------------------------- defect 9

def test_saves_fsync_data_before_the_pointer_and_clean_up_after_failures(corpus, tmp_path, monkeypatch):  # noqa: F811
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    trainer = Trainer(args(corpus, tmp_path, "run", "--train.steps", "1"))
    root = trainer.ckpt_root
    root.mkdir(parents=True)
    (root / ".tmp-step_00000000").mkdir()  # left behind by an earlier failed save
    trainer.run()
    names = [p.name for p in synced]
    pointer = names.index(".latest.tmp")
    for name in ("model.safetensors", "optimizer.safetensors", "state.json", "rng_rank00000.json", CHECKSUMS,
                 ".tmp-step_00000001", "checkpoints"):  # the files, their directory, the rename
        assert name in names[:pointer], f"{name} was not fsynced before `latest` moved"
    assert root.resolve() in synced[pointer:], "the checkpoints directory was not fsynced after `latest` moved"
    assert not (root / ".tmp-step_00000000").exists()

    # A save that fails (the disk is full) leaves no temporary directory and `latest` as it was.
    trainer.step = 2

    def full_disk(directory, optimizer):
        (Path(directory) / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(28, "No space left on device")

    trainer.runtime.save = full_disk
    with pytest.raises(OSError, match="No space left"):
        trainer.save()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert (root / "latest").read_text().strip() == "step_00000001"


# ---------------------------------------------------------------------------------- defect 4

def test_a_flipped_bit_or_a_file_of_another_checkpoint_is_caught(corpus, reference, tmp_path):  # noqa: F811
    out = resumed_copy(reference, tmp_path, ["step_00000004", "step_00000006"])
    ckpt = out / "checkpoints" / "step_00000006"
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-1000] ^= 0x10  # one bit of tensor data: safetensors itself does not notice
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors has SHA-256"):
        Trainer(parse_args(tiny_args(corpus, out, tmp_path / "cache", "--resume", "latest")))
    with pytest.raises(CheckpointError, match=r"model.safetensors has SHA-256"):
        consolidated_model(ckpt)
    shutil.copy(out / "checkpoints" / "step_00000004" / "model.safetensors", ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors has SHA-256"):
        consolidated_model(ckpt)
    shutil.copy(out / "checkpoints" / "step_00000004" / CHECKSUMS, ckpt / CHECKSUMS)
    with pytest.raises(CheckpointError, match=r"checkpoint_id .* different saves"):
        consolidated_model(ckpt)
    # Deleting checksums.json does not turn verification off; only a checkpoint of the format
    # before checksums (no checkpoint_id in state.json) loads unverified, with a warning.
    (ckpt / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=r"checksums.json is missing \(state.json's checkpoint_id \w+ says"):
        consolidated_model(ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    del state["checkpoint_id"]
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.warns(UserWarning, match="written by an older version"):
        consolidated_model(ckpt)


ZERO3 = ("--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32")
QWZ = ("--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_quantization_block_size", "256")


def test_state_json_is_verified_except_its_tokenizer_path(corpus, reference, tmp_path):  # noqa: F811
    """A flipped bit in state.json that leaves valid JSON (a key name: the chaos harness made
    "capturable" "capturabhe") used to load and train: state.json was tied to the rest by its
    checkpoint_id alone. checksums.json now holds its digest, over every key but the tokenizer
    path, the one edit people make (a moved tokenizer)."""
    out = resumed_copy(reference, tmp_path, ["step_00000008"])
    state_file = out / "checkpoints" / "step_00000008" / "state.json"
    original = state_file.read_text()
    state_file.write_text(original.replace('"capturable"', '"capturabhe"'))
    with pytest.raises(CheckpointError, match="state.json differs from what was saved .corrupted, or edited beyond "
                                              "tokenizer, the one key that may be."):
        Trainer(args(corpus, tmp_path, "run", "--resume", "auto", "--train.steps", "9"))
    with pytest.raises(CheckpointError, match="state.json differs from what was saved"):
        consolidated_model(state_file.parent)
    state = json.loads(original)
    moved = tmp_path / "moved" / Path(state["tokenizer"]).name
    moved.parent.mkdir()
    shutil.copy(state["tokenizer"], moved)
    state_file.write_text(json.dumps({**state, "tokenizer": str(moved)}))
    trainer = Trainer(args(corpus, tmp_path, "run", "--resume", "auto", "--train.steps", "9"))
    assert trainer.step == 8
    trainer.close()


def test_a_foreign_manifest_is_an_error_for_resume_and_consolidation(corpus, tmp_path):  # noqa: F811
    train(args(corpus, tmp_path, "plain", *ZERO3, "--train.steps", "2"))
    train(args(corpus, tmp_path, "qwz", *ZERO3, *QWZ, "--train.steps", "2"))
    plain, qwz = (tmp_path / name / "checkpoints" / "step_00000002" for name in ("plain", "qwz"))
    assert (plain / "manifest.json").read_bytes() != (qwz / "manifest.json").read_bytes()  # qwZ aligns offsets
    shutil.copy(plain / "manifest.json", qwz / "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json has .* when saved"):
        Trainer(args(corpus, tmp_path, "qwz", *ZERO3, *QWZ, "--resume", "latest", "--train.steps", "3"))
    proc = subprocess.run([sys.executable, "-m", "scripts.consolidate", str(qwz), str(tmp_path / "hf")], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "manifest.json has " in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------- defect 5

def test_every_process_group_gets_the_configured_timeout():
    from datetime import timedelta

    from zeropp.topology import build_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=17))
    try:
        mesh = build_mesh(ranks_per_node=1, secondary_size=1, thread_groups=True)
        timeouts = {key: g._get_backend(torch.device("cpu")).options._timeout for key, g in mesh._groups.items()}
        assert timeouts and set(timeouts.values()) == {timedelta(seconds=17)}, timeouts
        # Plain ZeRO-3 (no secondary size asked for) does not claim a secondary partition.
        assert "secondary" not in build_mesh(thread_groups=False).describe()
        assert "secondary partition of 1" in mesh.describe()
    finally:
        dist.destroy_process_group()


def _frozen_rank_run(rank, world_size, argv, port, victim, freeze_at, pid_file):
    """One rank of a 3-rank ZeRO++ run in which `victim` stops itself (SIGSTOP) before step
    `freeze_at`. A survivor returns its error line and the seconds since the freeze, then wakes
    the victim (SIGCONT), which fails on its own once the others are gone."""
    import time
    from datetime import timedelta

    from trainer.distributed import PeerError
    from trainer.heartbeat import interval_for

    cfg = parse_args(argv)
    dist.destroy_process_group()  # the spawner's group has no train.dist_timeout: the trainer's own
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=cfg.train.dist_timeout))
    if rank == victim:
        step = Trainer.train_step

        def freezing_step(self, *a, **k):
            if self.step + 1 == freeze_at:
                time.sleep(2 * interval_for(cfg.train.dist_timeout))  # a heartbeat of this step first
                Path(pid_file).write_text(f"{os.getpid()} {time.time()}")
                os.kill(os.getpid(), signal.SIGSTOP)
            return step(self, *a, **k)
        Trainer.train_step = freezing_step
    try:
        train(cfg)
        return "finished", 0.0
    except PeerError as e:
        if rank == victim:
            return "the victim", 0.0
        pid, frozen_at = Path(pid_file).read_text().split()
        with contextlib.suppress(ProcessLookupError):  # (another survivor woke it, and it has ended)
            os.kill(int(pid), signal.SIGCONT)
        return str(e), time.time() - float(frozen_at)


def test_a_frozen_rank_is_named_by_every_survivor_within_twice_the_timeout(corpus, tmp_path):  # noqa: F811
    """Issue 36, item 1: a SIGSTOPped rank used to leave only "Timed out" (or "pair closure")
    errors, and torchrun blamed a healthy rank. Every survivor now names the stopped rank, its
    host, pid, phase and last collective (from the ranks' heartbeats) within 2 x dist_timeout."""
    from trainer.spawn import free_port, run_ranks

    timeout = 4.0
    argv = tiny_args(corpus, tmp_path / "run", tmp_path / "cache", "--train.micro_batch_size", "1",
                     "--train.dist_timeout", str(timeout), "--zero_optimization.stage", "3",
                     "--zero_optimization.zero_quantized_weights", "true",
                     "--zero_optimization.zero_quantized_gradients", "true",
                     "--zero_optimization.zero_quantization_block_size", "64")
    out = run_ranks(_frozen_rank_run, 3, (argv, free_port(), 1, 3, str(tmp_path / "victim.pid")), timeout=120)
    assert out[1][0] == "the victim"
    pid = (tmp_path / "victim.pid").read_text().split()[0]
    for rank in (0, 2):
        line, seconds = out[rank]
        assert line.startswith(f"rank {rank}: a collective failed during training step 3: rank 1 (host ") and \
            f"pid {pid}) stopped responding: its last heartbeat was" in line and \
            "during training step 3, its last collective '" in line, line
        assert seconds < 2 * timeout, (seconds, line)


def test_every_timeout_message_maps_to_the_line_naming_the_stopped_rank():
    """gloo's and NCCL's messages for a collective that waited out its timeout are peer failures
    and timeouts (the "pair closure" one used to escape as a traceback), a lost connection a peer
    failure only; the heartbeats' records give the sentence either way."""
    from trainer.distributed import is_peer_failure, is_timeout
    from trainer.heartbeat import describe, stale

    for text in ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
                 "[gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure",
                 "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"):
        assert is_peer_failure(RuntimeError(text)) and is_timeout(RuntimeError(text)), text
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:3472")
    assert is_peer_failure(closed) and not is_timeout(closed)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))

    def record(age, doing, tag, calls):
        return {"time": 1000.0 - age, "host": "node1", "pid": 42, "doing": doing, "collective": tag, "calls": calls}
    records = {0: record(0.5, "training step 7", "qgZ all-to-all", 812),
               1: record(31.0, "training step 7", "forward gather", 809),
               2: record(0.2, "training step 7", "qgZ all-to-all", 812)}
    silent = stale(records, 0, 4.0, 1000.0)
    assert silent == [1]
    line = describe(records, silent, 0, 1000.0, records[0], timed_out=True)
    assert line.startswith("rank 1 (host node1, pid 42) stopped responding: its last heartbeat was 31 s ago, "
                           "during training step 7, its last collective 'forward gather' (call 809)"), line
    # Nobody stopped: a timeout then lists where each rank is (a diverging rank stands out) ...
    records[1] = record(0.1, "evaluation at step 6", "barrier", 700)
    line = describe(records, [], 0, 1000.0, records[0], timed_out=True)
    assert "ranks 0, 2: 'qgZ all-to-all' (call 812); rank 1: 'barrier' (call 700)" in line, line
    # ... and a lost connection says a rank died (its own error or the launcher's names it).
    assert "closed its connection" in describe(records, [], 0, 1000.0, records[0], timed_out=False)


# ---------------------------------------------------------------------------------- defect 10

def test_data_errors_name_the_file_and_the_cause(corpus, tmp_path):  # noqa: F811
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "store").mkdir()
    with IndexedDatasetBuilder(tmp_path / "store" / "tokens") as builder:
        builder.add_document(np.arange(600) % 530)  # ids up to 529: the 512-token tokenizer has no such
    trained = Trainer(args(corpus, tmp_path, "ok", "--train.steps", "1")).data.tokenizer.path
    cases = [
        (tmp_path / "empty.txt", [], "empty.txt' is empty"),
        (tmp_path / "binary.txt", [], "binary.txt' is not UTF-8 text"),
        (tmp_path / "store", [], "is a directory.*give that prefix"),
    ]
    for path, extra, message in cases:
        with pytest.raises(DataError, match=message):
            Trainer(args(corpus, tmp_path, "x", "--data.path", str(path), *extra))
    trainer = Trainer(args(corpus, tmp_path, "x", "--data.path", str(tmp_path / "store" / "tokens"),
                           "--data.tokenizer", str(trained), "--data.valid_fraction", "0.2"))
    with pytest.raises(DataError, match=r"holds token id 5\d\d, outside the tokenizer's 512 ids"):
        trainer.run()


def test_entry_point_errors_are_one_line_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--data.path", str(tmp_path), "--train.out_dir",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"train.py: error: data.path {str(tmp_path)!r} is a directory (expected a text/json/jsonl file, "
        f"a .bin/.idx prefix, or 'default')"]


# ---------------------------------------------------------------------------------- defect 12

def test_the_validation_set_does_not_depend_on_how_the_batch_is_split(corpus, tmp_path):  # noqa: F811
    whole = Trainer(args(corpus, tmp_path, "a", "--train.micro_batch_size", "8"))
    split = Trainer(args(corpus, tmp_path, "b", "--train.micro_batch_size", "2", "--train.grad_accum", "4"))
    assert whole.validation_samples() == split.validation_samples()
    assert len(whole.validation_samples()) == 2 * 8  # eval_batches global batches
    assert abs(whole.evaluate() - split.evaluate()) < 1e-6


def test_a_qwz_run_exports_the_weights_it_computed_with(corpus, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    trainer = Trainer(args(corpus, tmp_path, "qwz", *ZERO3, *QWZ, "--train.steps", "2", "--train.export_hf", "true"))
    try:
        result = trainer.run()
        tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
        trainer.model.eval()
        with torch.no_grad():
            trained = trainer.runtime(tokens)  # the run's own forward: weights on its qwZ grid
    finally:
        trainer.close()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "qwz" / "hf").eval()
    masters = consolidated_model(result.checkpoint).eval()
    with torch.no_grad():
        exported, master = hf(tokens).logits, masters(tokens)
    assert torch.allclose(exported, trained, atol=1e-5, rtol=1e-5)
    assert (master - trained).abs().max() > 100 * (exported - trained).abs().max()


def test_chaos_kill_trials(tmp_path):
    """The harness's fast subset: two SIGKILLs of a 1-process run, one inside a save; both must
    leave sound checkpoints and resume to the uninterrupted run's losses and tensors, bit for bit."""
    import random

    from scripts import chaos

    layout, cache = chaos.Layout("1-process", 0), tmp_path / "cache"
    reference = chaos.reference_run(layout, tmp_path, cache)
    tally, rng = chaos.Tally(), random.Random(0)
    for _ in range(6):
        if tally.in_save and tally.trials >= 2:
            break
        chaos.kill_trial(layout, tmp_path, cache, reference, in_save=not tally.in_save, rng=rng, tally=tally)
    assert tally.trials >= 2 and tally.in_save >= 1, tally
    assert tally.identical == tally.trials and not tally.problems, tally.problems
    assert (tally.corrupt, tally.dangling, tally.failed_resumes) == (0, 0, 0)
    assert max(tally.steps_lost) <= chaos.INTERVAL


# ---------------------------------------------------------------------------------- defects 3 and 6

def _torchrun(tmp_path, corpus, name, *extra, torchrun=()):  # noqa: F811
    from trainer.spawn import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), *torchrun, str(ROOT / "train.py"),
            *tiny_args(corpus, tmp_path / name, tmp_path / "cache", "--train.log_interval", "1",
                       "--train.checkpoint_interval", "2", "--zero_optimization.stage", "3", *extra)]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_a_preemption_signal_during_startup_exits_cleanly_before_any_step(corpus, tmp_path):  # noqa: F811
    """The signal is caught from train.py's first line (before torch loads), not only in the loop."""
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                             *tiny_args(corpus, out, tmp_path / "cache")], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    usr1 = 1 << (signal.SIGUSR1 - 1)
    while proc.poll() is None and not int(
            next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                 if line.startswith("SigCgt:")).split()[1], 16) & usr1:
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert "preempted before the first step: nothing new to save" in output
    assert not list((out / "checkpoints").glob("step_*")) and "lm loss" not in output


@pytest.mark.parametrize("entry", ["train.py", "finetune.py", "rlhf.py"])
def test_every_entry_point_catches_the_preemption_signal_before_torch_loads(entry):
    """catch_early() comes first in every entry point: when torch starts to load, the preemption
    signal already has a handler (a warning during the imports is recorded, not fatal)."""
    code = ("import os, runpy, signal, sys\n"
            "def hook(event, args):\n"
            "    if event == 'import' and args[0] == 'torch':\n"
            "        print('caught', signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None), flush=True)\n"
            "        os._exit(0)\n"
            "sys.addaudithook(hook)\n"
            f"sys.argv = [{entry!r}, '--help']\n"
            f"runpy.run_path({entry!r}, run_name='__main__')\n")
    env = {k: v for k, v in _env().items() if k != "PREEMPT_SIGNAL"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "caught True", proc.stdout + proc.stderr[-2000:]


def test_preemption_signal_to_the_torchrun_agent_saves_one_checkpoint_and_every_rank_exits_0(tmp_path):
    """SIGUSR1 kills torchrun's agent (it has no handler); its ranks, in sessions of their own, see
    their parent change, agree on a step, save one verified checkpoint and exit 0 (recorded by
    run_rank.py)."""
    from scripts import chaos

    line = chaos.agent_signal(chaos.Layout("ranks", 2), tmp_path, tmp_path / "cache")
    assert line.startswith("ok:"), line
    assert "preempted at step" in (tmp_path / "agent-signal.log").read_text()


def test_an_elastic_restart_resumes_bit_identically(corpus, tmp_path):  # noqa: F811
    """torchrun --max-restarts 1 and --resume auto, one rank SIGKILLed after step 3: the restarted
    attempt gets a store prefix of its own (trainer.distributed.elastic_store; without it it fails
    in gloo's connectFullMesh), resumes from the last checkpoint and ends with the uninterrupted run's losses
    and shards."""
    from scripts import chaos

    ref = subprocess.run(_torchrun(tmp_path, corpus, "ref"), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    log = tmp_path / "elastic.log"
    proc = chaos.start(_torchrun(tmp_path, corpus, "elastic", "--resume", "auto", "--train.dist_timeout", "30",
                                torchrun=["--max-restarts=1"]), log)
    chaos.watch(proc, tmp_path / "elastic", 3)
    os.kill(chaos.ranks_of(proc)[1], signal.SIGKILL)
    assert proc.wait(300) == 0, log.read_text()[-3000:]
    assert "resumed from checkpoint" in log.read_text()
    ref, got = tmp_path / "ref", tmp_path / "elastic"
    assert chaos.losses(got) == chaos.losses(ref) and len(chaos.losses(ref)) == 8
    final = "checkpoints/step_00000008"
    assert chaos._equal(chaos.tensors(got / final), chaos.tensors(ref / final))
