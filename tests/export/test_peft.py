"""PEFT adapters both ways, checked against the `peft` package itself on transformers' own models."""

import json

import pytest
import torch
from safetensors.torch import load_file

from export.peft import save_peft_adapter
from models.hf import load_hf_checkpoint
from models.lora import LoRALinear, apply_lora
from models.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft_adapter
from tests.models.conftest import VOCAB, make_hf_model
from tests.trainer.test_finetune import ft_args, ft_config, hf_config, synthetic, tokenizer_dir  # noqa: F401 (fixtures)

peft = pytest.importorskip("peft", reason="peft (PyPI) is needed to check the adapters against it")

TOL = dict(atol=1e-5, rtol=0)
# Our targets per family; a layer-specific one (blocks.1...) checks that PEFT adapts exactly our layers.
OUR_TARGETS = {"gpt2": ["o_proj", "up_proj", "blocks.1.mlp.down_proj"],  # GPT-2's q/k/v are fused in HF
               "opt": ["q_proj", "v_proj", "o_proj", "blocks.1.mlp.down_proj"],
               "llama-gqa": ["q_proj", "k_proj", "gate_proj", "blocks.1.mlp.down_proj"],
               "qwen2": ["q_proj", "v_proj", "up_proj", "blocks.0.attn.o_proj"]}
PEFT_TARGETS = {"gpt2": ["c_proj", "c_fc"],  # c_proj: attn.c_proj and mlp.c_proj
                "opt": ["q_proj", "v_proj", "out_proj", "fc2"],
                "llama-gqa": ["q_proj", "k_proj", "gate_proj", "down_proj"], "qwen2": ["v_proj", "o_proj", "up_proj"]}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            make_hf_model(kind).save_pretrained(path)
            cache[kind] = path
        return cache[kind]

    return get


def tokens():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def peft_logits(hf_dir, adapter_dir):
    from transformers import AutoModelForCausalLM

    """(logits of the adapted model, of the base model alone, the names of the layers PEFT adapted)."""
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(tokens()).logits
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()  # wraps `base` in place
    adapted = sorted(name.removesuffix(".lora_A") for name, _ in model.named_modules() if name.endswith(".lora_A"))
    with torch.no_grad():
        return model(tokens()).logits, plain, adapted


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama-gqa", "qwen2"])
def test_peft_loads_our_adapter_with_our_logits(kind, hf_dirs, tmp_path):
    model = load_hf_checkpoint(hf_dirs(kind)).eval()
    torch.manual_seed(0)
    wrapped = apply_lora(model, OUR_TARGETS[kind], r=4, alpha=6.0, dropout=0.1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0.0, 0.1)
        ours = model(tokens())
    out = save_peft_adapter(model, tmp_path / "adapter", str(hf_dirs(kind)))
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    logits, plain, adapted = peft_logits(hf_dirs(kind), out)
    torch.testing.assert_close(logits, ours, **TOL)
    assert (plain - ours).abs().max() > 1e-2  # the adapters matter
    assert len(adapted) == len(wrapped)  # PEFT adapts our layers, no others
    saved = load_file(out / ADAPTER_WEIGHTS)
    assert len(saved) == 2 * len(wrapped)
    if kind == "llama-gqa":  # PEFT's key names, as the brief of the format has them
        a = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
        torch.testing.assert_close(a, model.get_submodule("blocks.0.attn.q_proj").lora_A, atol=0, rtol=0)
        assert saved["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 6.0, 0.1)


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama-gqa", "qwen2"])
def test_a_peft_adapter_initialises_our_lora_with_peft_logits(kind, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    targets = PEFT_TARGETS[kind]
    base = AutoModelForCausalLM.from_pretrained(hf_dirs(kind), dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets,
                                                           fan_in_fan_out=kind == "gpt2"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected, plain, adapted = peft_logits(hf_dirs(kind), tmp_path / "adapter")
    assert (plain - expected).abs().max() > 1e-2

    model = load_hf_checkpoint(hf_dirs(kind)).eval()
    names = load_peft_adapter(model, tmp_path / "adapter")
    assert len(names) == len(adapted)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, **TOL)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{m}" for n in names for m in "AB"}  # ready to continue training

    # A fine-tune's model already has adapters (finetune.lora): the same layers and rank are filled in ...
    again = load_hf_checkpoint(hf_dirs(kind)).eval()
    apply_lora(again, names, r=3, alpha=5.0)
    load_peft_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(again(tokens()), expected, **TOL)
    # ... other ones are refused, naming what differs.
    other = load_hf_checkpoint(hf_dirs(kind))
    apply_lora(other, names, r=2, alpha=5.0)
    with pytest.raises(ValueError, match=r"r=3, lora_alpha=5.0.*r=2"):
        load_peft_adapter(other, tmp_path / "adapter")
    fewer = load_hf_checkpoint(hf_dirs(kind))
    apply_lora(fewer, names[:1], r=3, alpha=5.0)
    with pytest.raises(ValueError, match="finetune.lora.targets"):
        load_peft_adapter(fewer, tmp_path / "adapter")


def test_what_peft_and_our_lora_cannot_share_is_refused(hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    gpt2 = load_hf_checkpoint(hf_dirs("gpt2"))
    apply_lora(gpt2, ["q_proj", "o_proj"], r=2, alpha=4.0)
    with pytest.raises(ValueError, match=r"blocks.0.attn.q_proj.*fuses q, k and v.*c_attn"):
        save_peft_adapter(gpt2, tmp_path / "gpt2", "gpt2")
    assert not (tmp_path / "gpt2").exists()

    base = AutoModelForCausalLM.from_pretrained(hf_dirs("gpt2"), dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)).save_pretrained(
        tmp_path / "c_attn")
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn.*fused q/k/v"):
        load_peft_adapter(load_hf_checkpoint(hf_dirs("gpt2")), tmp_path / "c_attn")

    base = AutoModelForCausalLM.from_pretrained(hf_dirs("llama-gqa"), dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).save_pretrained(
        tmp_path / "dora")
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_peft_adapter(load_hf_checkpoint(hf_dirs("llama-gqa")), tmp_path / "dora")
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found"):
        load_peft_adapter(load_hf_checkpoint(hf_dirs("llama-gqa")), tmp_path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(load_hf_checkpoint(hf_dirs("llama-gqa")), tmp_path / "none", "x")


def test_consolidate_writes_a_lora_runs_adapters_that_peft_loads(tokenizer_dir, synthetic, tmp_path):  # noqa: F811
    """scripts/consolidate.py --peft-adapter on a real LoRA fine-tune (2 steps of finetune.py's trainer)."""
    from transformers import AutoModelForCausalLM

    from scripts.consolidate import main
    from trainer.loop import train

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("llama")).save_pretrained(hf_dir)
    for file in tokenizer_dir.iterdir():
        (hf_dir / file.name).write_bytes(file.read_bytes())
    train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "run", "--finetune.lora.r", "4",
                             "--finetune.lora.alpha", "8",
                             "--finetune.lora.targets", "q_proj,v_proj", "--train.steps", "2",
                             "--train.eval_interval", "2", "--train.eval_batches", "1", "--train.export_hf", "true")))
    main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "adapter"), "--peft-adapter"])
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["base_model_name_or_path"], config["r"], config["target_modules"]) == (
        str(hf_dir), 4, ["self_attn.q_proj", "self_attn.v_proj"])

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.randint(0, 600, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base(x).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(x).logits
    torch.testing.assert_close(adapted, merged(x).logits, **TOL)  # the run's own merged export is the reference
    assert (adapted - plain).abs().max() > 1e-2  # two steps moved the adapters
