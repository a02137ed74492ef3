"""compressed-tensors export, read back by transformers with the `compressed-tensors` package itself."""

import json

import pytest
import torch
from safetensors.torch import load_file

from export.compressed import export_compressed_tensors
from export.quantized import dequantized_state_dict
from kernels import on_grid, quantize_weights, unpack_codes
from models.hf import load_hf_checkpoint
from models.transformer import Transformer
from tests.models.conftest import make_hf_model
from tests.models.test_families import NEW_FAMILIES, TOKEN_IDS, make_new_family

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (PyPI) is needed to read the export back")


def ours(kind: str, tmp_path) -> Transformer:
    (make_new_family(kind) if kind in NEW_FAMILIES else make_hf_model(kind)).save_pretrained(tmp_path / "hf")
    return load_hf_checkpoint(tmp_path / "hf").eval()


def word_tokenizer(directory) -> str:
    """A word-level tokenizer.json whose special ids are TOKEN_IDS: SmolLM3's export needs one (see test_refusals)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": TOKEN_IDS["pad_token_id"], "<s>": TOKEN_IDS["bos_token_id"], "</s>": TOKEN_IDS["eos_token_id"]}
    words.update({w: i for i, w in enumerate("the cat sat on a mat".split(), start=len(words))})
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def on_grid_model(model: Transformer, bits: int, block: int, vectors: bool) -> Transformer:
    quantized = Transformer(model.config).eval()
    quantized.load_state_dict(dequantized_state_dict(model, model.config, bits, block, vectors), strict=False)
    return quantized


# llama-gqa: rows of 64 (q/k/v/o, gate/up) and 96 (down_proj): block 64 gives groups of 64 and of gcd(96, 64) = 32;
# block 256 spans 4 or 8/3 rows (groups of 64 and 32). opt: tied head, biases; opt-proj: project_in / project_out
# (Linear layers kept dense, in `ignore`). qwen2: q/k/v biases, tied head. qwen3: q/k norms, explicit head_dim;
# mistral: sliding window; llama3: Llama 3.1 RoPE scaling. The families of issue 37 (tests/models/test_families.py:
# every vector moved off its 0 / 1 start, windows of 5 < the 12 tokens): granite's four multipliers in config.json,
# olmo2's output norms and q/k norms over whole projections, smollm3's layers without RoPE (and its tokenizer),
# windowed qwen2 / qwen3 layers, GeGLU llama / mistral (block 256 spanning rows), gemma2's offset sandwich norms and
# soft-capping, gemma3's per-head offset q/k norms and per-layer RoPE; vectors on the grid include Gemma's norm
# weights, which both models use as 1 + weight.
@pytest.mark.parametrize("kind,bits,block,vectors", [("llama-gqa", 4, 64, False), ("llama-gqa", 8, 256, True),
                                                     ("opt", 4, 32, True), ("opt-proj", 8, 64, False),
                                                     ("qwen2", 3, 64, True), ("qwen3", 4, 32, False),
                                                     ("mistral", 4, 32, True), ("llama3", 8, 64, False),
                                                     ("granite", 4, 32, False), ("olmo2", 8, 64, True),
                                                     ("smollm3", 4, 64, False), ("qwen2-window", 3, 32, True),
                                                     ("qwen3-window", 4, 32, False), ("llama-gelu", 8, 256, True),
                                                     ("mistral-gelu", 2, 32, False), ("gemma2", 4, 32, True),
                                                     ("gemma3", 4, 64, True)])
def test_transformers_loads_it_with_our_quantized_logits(kind, bits, block, vectors, tmp_path):
    from transformers import AutoModelForCausalLM

    model = ours(kind, tmp_path)
    tokenizer = word_tokenizer(tmp_path / "tok") if kind == "smollm3" else None
    out = export_compressed_tensors(model, model.config, tmp_path / "ct", bits, block, tokenizer,
                                    vectors_on_grid=vectors)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded).__name__ == json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = on_grid_model(model, bits, block, vectors)(tokens)
        torch.testing.assert_close(loaded(tokens).logits, expected, atol=1e-5, rtol=0)
        assert (model(tokens) - expected).abs().max() > 1e-3  # the quantization is there to see
    if tokenizer is not None:
        assert TOKEN_IDS.items() <= loaded.config.to_dict().items()

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized") and "lm_head" in qc["ignore"]
    assert {g["weights"]["num_bits"] for g in qc["config_groups"].values()} == {bits}


def test_packing_and_scales_are_compressed_tensors_own(tmp_path):
    """Byte layout against compressed-tensors' pack_to_int32 and its decompressor, one layer whose rows (96) hold
    one and a half of our blocks (64): groups of 32, each with its block's scale."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized import pack_to_int32
    from compressed_tensors.quantization import QuantizationScheme

    model = ours("llama-gqa", tmp_path)
    bits, block = 4, 64
    out = export_compressed_tensors(model, model.config, tmp_path / "ct", bits, block)
    saved = load_file(out / "model.safetensors")
    w = model.blocks[1].mlp.down_proj.weight.detach()
    key = "model.layers.1.mlp.down_proj"
    q = quantize_weights(w.reshape(-1), bits, block)
    signed = (unpack_codes(q.codes, bits)[:w.numel()].to(torch.int16) - 2 ** (bits - 1)).to(torch.int8).view(w.shape)
    assert torch.equal(saved[f"{key}.weight_packed"], pack_to_int32(signed, bits))
    assert saved[f"{key}.weight_scale"].shape == (64, 3) and torch.equal(saved[f"{key}.weight_shape"],
                                                                          torch.tensor([64, 96]))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (scheme,) = [g for g in qc["config_groups"].values() if key in g["targets"]]
    assert scheme["weights"]["group_size"] == 32
    dense = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        {name: saved[f"{key}.{name}"] for name in ("weight_packed", "weight_scale", "weight_shape")},
        QuantizationScheme.model_validate(scheme))
    assert torch.equal(dense["weight"], on_grid(w, bits, block))
    assert torch.equal(saved["model.embed_tokens.weight"], on_grid(model.embed.tokens.weight.detach(), bits, block))


def test_refusals(tmp_path):
    gpt2 = ours("gpt2", tmp_path)
    with pytest.raises(ValueError, match="GPT-2's layers as Conv1D"):
        export_compressed_tensors(gpt2, gpt2.config, tmp_path / "gpt2", 4, 64)
    llama = ours("llama-gqa", tmp_path)
    with pytest.raises(ValueError, match="bits=5"):
        export_compressed_tensors(llama, llama.config, tmp_path / "x", 5, 64)
    smollm3 = ours("smollm3", tmp_path)
    with pytest.raises(ValueError, match="SmolLM3 with vocab_size=96 needs its tokenizer"):
        export_compressed_tensors(smollm3, smollm3.config, tmp_path / "smollm3", 4, 64)
    assert not any((tmp_path / name).exists() for name in ("gpt2", "x", "smollm3"))
