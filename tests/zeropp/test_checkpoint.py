"""Sharded checkpoints: exact resume, resharding to another world size, consolidation, clear errors."""

import pytest
import torch

from tests.zeropp.test_engine import batches, make_engine, make_model, train_step
from trainer.spawn import run_ranks
from zeropp.checkpoint import CheckpointError, consolidated_state_dict
from zeropp.config import ZeroConfig

FP32 = ZeroConfig(stage=3, communication_data_type="fp32")


def _train(engine, optimizer, rank, world, samples):
    """Steps over `samples` (each the global batch); returns the mean loss of each step."""
    losses = [train_step(engine, optimizer, sample, rank, world) for sample in samples]
    return losses


def _save_then_continue(rank, world, directory):
    engine, optimizer = make_engine(make_model("gpt2-tiny"), FP32, ranks_per_node=2)
    data = batches(8)
    _train(engine, optimizer, rank, world, data[:4])
    if rank == 0:
        directory.mkdir()
    torch.distributed.barrier()
    engine.save(directory, optimizer)
    torch.distributed.barrier()
    later = _train(engine, optimizer, rank, world, data[4:])
    state = engine.full_state_dict()
    engine.close()
    return later, state


def _resume(rank, world, directory, preset):
    engine, optimizer = make_engine(make_model(preset), FP32)
    engine.load(directory, optimizer)
    later = _train(engine, optimizer, rank, world, batches(8)[4:])
    state = engine.full_state_dict()
    engine.close()
    return later, state


def _load_other_model(rank, world, directory):
    engine, optimizer = make_engine(make_model("llama-tiny"), FP32)
    try:
        engine.load(directory, optimizer)
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()
    return "no error"


def test_resume_same_world_is_exact_and_reshard_4_to_2_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    later, state = run_ranks(_save_then_continue, 4, args=(ckpt,), ranks_per_node=2)[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json"] + [
        f"shards_rank{r:05d}.safetensors" for r in range(4)]

    same, same_state = run_ranks(_resume, 4, args=(ckpt, "gpt2-tiny"), ranks_per_node=2)[0]
    assert same == later  # bit-identical (same layout): master weights and AdamW states restored exactly
    assert all(torch.equal(same_state[k], state[k]) for k in state)

    two, two_state = run_ranks(_resume, 2, args=(ckpt, "gpt2-tiny"))[0]
    assert max(abs(a - b) for a, b in zip(two, later)) < 1e-5
    assert max((two_state[k] - state[k]).abs().max().item() for k in state) < 1e-5

    # Consolidation reads all shards without a process group.
    consolidated = consolidated_state_dict(ckpt)
    assert consolidated.keys() == state.keys()

    # Misuse: a checkpoint of another model, a truncated shard, a missing shard.
    message = run_ranks(_load_other_model, 2, args=(ckpt,))[0]
    assert "another model" in message, message
    shard = ckpt / "shards_rank00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="shards_rank00003"):
        consolidated_state_dict(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing.*shards_rank00003"):
        consolidated_state_dict(ckpt)
