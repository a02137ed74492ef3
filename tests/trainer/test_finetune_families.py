"""finetune.py's LoRA path on the newer families: tiny random Qwen2 (q/k/v biases, tied head), Qwen3 (q/k
norms, explicit head_dim), Mistral (a sliding window shorter than the training sequences) and Llama 3.1
(llama3 RoPE scaling beyond its original context) checkpoints made with transformers, and the families of
issue 37 (Granite, OLMo 2, SmolLM3, windowed Qwen2 / Qwen3, GeGLU LLaMA / Mistral, Gemma 2, Gemma 3). Each
trains, keeps its base weights, and both exports (the merged `hf/` directory and the PEFT adapter) give
transformers (and peft) the trained model's logits."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from export.peft import export_peft_adapter
from models.hf import load_hf_checkpoint
from models.lora import apply_lora
from tests.trainer.test_finetune import (BOS, EOS, PAD, ZERO3_FP32, auto_model, ft_args, ft_config,  # noqa: F401
                                         synthetic, tokenizer_dir)
from trainer.loop import train
from trainer.spawn import run_ranks
from zeropp.checkpoint import consolidated_state_dict, read_safetensors

FAMILIES = ["qwen2", "qwen3", "mistral", "llama3", "granite", "olmo2", "smollm3", "qwen2-window", "qwen3-window",
            "llama-gelu", "mistral-gelu", "gemma2", "gemma3"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
LORA = ("--finetune.lora.r", "4", "--finetune.lora.alpha", "8", "--finetune.lora.targets", ",".join(TARGETS))
STEPS = ("--train.steps", "6", "--train.eval_interval", "6", "--train.eval_batches", "2",
         "--train.eval_at_start", "true", "--train.checkpoint_interval", "6")
# Granite's adapters move its logits by residual_multiplier / logits_scaling = 1/6 of another family's: a larger step.
LR = {"granite": ("--optim.lr", "2e-2")}
WINDOW = 32  # the windows, shorter than the training examples (64 to 75 tokens)


def hf_config(family: str):
    """As tests/models/test_families.py's NEW_FAMILIES (what sets each family apart), at this tokenizer's
    vocabulary and special ids, with room for the training sequences and windows shorter than them."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig,
                              Olmo2Config, Qwen2Config, Qwen3Config, SmolLM3Config)

    small = dict(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS,
                 pad_token_id=PAD)
    three = {**small, "num_hidden_layers": 3}
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **small)
    if family == "qwen3":
        return Qwen3Config(head_dim=32, tie_word_embeddings=True, **small)
    if family == "mistral":
        return MistralConfig(sliding_window=WINDOW, **small)
    if family == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        return LlamaConfig(head_dim=32, rope_parameters=rope, **small)
    if family == "granite":  # every multiplier away from 1, biases on
        return GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                             logits_scaling=3.0, attention_bias=True, mlp_bias=True, **small)
    if family == "olmo2":  # output norms, q/k norms over whole projections
        return Olmo2Config(head_dim=32, attention_bias=True, **small)
    if family == "smollm3":  # every 2nd layer without RoPE, the window on those
        return SmolLM3Config(**{**small, "num_hidden_layers": 4}, no_rope_layer_interval=2, use_sliding_window=True,
                             sliding_window=WINDOW, attention_bias=True)
    if family == "qwen2-window":  # the window from layer max_window_layers on
        return Qwen2Config(**three, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3-window":
        return Qwen3Config(**three, head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "llama-gelu":
        return LlamaConfig(hidden_act="gelu_pytorch_tanh", **small)
    if family == "mistral-gelu":
        return MistralConfig(hidden_act="gelu", sliding_window=None, **small)
    if family == "gemma2":  # offset sandwich norms, both soft-caps, the window on layers 0 and 2
        return Gemma2Config(**three, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, attention_bias=True)
    assert family == "gemma3", family  # per-head offset q/k norms; RoPE per layer type, the full layer's scaled
    return Gemma3TextConfig(**three, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            sliding_window_pattern=3, rope_parameters={
                                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@torch.no_grad()
def make_hf_dir(family: str, tokenizer_dir: Path, directory: Path) -> Path:  # noqa: F811
    """transformers' random init, with every bias and norm gain moved off its 0 / 1 start (a bias or a
    q/k norm that went missing on the way would otherwise change nothing)."""
    torch.manual_seed(0)
    model = auto_model().from_config(hf_config(family), dtype=torch.float32)
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory)
    return directory


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tokens(n: int = 2, length: int = 80):
    """Longer than Mistral's window and Llama 3.1's original context."""
    return torch.randint(0, 600, (n, length), generator=torch.Generator().manual_seed(3))


def ours(hf_dir: Path, weights: dict) -> torch.nn.Module:
    """Our model with the run's (unmerged) adapters; a checkpoint stores a tied head once, as the token embedding."""
    model = load_hf_checkpoint(hf_dir)
    apply_lora(model, TARGETS, r=4, alpha=8.0)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"head.weight"} if model.config.tied_head else set()), missing
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_finetunes_the_family_and_exports_what_transformers_and_peft_load(
        family, tokenizer_dir, synthetic, tmp_path):  # noqa: F811 (fixtures)
    import peft

    hf_dir = make_hf_dir(family, tokenizer_dir, tmp_path / "base")
    result = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "run", *LORA, *STEPS, *LR.get(family, ()))))
    assert result.val_losses[6] < result.val_losses[0] - 0.05, result.val_losses  # it learns

    step = tmp_path / "run" / "checkpoints" / "step_00000006"
    final = read_safetensors(step / "model.safetensors")
    base_model = load_hf_checkpoint(hf_dir)
    base = base_model.state_dict()
    adapters = {name for name in final if ".lora_" in name}
    assert len(adapters) == 2 * len(TARGETS) * base_model.config.n_layer
    for name in final.keys() - adapters:  # the base weights, biases and q/k norms are the checkpoint's
        assert torch.equal(final[name], base[name.replace(".base.", ".")]), name

    x = tokens()
    with torch.no_grad():
        expected = ours(hf_dir, final)(x)
        reference = auto_model().from_pretrained(hf_dir, dtype=torch.float32).eval()
        plain = reference(x).logits
        merged = auto_model().from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
        assert type(merged) is type(reference)
        for key in ("tie_word_embeddings", "sliding_window", "rope_parameters", "num_key_value_heads", "layer_types"):
            assert getattr(merged.config, key, None) == getattr(reference.config, key, None), key
        assert head_dim(merged.config) == head_dim(reference.config)
        diff = (merged(x).logits - expected).abs().max().item()
        assert diff < 1e-5, diff

        adapter = export_peft_adapter(step, tmp_path / "adapter")
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf_dir)
        adapted = peft.PeftModel.from_pretrained(reference, adapter).eval()(x).logits
    peft_diff = (adapted - expected).abs().max().item()
    assert peft_diff < 1e-5, peft_diff
    assert (expected - plain).abs().max() > 1e-2  # the adapters moved the logits
    print(f"{family}: val loss {result.val_losses[0]:.4f} -> {result.val_losses[6]:.4f}, "
          f"merged export max |diff| {diff:.2e}, peft adapter {peft_diff:.2e}")


