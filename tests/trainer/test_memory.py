"""The activation count of the memory prediction (trainer.memory) against what autograd really keeps."""

import pytest
import torch

from models.config import ModelConfig
from models.transformer import Block, rope_cos_sin
from trainer.memory import _saved_bytes, activation_bytes


@pytest.mark.parametrize("preset, masked", [("llama-tiny", False), ("gpt2-tiny", False), ("qwen3-tiny", False),
                                            ("llama-tiny", True)])
@pytest.mark.parametrize("compute, params", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_a_blocks_counted_activations_equal_what_a_real_cpu_block_saves(preset, masked, compute, params):
    """Counted on the meta device, within 1% of the tensors a real block's forward saves on CPU, as
    the trainer runs it: fp32; bf16 autocast over fp32 weights (whose bf16 casts are kept); bf16
    weights; causal, or with an explicit mask (packed sequences). SDPA runs a fused kernel there,
    which keeps no T x T probabilities (but the additive form of a boolean mask)."""
    config = ModelConfig.from_preset(preset, vocab_size=256)
    batch, seq = 2, 512
    torch.manual_seed(0)
    block = Block(config, 0).to(params)
    x = torch.randn(batch, seq, config.d_model, dtype=params, requires_grad=True)
    rope = None
    if config.positions == "rope":
        rope = rope_cos_sin(torch.arange(seq).expand(batch, seq), config.head_dim, config.rope_theta,
                            config.rope_scaling, config.max_seq_len)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq) if masked else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute != params):
        real = _saved_bytes(block, lambda: block(x, rope, mask))
    counted = activation_bytes(config, batch, seq, compute, param_dtype=params, masked=masked)["blocks"]
    counted /= config.n_layer
    assert abs(counted / real - 1) < 0.01, (counted, real)


def test_checkpointing_keeps_block_inputs_and_one_recompute():
    config = ModelConfig.from_preset("llama-tiny", vocab_size=256)
    none = activation_bytes(config, 2, 128)
    full = activation_bytes(config, 2, 128, checkpointed=set(range(config.n_layer)))
    per_block = none["blocks"] // config.n_layer
    assert full["blocks"] == config.n_layer * 2 * 128 * config.d_model * 4
    assert full["recompute"] == per_block and none["recompute"] == 0
    assert full["head and loss"] == none["head and loss"]
