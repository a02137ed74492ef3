"""Quantized export (export/quantized.py) against independent references.

The reference grid is kernels.quantize/dequantize applied to each weight directly; GGUF files
are read back with gguf-py's reader and dequantizer and loaded by transformers; the qwZ claim
is checked against the weights a real ZeRO++ engine's forward computed with.
"""

import json
import operator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kernels
from data.corpus import default_corpus
from data.tokenizer import load_tokenizer, train_sentencepiece
from export import dequantized_state_dict, export_gguf, export_lowbit, gguf_qtype, load_lowbit, load_source, quantized
from models.config import ModelConfig
from models.hf import load_hf_checkpoint
from models.transformer import Transformer, lm_loss
from trainer.spawn import run_ranks

TOKENS, VOCAB = 400, 416  # the model's vocabulary is padded past the tokenizer's, as train.py pads it
GGUF_BITS = {"Q8_0": 8, "Q4_0": 4}
N_HEAD, N_KV_HEAD = 4, 2


def train_tokenizer(directory: Path) -> Path:
    """A 400-piece SentencePiece BPE (byte fallback) on 600 lines of the stdlib-docstring corpus."""
    lines = default_corpus(directory).read_text(encoding="utf-8").splitlines()[:600]
    (directory / "text.txt").write_text("\n".join(lines), encoding="utf-8")
    train_sentencepiece([directory / "text.txt"], directory / "sp" / "tokenizer", TOKENS)
    return directory / "sp"


def save_tiny_llama(directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random transformers LLaMA (GQA) saved with save_pretrained, with the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=N_HEAD, num_key_value_heads=N_KV_HEAD, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than HF's 0.02 init, so that 2- and 4-bit grids change the logits visibly
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    hf.save_pretrained(directory)
    load_tokenizer(tokenizer_dir).save(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, tokenizer_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), tokenizer_dir)


@pytest.fixture
def model(hf_dir):
    return load_hf_checkpoint(hf_dir)


