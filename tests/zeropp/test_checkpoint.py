"""Sharded checkpoints: exact resume, resharding to another world size, consolidation, clear errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.zeropp.test_engine import batches, make_engine, make_model, train_step
from trainer.spawn import run_ranks
from zeropp.checkpoint import CheckpointError, consolidated_state_dict, load_reducer_state, save_reducer_state
from zeropp.config import GradientCompression, ZeroConfig
from zeropp.runtime import Timings
from zeropp.separate import ProjectedReduce, Separate

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


# ------------------------------------------------------------------------------ streamed consolidation

LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]  # GPT-2: q and v are fused into c_attn in the HF export
QWZ_FROZEN = ZeroConfig(stage=3, communication_data_type="fp32", zero_quantized_weights=True,
                        zero_quantized_weights_bits=8, zero_quantization_block_size=64,
                        zero_quantized_nontrainable_weights=True)


def _save_checkpoints(rank, world, root):
    """A plain ZeRO-3 run's checkpoint and a LoRA run's with qwZ and frozen weights stored quantized."""
    return {"plain": _save_checkpoint(rank, world, root / "plain", FP32, False),
            "lora": _save_checkpoint(rank, world, root / "lora", QWZ_FROZEN, True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return run_ranks(_save_checkpoints, 2, args=(tmp_path_factory.mktemp("saved"),))[0]


def _save_checkpoint(rank, world, root, zero, lora):
    """One step, then a checkpoint as train.py writes one; the engine's full weights at the save."""
    import dataclasses

    from models.lora import apply_lora
    from trainer.checkpoint import save_checkpoint

    model = make_model("gpt2-tiny")
    if lora:
        apply_lora(model, LORA_TARGETS, r=2, alpha=4.0)
    engine, optimizer = make_engine(model, zero)
    train_step(engine, optimizer, batches(1)[0], rank, world)
    state = {"format": engine.checkpoint_format, "config": {"zero_optimization": dataclasses.asdict(zero)},
             "model_config": dataclasses.asdict(model.config), "tokenizer": None,
             "lora": {"r": 2, "alpha": 4.0, "dropout": 0.0, "targets": LORA_TARGETS} if lora else None}
    path = save_checkpoint(root, 1, state, optimizer, lambda d: engine.save(d, optimizer), rank)
    full = engine.full_state_dict()
    engine.close()
    return str(path), full


def test_streamed_consolidation_equals_the_engine_and_a_plain_checkpoint_exports_as_save_file(saved, tmp_path):
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from models.hf import to_hf_state_dict
    from trainer.checkpoint import export_hf
    from zeropp.checkpoint import sharded_weights, unsharded_tensors

    path, full = saved["plain"]
    lazy = sharded_weights(path)
    assert list(lazy) == list(full)  # every name, aliases included (the tied head)
    for name, tensor in full.items():
        assert lazy.spec(name).shape == tensor.shape and torch.equal(lazy[name], tensor), name
    assert consolidated_state_dict(path).keys() == full.keys()
    states = unsharded_tensors(path)
    assert all(torch.equal(states[name], full[name]) for name in states if name in full)
    assert {k.rsplit(".", 1)[1] for k in states if k not in full} == {"exp_avg", "exp_avg_sq", "step"}

    # The HF export: save_file of the engine's weights in HF names and layouts.
    model = make_model("gpt2-tiny")
    model.load_state_dict(full)
    export_hf(path, tmp_path / "hf")
    reference = {n: t.contiguous() for n, t in to_hf_state_dict(model.state_dict(), model.config).items()}
    save_file(reference, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    path = shutil.copytree(path, tmp_path / "cut")
    shard = Path(path) / "shards_rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="shards_rank00001"):
        dict(sharded_weights(path).items())  # some parameter has elements in rank 1's file


def test_merged_lora_export_on_the_trained_grid_equals_the_in_memory_merge(saved, tmp_path):
    """A LoRA run with frozen weights stored quantized and qwZ: export_hf(as_trained) writes, tensor by
    tensor, what today's in-memory path gives: the trainable weights on the qwZ grid, the stored frozen
    ones as they are, the adapters merged (merge_lora), saved by save_file."""
    from safetensors.torch import save_file

    from kernels import on_grid
    from models.hf import to_hf_state_dict
    from models.lora import apply_lora, merge_lora
    from trainer.checkpoint import consolidated_model, export_hf

    path, full = saved["lora"]
    model = make_model("gpt2-tiny")
    apply_lora(model, LORA_TARGETS, r=2, alpha=4.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name] if not p.requires_grad else on_grid(full[name], 8, 64))
    merge_lora(model)
    export_hf(path, tmp_path / "hf", as_trained=True, max_shard_size=30000)
    hf = {n: t.contiguous() for n, t in to_hf_state_dict(model.state_dict(), model.config).items()}
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == list(hf)
    for file in dict.fromkeys(index["weight_map"].values()):
        save_file({n: hf[n] for n, f in index["weight_map"].items() if f == file}, str(tmp_path / "ref.safetensors"),
                  metadata={"format": "pt"})
        assert (tmp_path / "hf" / file).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), file
    merged = consolidated_model(path, as_trained=True)
    assert all(torch.equal(p, model.state_dict()[n]) for n, p in merged.named_parameters())


