"""Sharded initialization and streamed loading: a model built on the meta device gets, shard by
shard, exactly the weights a materialized model has, on any world size and layout, and a rank
reads only its slices of a Hugging Face checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from models.config import ModelConfig
from models.hf import hf_model_on_meta, load_hf_checkpoint
from models.lora import apply_lora
from models.transformer import Transformer
from models.weights import InitWeights, materialize
from trainer.spawn import run_ranks
from zeropp.config import ZeroConfig
from zeropp.engine import Zero3Engine
from zeropp.topology import build_mesh

LAYOUTS = {  # name -> (ZeroConfig keys, mesh keys): alignments and groups that change the flat layout
    "zero3": (dict(), dict()),
    "qwZ int4 + hpZ": (dict(zero_quantized_weights=True, zero_quantized_weights_bits=4,
                            zero_quantization_block_size=64, zero_hpz_partition_size=2), dict(secondary_size=2)),
}


def fresh(preset: str, lora: bool) -> Transformer:
    """The trainer's way: seed, model on the meta device, LoRA adapters made in memory."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_preset(preset, vocab_size=96))
    if lora:
        apply_lora(model, ["q_proj", "down_proj"], r=4)
        materialize(model, InitWeights(model), only=lambda name: ".lora_" in name)
    return model


def _init_states(rank, world, cases):
    out = {}
    for preset, lora, layout in cases:
        zero, mesh = LAYOUTS[layout]
        if world % mesh.get("secondary_size", 1):
            continue  # hpZ needs whole secondary groups
        model = fresh(preset, lora)
        engine = Zero3Engine(model, ZeroConfig(stage=3, **zero), mesh=build_mesh(**mesh), weights=InitWeights(model))
        assert not any(p.is_meta for p in engine.module.parameters())
        out[(preset, lora, layout)] = engine.full_state_dict()
        engine.close()
    return out if rank == 0 else None


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_init_is_bit_identical_on_every_world_size_and_layout(world):
    """Each rank reads only its shards of a meta-device model; gathered, the weights equal a model
    initialized whole (eagerly, the usual nn.Module way) bit for bit."""
    cases = [(preset, lora, layout) for preset, lora in (("gpt2-tiny", False), ("llama-tiny", True)) for layout in LAYOUTS]
    states = run_ranks(_init_states, world, args=(cases,))[0]
    for (preset, lora, layout), state in states.items():
        torch.manual_seed(0)
        eager = Transformer(ModelConfig.from_preset(preset, vocab_size=96))
        if lora:
            apply_lora(eager, ["q_proj", "down_proj"], r=4)
        want = {**{n: p for n, p in eager.named_parameters()}, **eager.state_dict()}
        if lora:  # apply_lora draws the adapters from the global RNG: compare them with the trainer's way
            want.update({n: p for n, p in fresh(preset, lora).named_parameters() if ".lora_" in n})
        assert set(state) == set(want), (preset, layout)
        for name, tensor in state.items():
            assert torch.equal(tensor, want[name].view(tensor.shape)), (preset, lora, layout, name)


def _hf_load(rank, world, path, tokens):
    model, weights = hf_model_on_meta(path)
    engine = Zero3Engine(model, ZeroConfig(stage=3, communication_data_type="fp32"), weights=weights)
    shard_bytes = sum(u.shard_numel for u in engine.units.values()) * 2  # bf16 checkpoint
    with torch.no_grad():
        logits = engine(tokens)
    engine.close()
    return logits, weights.bytes_read, shard_bytes


def test_streamed_hf_load_equals_transformers_and_reads_only_the_ranks_slices(tmp_path):
    """ZeRO-3 on 2 ranks from a sharded bf16 checkpoint (index + 3 files): the logits equal
    transformers' own model; each rank reads about its half of the tensors (whole rows), not all."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    total = sum(p.numel() * 2 for p in hf.parameters())
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = hf.float()(tokens).logits
    for logits, read, shard_bytes in run_ranks(_hf_load, 2, args=(tmp_path, tokens)):
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        assert read <= shard_bytes + 24 * 64 * 4 * 2, (read, shard_bytes)  # + a partial row of each tensor
        assert read < 0.6 * total
    one = load_hf_checkpoint(tmp_path).eval()  # materialized tensor by tensor, one process
    with torch.no_grad():
        torch.testing.assert_close(one(tokens), want, atol=1e-5, rtol=0)
