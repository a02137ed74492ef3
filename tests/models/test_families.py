"""The newer families under the ZeRO-3 runtime: the two with parameters of new kinds (Qwen2's q/k/v
biases without o_proj / MLP biases, Qwen3's per-head q/k norms); the rest are RoPE and mask changes
inside a forward the runtime does not see. Then the families of issue 37 (Granite, OLMo 2, SmolLM3,
Qwen2 / Qwen3 with windowed layers, GeGLU MLPs, Gemma 2 / 3) against transformers' own classes: logits both ways, LoRA,
greedy generation."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig,
                          MistralConfig, Olmo2Config, Qwen2Config, Qwen3Config, SmolLM3Config)

from models.config import ModelConfig, num_params
from models.generate import generate
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.lora import apply_lora, merge_lora
from models.transformer import Transformer, lm_loss
from trainer.config import OptimSection
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp.config import ZeroConfig
from zeropp.engine import Zero3Engine
from zeropp.topology import build_mesh
from tests.models.test_generate import hf_greedy

PRESETS = ("qwen2-tiny", "qwen3-tiny")
OPTIM = OptimSection(lr=1e-3, weight_decay=0.1, warmup_steps=0, decay="constant", eps=1e-6)
STEPS, BATCH, SEQ, VOCAB = 3, 4, 12, 96  # VOCAB also sizes the new families' checkpoints


def _model(preset: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB))


def _batches():
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _train(model, step_fn):
    losses = []
    for sample in _batches():
        losses.append(step_fn(sample))
    return losses


def _reference(preset: str):
    model = _model(preset)
    opt = build_optimizer(model, OPTIM)

    def step(sample):
        loss = lm_loss(model(sample[:, :-1]), sample[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return _train(model, step), model.state_dict()


def _zero3(rank, world):
    out = {}
    for preset in PRESETS:
        engine = Zero3Engine(_model(preset), ZeroConfig(stage=3, communication_data_type="fp32"),
                             mesh=build_mesh(ranks_per_node=world))
        opt = build_optimizer(engine.module, OPTIM)

        def step(sample):
            mine = sample[rank * BATCH // world:(rank + 1) * BATCH // world]
            loss = lm_loss(engine(mine[:, :-1]), mine[:, 1:])
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            return total.item() / world

        losses = _train(engine, step)
        out[preset] = (losses, engine.full_state_dict())
        engine.close()
    return out if rank == 0 else None


def test_zero3_trains_the_new_families_like_one_process():
    results = run_ranks(_zero3, 2)[0]
    for preset in PRESETS:
        ref_losses, ref_state = _reference(preset)
        losses, state = results[preset]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, preset
        assert state.keys() == ref_state.keys()
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        assert worst < 1e-5, (preset, worst)


# --- the families of issue 37: parity with transformers' own classes, both ways, LoRA, generation ------------

TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # saved too: SmolLM3's default pad is 128004
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, **TOKEN_IDS)
WINDOW = 5  # shorter than the test sequences
NEW_FAMILIES = {
    # every multiplier away from 1 (attention_multiplier from 1 / sqrt(head_dim)), biases on
    "granite": lambda: GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                     logits_scaling=3.0, attention_bias=True, mlp_bias=True, **SMALL),
    # norms after attention and MLP only, q/k norms over all heads (of width 4 x 32 and 2 x 32 here)
    "olmo2": lambda: Olmo2Config(head_dim=32, attention_bias=True, **SMALL),
    # 4 layers, every 2nd without RoPE; the window on those (use_sliding_window) and shorter than the sequences
    "smollm3": lambda: SmolLM3Config(**{**SMALL, "num_hidden_layers": 4}, no_rope_layer_interval=2,
                                     use_sliding_window=True, sliding_window=WINDOW, attention_bias=True),
    # the window on the layers from max_window_layers on (transformers 5's reading of use_sliding_window)
    "qwen2-window": lambda: Qwen2Config(**{**SMALL, "num_hidden_layers": 3}, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1),
    "qwen3-window": lambda: Qwen3Config(**{**SMALL, "num_hidden_layers": 3}, head_dim=32, use_sliding_window=True,
                                        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                                                            "sliding_attention"]),
    # GeGLU MLPs: GELU's tanh form (as Gemma's) and the exact one
    "llama-gelu": lambda: LlamaConfig(hidden_act="gelu_pytorch_tanh", **SMALL),
    "mistral-gelu": lambda: MistralConfig(hidden_act="gelu", sliding_window=None, **SMALL),
    # offset norms before and after each sublayer, caps low enough to bite, the window on layers 0 and 2
    "gemma2": lambda: Gemma2Config(**{**SMALL, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
                                   sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                   attention_bias=True),
    # q/k norms per head (1 + weight), windowed layers 0 and 1 with their own unscaled RoPE, layer 2 scaled
    "gemma3": lambda: Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
                                       sliding_window=WINDOW, sliding_window_pattern=3, rope_parameters={
                                           "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
MAX_DIFF = 1e-5  # fp32, both ways


def make_new_family(kind: str, seed: int = 0):
    """transformers' model of `kind`, its matrices drawn at std 0.2 and its vectors (norm gains, biases) moved
    by N(0, 0.1), so that a misplaced norm or a missing bias shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(NEW_FAMILIES[kind](), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return model


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _padded_batch():
    tokens = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, :5], mask[2, :17] = 0, 0
    return tokens.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_new_family_logits_match_transformers(kind, tmp_path):
    hf = make_new_family(kind)
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path).eval()
    assert model.config.arch == hf.config.model_type
    assert num_params(model.config) == sum(p.numel() for p in hf.parameters())
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_diff(model(tokens), hf(tokens).logits) <= MAX_DIFF
        tokens, mask = _padded_batch()
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        ours = model(tokens, attention_mask=mask)
        ref = hf(tokens, attention_mask=mask, position_ids=position_ids).logits
    assert _max_diff(ours[mask.bool()], ref[mask.bool()]) <= MAX_DIFF


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_new_family_saves_what_transformers_loads(kind, tmp_path):
    make_new_family(kind, seed=1).save_pretrained(tmp_path / "src")
    model = load_hf_checkpoint(tmp_path / "src").eval()
    save_hf_checkpoint(model, tmp_path / "out", token_ids=TOKEN_IDS)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == type(make_new_family(kind)).__name__
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, model(tokens)) <= MAX_DIFF
        assert torch.equal(load_hf_checkpoint(tmp_path / "out").eval()(tokens), model(tokens))
    assert load_hf_checkpoint(tmp_path / "out").config == model.config


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_new_family_lora_trains_and_merges_into_what_transformers_loads(kind, tmp_path):
    make_new_family(kind).save_pretrained(tmp_path / "src")
    model = load_hf_checkpoint(tmp_path / "src")
    torch.manual_seed(0)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], r=4, alpha=8.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1)
    sample = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        loss = lm_loss(model(sample[:, :-1]), sample[:, 1:])
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable if p.shape[0] != 4)  # B's
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        adapted = model(sample)
        merged = merge_lora(model)(sample)
    assert _max_diff(merged, adapted) <= 1e-4  # W + B A * alpha / r rounded to fp32: not the same sums
    save_hf_checkpoint(model, tmp_path / "out", token_ids=TOKEN_IDS)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert _max_diff(hf(sample).logits, merged) <= MAX_DIFF


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_new_family_greedy_generation_matches_transformers(kind, tmp_path):
    hf = make_new_family(kind)
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    assert generate(model, prompts, 12) == hf_greedy(hf, prompts, 12)