def _separate_with_state():
    cfg = GradientCompression(method="separate", ratio=4, block_size=64, beta=0.9, reconstruction="contractive")
    reducer = ProjectedReduce(None, Separate(cfg, torch.device("cpu")), torch.float32, Timings())
    for key in ("blocks.0", "bucket1"):
        reducer.compressor.compress(key, torch.randn(2, 300, generator=torch.Generator().manual_seed(len(key))))
    return cfg, reducer


def test_reducer_state_loads_from_one_file_and_from_both_older_places(tmp_path):
    """ZeRO and DDP save the reducer's state in the same per-rank file; checkpoints written before
    kept it in DDP's compressor.rankNNNNN file or as "reducer." keys of ZeRO's shard file: all three
    restore the same state, and another world size starts from zero with a warning naming both."""
    cfg, saved = _separate_with_state()
    state = saved.state_dict()
    layouts = {"now": tmp_path / "now", "ddp before": tmp_path / "ddp", "zero before": tmp_path / "zero"}
    for directory in layouts.values():
        directory.mkdir()
    save_reducer_state(saved, layouts["now"], rank=1, world_size=2)
    save_file(state, str(layouts["ddp before"] / "compressor.rank00001.safetensors"), metadata={"world_size": "2"})
    save_file({**{f"reducer.{k}": v for k, v in state.items()}, "blocks.0.master": torch.zeros(3)},
              str(layouts["zero before"] / "shards_rank00001.safetensors"))
    (layouts["zero before"] / "manifest.json").write_text(json.dumps({"format": "zeropp-zero3-v1", "world_size": 2}))
    for name, directory in layouts.items():
        _, loaded = _separate_with_state()
        loaded.load_state_dict({})
        load_reducer_state(loaded, directory, rank=1, world_size=2, device=torch.device("cpu"))
        assert loaded.state_dict().keys() == state.keys(), name
        assert all(torch.equal(loaded.state_dict()[k], state[k]) for k in state), name
    _, fresh = _separate_with_state()
    fresh.load_state_dict({})
    with pytest.warns(UserWarning, match="saved on 2 ranks and cannot continue on 4"):
        load_reducer_state(fresh, layouts["now"], rank=1, world_size=4, device=torch.device("cpu"))
    assert fresh.state_dict() == {}
    with pytest.warns(UserWarning, match="no gradient reducer state for rank 0"):
        load_reducer_state(fresh, layouts["now"], rank=0, world_size=2, device=torch.device("cpu"))