def grid(w: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The reference: dequant(quant(w)) with qwZ's call (flat, fp16 scales)."""
    w = w.detach()
    q = kernels.quantize_weights(w.reshape(-1), bits, block)
    return kernels.dequantize(q.codes, q.scales, w.numel(), bits, block).view_as(w)


def our_name(gguf_name: str) -> str:
    """GGUF tensor name -> ours, written out here independently of gguf-py's tables."""
    top = {"token_embd": "embed.tokens", "output_norm": "norm", "output": "head"}
    block = {"attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj",
             "attn_output": "attn.o_proj", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_q_norm": "attn.q_norm",
             "attn_k_norm": "attn.k_norm"}
    module, leaf = gguf_name.rsplit(".", 1)
    if module.startswith("blk."):
        _, i, part = module.split(".")
        return f"blocks.{i}.{block[part]}.{leaf}"
    return f"{top[module]}.{leaf}"


def read_gguf(path: Path, permuted: bool = True) -> dict[str, tuple[torch.Tensor, gguf.GGMLQuantizationType]]:
    """Every tensor of a GGUF file, dequantized by gguf-py, q/k un-permuted by transformers' loader
    (llama.cpp's llama architecture only: qwen2 / qwen3 keep HF's layout)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = LlamaTensorProcessor(config={"num_attention_heads": N_HEAD, "num_key_value_heads": N_KV_HEAD})
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        values = gguf_dequantize(t.data, t.tensor_type)
        if permuted:
            values = heads.process(weights=values, name=t.name).weights
        out[our_name(t.name)] = (torch.from_numpy(np.array(values)), t.tensor_type)
    return out


def decode_by_hand(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The on-disk layout read per docs/kernels.md, one group of 8 codes at a time: code i is bits
    [i*bits, (i+1)*bits) of the group's `bits` bytes as a little-endian integer; x = (code - 2^(bits-1)) * s."""
    raw = codes.tolist()
    values = []
    for g in range(len(raw) // bits):
        word = int.from_bytes(bytes(raw[g * bits:(g + 1) * bits]), "little")
        for i in range(8):
            code = (word >> (i * bits)) & ((1 << bits) - 1)
            values.append((code - 2 ** (bits - 1)) * scales[len(values) // block].item())
    return torch.tensor(values, dtype=torch.float32)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


# ------------------------------------------------------------------------------ low-bit safetensors


@pytest.mark.parametrize("bits", [8, 6, 4, 3, 2])
def test_lowbit_round_trip_is_exactly_the_grid(bits, model, tokenizer_dir, tmp_path):
    block = 96  # not a power of two: blocks straddle rows, and each weight ends in a partial block
    out = export_lowbit(model, model.config, tmp_path / "out", bits, block, tokenizer_dir)
    loaded, meta = load_lowbit(out)
    assert loaded.config == model.config and (meta["bits"], meta["block_size"]) == (bits, block)
    for name, w in model.named_parameters():
        got = dict(loaded.named_parameters())[name]
        assert torch.equal(got, grid(w, bits, block) if w.dim() == 2 else w), name
    # What is on disk: packed codes (bits / 8 bytes per element, whole blocks) and fp16 scales.
    with safe_open(out / "model.safetensors", framework="pt") as f:
        codes = f.get_tensor("blocks.0.mlp.up_proj.weight.codes")
        scales = f.get_tensor("blocks.0.mlp.up_proj.weight.scales")
        assert f.get_tensor("norm.weight").dtype == torch.float32
    numel = 128 * 64
    assert codes.dtype == torch.uint8 and codes.numel() == -(-numel // block) * block * bits // 8
    assert scales.dtype == torch.float16 and scales.numel() == -(-numel // block)
    assert torch.equal(decode_by_hand(codes, scales, bits, block)[:numel].view(128, 64),
                       grid(model.blocks[0].mlp.up_proj.weight, bits, block))
    assert sorted(meta["quantized"]) == sorted(n for n, p in model.named_parameters() if p.dim() == 2)
    tok = load_tokenizer(out)
    assert tok.encode("Return the value.") == load_tokenizer(tokenizer_dir).encode("Return the value.")


def test_lowbit_vectors_on_grid_and_default_block(model, tokenizer_dir, tmp_path):
    with torch.no_grad():  # a trained norm's gains (all ones, the init, lie on the 4-bit grid exactly)
        model.blocks[0].attn_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    out = export_lowbit(model, model.config, tmp_path / "out", 4, tokenizer_dir=tokenizer_dir, vectors_on_grid=True)
    loaded, meta = load_lowbit(out)
    assert meta["block_size"] == 256 and meta["vectors_on_grid"]
    for name, w in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], grid(w, 4, 256)), name
    norm = model.blocks[0].attn_norm.weight
    assert not torch.equal(grid(norm, 4, 256), norm)  # the option does something here


def test_lowbit_accepts_a_state_dict_and_a_tied_head(tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("gpt2-tiny", vocab_size=VOCAB)  # GPT-2: tied head, biases, positions
    model = Transformer(config)
    out = export_lowbit(model.state_dict(), config, tmp_path / "out", 8, 64, tokenizer_dir)
    loaded, _ = load_lowbit(out)
    assert loaded.head.weight is loaded.embed.tokens.weight
    for name, w in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], grid(w, 8, 64) if w.dim() == 2 else w), name


def test_load_lowbit_names_the_broken_tensor(model, tokenizer_dir, tmp_path):
    out = export_lowbit(model, model.config, tmp_path / "out", 4, 64, tokenizer_dir)
    original = load_file(out / "model.safetensors")
    key = "blocks.1.attn.k_proj.weight.scales"
    save_file(dict(original, **{key: original[key][:-1]}), out / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'blocks\.1\.attn\.k_proj\.weight\.scales' is "
                                         r"torch\.float16 with 31 elements, expected torch\.float16 with 32"):
        load_lowbit(out)
    save_file({k: v for k, v in original.items() if k != "norm.weight"}, out / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'norm.weight' is missing"):
        load_lowbit(out)
    with pytest.raises(FileNotFoundError, match="quantization.json not found; expected a low-bit export"):
        load_lowbit(tmp_path)


# ------------------------------------------------------------------------------ GGUF


@pytest.mark.parametrize("block", [32, 96, 256])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_tensors_are_our_grid(qtype, block, model, tokenizer_dir, tmp_path):
    bits = {"Q8_0": 8, "Q4_0": 4}[qtype]
    path = export_gguf(model, model.config, tmp_path / "m.gguf", qtype, tokenizer_dir, block)
    tensors = read_gguf(path)
    params = dict(model.named_parameters())
    assert sorted(tensors) == sorted(params)
    for name, w in params.items():
        values, kind = tensors[name]
        if w.dim() == 2:
            assert kind == gguf.GGMLQuantizationType[qtype], name
            assert torch.equal(values, grid(w, bits, block)), name
        else:
            assert kind == gguf.GGMLQuantizationType.F32 and torch.equal(values, w), name

    reader = gguf.GGUFReader(path)
    c = model.config
    expected = {"general.architecture": "llama", "llama.context_length": c.max_seq_len,
                "llama.embedding_length": c.d_model, "llama.block_count": c.n_layer,
                "llama.feed_forward_length": c.d_ff, "llama.attention.head_count": c.n_head,
                "llama.attention.head_count_kv": c.n_kv_head, "llama.rope.dimension_count": c.head_dim,
                "llama.rope.freq_base": c.rope_theta, "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.padding_token_id": 3, "tokenizer.ggml.unknown_token_id": 0,
                "tokenizer.ggml.add_space_prefix": False, "zeropp.quantization_block_size": block}
    assert {k: field(reader, k) for k in expected} == expected
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(c.norm_eps)
    # The vocabulary: SentencePiece's pieces, scores and kinds, then unused [PAD] rows up to the model's.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    pieces = [sp.id_to_piece(i) for i in range(TOKENS)] + [f"[PAD{i}]" for i in range(TOKENS, VOCAB)]
    assert field(reader, "tokenizer.ggml.tokens") == pieces
    scores = field(reader, "tokenizer.ggml.scores")
    assert scores[:TOKENS] == pytest.approx([sp.get_score(i) for i in range(TOKENS)])
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[2] == gguf.TokenType.CONTROL and types[0] == gguf.TokenType.UNKNOWN
    assert types[4] == gguf.TokenType.BYTE and types[-1] == gguf.TokenType.UNUSED


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_transformers_loads_the_gguf_with_our_logits(qtype, model, tokenizer_dir, tmp_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    bits = {"Q8_0": 8, "Q4_0": 4}[qtype]
    export_gguf(model, model.config, tmp_path / "m.gguf", qtype, tokenizer_dir, 64)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = Transformer(model.config)
    ours.load_state_dict(dequantized_state_dict(model, model.config, bits, 64))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, expected, unquantized = hf(tokens).logits, ours(tokens), model(tokens)
    scale = expected.abs().max()
    rel = ((theirs - expected).abs().max() / scale).item()
    print(f"{qtype}: max |logit diff| / max |logit| = {rel:.2e} (vs the fp32 model: "
          f"{((unquantized - expected).abs().max() / scale).item():.2e})")
    assert rel <= 1e-3
    assert (unquantized - expected).abs().max() / scale > 1e-3  # the grid is not the fp32 model


def test_transformers_loads_a_tied_llama_gguf(tokenizer_dir, tmp_path):
    """No output.weight in the file: llama.cpp and transformers then use token_embd as the head."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB, d_ff=128, tie_embeddings=True)
    model = Transformer(config)
    export_gguf(model, config, tmp_path / "t.gguf", "Q8_0", tokenizer_dir, 64)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "t.gguf").tensors}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="t.gguf", dtype=torch.float32).eval()
    ours = Transformer(config)
    ours.load_state_dict(dequantized_state_dict(model, config, 8, 64), strict=False)  # the head is the embedding
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, expected = hf(tokens).logits, ours(tokens)
    assert (theirs - expected).abs().max() <= 1e-3 * expected.abs().max()


def random_model(preset: str, **overrides) -> Transformer:
    """A preset at our vocabulary with its vectors moved off 0 / 1, so that a bias or norm gain put in the
    wrong place shows."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def transformers_logits_match(path: Path, model: Transformer, bits: int, **config) -> None:
    """transformers' GGUF loader gives the logits of our model with the dequantized weights."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **config).eval()
    ours = Transformer(model.config)
    ours.load_state_dict(dequantized_state_dict(model, model.config, bits, 64), strict=False)  # tied head: strict off
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, expected = hf(tokens).logits, ours(tokens)
    assert (theirs - expected).abs().max() <= 1e-3 * expected.abs().max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gpt2_gguf_is_our_grid(qtype, tokenizer_dir, tmp_path):
    """llama.cpp's gpt2: fused attn_qkv (q, k, v rows, each its own parameter's blocks), nn.Linear layout, F32
    position table on the grid, biases and LayerNorm weights F32, no output for the tied head."""
    bits = GGUF_BITS[qtype]
    model = random_model("gpt2-tiny", max_seq_len=64)
    path = export_gguf(model, model.config, tmp_path / "g.gguf", qtype, tokenizer_dir, 64)
    reader = gguf.GGUFReader(path)
    block = {"attn_norm": "attn_norm", "attn_output": "attn.o_proj", "ffn_norm": "mlp_norm", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    top = {"token_embd": "embed.tokens", "position_embd": "embed.positions", "output_norm": "norm"}
    params, seen = dict(model.named_parameters()), set()
    for t in reader.tensors:
        values = torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type)))
        module, leaf = t.name.rsplit(".", 1)
        if module.startswith("blk."):
            _, i, part = module.split(".")
            names = [f"blocks.{i}.attn.{p}_proj.{leaf}" for p in "qkv"] if part == "attn_qkv" else \
                [f"blocks.{i}.{block[part]}.{leaf}"]
        else:
            names = [f"{top[module]}.{leaf}"]
        seen.update(names)
        want = [params[n] for n in names]
        if want[0].dim() == 2:
            assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if module == "position_embd"
                                     else gguf.GGMLQuantizationType[qtype]), t.name
            assert torch.equal(values, torch.cat([grid(w, bits, 64) for w in want])), t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and torch.equal(values, torch.cat(want)), t.name
    assert seen == set(params)
    c = model.config
    expected = {"general.architecture": "gpt2", "gpt2.context_length": 64, "gpt2.embedding_length": c.d_model,
                "gpt2.block_count": c.n_layer, "gpt2.feed_forward_length": c.d_ff,
                "gpt2.attention.head_count": c.n_head,
                "gpt2.vocab_size": VOCAB, "tokenizer.ggml.model": "llama"}
    assert {k: field(reader, k) for k in expected} == expected
    assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(c.norm_eps)
    # transformers reads gpt2.context_length into GPT2Config.n_ctx, not the n_positions its wpe is sized by.
    transformers_logits_match(path, model, bits, n_positions=64)


@pytest.mark.parametrize("preset, qtype", [("qwen2-tiny", "Q4_0"), ("qwen3-tiny", "Q8_0"), ("mistral-tiny", "Q4_0")])
def test_gguf_of_the_newer_families(preset, qtype, tokenizer_dir, tmp_path):
    """qwen2 (q/k/v biases, tied), qwen3 (q/k norms, head_dim 32 != 64 / 4) in HF's rotary layout; Mistral as
    llama.cpp's llama (q/k permuted), its sliding window declared as the context length."""
    bits, model = GGUF_BITS[qtype], random_model(preset)
    c = model.config
    path = export_gguf(model, c, tmp_path / "m.gguf", qtype, tokenizer_dir, 64)
    tensors = read_gguf(path, permuted=c.arch == "mistral")
    params = dict(model.named_parameters())
    assert sorted(tensors) == sorted(params)
    for name, w in params.items():
        values, kind = tensors[name]
        want = (gguf.GGMLQuantizationType[qtype], grid(w, bits, 64)) if w.dim() == 2 else \
            (gguf.GGMLQuantizationType.F32, w)
        assert kind == want[0] and torch.equal(values, want[1]), name
    reader = gguf.GGUFReader(path)
    arch = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}[c.arch]
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.context_length") == (c.sliding_window or c.max_seq_len)
    assert field(reader, f"{arch}.rope.dimension_count") == c.head_dim
    if c.explicit_head_dim:
        assert field(reader, f"{arch}.attention.key_length") == field(reader, f"{arch}.attention.value_length") == 32
    # transformers' qwen3 GGUF loader ignores key_length (and would take Qwen3Config's head_dim 128).
    transformers_logits_match(path, model, bits, **({"head_dim": c.head_dim} if c.arch == "qwen3" else {}))


def test_gguf_rope_scaling(tokenizer_dir, tmp_path):
    """Llama 3.1's scaling becomes llama.cpp's rope_freqs tensor (the divisor of each plain frequency, here
    against transformers' own llama3 frequencies); linear scaling becomes rope.scaling metadata."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = random_model("llama3-tiny")
    c = model.config
    reader = gguf.GGUFReader(export_gguf(model, c, tmp_path / "l3.gguf", "Q8_0", tokenizer_dir, 64))
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32
    hf = LlamaConfig(hidden_size=c.d_model, num_attention_heads=c.n_head, head_dim=c.head_dim,
                     max_position_embeddings=c.max_seq_len,
                     rope_parameters=dict(c.rope_scaling, rope_theta=c.rope_theta))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    factors = torch.from_numpy(np.array(freqs.data))
    torch.testing.assert_close(factors, plain / scaled, rtol=1e-6, atol=0)
    assert factors[0] == 1.0 and factors[-1] == c.rope_scaling["factor"]  # high frequencies kept, low ones divided

    linear = random_model("llama-tiny", d_ff=128, rope_scaling={"rope_type": "linear", "factor": 4.0})
    reader = gguf.GGUFReader(export_gguf(linear, linear.config, tmp_path / "lin.gguf", "Q8_0", tokenizer_dir, 64))
    assert (field(reader, "llama.rope.scaling.type"), field(reader, "llama.rope.scaling.factor")) == ("linear", 4.0)
    assert "rope_freqs.weight" not in {t.name for t in reader.tensors}


def bpe_tokenizer(directory: Path, byte_level: bool = True) -> Path:
    """A tokenizer.json BPE of 300 tokens (GPT-2's byte-level kind, or a whitespace-split one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = directory / "text.txt"
    text.write_text("\n".join(default_corpus(directory).read_text(encoding="utf-8").splitlines()[:600]))
    tok = Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<s>", "<pad>"],
                                               initial_alphabet=alphabet, show_progress=False))
    (directory / "tok").mkdir()
    tok.save(str(directory / "tok" / "tokenizer.json"))
    (directory / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<s>", "pad_token": "<pad>"}))
    return directory / "tok"


def test_gguf_with_a_byte_level_bpe_tokenizer(model, tmp_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoTokenizer

    tok_dir = bpe_tokenizer(tmp_path)
    export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", tok_dir, 64)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    ours = load_tokenizer(tok_dir)
    assert (field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    assert field(reader, "tokenizer.ggml.tokens") == [by_id[i] for i in range(300)] + [
        f"[PAD{i}]" for i in range(300, VOCAB)]
    assert len(field(reader, "tokenizer.ggml.merges")) == len(spec["model"]["merges"])
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[:3] == [gguf.TokenType.CONTROL] * 3 and types[3] == gguf.TokenType.NORMAL
    assert [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "bos", "padding")] == [
        ours.eos_id, ours.bos_id, ours.pad_id]
    text = "Return the number of items, e.g. len(x) == 3.\n  Indented."
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)

    with pytest.raises(ValueError, match="GGUF export supports SentencePiece models and GPT-2-style byte-level BPE "
                                         "tokenizer.json files .*; this one has model 'BPE', pre_tokenizer "
                                         "'Whitespace', decoder None"):
        export_gguf(model, model.config, tmp_path / "w.gguf", "Q8_0", bpe_tokenizer(tmp_path / "w", False), 64)


def test_gguf_refusals(model, tokenizer_dir, tmp_path):
    out = tmp_path / "m.gguf"
    refused = [
        ("opt-tiny", {}, r"supports arch \('llama', 'mistral', 'qwen2', 'qwen3', 'gpt2', 'granite', 'olmo2', "
                         r"'smollm3', 'gemma2', 'gemma3_text'\); this model is arch='opt' \(OPT has no llama.cpp "
                         r"architecture\)"),
        ("qwen3-tiny", {"qkv_bias": True, "o_bias": True}, r"qwen3 model has linear biases \(qkv, o, mlp\) = "
                                                           r"\(True, True, False\); llama.cpp's qwen3 architecture "
                                                           r"has \(False, False, False\)"),
        ("llama-tiny", {"d_ff": 128, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32}},
         "rope_scaling=.*'yarn'.* is not written to GGUF yet; plain RoPE .* and the 'llama3' and 'linear' "
         "scalings are"),
        ("llama-tiny", {"num_labels": 1}, "a score model"),
        # The newer families' switches inside an architecture that does not compute them (they would load and
        # compute something else in llama.cpp): a GeGLU LLaMA, a Qwen2 windowed on some layers (more in
        # test_gguf_families.py).
        ("llama-tiny", {"gate_activation": "gelu_tanh"}, r"ModelConfig.gate_activation='gelu_tanh' cannot be "
                                                          r"written as llama.cpp's llama, which computes with SwiGLU"),
        ("qwen2-tiny", {"sliding_window": 8, "sliding_window_layers": [1]},
         r"ModelConfig.sliding_window_layers=\[1\] cannot be written as llama.cpp's qwen2"),
    ]
    for preset, overrides, message in refused:
        cfg = ModelConfig.from_preset(preset, vocab_size=VOCAB, **overrides)
        with pytest.raises(ValueError, match=message):
            export_gguf(Transformer(cfg), cfg, out, "Q8_0", tokenizer_dir)
    with pytest.raises(ValueError, match="bits=6: GGUF holds our codes only at 8 bits .Q8_0. or 4 bits .Q4_0."):
        gguf_qtype(6)
    assert (gguf_qtype(8), gguf_qtype(4)) == ("Q8_0", "Q4_0")
    with pytest.raises(ValueError, match=r"qtype='Q5_K_M': expected one of \['Q8_0', 'Q4_0'\] \(our codes\) or a "
                                         r"K-quant mix \['Q4_K_M', 'Q4_K', 'Q6_K'\]"):
        export_gguf(model, model.config, out, "Q5_K_M", tokenizer_dir)
    with pytest.raises(ValueError, match="block_size=48: GGUF needs a multiple of 32"):
        export_gguf(model, model.config, out, "Q8_0", tokenizer_dir, 48)
    cfg = ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB, d_model=48, n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match="tensor 'model.embed_tokens.weight' has rows of 48 elements, not a multiple"):
        export_gguf(Transformer(cfg), cfg, out, "Q4_0", tokenizer_dir, 64)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_tokenizer_is_named(model, tmp_path):
    (tmp_path / "empty").mkdir()
    for exporter, target in ((export_lowbit, tmp_path / "out"), (export_gguf, tmp_path / "m.gguf")):
        args = (8, 256) if exporter is export_lowbit else ("Q8_0",)
        with pytest.raises(ValueError, match="an export needs the model's tokenizer"):
            exporter(model, model.config, target, *args, tokenizer_dir=None)
        for missing in (tmp_path / "absent", tmp_path / "empty"):
            with pytest.raises(FileNotFoundError, match=f"no tokenizer at {missing} .* expected a SentencePiece "
                                                        f".model file, or a directory containing tokenizer.json"):
                exporter(model, model.config, target, *args, tokenizer_dir=missing)
        assert not target.exists()


def test_lowbit_refusals(model, tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"bits=5: expected one of \(8, 6, 4, 3, 2\)"):
        export_lowbit(model, model.config, tmp_path / "out", 5, 256, tokenizer_dir)
    with pytest.raises(ValueError, match="block_size=100: expected a positive multiple of 8"):
        export_lowbit(model, model.config, tmp_path / "out", 4, 100, tokenizer_dir)
    small = ModelConfig.from_preset("llama-tiny", vocab_size=300)
    with pytest.raises(ValueError, match="has 400 tokens, more than the model's vocab_size=300"):
        export_lowbit(Transformer(small), small, tmp_path / "out", 4, 256, tokenizer_dir)
    state = model.state_dict()
    del state["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        export_lowbit(state, model.config, tmp_path / "out", 4, 256, tokenizer_dir)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ atomic outputs


def test_a_failed_export_leaves_the_old_output_intact(model, tokenizer_dir, tmp_path, monkeypatch):
    old_dir = export_lowbit(model, model.config, tmp_path / "out", 8, 64, tokenizer_dir)
    old_gguf = export_gguf(model, model.config, tmp_path / "m.gguf", "Q8_0", tokenizer_dir, 64)
    before = {p.name: p.read_bytes() for p in old_dir.iterdir()}, old_gguf.read_bytes()

    written = []

    def write_half(self, name, tensor):  # a crash (disk full) halfway through the weights
        if len(written) == 3:
            raise OSError("No space left on device")
        written.append(name)
        self.file.write(b"\0" * 100)

    monkeypatch.setattr(quantized.SafetensorsWriter, "write", write_half)
    with pytest.raises(OSError, match="No space left"):
        export_lowbit(model, model.config, tmp_path / "out", 4, 64, tokenizer_dir)

    def write_data_half(self, tensor, tensor_endianess=None):
        self.fout[0].write(b"\0" * 100)
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write_data_half)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(model, model.config, tmp_path / "m.gguf", "Q4_0", tokenizer_dir, 64)

    assert ({p.name: p.read_bytes() for p in old_dir.iterdir()}, old_gguf.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no temporary left behind
    monkeypatch.undo()
    export_lowbit(model, model.config, tmp_path / "out", 4, 64, tokenizer_dir)  # replaced when it succeeds
    assert json.loads((tmp_path / "out" / "quantization.json").read_text())["bits"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


def test_reexporting_a_lowbit_export_keeps_its_codes(model, tokenizer_dir, tmp_path):
    """dequant -> quant on the same grid is the identity, so a low-bit dir converts to GGUF losslessly."""
    direct = export_gguf(model, model.config, tmp_path / "a" / "m.gguf", "Q4_0", tokenizer_dir, 64)
    source = load_source(export_lowbit(model, model.config, tmp_path / "int4", 4, 64, tokenizer_dir))
    via = export_gguf(source.model, source.model.config, tmp_path / "b" / "m.gguf", "Q4_0", source.tokenizer, 64)
    assert (source.grid.bits, source.grid.block_size, source.kind) == (4, 64, "lowbit")
    assert direct.read_bytes() == via.read_bytes()


# ------------------------------------------------------------------------------ the qwZ training forward

QWZ_BITS, QWZ_BLOCK = 4, 96


def qwz_config() -> ModelConfig:
    return ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB, d_ff=128)


def _qwz_forward(rank, world):
    """One ZeRO++ (qwZ) step on 2 ranks, then a forward: the weights it used and the fp32 masters."""
    from zeropp.config import ZeroConfig
    from zeropp.engine import Zero3Engine

    torch.manual_seed(0)
    zero = ZeroConfig(stage=3, zero_quantized_weights=True, zero_quantized_weights_bits=QWZ_BITS,
                      zero_quantization_block_size=QWZ_BLOCK)
    engine = Zero3Engine(Transformer(qwz_config()), zero)
    optimizer = torch.optim.AdamW(engine.module.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(rank))
    engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
    engine.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    masters = engine.full_state_dict()
    engine(tokens[:, :-1])  # a forward binds the gathered (quantized) weights to the modules
    used = {name: operator.attrgetter(name)(engine.module).detach().clone() for name in masters}
    engine.close()
    return used, masters


def test_export_at_the_qwz_grid_reproduces_the_training_forward(tokenizer_dir, tmp_path):
    used, masters = run_ranks(_qwz_forward, 2)[0]
    config = qwz_config()
    loaded, _ = load_lowbit(export_lowbit(masters, config, tmp_path / "out", QWZ_BITS, QWZ_BLOCK, tokenizer_dir,
                                          vectors_on_grid=True))
    for name, p in loaded.named_parameters():
        assert torch.equal(p, used[name]), name
    path = export_gguf(masters, config, tmp_path / "m.gguf", "Q4_0", tokenizer_dir, QWZ_BLOCK, vectors_on_grid=True)
    for name, (values, _) in read_gguf(path).items():
        assert torch.equal(values, used[name]), name
    assert any(not torch.equal(used[n], masters[n]) for n in masters)  # the forward did use quantized weights