def _train_on_ranks(rank, world, argv):
    result = train(ft_config(*argv))
    return result.losses, result.val_losses


def test_lora_zero3_on_qwen2_matches_one_process(tokenizer_dir, synthetic, tmp_path):  # noqa: F811
    """Tied head, and LoRA wrapped around q/k/v layers that keep a frozen bias, sharded over 2 ranks."""
    hf_dir = make_hf_dir("qwen2", tokenizer_dir, tmp_path / "base")
    short = ("--train.steps", "4", "--train.eval_interval", "4", "--train.eval_batches", "1")
    reference = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "ref", *LORA, *short,
                                         "--train.micro_batch_size", "8")))
    losses, val_losses = run_ranks(_train_on_ranks, 2, args=(
        ft_args(hf_dir, synthetic, tmp_path / "zero", *LORA, *short, *ZERO3_FP32),))[0]
    worst = max(abs(losses[s] - reference.losses[s]) for s in reference.losses)
    assert worst < 1e-5, worst
    assert abs(val_losses[4] - reference.val_loss) < 1e-5

    shards = consolidated_state_dict(tmp_path / "zero" / "checkpoints" / "step_00000004")
    with torch.no_grad():
        expected = ours(hf_dir, shards)(tokens())
        merged = auto_model().from_pretrained(tmp_path / "zero" / "hf", dtype=torch.float32).eval()(tokens()).logits
    assert (merged - expected).abs().max() < 1e-5
