"""LoRA from outside: the adapter's arithmetic, what is frozen, merging, and the merged HF export."""

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM

from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.lora import LoRALinear, apply_lora, merge_lora
from tests.models.conftest import VOCAB

TOL = dict(atol=1e-5, rtol=0)


def test_lora_linear_is_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    lora = LoRALinear(base, r=4, alpha=8.0)
    x = torch.randn(3, 5, 16)
    assert torch.equal(lora(x), base(x))  # B starts at zero: exactly the base layer
    with torch.no_grad():
        lora.lora_B.normal_()
    A, B, W, b = lora.lora_A, lora.lora_B, base.weight, base.bias
    expected = x @ W.T + b + (x @ A.T @ B.T) * (8.0 / 4)
    torch.testing.assert_close(lora(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama-gqa", "qwen2", "qwen3"])
def test_apply_freezes_base_and_merge_gives_the_same_logits_and_a_plain_hf_checkpoint(kind, hf_checkpoint,
                                                                                      tmp_path):
    hf, path = hf_checkpoint(kind)
    model = load_hf_checkpoint(path).eval()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    wrapped = apply_lora(model, ["q_proj", "v_proj", "mlp.down_proj"], r=4, alpha=8.0, dropout=0.1)
    assert wrapped == [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.q_proj", "attn.v_proj", "mlp.down_proj")]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{w}.lora_{m}" for w in wrapped for m in "AB"}

    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, **TOL)  # B = 0: still the HF model
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.05)
        unmerged = model(tokens)  # eval mode: no dropout
        # Merged against unmerged in fp64 (the merged weights still rounded to fp32 as merge_lora makes
        # them): what merging changes, without fp32's reassociation noise of two forwards.
        unmerged64 = model.double()(tokens)
        model.float()
    assert (unmerged - hf(tokens).logits).abs().max() > 1e-2  # the adapters do change the model

    deltas = {f"{w}.weight": (m.lora_B @ m.lora_A).detach() * 2.0 for w, m in
              ((w, model.get_submodule(w)) for w in wrapped)}
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(type(model.get_submodule(w)) is nn.Linear for w in wrapped)
    merged_state = model.state_dict()
    assert merged_state.keys() == base_state.keys()
    for name, before in base_state.items():  # W + B @ A * alpha / r where adapted, untouched elsewhere
        torch.testing.assert_close(merged_state[name], before + deltas.get(name, 0), atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.double()(tokens), unmerged64, **TOL)
        merged = model.float()(tokens)

    save_hf_checkpoint(model, tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():  # transformers computes the merged model we computed
        torch.testing.assert_close(reloaded(tokens).logits, merged, **TOL)


def test_only_adapters_get_gradients(hf_checkpoint):
    _, path = hf_checkpoint("llama-gqa")
    model = load_hf_checkpoint(path)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], r=2)
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens).logsumexp(-1).mean().backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {name for name, p in model.named_parameters() if "lora_" in name}
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in with_grad if n.endswith("lora_B"))


def test_bad_targets_and_settings_are_named(hf_checkpoint):
    _, path = hf_checkpoint("llama-gqa")
    model = load_hf_checkpoint(path)
    with pytest.raises(ValueError, match=r"\['qproj', 'head'\] match no nn.Linear.*'attn.q_proj'.*'mlp.gate_proj'"):
        apply_lora(model, ["q_proj", "qproj", "head"])
    assert not any(p.requires_grad is False for p in model.parameters())  # nothing was changed
    with pytest.raises(ValueError, match="r=0"):
        apply_lora(model, ["q_proj"], r=0)
    with pytest.raises(ValueError, match="no LoRA targets"):
        apply_lora(model, [])
    apply_lora(model, ["q_proj"])
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, ["v_proj"])
